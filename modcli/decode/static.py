"""Decoding with static shapes, for torch.compile and CUDA graphs (gpt-fast style).

The eager decode (`MoDDecoder.decode_step`) gathers the rows a routed block processes, which takes a host sync per
routed block and gives shapes that change every step. Here every layer's K/V buffers are preallocated for
`max_tokens` and keep their address; one decode step is the export's `DecodeStepGraph` (the cache read only; a
routed block's work inside `torch.cond`, skipped when no row processes the token) followed by an in-place write of
the new K/V rows at each row's length (`write_new_rows`). The step has no host sync and no data-dependent shape,
so it compiles to one graph. On CUDA it runs as a CUDA graph (`mode="reduce-overhead"`) and, since inductor turns
a cond into a host-side branch that a CUDA graph cannot hold, branch-free there (`DecodeStepGraph(branch_free=
True)`: a routed block's work runs for every row and skipped rows are discarded, so decoding on CUDA gains the
single launch, not the skip). At batch > 1 a routed block whose token only a few rows process computes just
those rows, gathered into a fixed number of slots (`DecodeStepGraph(row_cap=...)`). The causal prefill
writes into the same buffers through the model's own forward, compiled with the selected count as a symbolic
size (`modcli.compiling`).

What the static shapes cost: attention reads all `max_tokens` slots of every layer (masked past each row's
length), and a routed layer's buffers are as large as a dense layer's (the eager cache grows with what was
stored). What they buy: no Python, no allocation and no sync per step.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from modcli.compiling import CompileStats, compile_module, first_call
from modcli.decode.graphs import DecodeStepGraph, row_cap_for
from modcli.errors import UserError
from modcli.hardware import TORCH_DTYPES
from modcli.models.cache import DecoderCache
from modcli.models.decoder import MoDDecoder


class StaticDecodeStep(nn.Module):
    """tokens (B,) -> logits (B, V): one decode step that updates the cache buffers (registered here) in place."""

    def __init__(self, graph: DecodeStepGraph, cache: DecoderCache) -> None:
        super().__init__()
        self.graph = graph
        self.kv_layers = graph.kv_layers  # --drop: layers without attention have no cache
        for layer in self.kv_layers:  # the cache's own tensors: one storage, two owners
            layer_cache = cache.layers[layer]
            self.register_buffer(f"keys_{layer}", layer_cache.keys, persistent=False)
            self.register_buffer(f"values_{layer}", layer_cache.values, persistent=False)
            self.register_buffer(f"lengths_{layer}", layer_cache.lengths, persistent=False)
            if layer in graph.local_layers:  # --sliding-window: each slot's original position
                self.register_buffer(f"slot_positions_{layer}", layer_cache.slot_positions, persistent=False)
        self.register_buffer("positions", cache.positions, persistent=False)

    def flat_cache(self) -> list[Tensor]:
        return [getattr(self, f"{kind}_{layer}") for layer in self.kv_layers for kind in self.graph.cache_kinds[layer]]

    def forward(self, tokens: Tensor) -> Tensor:
        cache = self.flat_cache()
        outputs = self.graph(tokens, self.positions, *cache)
        self.graph.write_outputs(outputs, cache, self.positions)
        self.positions.add_(1)
        return outputs[0]  # (B, V)


class StaticDecoder:
    """A model, a static KV cache for `batch` sequences of up to `max_tokens`, its prefill and its decode step.

    `compile`: torch.compile both (compile time and graph breaks in `compile_stats`); else they run eagerly, which
    is how the compiled path is checked against the eager one.
    """

    def __init__(self, model: MoDDecoder, batch: int, max_tokens: int, routing: str, device: torch.device,
                 dtype: str = "float32", compile: bool = True, branch_free: bool | None = None) -> None:
        family = model.config.family
        if not family.exportable:
            raise UserError(f"--compile: static decoding uses the export's decode step, which --arch "
                            f"{model.config.arch} does not have ({family.export_note})")
        self.model, self.routing = model, routing
        self.prefill_s = 0.0
        """Seconds of the last `prefill` (set by the callers that time it)."""
        self.cache = DecoderCache.allocate(model.config, batch, max_tokens, device, TORCH_DTYPES[dtype], static=True)
        # CUDA graphs cannot hold the host-side branch inductor makes of torch.cond: there the step is branch-free
        # (one graph launch a step; a routed block's work is done for every row and discarded for skipped rows).
        self.branch_free = device.type == "cuda" and compile if branch_free is None else branch_free
        # At batch > 1, a step where few rows process the token computes only those (up to about twice the expected
        # B x capacity rows; more take the all-rows branch).
        row_cap = row_cap_for(batch, model.config.capacity) if not model.config.dense else None
        graph = DecodeStepGraph(model, routing, branch_free=self.branch_free,
                                row_cap=row_cap if row_cap is not None and row_cap < batch else None).eval()
        self._step_module = StaticDecodeStep(graph, self.cache)
        self.compile_stats = CompileStats()
        self.compiled = compile
        if compile:
            self._step = compile_module(self._step_module, device, cuda_graphs=True)
            self._prefill = compile_module(self._prefill_eager, device, dynamic=None)
        else:
            self._step, self._prefill = self._step_module, self._prefill_eager
        self._first_step = self._first_prefill = compile

    def _prefill_eager(self, tokens: Tensor, lengths: Tensor | None = None) -> Tensor:
        return self.model(tokens, self.routing, cache=self.cache, lengths=lengths)

    def reset(self) -> None:
        """Forget every sequence (lengths and positions to 0; the buffers keep their address)."""
        for layer in self.cache.layers:
            layer.lengths.zero_()
            layer.full = None
        self.cache.positions.zero_()

    @torch.no_grad()
    def warm_up(self, tokens: Tensor, lengths: Tensor | None = None) -> None:
        """Compile the prefill at this shape and the decode step (their first calls, in `compile_stats`), then
        forget what they stored: later calls are the timed ones."""
        self.prefill(tokens, lengths)
        # the layout of the real steps, (B,) with stride 1 (at B = 1, `contiguous()` would keep the stride of T, and
        # the first real step would compile again: a stride change fails a guard)
        self.step(tokens[:, 0].clone(memory_format=torch.contiguous_format))
        self.reset()

    @torch.no_grad()
    def prefill(self, tokens: Tensor, lengths: Tensor | None = None) -> Tensor:
        """Causal forward of tokens (B, T) (right-padded after `lengths`), its K/V into the cache -> logits."""
        if self._first_prefill:
            self._first_prefill = False
            return first_call(lambda: self._prefill(tokens, lengths), self.compile_stats)
        return self._prefill(tokens, lengths)

    @torch.no_grad()
    def step(self, tokens: Tensor) -> Tensor:
        """tokens (B,) at each row's next position -> logits (B, V); the cache grows by what each block stored.

        The caller keeps every row within `max_tokens` (no check here: it would be a host sync per step)."""
        if self._first_step:
            self._first_step = False
            return first_call(lambda: self._step(tokens).clone(), self.compile_stats)
        return self._step(tokens).clone()  # a CUDA graph's output is overwritten by its next replay
