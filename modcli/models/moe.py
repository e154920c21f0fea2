"""A Mixture-of-Experts MLP (token choice), with optional no-op experts for integrated MoDE.

Every token's gate scores the E real experts and the N no-op experts: p = softmax(gate(x)) over E + N. The token
goes to its `top_k` highest-scoring experts (token choice: each token decides from itself alone, so the choice is
causal and decoding one token uses the same rule). Its MLP update is

    mlp(x) = sum over its chosen real experts e of w(p_e) * expert_e(x)

and the block writes x + mlp(x), as it does with the dense MLP. A no-op expert contributes nothing and costs
nothing: a token whose choices are all no-op experts skips the MLP.

The weight w (--expert-weight): `unit` (the default) is p / p.detach(): value 1, so a chosen expert's update is not
shrunk by the gate (at init p is about 1 / (E + N), which scaled a top-1 update and its gradient down by E + N),
while the gate still learns from the gradient of log p. `probability` is p itself (runs made before the option;
their config.json loads with it). The measured effect is in docs/families.md.

Two dispatches, the same maths:

- **Training** (and export): a static expert capacity counted over the whole batch, C = ceil(capacity_factor x
  B x n x top_k / (E + N)) slots per real expert (Switch Transformer; a per-sequence capacity drops far more, as
  one sequence's tokens often prefer the same expert). Choices are served first-choice first, then position by
  position across the batch; a choice beyond its expert's C slots is dropped (that expert adds nothing for the
  token: it rides the residual) and counted. The experts run as one batched matmul over (E, C) slots, so the work
  is fixed: E x C tokens per batch. An exported graph has no capacity limit (C = B x n: exact, but every expert
  does B x n tokens of work).
- **Evaluation and decoding**: no capacity limit (a capacity would make a token's fate depend on other tokens,
  which decoding one token cannot know). The experts loop over exactly the tokens that chose them (one host sync
  for their counts), so FLOPs and latency count only the experts a token really used.

Hash routing (`routing="hash"`, --expert-routing hash; Hash Layers, Roller et al. 2021, arXiv 2106.04426): the
expert is a fixed function of the token id, `hash_table[id]`, a buffer saved with the weights and built from a
fixed seed as randperm(vocab) % E, so each expert gets vocab / E ids (--hash-table random), or by `modcli train`
from the training split's token counts (--hash-table balanced: the most frequent ids first, each to the expert
with the fewest tokens so far, so each expert gets about 1 / E of the training tokens). There is no gate: the
weight is 1, the balancing loss is 0 (nothing to balance), and the choice never moves while the experts train (a
learned gate moves most tokens between experts on the tiny preset: docs/results.md). Capacity is kept: the random
table is balanced over the vocabulary, not over the data, so an expert whose ids are frequent overflows unless
the factor is raised. The caller passes the token ids (B, n) of exactly the tokens in x (a routed block gathers
them with its selection).

The load-balancing loss is Switch Transformer's: (E + N) x sum_i f_i x P_i over all E + N experts, with f_i the
share of the choices that go to expert i (before capacity) and P_i the mean gate probability of expert i. It aims
at a uniform share, so with N no-op experts about N / (E + N) of the choices skip the MLP. The objective adds it
per MoE layer, summed (modcli.training.objective).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx.experimental.symbolic_shapes import guard_or_false


@dataclass
class ExpertStats:
    """What one MoE MLP did in its last forward pass (tensors, so reading them does not sync the device)."""

    aux_loss: Tensor
    """Switch load-balancing loss (0-d)."""
    load: Tensor
    """(E + N,) share of the choices each expert received (before capacity), no-op experts last."""
    dropped: Tensor
    """(0-d) share of the choices of real experts dropped by the capacity limit (0 outside training)."""
    noop: Tensor
    """(0-d) share of the choices that went to a no-op expert."""


EXPERT_WEIGHTS = ("unit", "probability")
"""--expert-weight: how a chosen expert's gate probability scales its update (see the module docstring)."""
HASH_TABLE_SEED = 0
"""The seed of hash routing's table (`hash_table`): every run of the same vocabulary and E gets the same table."""


def hash_table(vocab_size: int, experts: int) -> Tensor:
    """(vocab,) token id -> expert, a fixed random permutation modulo E: each expert gets floor or ceil(vocab / E)
    ids, the same for every run (HASH_TABLE_SEED)."""
    generator = torch.Generator().manual_seed(HASH_TABLE_SEED)
    return torch.randperm(vocab_size, generator=generator) % experts


def balanced_hash_table(counts: Tensor, experts: int) -> Tensor:
    """(vocab,) token id -> expert, Hash Layers' balanced assignment (Roller et al. 2021) from `counts` (vocab,),
    each id's number of training tokens: the ids in falling count (ties: the lower id first), each given to the
    expert with the fewest tokens so far (ties: the fewest ids, then the lower expert). An expert's share is then
    within the largest single id's share of 1 / E. Ids never seen (last) each go to the expert with the fewest ids,
    so text with other ids still spreads over every expert."""
    count = [int(c) for c in counts.tolist()]
    load, ids, table = [0] * experts, [0] * experts, [0] * len(count)
    for token in sorted(range(len(count)), key=lambda token: (-count[token], token)):
        if count[token] > 0:
            expert = min(range(experts), key=lambda e: (load[e], ids[e], e))
        else:
            expert = min(range(experts), key=lambda e: (ids[e], load[e], e))
        table[token] = expert
        load[expert] += count[token]
        ids[expert] += 1
    return torch.tensor(table, dtype=torch.long)


def balance_hash_tables(model: nn.Module, counts: Tensor) -> list[float] | None:
    """Give every hash-routed MoE MLP of `model` the balanced table of `counts` (--hash-table balanced); returns
    the share of the counted tokens each expert gets, or None when the model has no hash-routed MLP."""
    tables: dict[int, Tensor] = {}  # one table per number of experts
    for module in model.modules():
        if isinstance(module, MoEMLP) and module.hashed:
            if module.experts not in tables:
                tables[module.experts] = balanced_hash_table(counts, module.experts)
            module.hash_table.copy_(tables[module.experts])
    if not tables:
        return None
    experts, table = next(iter(tables.items()))
    load = torch.zeros(experts, dtype=torch.float64).index_add_(0, table, counts.double())
    return (load / load.sum().clamp(min=1)).tolist()


def expert_capacity(tokens: int, top_k: int, pool: int, capacity_factor: float) -> int:
    """Slots per real expert for a batch of `tokens` tokens (all its sequences together): ceil(factor x tokens x
    top_k / pool), at most `tokens` (a token chooses an expert at most once); an infinite factor (the
    --expert-capacity-warmup steps) is no limit."""
    if math.isinf(capacity_factor):
        return max(1, tokens)
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * top_k / pool)))


def load_balancing_loss(probs: Tensor, choice: Tensor) -> Tensor:
    """Switch's auxiliary loss: pool x sum_i f_i P_i; probs (N, pool) gate probabilities, choice (N, K) chosen."""
    pool = probs.shape[-1]
    share = F.one_hot(choice, pool).float().sum(dim=1).mean(dim=0) / choice.shape[-1]  # (pool,) f_i
    return pool * (share * probs.float().mean(dim=0)).sum()


class MoEMLP(nn.Module):
    """Token-choice top-k over `experts` SwiGLU experts (stacked weights) plus `noop_experts` that do nothing."""

    def __init__(self, d_model: int, hidden: int, experts: int, top_k: int = 1, capacity_factor: float = 1.25,
                 noop_experts: int = 0, expert_weight: str = "unit", routing: str = "learned",
                 vocab_size: int = 0) -> None:
        """`routing` learned (a gate) or hash (the fixed `hash_table` of `vocab_size` ids; top-1, no no-op
        experts, no gate parameters)."""
        super().__init__()
        self.experts, self.noop_experts, self.top_k = experts, noop_experts, top_k
        self.expert_weight = expert_weight
        self.hidden, self.capacity_factor = hidden, capacity_factor
        self.hashed = routing == "hash"
        if self.hashed:
            if top_k != 1 or noop_experts or vocab_size < 1:
                raise ValueError("hash routing is top-1 over the real experts of a known vocabulary")
            self.register_buffer("hash_table", hash_table(vocab_size, experts))  # (vocab,) saved with the weights
        else:
            self.gate = nn.Linear(d_model, experts + noop_experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(experts, d_model, 2 * hidden))  # (E, D, 2H)
        self.down = nn.Parameter(torch.empty(experts, hidden, d_model))  # (E, H, D)
        nn.init.normal_(self.gate_up, std=0.02)
        nn.init.normal_(self.down, std=0.02)
        self.stats: ExpertStats | None = None

    @property
    def pool(self) -> int:
        return self.experts + self.noop_experts

    def route(self, x: Tensor, token_ids: Tensor | None = None) -> tuple[Tensor | None, Tensor, Tensor]:
        """x (B, n, D) and its token ids (B, n) -> gate probabilities (B, n, E + N) in float32, the chosen experts
        (B, n, K) and the weights of their updates (B, n, K): their probabilities, or value 1 with the gradient of
        log p (`unit`). Hash routing: no probabilities (None), the table's expert of each id, weight 1."""
        if self.hashed:
            if token_ids is None:
                raise ValueError("a hash-routed MoE MLP needs the token ids of its tokens")
            choice = self.hash_table[token_ids][..., None]  # (B, n, 1)
            return None, choice, torch.ones(choice.shape, device=x.device)
        probs = self.gate(x).float().softmax(dim=-1)  # (B, n, pool)
        weight, choice = probs.topk(self.top_k, dim=-1)  # (B, n, K)
        if self.expert_weight == "unit":  # exactly 1 (x / x = 1 in floating point) unless p underflowed to 0
            weight = weight / weight.detach().clamp(min=torch.finfo(weight.dtype).tiny)
        return probs, choice, weight

    def forward(self, x: Tensor, token_ids: Tensor | None = None) -> Tensor:
        """x (B, n, D) -> the MLP update (B, n, D); zero for a token whose choices were no-op or dropped.
        `token_ids` (B, n): the ids of x's tokens (read by hash routing only)."""
        probs, choice, weight = self.route(x, token_ids)
        # A traced graph (export, torch.compile, a torch.cond branch) cannot read per-expert counts on the host.
        traced = torch.compiler.is_compiling()
        static = self.training or traced
        # An exported decode step has one token per row; the forward graph's (B, k) of a staged block is symbolic.
        if static and not self.training and guard_or_false(x.shape[1] == 1):
            out, dropped = self._decode_dispatch(x, choice, weight), torch.zeros((), device=x.device)
        elif static:
            tokens = x.shape[0] * x.shape[1]
            capacity = expert_capacity(tokens, self.top_k, self.pool, self.capacity_factor) if self.training \
                else tokens
            out, dropped = self._static_dispatch(x, choice, weight, capacity)
        else:
            out, dropped = self._exact_dispatch(x, choice, weight), torch.zeros((), device=x.device)
        if traced and not self.training:  # an inference graph has no use for the statistics (torch.cond forbids them)
            return out
        flat_choice = choice.flatten(0, 1)  # (B n, K)
        aux = (torch.zeros((), device=x.device) if probs is None  # hash routing: nothing to balance
               else load_balancing_loss(probs.flatten(0, 1), flat_choice))
        load = F.one_hot(flat_choice, self.pool).float().sum(dim=1).mean(dim=0) / self.top_k  # (pool,)
        self.stats = ExpertStats(aux, load.detach(), dropped, load[self.experts:].sum().detach())
        return out

    def expert(self, e: int, x: Tensor) -> Tensor:
        """Expert e's SwiGLU on x (..., D)."""
        gate, up = (x @ self.gate_up[e]).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.down[e]

    def _exact_dispatch(self, x: Tensor, choice: Tensor, weight: Tensor) -> Tensor:
        """Each real expert runs on exactly the tokens that chose it (a loop over experts, none over tokens)."""
        batch, n, d_model = x.shape
        tokens = x.reshape(-1, d_model)  # (N, D)
        flat_choice, flat_weight = choice.reshape(-1), weight.reshape(-1)  # (N K,)
        token_of = torch.arange(tokens.shape[0], device=x.device).repeat_interleave(self.top_k)  # (N K,)
        order = flat_choice.argsort(stable=True)  # choices grouped by expert, no-op experts last
        counts = torch.bincount(flat_choice, minlength=self.pool)[:self.experts].tolist()  # one host sync
        out = torch.zeros_like(tokens)  # (N, D)
        start = 0
        for e, count in enumerate(counts):
            if count:
                picked = order[start:start + count]  # (count,)
                rows = token_of[picked]
                update = self.expert(e, tokens[rows]) * flat_weight[picked, None].to(x.dtype)  # (count, D)
                out = out.index_add(0, rows, update)
            start += count
        return out.view(batch, n, d_model)

    def _decode_dispatch(self, x: Tensor, choice: Tensor, weight: Tensor) -> Tensor:
        """One token per row, x (B, 1, D), in static shapes (the exported decode step): each row's chosen experts'
        weights are gathered and applied by a batched matmul, so a row does its top-k experts' work, not E. Rows
        that chose a no-op expert are computed and discarded, unless no row chose a real expert: then `torch.cond`
        (an ONNX If) skips the experts altogether."""
        real = choice < self.experts  # (B, 1, K)

        def run(x: Tensor, choice: Tensor, weight: Tensor) -> Tensor:
            batch, _, d_model = x.shape  # read inside: a cond branch may not close over symbolic sizes
            real = choice < self.experts
            index = torch.where(real, choice, torch.zeros_like(choice)).reshape(-1)  # (B K,)
            rows = x.expand(batch, self.top_k, d_model).reshape(-1, 1, d_model)  # (B K, 1, D)
            gate, up = torch.bmm(rows, self.gate_up[index]).chunk(2, dim=-1)  # (B K, 1, H) each
            done = torch.bmm(F.silu(gate) * up, self.down[index]).view(batch, self.top_k, d_model)  # (B, K, D)
            return (done * (weight * real).to(x.dtype).view(batch, self.top_k, 1)).sum(dim=1, keepdim=True)

        def skip(x: Tensor, choice: Tensor, weight: Tensor) -> Tensor:
            return torch.zeros_like(x)

        if not self.noop_experts:
            return run(x, choice, weight)
        return torch.cond(real.any(), run, skip, (x, choice, weight))

    def _static_dispatch(self, x: Tensor, choice: Tensor, weight: Tensor, capacity: int) -> tuple[Tensor, Tensor]:
        """Each real expert gets `capacity` slots over the whole batch; choices beyond them are dropped. Returns the
        update (B, n, D) and the share of real-expert choices dropped (0-d)."""
        batch, n, d_model = x.shape
        experts, top_k = self.experts, self.top_k
        # Choices in priority order: every token's first choice, position by position across the batch (position 0
        # of every row, then position 1, ...), then every token's second choice, ...
        ordered = choice.permute(2, 1, 0).reshape(top_k * n * batch)  # (K n B,)
        one_hot = F.one_hot(ordered, self.pool)[:, :experts]  # (K n B, E); no-op choices are all zero
        rank = ((one_hot.cumsum(dim=0) - 1) * one_hot).sum(dim=-1)  # (K n B,) slot within its expert
        real = ordered < experts  # (K n B,)
        kept = real & (rank < capacity)
        dump = experts * capacity  # one extra slot takes every dropped or no-op choice, then is discarded
        slot = torch.where(kept, ordered * capacity + rank, torch.full_like(rank, dump))  # (K n B,)
        rows = torch.arange(batch, device=x.device) * n  # (B,) first flat token of each row
        token_of = (torch.arange(n, device=x.device)[:, None] + rows[None, :]).reshape(-1).repeat(top_k)  # (K n B,)
        inputs = x.reshape(batch * n, d_model)[token_of]  # (K n B, D)
        buffer = x.new_zeros(dump + 1, d_model).index_put((slot,), inputs)  # (E C + 1, D)
        hidden = buffer[:dump].view(experts, capacity, d_model)  # (E, C, D)
        gate, up = torch.bmm(hidden, self.gate_up).chunk(2, dim=-1)  # (E, C, H) each
        done = torch.bmm(F.silu(gate) * up, self.down).view(dump, d_model)  # (E C, D)
        done = torch.cat([done, x.new_zeros(1, d_model)])  # the dump slot's output is zero
        ordered_weight = weight.permute(2, 1, 0).reshape(-1)  # (K n B,)
        per_choice = done[slot] * (ordered_weight * kept).to(x.dtype)[:, None]  # (K n B, D)
        out = per_choice.view(top_k, n, batch, d_model).sum(dim=0).transpose(0, 1)  # (B, n, D)
        dropped = (real & ~kept).sum() / real.sum().clamp(min=1)
        return out, dropped.detach().float()
