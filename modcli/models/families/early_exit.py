"""The early-exit family (`--arch early-exit`, LayerSkip): its options, their validation, layer dropout, exit losses.
The decoder is modcli.models.early_exit."""

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


EARLY_EXIT = EarlyExit(
    "early-exit", "modcli.models.early_exit:EarlyExitDecoder",
    "LayerSkip-style early exit: dense blocks, layer dropout rising with depth, an exit loss at every layer "
    "through the shared final norm and head; confidence exit and self-speculative decoding",
    options=EarlyExitOptions, aux_losses=("exits",), mod_routing=False, experts=False,
    exit_decoding=True,
    export_note="the bundle holds the full-depth forward and decode graphs; confidence exit and self-speculative "
                "decoding are not exported (the exit depth is data-dependent)")
