"""Mixture-of-Recursions (Bae et al., 2025): a shared stack of blocks applied up to N times, with expert-choice
routing that keeps a shrinking share of the tokens before each recursion step.

Sharing ("middle-cycle"): the first and the last block are unique, the `RECURSION.shared_blocks(config)` blocks between them are
one shared stack applied `recursions` times, so `n_layers` (the unrolled depth, as for the dense twin) is
2 + recursions x shared blocks while the parameters count only 2 + shared blocks. The middle-cycle
choice follows the MoR paper, which found unique first and last layers better than sharing them: the embedding
side and the head side do different work from the middle.

Routing: before step r a router (one per step, `modcli.models.routing.topk.TopKRouter`: a linear scorer and a
stop-gradient predictor) scores every token. In training (mode `topk`) it keeps the top k_r = max(1, floor(c_r x T))
of the tokens still active (`--recursion-capacities`, non-increasing; the others have left with the hidden state
they had); the selected tokens run the shared stack (attention among themselves, causal, at their original
positions) and are written back (--recursion-update):

- `published` (the default), as the authors' code writes it (raymin0223/mixture_of_recursions,
  `model/mor_model/expert_choice_router.py`: `scatter_add(x, index, alpha * sigmoid(l) * block_output)`, where the
  block output is the hidden state with its residual): x + alpha w stack(x), w = sigmoid(router logit) (the
  --router-weight), alpha = --recursion-alpha (0.1, their configs'). The stack's output is added to x, not put in
  its place: the residual is carried once by x and once inside stack(x), as published. At init (w about 0.5) a
  step changes its tokens by about 5%, so a fresh model starts close to its first block alone.
- `delta`: x + w (stack(x) - x), the MoD block update with the stack as f (runs saved before the option load with
  it: with w = 1 a selected token leaves with stack(x), the plain recursive transformer).

Top-k sees the whole sequence, so as in MoD the auxiliary BCE loss teaches each router's sign (`router` mode) and
the predictor (`predictor` mode) to match it, over the tokens still active before the step only (as the authors':
a token that has left is no negative example for a later step, whose rule it never meets); those causal rules
decide token by token: a token continues to step r when it was active at step r - 1 and the rule says yes.

Recursion-wise KV caching: each step's blocks keep their own cache (`DecoderCache` layer 1 + r x R + j for step r,
shared block j) holding only the tokens that step processed, so the cache shrinks with depth; a cached decode
equals the causal full forward (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from modcli.config import ModelConfig
from modcli.errors import UserError
from modcli.models.cache import DecoderCache
from modcli.models.decoder import Block, ForwardAux, MoDDecoder, config_rope, decode_rope
from modcli.models.families.recursion import RECURSION
from modcli.models.routing.base import RouterCapabilities, RoutingRecord
from modcli.models.routing.selection import Selection, gather_tokens, residual_update, scatter_tokens, select_causal, select_topk
from modcli.models.routing.topk import TopKRouter, _labels, agreement

CAPABILITIES = RouterCapabilities(
    modes=("topk", "router", "predictor"), causal_modes=("router", "predictor"), static_mode="topk",
    needs_predictor=("predictor",), graphs=(),
    parameters="a linear router and a predictor MLP per recursion step",
    notes={"topk": "top-k of the still-active tokens before each recursion step (training; non-causal)",
           "router": "continue while the step's router logit > 0 (causal, trained by BCE against top-k)",
           "predictor": "continue while the step's predictor logit > 0 (causal, stop-gradient MLP)"})


@dataclass
class RecursionRecord(RoutingRecord):
    """A recursion step's RoutingRecord, with the tokens that were still active before the step."""

    active: Tensor | None = None
    """(B, T) bool: the tokens the step's router chose among (None: every token, the first step)."""


class RecursionRouter(TopKRouter):
    """A recursion step's router: the top-k router, its losses and statistics over the still-active tokens only."""

    def losses(self, record: RoutingRecord) -> tuple[Tensor, Tensor]:
        """BCE of the router and predictor logits against the step's top-k choice, averaged over the tokens that
        were active before the step (those that left earlier are not counted)."""
        labels, active = _labels(record), _active(record)  # (B, T) each
        count = active.sum().clamp(min=1)

        def bce(logits: Tensor) -> Tensor:
            per_token = F.binary_cross_entropy_with_logits(logits.float(), labels, reduction="none")  # (B, T)
            return (per_token * active).sum() / count

        predictor = record.router_logits.new_zeros((), dtype=torch.float32)
        if record.predictor_logits is not None:
            predictor = bce(record.predictor_logits)
        return bce(record.router_logits), predictor

    @torch.no_grad()
    def metrics(self, record: RoutingRecord) -> dict[str, dict[str, float]]:
        """Each causal rule against top-k, over the still-active tokens."""
        labels, active = _labels(record), _active(record).bool()
        out = {"router": agreement(record.router_logits[active] > 0, labels[active])}
        if record.predictor_logits is not None:
            out["predictor"] = agreement(record.predictor_logits[active] > 0, labels[active])
        return out


def _active(record: RoutingRecord) -> Tensor:
    """(B, T) float: 1 for the tokens the step chose among."""
    active = getattr(record, "active", None)
    return torch.ones_like(record.router_logits, dtype=torch.float32) if active is None else active.float()


class RecursionDecoder(MoDDecoder):
    """Embedding, a unique first block, the shared stack applied `recursions` times, a unique last block, head."""

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        plain = config.dense_twin()  # the blocks are plain dense blocks; routing happens between them
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.first = Block(plain, 0)
        self.shared = nn.ModuleList(Block(plain, 1 + j) for j in range(RECURSION.shared_blocks(config)))
        self.last = Block(plain, config.n_layers - 1)
        self.routers = nn.ModuleList(RecursionRouter(plain, step) for step in range(config.family_options.recursions))
        self._add_head_and_initialise((self.first, *self.shared, self.last))

    @property
    def blocks(self) -> list[Block]:  # the unique blocks (what FSDP wraps, what MoE statistics read)
        return [self.first, *self.shared, self.last]

    # --- routing: the commands ask these, as for MoD -------------------------------------------------------------

    @property
    def capabilities(self) -> RouterCapabilities:
        return CAPABILITIES

    def routing_modes(self) -> tuple[str, ...]:
        return self.routers[0].modes()

    @property
    def training_mode(self) -> str:
        return "topk"

    def check_routing(self, routing: str, causal: bool = False) -> None:
        offered = self.causal_modes() if causal else self.routing_modes()
        if routing not in offered:
            why = " (this model has no predictor)" if routing == "predictor" else ""
            if causal and routing in self.routing_modes():
                why = f" ({routing} is not causal: it sees the future and cannot decode)"
            raise UserError(f"--routing {routing}: Mixture-of-Recursions offers {', '.join(offered)}{why}")

    def step_share(self, step: int) -> float:
        """The share of the tokens still active before step r that step r keeps: c_r / c_(r-1) (what a fresh
        router is calibrated to, `modcli profile`)."""
        capacities = RECURSION.capacities(self.config)
        return capacities[step] / (capacities[step - 1] if step else 1.0)

    def cache_layer(self, step: int, shared: int) -> int:
        """Index in the DecoderCache of shared block `shared` at recursion step `step`."""
        return 1 + step * RECURSION.shared_blocks(self.config) + shared

    # --- the passes ----------------------------------------------------------------------------------------------

    def forward(self, tokens: Tensor, routing: str | None = None, *, return_aux: bool = False,
                cache: DecoderCache | None = None, cache_rows: Tensor | None = None, lengths: Tensor | None = None,
                capacity: float | None = None, k: int | None = None):
        """tokens (B, T) -> logits (B, T, V); with `return_aux`, (logits, ForwardAux) holding one RoutingRecord per
        recursion step, its `layer` the step. `routing`, `cache`, `cache_rows`, `lengths` as for
        MoDDecoder.forward; `capacity` and `k` are not used (the recursion capacities are fixed)."""
        routing = self.training_mode if routing is None else routing
        self.check_routing(routing)
        causal = CAPABILITIES.is_causal(routing)
        if lengths is not None and not causal:
            raise ValueError(f"padded rows (lengths) need causal routing: {routing} would rank the padding")
        batch, seq_len = tokens.shape
        positions = torch.arange(seq_len, device=tokens.device)
        cos, sin = config_rope(self.config, positions)  # (T, hd/2)
        if cache is not None and cache_rows is None:
            cache_rows = torch.arange(batch, device=tokens.device)
        layer_cache = (lambda i: cache.layers[i]) if cache is not None else (lambda i: None)
        x = self.embed(tokens)  # (B, T, D)
        x, _ = self.first(x, cos, sin, "dense", cache=layer_cache(0), cache_rows=cache_rows, lengths=lengths)
        active = torch.ones(batch, seq_len, dtype=torch.bool, device=tokens.device)  # (B, T)
        if lengths is not None:
            active &= positions[None, :] < lengths[:, None]
        records = []
        for step, router in enumerate(self.routers):
            router_logits = router.logits(x, positions)  # (B, T)
            predictor_logits = router.predictor_logits(x) if return_aux or routing == "predictor" else None
            if causal:
                decisions = router.decide(x, router_logits, routing, positions, 1.0, predictor_logits) & active
                selection = select_causal(decisions)
            else:
                k_step = min(RECURSION.step_tokens(self.config, step, seq_len), int(active.sum(dim=1).min()))
                selection = select_topk(router_logits.masked_fill(~active, float("-inf")), k_step)
            records.append(RecursionRecord(step, routing, router, router_logits, predictor_logits, selection,
                                           self.step_share(step), active=active if step else None))
            active = _selected_mask(selection, seq_len)
            x = self._recursion_step(x, selection, router, router_logits, cos, sin, step, cache, cache_rows)
        x, _ = self.last(x, cos, sin, "dense", cache=layer_cache(self.config.n_layers - 1), cache_rows=cache_rows,
                         lengths=lengths)
        if cache is not None:
            cache.positions[cache_rows] = seq_len if lengths is None else lengths
        logits = self.head(self.norm(x))  # (B, T, V)
        return (logits, ForwardAux(records)) if return_aux else logits

    def _recursion_step(self, x: Tensor, selection: Selection, router: TopKRouter, router_logits: Tensor,
                        cos: Tensor, sin: Tensor, step: int, cache: DecoderCache | None,
                        cache_rows: Tensor | None) -> Tensor:
        """The shared stack on the selected tokens only, written back by --recursion-update (`write_back`)."""
        idx = selection.selected_idx  # (B, k)
        if idx.shape[1] == 0:
            if cache is not None:
                for shared in range(len(self.shared)):
                    cache.layers[self.cache_layer(step, shared)].forget(cache_rows)
            return x
        x_selected = gather_tokens(x, idx)  # (B, k, D)
        hidden = x_selected
        for shared, block in enumerate(self.shared):
            prefill = None
            if cache is not None:
                prefill = (cache.layers[self.cache_layer(step, shared)], cache_rows, selection.counts)
            hidden = hidden + block.delta(hidden, cos[idx], sin[idx], prefill)  # (B, k, D)
        keep = None if selection.valid is None else selection.valid.unsqueeze(-1)
        return scatter_tokens(x, idx, self.write_back(x_selected, hidden, router, router_logits.gather(1, idx), keep))

    def write_back(self, x_selected: Tensor, stacked: Tensor, router: TopKRouter, logits: Tensor,
                   keep: Tensor | None = None) -> Tensor:
        """The selected tokens after the step, from their input x_selected and the stack's output `stacked` (..., k,
        D) and their router logits (..., k): x + alpha w stack(x) (`published`) or x + w (stack(x) - x)
        (`delta`), through the one routed-update function."""
        weight = router.weight(logits).unsqueeze(-1)  # (..., k, 1)
        if self.config.family_options.recursion_update == "published":
            return residual_update(x_selected, stacked, self.config.family_options.recursion_alpha * weight, keep)
        return residual_update(x_selected, stacked - x_selected, weight, keep)

    @torch.no_grad()
    def decode_step(self, tokens: Tensor, cache: DecoderCache, routing: str | None = None) -> Tensor:
        """tokens (B,) -> logits (B, V); a token leaves the recursion at the first step whose rule says no."""
        routing = routing or self.causal_modes()[0]
        self.check_routing(routing, causal=True)
        positions = cache.positions  # (B,)
        x = self.embed(tokens)[:, None]  # (B, 1, D)
        rope = decode_rope(self.config, positions)  # (B, 1, hd/2) each, shared by every block and recursion
        x = self.first.decode(x, positions, "dense", cache.layers[0], rope=rope)
        active = torch.ones(tokens.shape[0], dtype=torch.bool, device=tokens.device)  # (B,)
        for step, router in enumerate(self.routers):
            router_logits = router.logits(x, positions[:, None])  # (B, 1)
            active = active & router.decide(x, router_logits, routing, positions[:, None], 1.0)[:, 0]
            rows = active.nonzero().squeeze(1)  # (n,) a host sync per step, as in MoD's eager decode
            if rows.numel() == 0:
                continue  # every token has left (later routers still score, as the FLOP count assumes)
            x_rows = x[rows]  # (n, 1, D)
            cos, sin = rope[0][rows], rope[1][rows]  # (n, 1, hd/2)
            hidden = x_rows
            for shared, block in enumerate(self.shared):
                hidden = hidden + block._decode_delta(hidden, cos, sin, cache.layers[self.cache_layer(step, shared)],
                                                      rows)
            x = x.index_put((rows,), self.write_back(x_rows, hidden, router, router_logits[rows]))
        x = self.last.decode(x, positions, "dense", cache.layers[-1], rope=rope)
        cache.positions += 1
        return self.head(self.norm(x))[:, 0]  # (B, V)

    def active_parameters(self) -> int:
        return self.num_parameters()  # every parameter may be used by a token (the stack is shared, not routed)


def _selected_mask(selection: Selection, seq_len: int) -> Tensor:
    """(B, T) bool: the real selected positions."""
    idx = selection.selected_idx
    valid = torch.ones_like(idx, dtype=torch.bool) if selection.valid is None else selection.valid
    mask = torch.zeros(idx.shape[0], seq_len, dtype=torch.bool, device=idx.device)
    return mask.scatter(1, idx, valid)
