"""Data-parallel (DDP) and sharded (FSDP2) training under `torchrun`, with no extra flags.

`torchrun` sets RANK, WORLD_SIZE and LOCAL_RANK; when WORLD_SIZE > 1 the process group is started with NCCL on
CUDA and Gloo on the CPU. MoD routing is per sequence, so routed blocks need no communication: the only
collectives are the gradient reduction of DDP/FSDP, the loss average for logging, and the checkpoint gather
(weights, optimizer, and every rank's RNG states).

Checkpoints hold a gathered full state dict (model and optimizer keyed by parameter name), the same format as a
single-process run, so a run can resume with any world size and either --parallel mode. Every rank reads the
checkpoint folder, so multi-node runs need --out on a shared filesystem.
"""

from __future__ import annotations

import gc
import os
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from modcli.errors import UserError
from modcli.hardware import resolve_device

PARALLEL_MODES = ("ddp", "fsdp")


@dataclass
class DistributedContext:
    """This process' place in the job (rank 0 of 1 without torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def setup(device_flag: str) -> DistributedContext:
    """Read the torchrun environment, pick the device and backend, and start the process group if needed."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_flag)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    context = DistributedContext(rank, world_size, local_rank, device)
    if context.enabled and not dist.is_initialized():
        if device.type == "mps":
            raise UserError("--device mps does not support multi-process training; use cpu or cuda")
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=10),
                                device_id=device if device.type == "cuda" else None)
    return context


def teardown(context: DistributedContext) -> None:
    """Destroy the process group once nothing that uses it is left: DDP's reducer, which the caller has dropped,
    may sit in a reference cycle, and freed after its process group it can hang; collect it first."""
    if context.enabled and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def agree_on_errors(context: DistributedContext, error: Exception | None) -> None:
    """All ranks learn whether any rank failed during set-up and raise the first error, instead of hanging."""
    if not context.enabled:
        if error is not None:
            raise error
        return
    errors: list = [None] * context.world_size
    dist.all_gather_object(errors, None if error is None else (type(error).__name__, str(error)))
    for rank, found in enumerate(errors):
        if found is not None:
            if error is not None and rank == context.rank:
                raise error
            raise UserError(f"rank {rank} failed: {found[1]}")


def wrap_model(model: nn.Module, context: DistributedContext, parallel: str) -> nn.Module:
    """DDP, or FSDP2 with `fully_shard` on every block and then the root; unchanged for one process."""
    if parallel not in PARALLEL_MODES:
        raise UserError(f"--parallel must be ddp or fsdp, got {parallel!r}")
    if not context.enabled:
        return model
    if parallel == "ddp":

        device_ids = [context.device.index] if context.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)


    # The routing records returned beside the activations hold views (router logits squeezed to (B, T)); they
    # are never modified in place, which is what FSDP2's warning is about.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def gradient_sync(wrapped: nn.Module, enabled: bool) -> None:
    """Skip the gradient all-reduce on all but the last micro-step of gradient accumulation."""
    if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        wrapped.require_backward_grad_sync = enabled
    elif hasattr(wrapped, "set_requires_gradient_sync"):
        wrapped.set_requires_gradient_sync(enabled)


def barrier(context: DistributedContext) -> None:
    """Wait for every rank (e.g. until rank 0 has written a file the others read)."""
    if context.enabled:
        dist.barrier()


def mean_across_ranks(value: torch.Tensor, context: DistributedContext) -> torch.Tensor:
    if context.enabled:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.AVG if context.device.type == "cuda" else dist.ReduceOp.SUM)
        if context.device.type != "cuda":  # Gloo has no AVG
            value /= context.world_size
    return value



def gather_to_main(value: Any, context: DistributedContext) -> list[Any] | None:
    """Every rank's picklable `value`, indexed by rank, on rank 0 (None on the others); a collective."""
    if not context.enabled:
        return [value]
    gathered: list[Any] | None = [None] * context.world_size if context.is_main else None
    dist.gather_object(value, gathered, dst=0)
    return gathered
