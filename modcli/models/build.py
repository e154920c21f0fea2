"""Building a fresh decoder from its config: the family's class (modcli.models.families), after a check that its
weights fit in memory, so that an absurd size is one line (UserError) and not a traceback."""

from __future__ import annotations

import torch
from torch import nn

from modcli.config import ModelConfig
from modcli.errors import UserError


def minimum_parameters(config: ModelConfig) -> int:
    """A lower bound of a model's parameter count from its config (embedding, and each block's query and output
    projections): enough to refuse absurd sizes before building anything."""
    width = config.n_heads * config.head_dim
    return config.vocab_size * config.d_model + config.n_layers * 2 * config.d_model * width


def available_memory() -> int | None:
    """Bytes of memory the kernel says are available (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits_in_memory(config: ModelConfig, bytes_per_parameter: int = 4) -> None:
    """Refuse (UserError) a model whose weights alone would not fit in the available memory."""
    need = minimum_parameters(config) * bytes_per_parameter
    available = available_memory()
    if available is not None and need > available:
        raise UserError(f"a model of --d-model {config.d_model}, --n-layers {config.n_layers}, --vocab-size "
                        f"{config.vocab_size} needs at least {need / 2**30:,.1f} GiB for its weights, more than the "
                        f"{available / 2**30:,.1f} GiB of memory available")


def build_model(config: ModelConfig) -> nn.Module:
    """A freshly initialised model of the config's family (--arch) on the CPU (a MoDDecoder or a subclass)."""
    check_fits_in_memory(config)
    try:
        return config.family.model_class()(config)
    except (MemoryError, torch.OutOfMemoryError) as exc:
        raise UserError(f"the model does not fit in memory ({_one_line(exc)})") from None
    except RuntimeError as exc:
        if "alloc" not in str(exc).lower():
            raise
        raise UserError(f"the model does not fit in memory ({_one_line(exc)})") from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
