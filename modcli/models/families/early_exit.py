"""The early-exit family (`--arch early-exit`, LayerSkip): its options, their validation, layer dropout, exit losses,
its decoding options (confidence exit, self-speculative) and its evaluation's per-exit losses. The decoder and the
decoding hook are modcli.models.early_exit."""

from __future__ import annotations

from dataclasses import dataclass

from modcli.errors import UserError
from modcli.models.families.base import Family


@dataclass(frozen=True)
class EarlyExitOptions:
    """--arch early-exit's own options (ModelConfig.family_options)."""

    layer_dropout_max: float = 0.1
    """--arch early-exit: training-time probability of skipping the last block for a whole sequence; block l of L
    is skipped with probability layer_dropout_max x l / (L - 1), 0 for the first."""
    exit_loss_scale: float = 0.5
    """--arch early-exit: weight of the early-exit loss beside the final layer's loss (weight 1): the exits of
    blocks 0..L-2, through the shared final norm and head, weighted (l + 1) / sum(j + 1), rising with depth."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.layer_dropout_max < 1.0:
            raise UserError(f"--layer-dropout-max must be in [0, 1), got {self.layer_dropout_max}")
        if self.exit_loss_scale < 0:
            raise UserError(f"--exit-loss-scale must be >= 0, got {self.exit_loss_scale}")


@dataclass(frozen=True)
class ExitDecodingOptions:
    """--arch early-exit's options of `modcli generate` (GenerateConfig.family_decoding): decoding with exits."""

    exit_threshold: float | None = None
    """Early-exit models: each new token leaves the blocks at the first exit whose top probability reaches this
    (modcli.models.early_exit; 1.0 = the full model); None = full depth."""
    speculative: int | None = None
    """Early-exit models: self-speculative decoding, drafting with the first E blocks (greedy only); None = off."""
    draft_tokens: int = 4
    """--speculative: tokens drafted per round."""

    def __post_init__(self) -> None:
        if self.exit_threshold is not None and not 0 < self.exit_threshold <= 1:
            raise UserError(f"--exit-threshold must be in (0, 1], got {self.exit_threshold}")
        if self.speculative is not None and not self.speculative >= 1:
            raise UserError(f"--speculative must be >= 1 (draft blocks), got {self.speculative}")
        if not self.draft_tokens >= 1:
            raise UserError(f"--draft-tokens must be >= 1, got {self.draft_tokens}")
        if self.speculative is not None and self.exit_threshold is not None:
            raise UserError("give --exit-threshold or --speculative, not both")

    def check_generation(self, config) -> None:
        """Against `modcli generate`'s own settings (GenerateConfig): the static cache of --compile decodes at full
        depth, and self-speculative decoding is greedy."""
        if config.compile and (self.exit_threshold is not None or self.speculative is not None):
            raise UserError("--compile decodes at full depth with a static cache; it does not combine with "
                            "--exit-threshold or --speculative")
        if self.speculative is not None and config.temperature != 0:
            raise UserError("--speculative decodes greedily (its output is the full model's greedy output): pass "
                            "--temperature 0")


@dataclass(frozen=True)
class EarlyExit(Family):
    def describe(self, config) -> str:
        options = config.family_options
        return f"early exit (layer dropout {options.layer_dropout_max:g}, exit loss {options.exit_loss_scale:g})"

    def layer_dropout(self, config, layer: int) -> float:
        """Linear in depth: 0 for the first block, layer_dropout_max for the last."""
        if config.n_layers == 1:
            return 0.0
        return config.family_options.layer_dropout_max * layer / (config.n_layers - 1)

    def extra_head_passes(self, config) -> int:
        """An exit after every block but the last, when the exit loss is on."""
        return config.n_layers - 1 if config.family_options.exit_loss_scale > 0 else 0

    def evaluation_losses(self, model, inputs, targets) -> dict:
        """The loss of the exit after every block, through the shared final norm and head (block0 .. block{L-1}, the
        last being the model's loss): the decoder's `exit_losses`."""
        return model.exit_losses(inputs, targets)


EARLY_EXIT = EarlyExit(
    "early-exit", "modcli.models.early_exit:EarlyExitDecoder",
    "LayerSkip-style early exit: dense blocks, layer dropout rising with depth, an exit loss at every layer "
    "through the shared final norm and head; confidence exit and self-speculative decoding",
    options=EarlyExitOptions, aux_losses=("exits",), mod_routing=False, experts=False,
    decoding_options=ExitDecodingOptions, decoding="modcli.models.early_exit:exit_decoding",
    export_note="the bundle holds the full-depth forward and decode graphs; confidence exit and self-speculative "
                "decoding are not exported (the exit depth is data-dependent)")
