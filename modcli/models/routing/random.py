"""`random`: the paper's control. No router parameters; k random tokens per sequence, router weight 1.

Training draws fresh random scores every step (the torch generator, so a resumed run draws the same ones) and keeps
the top k. Evaluation and decoding use a fixed hash of (layer, position) instead, so results are reproducible and
the cached decode equals the full forward: the `topk` mode keeps the k positions with the highest hash (non-causal:
which k depends on T), the causal `router` mode processes a token when its hash falls below capacity, i.e. with
probability capacity. A learned router must beat this one's loss to show that routing learnt anything.
"""

from __future__ import annotations

import torch
from torch import Tensor

from modcli.models.routing.base import ExportedRule, Router, RouterCapabilities
from modcli.models.routing.selection import HASH_MODULUS, Selection, position_hash, select_topk

HASH_SCALE = 256
"""Hash values are divided by this before they become floats, so every value is exact in float32 (< 2**23)."""


class RandomRouter(Router):
    kind = "random"
    capabilities = RouterCapabilities(
        modes=("topk", "router"), causal_modes=("router",), static_mode="topk", parameters="none",
        notes={"topk": "k random tokens per sequence (fresh each training step; a fixed position hash in evaluation; "
                       "non-causal: which k depends on T)",
               "router": "a token is processed with probability capacity, by a hash of layer and position (causal)"})

    def logits(self, x: Tensor, positions: Tensor, previous_attention: Tensor | None = None) -> Tensor:
        batch, seq_len = x.shape[:2]
        if self.training:
            return torch.rand(batch, seq_len, device=x.device)  # (B, T) fresh scores every step
        return self._hash(positions).expand(batch, seq_len)  # (B, T)

    def _hash(self, positions: Tensor) -> Tensor:
        """(T,) or (B, T) positions -> the same shape of exact float32 scores in [0, 2**23)."""
        return (position_hash(self.layer, positions) // HASH_SCALE).float()

    def select(self, logits: Tensor, mode: str, k: int) -> Selection:
        return select_topk(logits, k)

    def decide(self, x: Tensor, logits: Tensor, mode: str, positions: Tensor, capacity: float,
               predictor_logits: Tensor | None = None) -> Tensor:
        return (self._hash(positions) < self._hash_cut(capacity)).expand(logits.shape)  # (B, T)

    @staticmethod
    def _hash_cut(capacity: float) -> float:
        """hash // HASH_SCALE below this for a share `capacity` of the positions."""
        return float(capacity * (HASH_MODULUS // HASH_SCALE))

    def exported_rule(self, mode: str) -> ExportedRule | None:
        if mode != "router":
            return None
        return ExportedRule("position_hash", cut=self._hash_cut(self.config.capacity))  # no parameters: weight 1
