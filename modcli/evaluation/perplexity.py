"""`modcli eval`: validation loss, bits per byte and perplexity under each routing mode of the model's router.

A full-sequence mode (top-k, the training-time rule of the topk router) sees the future: token t's selection
depends on later tokens, so its numbers are a reference only. The causal modes (for the topk router `router`,
router logit > 0, and `predictor`, predictor logit > 0) are what decoding can really do; their losses are the
honest ones. Each mode is listed with `causal: true|false`, from the router's capabilities.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from modcli.checkpoint.store import load_model_from
from modcli.config import DataConfig, require
from modcli.data.corpus import evaluation_batches, load_corpus
from modcli.data.tokenizer import load_tokenizer
from modcli.evaluation.breakdown import LossBreakdown, breakdown, check_comparable, per_token_losses
from modcli.hardware import autocast, resolve_device
from modcli.models.decoder import MoDDecoder
from modcli.packed_linear import inference_linears
from modcli.training.objective import bits_per_byte, lm_loss, routing_agreement


@dataclass
class EvalConfig:
    """What `modcli eval` measures."""

    checkpoint: str
    """A run folder (its newest checkpoint) or one checkpoint folder."""
    data: str | None = None
    """Evaluate on this corpus' validation split instead of the one the model was trained on."""
    glob: str = "**/*"
    """File pattern when --data is a folder."""
    routing: list[str] = field(default_factory=list, metadata={"repeated": True})
    """Routing modes to evaluate (repeat the flag); empty = every mode of the model's router (non-causal ones as a
    reference). With --tasks: the one causal mode to run them under (default: the router's first)."""
    batches: int = 16
    """Validation batches."""
    batch_size: int = 8
    """Sequences per batch."""
    device: str = "auto"
    """auto, cpu, cuda or mps."""
    dtype: str = "float32"
    """Autocast dtype."""
    packed_linears: bool | None = None
    """On the CPU in float32: nn.Linear through oneDNN's prepacked kernel (`modcli.packed_linear`); False = PyTorch's
    default BLAS; None = the CPU's default (`packed_linear.packed_by_default`: AMD)."""
    against: str | None = None
    """Also score the same windows with this model (the original a conversion came from: a run folder or checkpoint)
    and break the loss difference down by token: by kind of token, by position in the window, the worst tokens, and
    the share of the extra loss the worst 1% and 10% of tokens carry (modcli.evaluation.breakdown)."""

    def __post_init__(self) -> None:
        require(self.batches >= 1, f"--batches must be >= 1, got {self.batches}")
        require(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")


@dataclass
class ModeResult:
    routing: str
    causal: bool
    loss: float
    bits_per_byte: float
    perplexity: float
    processed_fraction: dict[str, float]
    """Per routed block: fraction of tokens the block processed in this mode."""


@dataclass
class EvalResult:
    checkpoint: str
    step: int
    corpus: str
    tokens: int
    results: list[ModeResult]
    agreement: dict[str, dict[str, dict[str, float]]]
    """Per routed block, the router's statistics in its training mode (`Router.metrics`): for topk the causal rules
    against top-k (accuracy, precision, recall, processed fraction)."""
    router: str | None = None
    """The router kind (None for a dense model)."""
    kind: str = ""
    """The model family in words (ModelConfig.kind): dense, MoD ..., MoE ..., staged MoDE ..., integrated MoDE ..."""
    exit_losses: dict[str, float] = field(default_factory=dict)
    """The model family's own evaluation losses (`Family.evaluation_losses`, nats/token) on the same windows, by
    name; empty for a family with none. Early-exit models: the loss of the exit after each block, through the shared
    final norm and head (causal; the last block's is the model's loss)."""
    linear_kernel: str = "aten"
    """What nn.Linear ran with: onednn-packed (CPU float32, `modcli.packed_linear`) or aten (PyTorch's default)."""
    breakdown: LossBreakdown | None = None
    """With --against: where the loss difference to that model goes, token by token."""


@torch.no_grad()
def evaluate(config: EvalConfig) -> EvalResult:
    device = resolve_device(config.device)
    model, run_config, checkpoint = load_model_from(config.checkpoint, device)
    seq_len = run_config.model.seq_len
    data = run_config.data if config.data is None else DataConfig(data=config.data, glob=config.glob,
                                                                  tokenizer=run_config.data.tokenizer)
    tokenizer = load_tokenizer(data.tokenizer, checkpoint.parent, model.config.vocab_size)
    corpus = load_corpus(data, seq_len, tokenizer)
    for mode in config.routing:
        model.check_routing(mode)
    if run_config.model.dense:
        modes = ["dense"]
    else:
        modes = list(config.routing) or list(model.routing_modes())
    original = None
    if config.against is not None:
        original, original_config, _ = load_model_from(config.against, device)
        check_comparable(model, original, run_config.data.tokenizer, original_config.data.tokenizer, config.against)
    with inference_linears(model, device, config.dtype, config.packed_linears) as linears:
        result = _evaluate(config, model, run_config, checkpoint, corpus, modes, device)
        if original is not None:
            with inference_linears(original, device, config.dtype, config.packed_linears):
                result.breakdown = _breakdown(config, model, original, corpus, seq_len, tokenizer, device)
    return dataclasses.replace(result, linear_kernel=linears.kernel)


def _first_causal(model: MoDDecoder) -> str:
    return "dense" if model.config.dense else model.causal_modes()[0]


def _breakdown(config: EvalConfig, model: MoDDecoder, original: MoDDecoder, corpus, seq_len: int, tokenizer,
               device: torch.device) -> LossBreakdown:
    """--against: per-token losses of both models on `evaluate`'s windows, broken down (`breakdown`)."""
    routing, original_routing = _first_causal(model), _first_causal(original)
    losses, against_losses, all_targets = [], [], []
    for inputs, targets in evaluation_batches(corpus.val, seq_len, config.batch_size, config.batches):
        inputs, targets = inputs.to(device), targets.to(device)
        with autocast(device, config.dtype):
            losses.append(per_token_losses(model, inputs, targets, routing).cpu())  # (B, T)
            against_losses.append(per_token_losses(original, inputs, targets, original_routing).cpu())
        all_targets.append(targets.cpu())
    return breakdown(torch.cat(losses), torch.cat(against_losses), torch.cat(all_targets),
                     lambda token: tokenizer.decode([token]), config.against, routing)


def _evaluate(config: EvalConfig, model: MoDDecoder, run_config, checkpoint: Path, corpus, modes: list[str],
              device: torch.device) -> EvalResult:
    """`evaluate`'s loop over the validation batches and routing modes."""
    seq_len = run_config.model.seq_len
    caps = model.capabilities
    family = run_config.model.family
    family_totals: dict[str, float] = {}
    totals = {mode: 0.0 for mode in modes}
    processed = {mode: {} for mode in modes}
    agreement_sums: dict = {}
    n_batches = 0
    for inputs, targets in evaluation_batches(corpus.val, seq_len, config.batch_size, config.batches):
        inputs, targets = inputs.to(device), targets.to(device)
        n_batches += 1
        for mode in modes:
            with autocast(device, config.dtype):
                logits, aux = model(inputs, mode, return_aux=True)
                records = aux.records
            totals[mode] += lm_loss(logits, targets).item()
            for record in records:
                key = f"block{record.layer}"
                fraction = record.selection.counts.sum().item() / inputs.numel()
                processed[mode][key] = processed[mode].get(key, 0.0) + fraction
            for layer in run_config.model.noop_layers():  # integrated MoDE: the share of choices that ran an expert
                key = f"block{layer} mlp"
                fraction = 1.0 - aux.experts[layer].noop.item()
                processed[mode][key] = processed[mode].get(key, 0.0) + fraction
            if records and mode == model.training_mode:
                _accumulate(agreement_sums, routing_agreement(records))
        with autocast(device, config.dtype):
            family_losses = family.evaluation_losses(model, inputs, targets)
        for name, loss in family_losses.items():
            family_totals[name] = family_totals.get(name, 0.0) + loss.item()

    results = []
    for mode in modes:
        loss = totals[mode] / n_batches
        results.append(ModeResult(
            routing=mode, causal=caps is None or caps.is_causal(mode), loss=loss,
            bits_per_byte=bits_per_byte(loss, corpus.bytes_per_token), perplexity=math.exp(loss),
            processed_fraction={k: v / n_batches for k, v in processed[mode].items()}))
    agreement = {block: {rule: {k: v / n_batches for k, v in stats.items()} for rule, stats in rules.items()}
                 for block, rules in agreement_sums.items()}
    state_step = int(checkpoint.name.split("-")[-1]) if checkpoint.name.startswith("step-") else 0
    return EvalResult(str(checkpoint), state_step, corpus.description, n_batches * config.batch_size * seq_len,
                      results, agreement, None if run_config.model.dense else run_config.model.router,
                      run_config.model.kind, {name: total / n_batches for name, total in family_totals.items()})


def _accumulate(total: dict, update: dict) -> None:
    for key, value in update.items():
        if isinstance(value, dict):
            _accumulate(total.setdefault(key, {}), value)
        else:
            total[key] = total.get(key, 0.0) + value
