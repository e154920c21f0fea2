"""modcli: Mixture-of-Depths decoders you can train, evaluate, decode and profile.

The Python API mirrors the command line: `modcli train` is `train(RunConfig(...))`. Names are imported on first
use so that `modcli --help` does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "DataConfig": "modcli.config", "ModelConfig": "modcli.config", "RunConfig": "modcli.config",
    "TrainConfig": "modcli.config", "resolve_run_config": "modcli.config",
    "EvalConfig": "modcli.evaluation.perplexity", "evaluate": "modcli.evaluation.perplexity",
    "HarnessConfig": "modcli.evaluation.harness", "evaluate_tasks": "modcli.evaluation.harness",
    "SensitivityConfig": "modcli.evaluation.sensitivity_config", "sensitivity": "modcli.evaluation.sensitivity",
    "measured_map": "modcli.evaluation.sensitivity", "plan_from": "modcli.evaluation.sensitivity",
    "GenerateConfig": "modcli.decode.generation", "generate": "modcli.decode.generation",
    "Utf8Stream": "modcli_runtime.text",
    "MoDDecoder": "modcli.models.decoder", "train": "modcli.training.loop",
    "ExportConfig": "modcli.bundle.config", "export": "modcli.bundle.writer",
    "export_hf": "modcli.bundle.hf.writer", "export_gguf": "modcli.bundle.gguf_export",
    "ProfileConfig": "modcli.profiling.config", "profile": "modcli.profiling.profile",
    "ImportConfig": "modcli.pretrained.importer", "import_model": "modcli.pretrained.importer",
    "RouteConfig": "modcli.reports.route_map", "route_map": "modcli.reports.route_map",
    "write_html": "modcli.reports.route_map", "write_png": "modcli.reports.route_map",
    "PNG_WINDOW": "modcli.reports.route_map", "PNG_MAX_TOKENS": "modcli.reports.route_map",
    "TokenizerTrainConfig": "modcli.data.tokenizer_training", "train_tokenizer": "modcli.data.tokenizer_training",
    "curves_plot": "modcli.reports.plots", "run_sweep": "modcli.sweep.runner",
    "complete_checkpoints": "modcli.checkpoint.store", "read_config": "modcli.checkpoint.store",
    "resolve_checkpoint": "modcli.checkpoint.store", "load_model": "modcli.checkpoint.store",
    "tune_cpu_allocator": "modcli.hardware",
}
"""Name -> the module that defines it, imported on first use: the config and library function of every command
(`modcli sweep`'s is `run_sweep`: `modcli.sweep` is the package modcli/sweep/) and
what the commands call besides."""

def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'modcli' has no attribute {name!r}")


__all__ = [*_EXPORTS, "__version__"]
