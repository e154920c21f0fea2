"""The models `modcli profile` compares: the one profiled (a checkpoint or a fresh model), its baseline (the dense or
MoE twin, another checkpoint, or none), and the calibration of untrained routers.

A model built from a config (no checkpoint) has untrained routers, whose causal yes/no would process about half of
the tokens. At each measured T, before anything is timed, each routed block's router and predictor bias is shifted
so that the causal rule (`--routing`) says yes to the top `capacity` share of the tokens, as a trained router does:
block by block in causal routing, on calibration tokens drawn apart from the timed ones. Such runs are labelled
"calibrated". A checkpoint's routers are used as trained.
"""

from __future__ import annotations

import torch

from modcli.checkpoint.store import load_model_from
from modcli.config import ModelConfig
from modcli.errors import UserError
from modcli.hardware import seed_everything
from modcli.models.build import build_model
from modcli.models.decoder import MoDDecoder
from modcli.profiling.calls import input_tokens
from modcli.profiling.config import ModelInfo, ProfileConfig

CALIBRATION_SEED_OFFSET = 2**31
"""Calibration tokens use seed + 2**31 + T; timed tokens use seed + T, so the two never coincide."""
CALIBRATION_ROWS = 8
"""Sequences of calibration tokens: the share a quantile keeps generalises better from more tokens."""


def load_subject(config: ProfileConfig, device: torch.device) -> tuple[MoDDecoder, ModelInfo]:
    """The profiled model: the checkpoint's, or a fresh one of `config.model` (its routers to be calibrated)."""
    if config.checkpoint is not None:
        model, _, checkpoint = load_model_from(config.checkpoint, device)
        return model, model_info(model, str(checkpoint), calibrated=False)
    model_config = config.model or ModelConfig()
    seed_everything(config.seed)
    model = build_model(model_config).to(device).eval()
    return model, model_info(model, "config", calibrated=not model_config.dense)  # unless nothing to shift


def load_baseline(config: ProfileConfig, model: MoDDecoder, info: ModelInfo,
                  device: torch.device) -> tuple[MoDDecoder | None, ModelInfo | None]:
    """What `--compare` names: the dense twin, the MoE twin, another checkpoint, or nothing."""
    if config.compare == "none":
        return None, None
    if config.compare in ("dense", "moe"):
        mc = model.config
        if config.compare == "dense":
            twin_config, what = mc.dense_mlp_twin(), "dense twin"
            if twin_config == mc:
                raise UserError(f"--compare dense: {info.source} is already dense; compare it with a checkpoint or "
                                "none")
        else:
            twin_config, what = mc.dense_twin(), "MoE twin"
            if not mc.experts:
                raise UserError(f"--compare moe: {info.source} has no experts (train it with --experts E)")
            if not mc.routed_layers() and not mc.noop_layers():
                raise UserError(f"--compare moe: {info.source} is already MoE without MoD; compare it with dense")
        seed_everything(config.seed)
        twin = build_model(twin_config).to(device).eval()
        return twin, model_info(twin, f"{what} of {info.source}", calibrated=False)
    try:
        other, _, checkpoint = load_model_from(config.compare, device)
    except UserError as exc:
        raise UserError(f"--compare: {exc}") from None
    return other, model_info(other, str(checkpoint), calibrated=False)


def model_info(model: MoDDecoder, source: str, calibrated: bool) -> ModelInfo:
    """What the result says about `model`: label, source, parameter counts, routing, the whole config."""
    mc = model.config
    return ModelInfo(label=mc.kind, source=source, parameters=model.num_parameters(),
                     active_parameters=model.active_parameters(), dense=mc.dense,
                     routed_layers=mc.routed_layers(), capacity=mc.capacity, routers_calibrated=calibrated,
                     config=mc.flat())


@torch.no_grad()
def calibrate_routers(model: MoDDecoder, config: ProfileConfig, device: torch.device, seq_len: int) -> bool:
    """Shift each untrained router (`Router.calibrate`) so its causal rule keeps the top `capacity` share.

    Block by block in order, running the model in the causal routing being profiled, because a block's decisions
    and router weights change what the next block sees. The tokens are drawn apart from the timed ones. Returns
    False when the router kind has nothing to calibrate (e.g. random).
    """
    tokens = input_tokens(model.config, CALIBRATION_ROWS, seq_len, config.seed + CALIBRATION_SEED_OFFSET, device)
    calibrated = False
    count = len(model(tokens, config.routing, return_aux=True)[1].records)
    for index in range(count):  # each router in order (MoD: routed blocks; Mixture-of-Recursions: steps)
        record = model(tokens, config.routing, return_aux=True)[1].records[index]
        calibrated |= record.router.calibrate(record, record.capacity)
    return calibrated
