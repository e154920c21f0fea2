"""Early exit, LayerSkip-style (Elhoushi et al., 2024, arXiv 2404.16710): `--arch early-exit`.

The model is the dense decoder (MoD's `Block` with routing off, the same embedding, final norm and tied head); what
changes is training and decoding.

Training
- Layer dropout rising with depth: block l of L is skipped with probability p_l = layer_dropout_max x l / (L - 1)
  (0 for the first block), for a whole sequence: each batch row draws its own coin per block. The coins come from
  the CPU generator, so the kept rows are known on the host and the block runs on them alone (`index_select`, then
  `index_copy` back): a dropped row costs no work and no device sync. A dropped row's hidden state passes on
  unchanged (no 1 / (1 - p) rescaling, as in LayerSkip). Evaluation and decoding never drop.
- Early-exit loss: the hidden state after every block but the last goes through the shared final norm and head;
  the loss is exit_loss_scale x sum_l w_l CE_l with w_l = (l + 1) / sum_j (j + 1) over blocks 0..L-2, rising
  with depth like LayerSkip's scale, added to the final layer's loss at weight 1 (`modcli.training.objective`'s
  "exits" loss, from the exit logits the forward returns in its ForwardAux). Every exit every step: with a byte
  vocabulary the head costs ~7% of a block, so LayerSkip's rotational curriculum (for 32k-token heads) is not
  needed.

Decoding (`modcli generate` with the family's decoding options, `ExitDecodingOptions`; its hook `exit_decoding` builds
the `ConfidenceExit` or `SelfSpeculative` decoding that generate's loop runs; the prompt is always prefilled at full
depth)
- Confidence exit (`--exit-threshold P`, CALM's softmax response): a token climbs the blocks and stops after the
  first block whose softmax top probability through the shared norm and head reaches P; its logits are that exit's.
  The blocks it skips still need its K/V for later tokens: each skipped block runs only its attention norm and
  K/V projections on the exit hidden state (CALM's propagation of the exited state), so the cache stays full and
  later tokens attend exactly as the full model would to such a token. Rounding can make a top probability exactly
  1.0, so P = 1.0 never exits: it is the full model.
- Self-speculative decoding (`--speculative E`, greedy only): draft `--draft-tokens K` tokens greedily with the
  first E blocks and the head, then verify them in one pass of blocks E..L-1 over the K + 1 positions (the token
  the full model chose last, then the drafts): blocks 0..E-1 are not run again, their K/V written while drafting
  are the verify pass's cache and their outputs its inputs (only the last draft goes through blocks 0..E-1 once
  more). The longest prefix of drafts the full model agrees with is accepted, plus the full model's own next token;
  the cache is rolled back past the rejected drafts by setting each row's length. The output is the full model's
  greedy output token for token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from modcli.config import ModelConfig
from modcli.errors import UserError
from modcli.models.cache import DecoderCache
from modcli.models.decoder import ForwardAux, MoDDecoder, config_rope, decode_rope

if TYPE_CHECKING:
    from modcli.decode.generation import DecodeRun
    from modcli.models.families.early_exit import ExitDecodingOptions


def exit_weights(config: ModelConfig) -> list[float]:
    """w_l of the exits after blocks 0..L-2: (l + 1) / sum_j (j + 1), rising with depth, summing to 1."""
    exits = config.n_layers - 1
    total = exits * (exits + 1) / 2
    return [(layer + 1) / total for layer in range(exits)]


class EarlyExitDecoder(MoDDecoder):
    """The dense decoder trained with layer dropout and an exit loss at every block; decodes with exits.

    It has MoDDecoder's interface (forward, decode_step, routing_modes, check_routing, ...), with no routed block:
    its one routing mode is "dense", and `forward` / `decode_step` are the full-depth model.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.register_buffer("exit_loss_weights", torch.tensor(exit_weights(config)), persistent=False)  # (L-1,)

    def kept_rows(self, layer: int, batch: int) -> Tensor | None:
        """Training: the batch rows that run block `layer` (layer dropout, drawn on the CPU); None = every row."""
        p = self.config.family.layer_dropout(self.config, layer)
        if not self.training or p == 0.0:
            return None
        keep = torch.rand(batch) >= p  # (B,) one coin per sequence
        return None if bool(keep.all()) else keep.nonzero().squeeze(1)

    def forward(self, tokens: Tensor, routing: str | None = None, *, return_aux: bool = False,
                cache: DecoderCache | None = None, cache_rows: Tensor | None = None, lengths: Tensor | None = None,
                capacity: float | None = None, k: int | None = None):
        """tokens (B, T) -> logits (B, T, V) of the last block; with `return_aux`, (logits, ForwardAux) whose
        exit_logits hold the exits of a training-mode pass (nothing is routed). `cache`, `cache_rows`, `lengths` as
        in MoDDecoder.forward; `capacity` and `k` mean nothing here. In training mode, blocks are dropped per row
        (never with a cache)."""
        self.check_routing(routing or self.training_mode)
        batch, seq_len = tokens.shape
        cos, sin = config_rope(self.config, torch.arange(seq_len, device=tokens.device))  # (T, hd/2)
        if cache is not None and cache_rows is None:
            cache_rows = torch.arange(batch, device=tokens.device)
        want_exits = return_aux and self.training and self.config.family_options.exit_loss_scale > 0
        x = self.embed(tokens)  # (B, T, D)
        exits = []
        for layer, block in enumerate(self.blocks):
            keep = self.kept_rows(layer, batch) if cache is None else None
            if keep is None:
                layer_cache = cache.layers[layer] if cache is not None else None
                x, _ = block(x, cos, sin, "dense", False, layer_cache, cache_rows, lengths)
            elif keep.numel():
                keep = keep.to(tokens.device)
                kept, _ = block(x.index_select(0, keep), cos, sin, "dense")  # (b, T, D)
                x = x.index_copy(0, keep, kept)
            if want_exits and layer < self.config.n_layers - 1:
                exits.append(x)
        if cache is not None:
            cache.positions[cache_rows] = seq_len if lengths is None else lengths
        logits = self.head(self.norm(x))  # (B, T, V)
        if not return_aux:
            return logits
        exit_logits = self.head(self.norm(torch.stack(exits))) if exits else None  # (L-1, B, T, V)
        return logits, ForwardAux(exit_logits=exit_logits, exit_weights=self.exit_loss_weights)

    @torch.no_grad()
    def exit_layer_logits(self, tokens: Tensor) -> Tensor:
        """tokens (B, T) -> (L, B, T, V): the logits of the exit after every block, the last being the model's."""
        batch, seq_len = tokens.shape
        cos, sin = config_rope(self.config, torch.arange(seq_len, device=tokens.device))
        x = self.embed(tokens)  # (B, T, D)
        hidden = []
        for block in self.blocks:
            x, _ = block(x, cos, sin, "dense")
            hidden.append(x)
        return self.head(self.norm(torch.stack(hidden)))  # (L, B, T, V)

    # --- decoding with exits ------------------------------------------------------------------------------------

    @torch.no_grad()
    def exit_losses(self, tokens: Tensor, targets: Tensor) -> dict[str, Tensor]:
        """The mean next-token cross-entropy (nats) of the exit after every block (block0 .. block{L-1}, the last
        being the model's), as modcli.training.objective.lm_loss computes it."""
        return {f"block{layer}": F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
                for layer, logits in enumerate(self.exit_layer_logits(tokens))}  # (L, B, T, V)

    def decode_step_exit(self, tokens: Tensor, cache: DecoderCache, threshold: float) -> tuple[Tensor, Tensor]:
        """Confidence exit: tokens (B,) -> (logits (B, V) of each row's exit, the block each row left after (B,)).

        Every block writes every row's K/V (an exited row's from its exit hidden state: CALM's rule); attention and
        MLP run only for the rows still climbing. One host sync per block for the exit decision.
        """
        batch = tokens.shape[0]
        device = tokens.device
        last = self.config.n_layers - 1
        x = self.embed(tokens)[:, None]  # (B, 1, D); an exited row's entry stays its exit hidden state
        cos, sin = config_rope(self.config, cache.positions[:, None])  # (B, 1, hd/2)
        every_row = torch.arange(batch, device=device)
        active = every_row  # rows still climbing
        exit_layer = torch.full((batch,), last, dtype=torch.long, device=device)
        for layer, block in enumerate(self.blocks):
            attn = block.attn
            q, k, v = attn._heads(block.attn_norm(x), cos, sin)  # (B, H, 1, hd), (B, Hkv, 1, hd)
            keys, values, mask = cache.layers[layer].append(every_row, k, v)  # (B, Hkv, L, hd), (B, 1, 1, L)
            if active.numel() == 0:
                continue  # every row has exited: this block only fills the cache
            if active.numel() < batch:
                q, keys, values, mask = q[active], keys[active], values[active], mask[active]
            out = F.scaled_dot_product_attention(q, attn.share_kv(keys.to(q.dtype)), attn.share_kv(values.to(q.dtype)),
                                                 attn_mask=mask)  # (n, H, 1, hd)
            x_active = x[active]  # (n, 1, D)
            attn_update = attn.proj(out.transpose(1, 2).reshape(active.numel(), 1, -1))
            delta = attn_update + block.mlp(block.mlp_norm(x_active + attn_update))  # as Block.decode computes it
            x = x.index_put((active,), x_active + delta)
            if layer < last and threshold < 1.0:
                top = self.head(self.norm(x[active, 0])).float().softmax(dim=-1).amax(dim=-1)  # (n,)
                confident = top >= threshold
                if bool(confident.any()):  # the host sync that lets an exited row skip the blocks above
                    exit_layer[active[confident]] = layer
                    active = active[~confident]
        cache.positions += 1
        return self.head(self.norm(x))[:, 0], exit_layer  # (B, V), (B,)

    @torch.no_grad()
    def draft_step(self, tokens: Tensor, cache: DecoderCache, positions: Tensor, draft_layers: int) -> Tensor:
        """Blocks 0..E-1 on one token per row at `positions` (B,), appending their K/V -> the hidden state (B, 1, D)
        after block E-1. The cache's positions and the K/V of blocks E.. are left as they were."""
        x = self.embed(tokens)[:, None]  # (B, 1, D)
        rope = decode_rope(self.config, positions)  # (B, 1, hd/2) each, shared by the draft blocks
        for layer in range(draft_layers):
            x = self.blocks[layer].decode(x, positions, "dense", cache.layers[layer], rope=rope)
        return x

    @torch.no_grad()
    def extend(self, x: Tensor, cache: DecoderCache, first_layer: int) -> Tensor:
        """Blocks first_layer..L-1 on n new tokens per row, x (B, n, D) their inputs at positions
        cache.positions + 0..n-1: each block writes their K/V after its cached ones and attends causally over both.
        Returns the logits (B, n, V). The cache's positions are left as they were (cache.positions[b] must be each
        block's cached length of row b, as after a prefill or `DecoderCache.truncate`)."""
        batch, n, _ = x.shape
        positions = cache.positions[:, None] + torch.arange(n, device=x.device)  # (B, n)
        cos, sin = config_rope(self.config, positions)  # (B, n, hd/2)
        for layer in range(first_layer, self.config.n_layers):
            block = self.blocks[layer]
            attn = block.attn
            q, k, v = attn._heads(block.attn_norm(x), cos, sin)  # (B, H, n, hd), (B, Hkv, n, hd)
            keys, values, mask = cache.layers[layer].extend(k, v)  # (B, Hkv, L, hd), (B, 1, n, L)
            out = F.scaled_dot_product_attention(q, attn.share_kv(keys.to(q.dtype)), attn.share_kv(values.to(q.dtype)),
                                                 attn_mask=mask)  # (B, H, n, hd)
            attn_update = attn.proj(out.transpose(1, 2).reshape(batch, n, -1))  # (B, n, D)
            x = x + (attn_update + block.mlp(block.mlp_norm(x + attn_update)))
        return self.head(self.norm(x))  # (B, n, V)


# --- generation -------------------------------------------------------------------------------------------------


@dataclass
class ExitStats:
    """What decoding with exits did, for GenerateResult."""

    decoding: str
    """full, confidence (threshold P) or speculative (E blocks, K drafts)."""
    exit_layers: dict[str, int] = field(default_factory=dict)
    """Confidence exit: how many decoded tokens left after each block (block L-1 = the full depth)."""
    drafted: int = 0
    """Speculative: draft tokens proposed (all rows)."""
    accepted: int = 0
    """Speculative: draft tokens the full model agreed with."""
    rounds: int = 0
    """Speculative: draft-and-verify rounds."""

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_exit_block(self) -> float | None:
        """Confidence exit: blocks run per decoded token, on average (L = full depth)."""
        total = sum(self.exit_layers.values())
        if not total:
            return None
        return sum((int(name.removeprefix("block")) + 1) * count for name, count in self.exit_layers.items()) / total

    def result_fields(self, batch: int) -> dict[str, Any]:
        """GenerateResult's fields of decoding with exits."""
        return dict(decoding=self.decoding, acceptance_rate=self.acceptance_rate,
                    tokens_per_round=None if not self.rounds else
                    (self.accepted + batch * self.rounds) / (batch * self.rounds),
                    mean_exit_block=self.mean_exit_block, exit_blocks=dict(sorted(self.exit_layers.items())) or None)


def exit_decoding(model: EarlyExitDecoder, options: ExitDecodingOptions) -> ConfidenceExit | SelfSpeculative | None:
    """The family's decoding hook (`Family.decoding`): confidence exit for --exit-threshold, self-speculative
    decoding for --speculative (E must fit the model's depth: a UserError), None (full depth) for neither."""
    if options.speculative is not None:
        layers = model.config.n_layers
        if not 1 <= options.speculative < layers:
            raise UserError(f"--speculative must be in 1..{layers - 1} (draft blocks, fewer than the model's "
                            f"{layers}), got {options.speculative}")
        return SelfSpeculative(model, options.speculative, options.draft_tokens)
    if options.exit_threshold is not None:
        return ConfidenceExit(model, options.exit_threshold)
    return None


class ConfidenceExit:
    """`modcli generate --exit-threshold P`: generate's token-by-token loop (its sampler, its streaming) with the
    confidence-exit step, `EarlyExitDecoder.decode_step_exit`, counting each token's exit block."""

    spare_tokens = 0

    def __init__(self, model: EarlyExitDecoder, threshold: float) -> None:
        self.model, self.threshold = model, threshold
        self.stats = ExitStats(f"confidence (exit at top probability >= {threshold:g})")

    def step_rows(self, batch: int) -> int:
        return batch

    def decode(self, run: DecodeRun) -> list[list[int]]:
        exit_layers = self.stats.exit_layers

        def step(tokens: Tensor) -> Tensor:
            with run.autocast():
                logits, exit_block = self.model.decode_step_exit(tokens, run.cache, self.threshold)  # (B, V), (B,)
                for block in exit_block.tolist():
                    exit_layers[f"block{block}"] = exit_layers.get(f"block{block}", 0) + 1
                return logits.float()

        return run.steps(step)

    def result_fields(self, batch: int) -> dict[str, Any]:
        return self.stats.result_fields(batch)


class SelfSpeculative:
    """`modcli generate --speculative E --draft-tokens K`: rounds of K drafts and one verify pass
    (`speculative_decode`) from the prefill's logits, instead of generate's token-by-token loop; greedy."""

    def __init__(self, model: EarlyExitDecoder, draft_layers: int, draft_tokens: int) -> None:
        self.model, self.draft_layers, self.draft_tokens = model, draft_layers, draft_tokens
        self.spare_tokens = draft_tokens + 1  # a round's drafts may run past the last token
        self.stats = ExitStats("")

    def step_rows(self, batch: int) -> int:
        """A verify pass runs each row's drafts and its last token: B x (K + 1)."""
        return batch * (self.draft_tokens + 1)

    def decode(self, run: DecodeRun) -> list[list[int]]:
        with run.autocast():
            outputs, self.stats = speculative_decode(self.model, run.logits, run.cache, run.max_new_tokens,
                                                     self.draft_layers, self.draft_tokens, run.on_token)
        return outputs

    def result_fields(self, batch: int) -> dict[str, Any]:
        return self.stats.result_fields(batch)


@torch.no_grad()
def speculative_decode(model: EarlyExitDecoder, logits: Tensor, cache: DecoderCache, max_new_tokens: int,
                       draft_layers: int, draft_tokens: int,
                       on_token: Callable[[int, int], None] | None = None) -> tuple[list[list[int]], ExitStats]:
    """Greedy self-speculative decoding after a prefill: logits (B, V) at each row's last prompt token -> each row's
    max_new_tokens new tokens (the full model's greedy choices) and the statistics. `on_token(row, token)` is called
    for every new token in order. The cache needs draft_tokens + 1 spare slots beyond the last position."""
    batch = logits.shape[0]
    stats = ExitStats(decoding=f"speculative (first {draft_layers} blocks draft {draft_tokens} tokens)")
    outputs: list[list[int]] = [[] for _ in range(batch)]
    next_tokens = logits.argmax(dim=-1)  # (B,) the full model's choice, not yet in the cache
    prompt_lengths = cache.positions.clone()  # (B,)

    def emit(row: int, token: int) -> None:
        if len(outputs[row]) < max_new_tokens:
            outputs[row].append(token)
            if on_token is not None:
                on_token(row, token)

    for row, token in enumerate(next_tokens.tolist()):
        emit(row, token)
    while min(len(out) for out in outputs) < max_new_tokens:
        needed = max_new_tokens - min(len(out) for out in outputs)
        drafts_this_round = min(draft_tokens, needed - 1)  # a round gives at most drafts + 1 tokens
        start = cache.positions.clone()  # (B,) position of next_tokens
        hidden, drafts = [], []
        token = next_tokens
        for i in range(drafts_this_round + 1):  # the last pass only feeds the last draft to blocks 0..E-1
            h = model.draft_step(token, cache, start + i, draft_layers)  # (B, 1, D)
            hidden.append(h)
            if i < drafts_this_round:
                token = model.head(model.norm(h[:, 0])).float().argmax(dim=-1)  # (B,) greedy draft
                drafts.append(token)
        verified = model.extend(torch.cat(hidden, dim=1), cache, draft_layers).float().argmax(dim=-1)  # (B, n)
        if drafts:
            drafted = torch.stack(drafts, dim=1)  # (B, k)
            accepted = (drafted == verified[:, :-1]).long().cumprod(dim=1).sum(dim=1)  # (B,) longest agreeing prefix
        else:
            drafted = verified[:, :0]
            accepted = torch.zeros(batch, dtype=torch.long, device=logits.device)
        next_tokens = verified.gather(1, accepted[:, None])[:, 0]  # (B,) the full model's token after them
        cache.truncate(start + accepted + 1)  # next_tokens' predecessor and the accepted drafts stay cached
        stats.rounds += 1
        stats.drafted += batch * drafts_this_round
        stats.accepted += int(accepted.sum())
        for row, (count, row_drafts, token) in enumerate(zip(accepted.tolist(), drafted.tolist(),
                                                             next_tokens.tolist(), strict=True)):
            for drafted_token in row_drafts[:count]:
                emit(row, drafted_token)
            emit(row, token)
    # What plain decoding leaves cached: the prompt and every new token but the last (not the overshoot).
    cache.truncate(torch.minimum(cache.positions, prompt_lengths + max_new_tokens - 1))
    return outputs, stats
