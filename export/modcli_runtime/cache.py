"""The decode graph's KV cache in numpy buffers on the host: what the graph reads and the runtime writes in place.

numpy only. The device-resident variant for the CUDA provider, with the same interface, is modcli_runtime.device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}


@dataclass
class CacheSpec:
    """The decode graph's KV cache: one (B, Hkv, slots, hd) pair and one (B,) length vector per layer.

    The graph only reads it; after each step `write_rows` stores the step's K/V (outputs new_keys.L/new_values.L,
    (B, Hkv, 1, hd)) at slot lengths.L[b] of these numpy buffers, in place, and adds 1 to lengths.L[b]: for every
    row in a layer outside `processed_row_layers`, and only for rows with processed.L[b] true in the layers of
    `processed_row_layers` (attention-routed layers). Buffers grow by doubling when a row's next slot would not fit.

    A local (sliding-window) layer, in `local_layers`, has one more buffer, slot_positions.L (B, slots) int64: the
    original position of the token in each slot (a routed layer's slot s is the s-th token it kept, not position
    s), which its decode graph reads to mask the keys `window` or more positions back. `write_rows` stores the
    step's `positions` feed in it, at the slot where it stores the row's K/V.
    """

    n_layers: int
    n_heads: int
    head_dim: int
    dtype: str
    routed_layers: list[int]
    capacity: tuple[int, int]
    processed_row_layers: list[int]
    """Layers where only the rows that processed the token store its K/V (attention is routed); every other layer
    stores every row's."""
    kv_layers: list[int] | None = None
    """The layers that have a cache (a static drop removes a layer's attention and its cache); None = every layer
    (bundles written before drops existed)."""
    local_layers: list[int] = field(default_factory=list)
    """Local (sliding-window) layers: their cache also holds slot_positions.L (bundles of format 3 and later)."""

    @property
    def layers(self) -> list[int]:
        """The layers with a cache, in order."""
        return list(range(self.n_layers)) if self.kv_layers is None else self.kv_layers

    @classmethod
    def from_manifest(cls, decode: dict[str, Any]) -> CacheSpec:
        cache = decode["cache"]
        spec = cls(int(cache["n_layers"]), int(cache["n_heads"]), int(cache["head_dim"]), cache["dtype"],
                   [int(layer) for layer in cache["routed_layers"]], tuple(cache["capacity"]),
                   [int(layer) for layer in cache["processed_row_layers"]],
                   None if cache.get("kv_layers") is None else [int(layer) for layer in cache["kv_layers"]],
                   [int(layer) for layer in cache.get("local_layers", [])])
        if (spec.dtype not in NUMPY_DTYPES or not set(spec.processed_row_layers) <= set(spec.routed_layers)
                or not set(spec.layers) <= set(range(spec.n_layers)) or not set(spec.local_layers) <= set(spec.layers)):
            raise ValueError("bad cache description")
        return spec

    def writes_every_row(self, layer: int) -> bool:
        return layer not in self.processed_row_layers

    def initial_slots(self, layer: int, max_tokens: int) -> int:
        """Layers that store every row hold every token; attention-routed ones start at twice the top-k share and
        grow when full."""
        if self.writes_every_row(layer):
            return max(1, max_tokens)
        num, den = self.capacity
        return max(1, min(max_tokens, max(16, 2 * max(1, max_tokens * num // den))))

    def allocate(self, batch: int, max_tokens: int) -> dict[str, np.ndarray]:
        dtype = NUMPY_DTYPES[self.dtype]
        feeds: dict[str, np.ndarray] = {}
        for layer in self.layers:
            shape = (batch, self.n_heads, self.initial_slots(layer, max_tokens), self.head_dim)
            feeds[f"keys.{layer}"] = np.zeros(shape, dtype=dtype)
            feeds[f"values.{layer}"] = np.zeros(shape, dtype=dtype)
            feeds[f"lengths.{layer}"] = np.zeros(batch, dtype=np.int64)
            if layer in self.local_layers:
                feeds[f"slot_positions.{layer}"] = np.zeros((batch, shape[2]), dtype=np.int64)
        return feeds

    def ensure_room(self, feeds: dict[str, np.ndarray]) -> None:
        """Grow each layer's buffers (doubling) so that every row's next slot fits."""
        for layer in self.layers:
            self._grow(feeds, layer, int(feeds[f"lengths.{layer}"].max()) + 1)

    @staticmethod
    def _grow(feeds: dict[str, np.ndarray], layer: int, needed: int) -> None:
        """At least `needed` slots in the layer's buffers: doubling, so a copy happens O(log tokens) times."""
        keys = feeds[f"keys.{layer}"]
        if needed <= keys.shape[2]:
            return
        slots = max(needed, 2 * keys.shape[2])
        for name in ("keys", "values"):
            old = feeds[f"{name}.{layer}"]
            grown = np.zeros((*old.shape[:2], slots, old.shape[3]), dtype=old.dtype)
            grown[:, :, :old.shape[2]] = old
            feeds[f"{name}.{layer}"] = grown
        grow_slot_positions(feeds, layer, slots)

    def write_rows(self, feeds: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
        """Store one decode step's K/V in the cache buffers of `feeds`, in place, and advance their lengths.

        Row b's new_keys.L/new_values.L go to slot lengths.L[b] for every row of a layer that writes every row,
        and only for rows with processed.L[b] true in `processed_row_layers`; those rows' lengths grow by one. Only
        the written rows are touched (a buffer is reallocated only when it must grow).
        """
        for layer, every_row, (keys_name, values_name, lengths_name) in zip(self.layers, self._every_row,
                                                                             self._names, strict=True):
            lengths = feeds[lengths_name]
            if every_row:
                rows = np.arange(lengths.shape[0])
            else:
                processed = outputs[f"processed.{layer}"]
                if not processed.any():  # the block skipped the token in every row: nothing to store
                    continue
                rows = np.flatnonzero(processed)
            slots = lengths[rows]  # (n,)
            if slots.max() >= feeds[keys_name].shape[2]:
                self._grow(feeds, layer, int(slots.max()) + 1)
            new_keys, new_values = outputs[f"new_{keys_name}"], outputs[f"new_{values_name}"]
            keys, values = feeds[keys_name], feeds[values_name]
            if layer in self.local_layers:  # the rows' positions beside their K/V
                feeds[f"slot_positions.{layer}"][rows, slots] = feeds["positions"][rows]
            if rows.size <= 4:  # a few rows: plain indexing is cheaper than numpy's advanced indexing
                for row, slot in zip(rows.tolist(), slots.tolist(), strict=True):
                    keys[row, :, slot] = new_keys[row, :, 0]
                    values[row, :, slot] = new_values[row, :, 0]
            else:  # (n, Hkv, hd) into (B, Hkv, S, hd) at [row, :, slot, :]
                keys[rows, :, slots] = new_keys[rows, :, 0]
                values[rows, :, slots] = new_values[rows, :, 0]
            lengths[rows] = slots + 1

    def __post_init__(self) -> None:
        self._every_row = tuple(self.writes_every_row(layer) for layer in self.layers)
        self._names = tuple((f"keys.{layer}", f"values.{layer}", f"lengths.{layer}") for layer in self.layers)


def grow_slot_positions(feeds: dict[str, Any], layer: int, slots: int) -> None:
    """A local layer's slot_positions.L (B, S) widened to `slots` along with its K/V buffers (numpy, on the host, in
    both caches: the decode graph reads it as a small int64 input); nothing for other layers."""
    name = f"slot_positions.{layer}"
    old = feeds.get(name)
    if old is None or old.shape[1] >= slots:
        return
    grown = np.zeros((old.shape[0], slots), dtype=old.dtype)
    grown[:, :old.shape[1]] = old
    feeds[name] = grown
