"""`modcli sensitivity`: where a dense decoder can spare depth. For every block and part (its attention update, its
MLP update, the whole block) the validation loss when that sublayer is removed for every token (`drop_loss`), when
a random share of tokens skips it (`share_losses`), and the one-forward score Block Influence, 1 - cos(x, x + f(x))
averaged over the tokens (ShortGPT's BI, here per part).

A sublayer is removed from outside the decoder, by forward hooks on `block.attn` and `block.mlp`: the block is
pre-norm residual (x + attn(norm(x)), then + mlp(norm(.))), so a zero attention or MLP update is that sublayer
removed (tests/evaluation/test_sensitivity.py checks it against a hand-written forward). For a share, measured two
ways: the skipped tokens taken out of the attention altogether (no query, no key, no value: the kept tokens attend
among themselves at their original positions, as an MoD routed block does; `share_losses`), and the skipped tokens
keeping their keys and values for the others (no query, no update: the kept tokens attend to every earlier token,
as a routed block with --keep-skipped-kv does; `share_losses_kv_kept`). Either way they get a zero MLP update.

Each (block, part) forward starts from the dense hidden state entering that block, computed once per batch: the
blocks before it are the dense model's, so removing block i costs L - i blocks, not L. Those states are held for
every window at once (windows x T x D x L numbers: 8 windows of 256 tokens of SmolLM2-135M, 140 MB in float32).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from modcli.checkpoint.store import load_model_from, read_config, resolve_checkpoint
from modcli.config import DataConfig
from modcli.data.corpus import evaluation_batches, load_corpus
from modcli.data.tokenizer import load_tokenizer
from modcli.errors import UserError
from modcli.evaluation.plan import Plan, plan_drops, write_plan
from modcli.evaluation.sensitivity_config import PARTS, SensitivityConfig, share_key
from modcli.hardware import autocast, resolve_device
from modcli.models.decoder import Block, MoDDecoder, config_rope
from modcli.models.routing.block_rule import route_part
from modcli.models.routing.selection import gather_tokens, scatter_tokens
from modcli.packed_linear import inference_linears
from modcli.reports.plots import DPI
from modcli.reports.plots import _pyplot as pyplot  # matplotlib with the Agg backend, imported when called
from modcli.training.objective import lm_loss


@dataclass
class PartSensitivity:
    """One sublayer of one block, removed."""

    block: int
    part: str
    """attention, mlp or block (both)."""
    drop_loss: float
    """Validation loss (nats/token) with the sublayer removed for every token."""
    share_losses: dict[str, float]
    """Per share ("0.125"): the loss when that share of tokens, chosen at random, skips the sublayer."""
    block_influence: float
    """1 - cos(x, x + f(x)) of the sublayer's update f in the dense model, averaged over the tokens."""
    share_losses_kv_kept: dict[str, float] = field(default_factory=dict)
    """Per share: the same, the skipped tokens keeping their keys and values for the others (--keep-skipped-kv;
    the MLP's equal `share_losses`); empty in maps saved before it was measured."""


@dataclass
class SensitivityResult:
    checkpoint: str
    kind: str
    """The model family in words (ModelConfig.kind)."""
    corpus: str
    seq_len: int
    """Window length in tokens."""
    windows: int
    tokens: int
    dense_loss: float
    """Validation loss (nats/token) of the model as it is, on the same windows."""
    shares: list[float]
    skipped_tokens: dict[str, int]
    """Per share: the tokens of each window that skip (round(share x seq_len), at least one token is kept)."""
    results: list[PartSensitivity]
    """Every block's attention, mlp and block, in block order."""
    kv_kept: bool = False
    """Whether `share_losses` were measured with skipped tokens keeping their keys and values for the others: always
    False (they are left out there); `share_losses_kv_kept` holds the shares measured with them kept."""
    seed: int = 1337
    seconds: float = 0.0
    """Wall time of the measurement (model loading and corpus reading excluded)."""
    plot: str | None = None
    """The heatmap PNG written (--plot), else None."""
    linear_kernel: str = "aten"
    """What nn.Linear ran with: onednn-packed (CPU float32, `modcli.packed_linear`) or aten."""


@contextlib.contextmanager
def removed(block: Block, part: str, kept: Tensor | None = None, keep_kv: bool = False) -> Iterator[None]:
    """Inside: `part` (attention, mlp or block) of `block` removed, by forward hooks. `kept` None: for every token;
    else (B, k) the positions, ascending, of the tokens that still run it: the others skip, attention among the
    kept tokens only (their original positions for RoPE and the causal mask), or with `keep_kv` the kept tokens'
    queries over every token's keys and values; a zero MLP update."""
    sublayers = route_part(part)
    handles = []
    try:
        if sublayers.attention:
            if kept is None:
                handles.append(block.attn.register_forward_hook(_zero_update))
            else:
                handles += _attention_among(block.attn, kept, keep_kv)
        if sublayers.mlp:
            handles.append(block.mlp.register_forward_hook(
                _zero_update if kept is None else _masked_update(kept)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _zero_update(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
    return torch.zeros_like(output)


def _masked_update(kept: Tensor) -> Callable:
    """A forward hook keeping the update (B, T, D) of the tokens at `kept` (B, k) and zeroing the others'."""
    def hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        keep = torch.zeros(output.shape[:2], device=output.device, dtype=output.dtype).scatter(1, kept, 1.0)  # (B, T)
        return output * keep.unsqueeze(-1)
    return hook


def _attention_among(attention: nn.Module, kept: Tensor, keep_kv: bool = False) -> list:
    """Hooks making `attention` (called as attn(x, cos, sin, prefill, received, context), x (B, T, D), cos/sin (1 or
    B, T, hd/2)) run on the tokens at `kept` (B, k) only and return their update at their positions, zero elsewhere.
    `keep_kv`: every token's keys and values stay in the attention (the kept tokens' queries only: `context`)."""
    length = {}

    def gather(module: nn.Module, args: tuple) -> tuple:
        x, cos, sin, prefill, received, *_ = (*args, None, None, None)
        batch, length["T"] = x.shape[0], x.shape[1]
        cos, sin = cos.expand(batch, -1, -1), sin.expand(batch, -1, -1)  # (B, T, hd/2)
        context = (*module.keys_values(x, cos, sin), kept) if keep_kv else None  # every token's K/V (B, Hkv, T, hd)
        return (gather_tokens(x, kept), gather_tokens(cos, kept), gather_tokens(sin, kept), prefill, received,
                context)  # (B, k, .)

    def scatter(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        batch, _, d_model = output.shape  # (B, k, D)
        return scatter_tokens(output.new_zeros(batch, length["T"], d_model), kept, output)  # (B, T, D)

    return [attention.register_forward_pre_hook(gather), attention.register_forward_hook(scatter)]


def blocks_from(model: MoDDecoder, x: Tensor, first: int, tokens: Tensor) -> Tensor:
    """The rest of the dense model's forward from the hidden state x (B, T, D) entering block `first`: its logits
    (B, T, V). MoDDecoder.forward without routing records, started part way."""
    cos, sin = config_rope(model.config, torch.arange(tokens.shape[1], device=tokens.device))  # (T, hd/2)
    for block in model.blocks[first:]:
        x, _ = block(x, cos, sin, model.training_mode, token_ids=tokens)
    return model.head(model.norm(x))  # (B, T, V)


def dense_pass(model: MoDDecoder, tokens: Tensor) -> tuple[Tensor, list[Tensor], dict[str, Tensor]]:
    """The dense forward of tokens (B, T): its logits (B, T, V), the hidden state entering each block (B, T, D),
    and each part's Block Influence per block (L,), mean over the tokens."""
    updates: dict[str, Tensor] = {}
    hooks = []
    for block in model.blocks:
        hooks.append(block.attn.register_forward_hook(lambda m, a, out: updates.__setitem__("attention", out)))
        hooks.append(block.mlp.register_forward_hook(lambda m, a, out: updates.__setitem__("mlp", out)))
    cos, sin = config_rope(model.config, torch.arange(tokens.shape[1], device=tokens.device))  # (T, hd/2)
    x = model.embed(tokens)  # (B, T, D)
    hidden, influence = [], {part: [] for part in PARTS}
    try:
        for block in model.blocks:
            hidden.append(x)
            out, _ = block(x, cos, sin, model.training_mode, token_ids=tokens)
            after_attention = x + updates["attention"]  # what the MLP's residual adds to
            for part, (before, after) in {"attention": (x, after_attention), "mlp": (after_attention, out),
                                          "block": (x, out)}.items():
                influence[part].append(1 - F.cosine_similarity(before.float(), after.float(), dim=-1).mean())
            x = out
    finally:
        for hook in hooks:
            hook.remove()
    return model.head(model.norm(x)), hidden, {part: torch.stack(values) for part, values in influence.items()}


def kept_positions(batch: int, seq_len: int, share: float, generator: torch.Generator) -> Tensor:
    """(B, k) ascending positions of the tokens that run the sublayer when `share` of them skip, at random:
    round(share x T) skip, at least one is kept."""
    kept = max(1, seq_len - skipped_count(seq_len, share))
    order = torch.rand(batch, seq_len, generator=generator).argsort(dim=1)  # a random permutation per row
    return order[:, :kept].sort(dim=1).values  # (B, k) ascending: the causal order among them is kept


def skipped_count(seq_len: int, share: float) -> int:
    return min(seq_len - 1, math.floor(share * seq_len + 0.5))


def check_measurable(model: MoDDecoder, kind: str) -> None:
    """A UserError unless `model` is a dense decoder whose forward is MoDDecoder's (the blocks run one after the
    other): the hooks and the forward from part way assume it."""
    if not model.config.dense or type(model).forward is not MoDDecoder.forward:
        raise UserError(f"modcli sensitivity measures a dense decoder (an imported run, or one trained with --dense); "
                        f"this run is {kind}")


@torch.no_grad()
def sensitivity(config: SensitivityConfig,
                on_block: Callable[[int, int, float], None] | None = None) -> SensitivityResult:
    """Measure every block's and part's removal; `on_block(block, blocks, seconds)` after each block is done."""
    if config.plot and not Path(config.plot).resolve().parent.is_dir():
        raise UserError(f"--plot: the folder of {config.plot} does not exist")
    device = resolve_device(config.device)
    model, run_config, checkpoint = load_model_from(config.checkpoint, device)
    check_measurable(model, run_config.model.kind)
    seq_len = run_config.model.seq_len if config.seq_len is None else config.seq_len
    if seq_len > run_config.model.seq_len:
        raise UserError(f"--seq-len must be <= the run's seq_len {run_config.model.seq_len}, got {seq_len}")
    data = run_config.data if config.data is None else DataConfig(data=config.data, glob=config.glob,
                                                                  tokenizer=run_config.data.tokenizer)
    corpus = load_corpus(data, seq_len, load_tokenizer(data.tokenizer, checkpoint.parent, model.config.vocab_size))
    batches = [(inputs.to(device), targets.to(device))
               for inputs, targets in evaluation_batches(corpus.val, seq_len, config.batch_size, config.batches)]
    generator = torch.Generator().manual_seed(config.seed)
    kept = [{share: kept_positions(inputs.shape[0], seq_len, share, generator).to(device) for share in config.shares}
            for inputs, _ in batches]
    with inference_linears(model, device, config.dtype, None) as linears, autocast(device, config.dtype):
        start = time.perf_counter()
        results, dense_loss = _measure(model, batches, kept, config, lambda block: on_block(
            block, len(model.blocks), time.perf_counter() - start) if on_block else None)
        seconds = time.perf_counter() - start
    result = SensitivityResult(
        str(checkpoint), run_config.model.kind, corpus.description, seq_len, len(batches) * config.batch_size,
        len(batches) * config.batch_size * seq_len, dense_loss, list(config.shares),
        {share_key(share): skipped_count(seq_len, share) for share in config.shares}, results, seed=config.seed,
        seconds=seconds, linear_kernel=linears.kernel)
    if config.plot:
        result.plot = sensitivity_plot(result, config.plot)
    return result


def measured_map(config: SensitivityConfig) -> SensitivityResult:
    """--measured: the map a `modcli sensitivity --json` run saved, checked to be of this checkpoint."""
    path = Path(config.measured)
    try:
        saved = json.loads(path.read_text())
        results = [PartSensitivity(**r) for r in saved.pop("results")]
        result = SensitivityResult(**saved, results=results)
    except FileNotFoundError:
        raise UserError(f"--measured: {path} does not exist") from None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise UserError(f"--measured: {path} is not a map saved by modcli sensitivity --json "
                        f"({' '.join(str(exc).split())[:120]})") from None
    if Path(result.checkpoint).resolve() != resolve_checkpoint(config.checkpoint).resolve():
        raise UserError(f"--measured: {path} maps {result.checkpoint}, not {config.checkpoint}")
    return result


def plan_from(config: SensitivityConfig, result: SensitivityResult) -> Plan:
    """--plan: the cheapest cuts (static drops, and routed sublayers with --plan-routing) meeting --target-flops
    (modcli.evaluation.plan), written as TOML."""
    model = read_config(Path(result.checkpoint)).model
    plan = plan_drops(model, result.results, result.dense_loss, result.seq_len, config.target_flops,
                      config.plan_routing, config.plan_keep_skipped_kv)
    write_plan(plan, config.plan, result.checkpoint)
    return plan


def _measure(model: MoDDecoder, batches: list[tuple[Tensor, Tensor]], kept: list[dict[float, Tensor]],
             config: SensitivityConfig, done: Callable[[int], None]) -> tuple[list[PartSensitivity], float]:
    """The dense pass of every batch (its loss, hidden states and Block Influence), then block by block each
    part's drop and shares, each forward from the dense state entering the block."""
    dense_total, influence, hidden = 0.0, dict.fromkeys(PARTS, 0.0), []
    for inputs, targets in batches:
        logits, states, scores = dense_pass(model, inputs)
        dense_total += lm_loss(logits, targets).item()
        hidden.append(states)
        influence = {part: influence[part] + scores[part] for part in PARTS}  # (L,) each
    n = len(batches)

    def loss(layer: int, part: str, share: float | None, keep_kv: bool = False) -> float:
        total = 0.0
        for index, (inputs, targets) in enumerate(batches):
            with removed(model.blocks[layer], part, None if share is None else kept[index][share], keep_kv):
                total += lm_loss(blocks_from(model, hidden[index][layer], layer, inputs), targets).item()
        return total / n

    results = []
    for layer in range(len(model.blocks)):
        for part in PARTS:
            share_losses = {share_key(share): loss(layer, part, share) for share in config.shares}
            # keeping K/V changes nothing where attention runs for every token (the MLP alone)
            kv_kept = (share_losses if not route_part(part).attention
                       else {share_key(share): loss(layer, part, share, keep_kv=True) for share in config.shares})
            results.append(PartSensitivity(layer, part, loss(layer, part, None), share_losses,
                                           (influence[part][layer] / n).item(), dict(kv_kept)))
        done(layer)
    return results, dense_total / n


def sensitivity_plot(result: SensitivityResult, path: str | Path) -> str:
    """A heatmap per measurement (removed for every token, each share, Block Influence): blocks down, parts
    across, each cell the loss increase over dense (nats/token) or the score, written as a number where it fits."""
    plt = pyplot()
    blocks = 1 + max(r.block for r in result.results)
    panels = [("removed for every token\nloss - dense (nats)", lambda r: r.drop_loss - result.dense_loss)]
    panels += [(f"{share_key(share)} of tokens skip\nloss - dense (nats)",
                lambda r, key=share_key(share): r.share_losses[key] - result.dense_loss) for share in result.shares]
    panels.append(("Block Influence\n1 - cos(x, x + f(x))", lambda r: r.block_influence))
    by_place = {(r.block, r.part): r for r in result.results}
    fig, axes = plt.subplots(1, len(panels), figsize=(2.9 * len(panels) + 0.6, 0.26 * blocks + 1.9), squeeze=False)
    for ax, (title, value) in zip(axes[0], panels, strict=True):
        values = np.array([[value(by_place[block, part]) for part in PARTS] for block in range(blocks)])  # (L, 3)
        # a few cells (block 0, the last MLP) can cost ten times the rest: the colours stop at the 90th percentile
        # (the numbers in the cells do not), so the differences among the others stay visible
        top = float(np.quantile(values, 0.9))
        clipped = values.max() > 2 * top > 0
        vmax = top if clipped else float(values.max())
        vmin = min(0.0, float(values.min()))
        image = ax.imshow(values, aspect="auto", cmap="magma_r", interpolation="nearest", vmin=vmin, vmax=vmax)
        fig.colorbar(image, ax=ax, fraction=0.08, pad=0.03, extend="max" if clipped else "neither")
        ax.set_xticks(range(len(PARTS)), PARTS)
        ax.set_yticks(range(blocks), [str(block) for block in range(blocks)], fontsize=7 if blocks > 16 else 9)
        ax.set_ylabel("block")
        ax.set_title(title, fontsize=9)
        if blocks <= 40:
            for (block, column), cell in np.ndenumerate(values):
                ax.text(column, block, f"{cell:.2f}", ha="center", va="center", fontsize=6,
                        color="white" if cell > vmin + 0.6 * (vmax - vmin) else "black")
    run = Path(result.checkpoint)
    fig.suptitle(f"{run.parent.name}/{run.name}: dense loss {result.dense_loss:.3f}, {result.windows} window"
                 f"{'s' if result.windows > 1 else ''} of "
                 f"{result.seq_len} tokens", fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=DPI)
    except OSError as exc:
        raise UserError(f"--plot: cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return str(path)
