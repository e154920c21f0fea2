"""modcli: Mixture-of-Depths decoders you can train, evaluate, decode and profile.

The Python API mirrors the command line: `modcli train` is `train(RunConfig(...))`. Names are imported on first
use so that `modcli --help` does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "DataConfig": "modcli.config", "ModelConfig": "modcli.config", "RunConfig": "modcli.config",
    "TrainConfig": "modcli.config", "resolve_run_config": "modcli.config",
    "EvalConfig": "modcli.evaluation", "evaluate": "modcli.evaluation",
    "GenerateConfig": "modcli.generation", "generate": "modcli.generation",
    "MoDDecoder": "modcli.model", "train": "modcli.training",
    "ExportConfig": "modcli.export_bundle", "export": "modcli.export_bundle",
    "ProfileConfig": "modcli.profiling", "profile": "modcli.profiling",
}

if TYPE_CHECKING:
    from modcli.model import MoDDecoder


def load_model(run_or_checkpoint: str | Path, device: str = "cpu") -> MoDDecoder:
    """Load a trained model in eval mode; call it as `model(tokens, routing="router")` with tokens (B, T)."""
    from modcli.checkpoint import load_model_from

    return load_model_from(run_or_checkpoint, device)[0]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'modcli' has no attribute {name!r}")


__all__ = [*_EXPORTS, "load_model", "__version__"]
