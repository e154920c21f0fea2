"""`modcli eval RUN --against ORIGINAL`: where a converted model's extra loss goes, token by token.

Both models score the same validation windows (the converted one under its first causal routing mode, the original
under its own); each target token's loss difference `delta_t = loss_t(RUN) - loss_t(ORIGINAL)` (nats) is then
summed by kind of token (what the target token's text is: whitespace, a word or identifier, digits, punctuation or
operators, or a mix), by where it sits in the window (quarters), and per distinct token; and the share of the total
extra loss that the worst 1% and 10% of tokens carry says whether a cut costs a little everywhere or a lot in a few
places. The per-block side of the question is the sensitivity map's (`modcli sensitivity`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from modcli.errors import UserError

TOKEN_KINDS = ("whitespace", "word", "digits", "punctuation", "mixed")
"""What a target token's text is (`token_kind`)."""


def token_kind(text: str) -> str:
    """whitespace (only spaces, tabs, newlines), word (letters, digits and underscores, at least one letter; a leading
    space allowed), digits, punctuation (no letter, digit or space after the leading space), or mixed."""
    if not text.strip():
        return "whitespace"
    body = text[1:] if text[0] == " " else text
    if body.isdigit():
        return "digits"
    if body.replace("_", "a").isalnum() and any(ch.isalpha() for ch in body):
        return "word"
    if not any(ch.isalnum() or ch.isspace() for ch in body):
        return "punctuation"
    return "mixed"


@dataclass
class LossShare:
    """The tokens of one group and their losses."""

    tokens: float
    """The group's share of the evaluated tokens."""
    loss: float
    """Mean loss of the group's tokens under the model (nats)."""
    against_loss: float
    """Mean loss of the same tokens under the original."""
    extra: float
    """The group's share of the total extra loss (sum of deltas); the shares of all groups add up to 1."""


@dataclass
class WorstToken:
    text: str
    """The target token's text (repr-quoted so whitespace shows)."""
    count: int
    """How often it is a target in the evaluated windows."""
    delta: float
    """Its mean loss difference (nats)."""
    extra: float
    """Its share of the total extra loss."""


@dataclass
class LossBreakdown:
    against: str
    """The original's checkpoint."""
    routing: str
    """The mode the model was run in (its first causal one; dense for a model without routers)."""
    loss: float
    against_loss: float
    tokens: int
    top_shares: dict[str, float]
    """Share of the total extra loss carried by the worst 1% and 10% of tokens (by delta)."""
    improved: float
    """Share of tokens whose loss fell."""
    kinds: dict[str, LossShare] = field(default_factory=dict)
    positions: dict[str, LossShare] = field(default_factory=dict)
    """By quarter of the window: positions 0..T/4-1, T/4..T/2-1, ..."""
    worst: list[WorstToken] = field(default_factory=list)
    """The distinct target tokens with the largest summed extra loss, worst first."""


def per_token_losses(model, inputs: torch.Tensor, targets: torch.Tensor, routing: str) -> torch.Tensor:
    """(B, T) next-token cross-entropy of each target (nats)."""
    logits = model(inputs, routing)  # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)


def check_comparable(model, original, tokenizer_spec: str, original_spec: str, against: str) -> None:
    """A UserError unless both models read the same token ids (vocabulary and tokenizer)."""
    if model.config.vocab_size != original.config.vocab_size or tokenizer_spec != original_spec:
        raise UserError(f"--against {against}: its tokenizer ({original_spec}, vocabulary "
                        f"{original.config.vocab_size}) is not the model's ({tokenizer_spec}, "
                        f"{model.config.vocab_size}); compare a model with the one it was converted from")


def breakdown(losses: torch.Tensor, against_losses: torch.Tensor, targets: torch.Tensor, decode, against: str,
              routing: str, worst: int = 10) -> LossBreakdown:
    """The breakdown of per-token losses (N, T) of the model and of the original on the same targets (N, T);
    `decode(id) -> str` spells a token."""
    delta = (losses - against_losses).double()  # (N, T)
    total = delta.sum().item()
    count = delta.numel()
    flat = delta.flatten()
    ranked = flat.sort(descending=True).values
    top = {f"{p}%": ranked[:max(1, count * p // 100)].sum().item() / total if total else 0.0 for p in (1, 10)}

    def share(mask: torch.Tensor) -> LossShare:
        n = int(mask.sum())
        if n == 0:
            return LossShare(0.0, 0.0, 0.0, 0.0)
        return LossShare(n / count, losses[mask].mean().item(), against_losses[mask].mean().item(),
                         delta[mask].sum().item() / total if total else 0.0)

    ids = targets.flatten().tolist()
    spelled = {token: decode(token) for token in set(ids)}
    kind_of = {token: token_kind(text) for token, text in spelled.items()}
    kind_ids = torch.tensor([TOKEN_KINDS.index(kind_of[token]) for token in ids]).view(targets.shape)
    kinds = {kind: share(kind_ids == index) for index, kind in enumerate(TOKEN_KINDS)}
    seq_len = targets.shape[1]
    quarter = torch.arange(seq_len) * 4 // seq_len  # (T,)
    positions = {f"{q * seq_len // 4}-{(q + 1) * seq_len // 4 - 1}": share((quarter == q).expand_as(targets))
                 for q in range(4)}
    sums = torch.zeros(max(ids) + 1, dtype=torch.float64).index_add_(0, targets.flatten(), flat)
    counts = torch.zeros(max(ids) + 1, dtype=torch.long).index_add_(0, targets.flatten(),
                                                                   torch.ones_like(targets.flatten()))
    order = sums.argsort(descending=True)[:worst].tolist()
    worst_tokens = [WorstToken(repr(spelled[token]), int(counts[token]), sums[token].item() / int(counts[token]),
                               sums[token].item() / total if total else 0.0) for token in order if counts[token]]
    return LossBreakdown(against, routing, losses.mean().item(), against_losses.mean().item(), count, top,
                         (delta < 0).double().mean().item(), kinds, positions, worst_tokens)
