"""KV cache for decoding: one preallocated buffer per layer, written by slot, lengths per sequence.

A dense block stores every token. A routed block stores K/V only for the tokens it processed (already rotated
by RoPE at their original positions, in causal order), so its cache is really shorter; with --keep-skipped-kv (or
--route-part mlp) it stores every token, like a dense block (`kv_is_routed`). Routed buffers start
small and double when full, so memory follows what was stored rather than the longest possible sequence.
"""

from __future__ import annotations

import torch
from torch import Tensor


def store_token(keys: Tensor, values: Tensor, rows: Tensor, slots: Tensor, new_keys: Tensor,
                new_values: Tensor) -> None:
    """The one torch-side write of a decoded token's K/V: new_keys/new_values (n, Hkv, 1, hd) into the buffers
    keys/values (B, Hkv, S, hd) at [rows[i], :, slots[i]], in place (advanced-index assignment: index_put_)."""
    keys[rows, :, slots] = new_keys[:, :, 0].to(keys.dtype)  # (n, Hkv, hd) at [rows[i], :, slots[i]]
    values[rows, :, slots] = new_values[:, :, 0].to(values.dtype)


def write_new_rows(keys: Tensor, values: Tensor, lengths: Tensor, new_keys: Tensor, new_values: Tensor,
                   writes: Tensor | None = None) -> Tensor:
    """Store one decode step's K/V in preallocated buffers, in place, with static shapes and no host sync.

    keys/values (B, Hkv, S, hd) buffers, lengths (B,), new_keys/new_values (B, Hkv, 1, hd) as the decode graph
    returns them, writes (B,) bool: the rows that keep this step's K/V (a routed layer's `processed`; None = every
    row). Every row's K/V go to slot lengths[b]; only the rows that keep them advance their length, so for the
    others the slot stays past their length: never attended to, overwritten by their next kept token. The caller
    gives every row room (lengths[b] < S), as a cache preallocated for max_tokens does while positions < max_tokens;
    the slot is clamped to S - 1 so that a write never goes out of bounds. Returns the new lengths (B,): lengths +
    writes (the caller copies them into its length buffer: `lengths.copy_(...)`).
    """
    batch, slots = keys.shape[0], keys.shape[2]
    rows = torch.arange(batch, device=keys.device)  # (B,)
    slot = lengths.clamp(max=slots - 1)  # (B,)
    # Advanced-index assignment (index_put_), not scatter_: compiled, a scatter_ into a buffer becomes a copy of the
    # whole buffer (O(cache) a step), an index_put_ stays in place (measured: 1.3 ms vs 18 us at 8192 slots).
    # Every row writes at its slot lengths[b], those that keep nothing too: that slot lies past the row's length, so
    # no attention reads it and the row's next kept token overwrites it (during a step lengths[b] <= position < S,
    # so the clamp never moves a write onto a real slot). No gather, no select: two small in-place writes.
    store_token(keys, values, rows, slot, new_keys, new_values)
    return lengths + 1 if writes is None else lengths + writes.to(lengths.dtype)



class LayerKVCache:
    """K/V of one layer for a batch: (B, H, slots, head_dim) buffers and per-sequence lengths (B,)."""

    def __init__(self, batch: int, n_heads: int, head_dim: int, slots: int, max_slots: int,
                 device: torch.device, dtype: torch.dtype, static: bool = False, window: int = 0) -> None:
        self.max_slots = max_slots
        # --sliding-window: a local layer keeps each slot's original position (B, S), so that decode attends only
        # to keys at distance < window (a routed layer's slots are not its positions; the decode graph reads it as
        # slot_positions.L: modcli.decode.graphs); the buffers stay full-size
        self.window = window
        self.slot_positions = torch.zeros(batch, slots, dtype=torch.long, device=device) if window else None
        self.static = static  # never grows: buffers keep their address (compiled steps, CUDA graphs)
        self.keys = torch.zeros(batch, n_heads, slots, head_dim, device=device, dtype=dtype)
        self.values = torch.zeros_like(self.keys)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # (B,)
        self.max_length = 0  # host-side upper bound of lengths: attention reads only this many slots
        # Host-side: True when every row's length is max_length (every row holds the same slots, as in a dense layer
        # after an unpadded prefill), False when not, None when unknown (checked once, at the next append).
        self.full: bool | None = True

    @property
    def slots(self) -> int:
        return self.keys.shape[2]

    def _ensure_slots(self, needed: int) -> None:
        if self.static or needed <= self.slots:
            return
        new_slots = min(max(needed, 2 * self.slots), max(needed, self.max_slots))
        grow = new_slots - self.slots
        pad = self.keys.new_zeros(*self.keys.shape[:2], grow, self.keys.shape[3])
        self.keys = torch.cat([self.keys, pad], dim=2)
        self.values = torch.cat([self.values, pad], dim=2)
        if self.slot_positions is not None:
            more = self.slot_positions.new_zeros(self.slot_positions.shape[0], grow)  # (B, grow)
            self.slot_positions = torch.cat([self.slot_positions, more], dim=1)

    def write_prefix(self, rows: Tensor, keys: Tensor, values: Tensor, counts: Tensor,
                     positions: Tensor | None = None) -> None:
        """Prefill: keys/values (n, H, k, hd) go to slots 0..k-1 of `rows`; only `counts` of them are real.
        `positions` (n, k) or (k,): their original positions, which a local layer keeps (None: 0..k-1)."""
        k = keys.shape[2]
        self._ensure_slots(k)
        if self.slot_positions is not None:
            self.slot_positions[rows, :k] = (torch.arange(k, device=keys.device) if positions is None else positions)
        self.keys[rows, :, :k] = keys.to(self.keys.dtype)
        self.values[rows, :, :k] = values.to(self.values.dtype)
        self.lengths[rows] = counts
        self.full = None
        if not torch.compiler.is_compiling():  # compiled, k is a symbolic size; static decoding reads lengths only
            self.max_length = max(self.max_length, k)

    def append(self, rows: Tensor, keys: Tensor, values: Tensor,
               positions: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Decode: write one token per row (keys (n, H, 1, hd)) at its sequence's next slot.

        Returns the keys and values to attend to, (n, H, L, hd), and a boolean mask (n, 1, 1, L) that always
        includes the slot just written, so no attention row is ever fully masked; None when every row appends and
        every row's slots are all real (`full`): nothing to mask. A local layer (`window`) needs the tokens'
        positions (n,) and masks the slots at distance >= window from them.
        """
        if self.window:
            keys, values, mask = self._append(rows, keys, values, positions)
            span = keys.shape[2]
            stored = self.slot_positions[rows, :span]  # (n, L)
            near = stored > (positions[:, None] - self.window)  # (n, L) distance < window
            return keys, values, near[:, None, None, :] if mask is None else mask & near[:, None, None, :]
        return self._append(rows, keys, values)

    def _append(self, rows: Tensor, keys: Tensor, values: Tensor,
                positions: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        self._ensure_slots(self.max_length + 1)
        every_row = rows.shape[0] == self.keys.shape[0]
        if every_row and not torch.compiler.is_compiling():
            if self.full is None:  # one host sync, then known until something writes lengths out of step
                low, high = torch.aminmax(self.lengths)
                self.full = int(low) == int(high) == self.max_length
            if self.full:
                # Every row appends at the same slot and sees every slot: two slice copies and no mask, in place
                # of the indexed writes, the per-row slots and the mask of the general path.
                span = self.max_length + 1
                self.keys[:, :, span - 1:span] = keys.to(self.keys.dtype)
                self.values[:, :, span - 1:span] = values.to(self.values.dtype)
                if self.slot_positions is not None:
                    self.slot_positions[:, span - 1] = positions
                self.lengths += 1
                self.max_length = span
                return self.keys[:, :, :span], self.values[:, :, :span], None
        if not every_row:  # the rows fall out of step (a row that catches up again is only missed, never wrong)
            self.full = False
        slot = self.lengths[rows]  # (n,)
        store_token(self.keys, self.values, rows, slot, keys, values)
        if self.slot_positions is not None:
            self.slot_positions[rows, slot] = positions
        self.lengths[rows] = slot + 1
        self.max_length += 1
        span = self.max_length
        mask = torch.arange(span, device=slot.device)[None, :] <= slot[:, None]  # (n, L)
        if rows.shape[0] == self.keys.shape[0]:
            # Every row appends (always so in a dense layer): `rows` holds each row once, in order, so views of
            # the buffers replace an indexed copy of the whole cache at every step.
            return self.keys[:, :, :span], self.values[:, :, :span], mask[:, None, None, :]
        return self.keys[rows, :, :span], self.values[rows, :, :span], mask[:, None, None, :]

    def extend(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Several tokens for every row (keys (B, H, n, hd)) at each row's next n slots: the verify pass of
        speculative decoding (dense layers only, where a row's slot is its position).

        Returns the keys and values to attend to, (B, H, L, hd), and a boolean mask (B, 1, n, L): new token i of
        row b sees the row's cached slots and new tokens 0..i.
        """
        batch, _, n, _ = keys.shape
        self._ensure_slots(self.max_length + n)
        slots = self.lengths[:, None] + torch.arange(n, device=keys.device)  # (B, n)
        rows = torch.arange(batch, device=keys.device)[:, None].expand(batch, n)  # (B, n)
        self.keys[rows, :, slots] = keys.transpose(1, 2).to(self.keys.dtype)  # (B, n, H, hd) into (B, H, slots, hd)
        self.values[rows, :, slots] = values.transpose(1, 2).to(self.values.dtype)
        self.lengths += n
        self.max_length += n  # every row moved by n: `full` stays what it was
        span = self.max_length
        mask = torch.arange(span, device=keys.device)[None, None, :] <= slots[:, :, None]  # (B, n, L)
        return self.keys[:, :, :span], self.values[:, :, :span], mask[:, None]

    def truncate(self, lengths: Tensor) -> None:
        """Keep the first lengths[b] slots of each row (B,): the rest are forgotten and overwritten by later writes
        (speculative decoding's rollback of rejected drafts)."""
        self.lengths.copy_(torch.minimum(self.lengths, lengths))
        self.max_length = int(self.lengths.max()) if self.lengths.numel() else 0
        self.full = None

    def forget(self, rows: Tensor) -> None:
        """Empty the given rows (their lengths to 0; the buffers keep what they held, to be overwritten)."""
        self.lengths[rows] = 0
        self.full = None

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of K and V for one token of one sequence."""
        return 2 * self.keys.shape[1] * self.keys.shape[3] * self.keys.element_size()

    def stored_bytes(self) -> int:
        """Bytes of K and V actually held for the tokens this layer processed (filled slots only)."""
        return int(self.lengths.sum()) * self.bytes_per_slot

    def allocated_bytes(self) -> int:
        """Bytes of the K and V buffers as allocated, filled or not (what the device really holds)."""
        return self.keys.shape[0] * self.slots * self.bytes_per_slot


class DecoderCache:
    """The caches of every layer plus each sequence's next position."""

    def __init__(self, layers: list[LayerKVCache], positions: Tensor, max_tokens: int) -> None:
        self.layers = layers
        self.positions = positions  # (B,) position of the next token of each sequence
        self.max_tokens = max_tokens  # the most tokens a sequence may hold (a dense layer's preallocated slots)

    @classmethod
    def allocate(cls, config, batch: int, max_tokens: int, device: torch.device,
                 dtype: torch.dtype = torch.float32, static: bool = False) -> DecoderCache:
        """Dense layers (and routed ones that store every token's K/V: `kv_is_routed` false) get `max_tokens` slots
        up front; routed layers start at the top-k share and grow, unless `static` (every layer preallocated for
        max_tokens, gpt-fast style: fixed shapes and addresses for a compiled decode step, at the price of the memory
        a routed layer would save)."""
        layers = []
        for layer in range(config.n_layers):
            if config.attention_dropped(layer):  # --drop: no attention, no cache (an empty one keeps the indices)
                layers.append(LayerKVCache(batch, config.kv_heads, config.head_dim, 0, 0, device, dtype, static))
                continue
            if config.kv_is_routed(layer) and not static:
                slots = min(max_tokens, max(16, 2 * config.capacity_tokens(max_tokens)))
            else:
                slots = max_tokens
            window = config.sliding_window if config.is_sliding(layer) else 0
            layers.append(LayerKVCache(batch, config.kv_heads, config.head_dim, slots, max_tokens, device, dtype,
                                       static, window))
        return cls(layers, torch.zeros(batch, dtype=torch.long, device=device), max_tokens)

    def truncate(self, lengths: Tensor) -> None:
        """Roll every sequence back to its first lengths[b] tokens (B,), in every layer (dense layers: a slot is a
        position): speculative decoding's rollback past rejected drafts."""
        for layer in self.layers:
            layer.truncate(lengths)
        self.positions.copy_(lengths)

    def stored_bytes(self) -> int:
        """K/V bytes of the tokens each layer really processed (filled slots)."""
        return sum(layer.stored_bytes() for layer in self.layers)

    def allocated_bytes(self) -> int:
        """K/V bytes of the buffers as allocated (routed buffers grow by doubling, so some slots are empty)."""
        return sum(layer.allocated_bytes() for layer in self.layers)

    def dense_equivalent_bytes(self) -> int:
        """What a dense model of the same shape would store for the same tokens."""
        return int(self.positions.sum()) * self.layers[0].bytes_per_slot * len(self.layers)

    def dense_equivalent_allocated_bytes(self) -> int:
        """What `allocate` gives a dense model of the same shape: every layer preallocates `max_tokens` slots."""
        batch = self.positions.shape[0]
        return batch * self.max_tokens * self.layers[0].bytes_per_slot * len(self.layers)
