"""A KV cache that stays on the execution provider's device (CUDA), for `--provider cuda`. numpy + onnxruntime only.

With numpy buffers (modcli_runtime.cache.CacheSpec), onnxruntime's CPU provider reads the cache where it lies, but
the CUDA provider would copy every layer's whole cache from host to device at every step. Here the cache is held
as onnxruntime OrtValues on the device instead, bound to the decode graph with I/O binding
(`bind_ortvalue_input`), and the step's new rows come back as device OrtValues (`bind_output(name, "cuda")`); only
tokens, positions, lengths, a local layer's slot_positions, logits and the processed flags cross to and from the
host.

The rows are written on the device, in place, by the bundle's `cache_write.onnx` (written by `modcli export`):
Gather the writing rows of new_keys.L, then ScatterND them into the cache at [row, head, lengths[row]], with the
graph's output bound to the very OrtValue that is its input. onnxruntime's ScatterND kernels (CPU and CUDA) copy
their input to their output only when the two are different buffers, so the write touches the new rows only. The
result is correct whatever onnxruntime does with that aliasing (at worst it would copy the layer's cache on the
device, at device bandwidth); only the speed relies on the kernels' in-place case, which is kernel behaviour rather
than a documented contract. The path is used for the CUDA provider (or when asked: the tests run it with the CPU
provider). Growth (doubling) goes through the host: O(log tokens) times.

Not tested on a GPU here (no GPU in the development sessions): on CUDA it is the same code with device "cuda".
"""

from __future__ import annotations

from typing import Any

import numpy as np

from modcli_runtime.cache import NUMPY_DTYPES, CacheSpec, grow_slot_positions

WRITER_GRAPH = "cache_write"
"""The bundle's graph that writes rows into a cache buffer in place (inputs cache, new_rows, rows, indices)."""


class DeviceCache:
    """KV cache buffers as device OrtValues: `allocate`, `step` (the decode graph through I/O binding) and
    `write_rows` (in place, on the device); the same interface as CacheSpec for `generate_tokens`."""

    def __init__(self, spec: CacheSpec, decode_session, writer_session, device: str = "cuda",
                 device_id: int = 0) -> None:
        self.spec = spec
        self.decode = decode_session
        self.writer = writer_session
        self.device, self.device_id = device, device_id
        self.n_layers, self.routed_layers = spec.n_layers, spec.routed_layers
        self.layers = spec.layers  # the layers with a cache (a static drop leaves a layer without)
        self.processed_row_layers = spec.processed_row_layers
        self.input_names = [value.name for value in decode_session.get_inputs()]
        self.output_names = [value.name for value in decode_session.get_outputs()]

    def to_device(self, array: np.ndarray):
        """A copy of a numpy array as an OrtValue on this cache's device."""
        import onnxruntime as ort

        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), self.device, self.device_id)

    def allocate(self, batch: int, max_tokens: int) -> dict[str, Any]:
        """Zero-filled buffers (slots beyond a row's length must hold finite values: attention masks them by a 0
        weight) on the device; lengths stay numpy on the host."""
        dtype = NUMPY_DTYPES[self.spec.dtype]
        feeds: dict[str, Any] = {}
        for layer in self.spec.layers:
            shape = (batch, self.spec.n_heads, self.spec.initial_slots(layer, max_tokens), self.spec.head_dim)
            for name in ("keys", "values"):
                feeds[f"{name}.{layer}"] = self.to_device(np.zeros(shape, dtype=dtype))
            feeds[f"lengths.{layer}"] = np.zeros(batch, dtype=np.int64)
            if layer in self.spec.local_layers:  # a local layer's slot positions: small, kept on the host
                feeds[f"slot_positions.{layer}"] = np.zeros((batch, shape[2]), dtype=np.int64)
        return feeds

    def step(self, feeds: dict[str, Any]) -> dict[str, Any]:
        """One decode step: logits and processed flags as numpy, new_keys.L/new_values.L as device OrtValues."""
        binding = self.decode.io_binding()
        for name in self.input_names:
            value = feeds[name]
            if isinstance(value, np.ndarray):
                binding.bind_cpu_input(name, np.ascontiguousarray(value))
            else:
                binding.bind_ortvalue_input(name, value)
        for name in self.output_names:
            if name.startswith("new_"):
                binding.bind_output(name, self.device, self.device_id)
            else:
                binding.bind_output(name)  # host memory: the runtime reads these
        self.decode.run_with_iobinding(binding)
        values = binding.get_outputs()
        return {name: value if name.startswith("new_") else value.numpy()
                for name, value in zip(self.output_names, values, strict=True)}

    def _grow(self, feeds: dict[str, Any], layer: int, needed: int) -> None:
        slots = feeds[f"keys.{layer}"].shape()[2]
        if needed <= slots:
            return
        for name in ("keys", "values"):
            old = feeds[f"{name}.{layer}"].numpy()  # through the host: doubling makes this rare
            grown = np.zeros((*old.shape[:2], max(needed, 2 * slots), old.shape[3]), dtype=old.dtype)
            grown[:, :, :slots] = old
            feeds[f"{name}.{layer}"] = self.to_device(grown)
        grow_slot_positions(feeds, layer, max(needed, 2 * slots))

    def write_rows(self, feeds: dict[str, Any], outputs: dict[str, Any]) -> None:
        """`CacheSpec.write_rows` on the device: row b's new K/V at slot lengths.L[b], in place."""
        batch = feeds[f"lengths.{self.spec.layers[0]}"].shape[0] if self.spec.layers else 0
        heads = np.arange(self.spec.n_heads)
        for layer in self.spec.layers:
            if self.spec.writes_every_row(layer):
                rows = np.arange(batch)
            else:
                rows = np.flatnonzero(outputs[f"processed.{layer}"])
            if rows.size == 0:
                continue
            lengths = feeds[f"lengths.{layer}"]
            slots = lengths[rows]  # (n,)
            self._grow(feeds, layer, int(slots.max()) + 1)
            if layer in self.spec.local_layers:  # the rows' positions beside their K/V (host memory)
                feeds[f"slot_positions.{layer}"][rows, slots] = feeds["positions"][rows]
            indices = np.empty((rows.size, heads.size, 3), dtype=np.int64)  # (n, Hkv, [row, head, slot])
            indices[..., 0], indices[..., 1], indices[..., 2] = rows[:, None], heads[None, :], slots[:, None]
            for name in ("keys", "values"):
                cache = feeds[f"{name}.{layer}"]
                binding = self.writer.io_binding()
                binding.bind_ortvalue_input("cache", cache)
                binding.bind_ortvalue_input("new_rows", outputs[f"new_{name}.{layer}"])
                binding.bind_cpu_input("rows", rows.astype(np.int64))
                binding.bind_cpu_input("indices", indices)
                binding.bind_ortvalue_output("cache_out", cache)  # the same buffer: ScatterND writes in place
                self.writer.run_with_iobinding(binding)
            lengths[rows] = slots + 1
