"""A-MoD's score (the attention a token received in the block before) is position-neutral in a causal decoder:
uniform attention scores every position alike, and the score is each weight over its row's uniform share 1 / (i + 1)
and over the usual such ratio at its query-key distance, averaged over the queries that see the token and over
heads."""

from __future__ import annotations

import torch

from modcli.models.decoder import Attention, config_rope
from tests.conftest import tiny_model_config

ATOL = 1e-5


def attention_and_rope(n: int):
    config = tiny_model_config(d_model=32, n_heads=4, seq_len=n)
    torch.manual_seed(0)
    return Attention(config), config_rope(config, torch.arange(n))


@torch.no_grad()
def test_uniform_attention_scores_every_position_equally():
    n = 64
    attention, (cos, sin) = attention_and_rope(n)
    attention.qkv.weight[: attention.sizes[0]] = 0.0  # q = 0: every query attends uniformly to the tokens it sees
    received = {}
    attention(torch.randn(2, n, 32), cos[None], sin[None], received=received)
    scores = received["scores"]  # (B, n)
    torch.testing.assert_close(scores, scores[:, :1].expand(2, n), atol=ATOL, rtol=0)
    one = {}
    attention(torch.randn(1, n, 32), cos[None], sin[None], received=one)
    torch.testing.assert_close(one["scores"], torch.ones(1, n), atol=ATOL, rtol=0)  # one sequence: not standardised


def test_with_a_batch_each_position_is_standardised_over_the_sequences():
    from modcli.models.decoder import received_attention

    torch.manual_seed(0)
    probs = torch.rand(3, 2, 10, 10).tril().softmax(-1).tril()
    probs = probs / probs.sum(-1, keepdim=True)  # (B, H, n, n) causal rows summing to 1
    scores = received_attention(probs)  # (B, n)
    torch.testing.assert_close(scores.mean(0), torch.zeros(10), atol=1e-3, rtol=0)
    torch.testing.assert_close(scores.std(0, correction=0), torch.ones(10), atol=1e-3, rtol=0)  # rounded to 1/1024


@torch.no_grad()
def test_the_score_compares_each_weight_with_the_usual_one_at_its_distance():
    n = 12
    attention, (cos, sin) = attention_and_rope(n)
    x = torch.randn(1, n, 32)
    received = {}
    attention(x, cos[None], sin[None], received=received)
    q, k, _ = attention._heads(x, cos[None], sin[None])
    probs = (q @ k.transpose(-1, -2) / attention.head_dim ** 0.5).masked_fill(
        ~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")).softmax(-1)[0]  # (H, n, n)
    heads = probs.shape[0]
    relative = [[[probs[h, i, j] * (i + 1) for j in range(n)] for i in range(n)] for h in range(heads)]
    usual = [[sum(relative[h][i][i - d] for i in range(d, n)) / (n - d) for d in range(n)] for h in range(heads)]
    expected = torch.zeros(n)
    for j in range(n):
        ratios = [relative[h][i][j] / usual[h][i - j] for h in range(heads) for i in range(j, n)]
        expected[j] = sum(ratios) / len(ratios)
    torch.testing.assert_close(received["scores"][0], expected, atol=1 / 2048, rtol=0)  # rounded to 1/1024


@torch.no_grad()
def test_runs_saved_before_the_option_keep_the_seen_by_score():
    from modcli.config import RunConfig
    from modcli.models.decoder import received_attention

    saved = RunConfig(model=tiny_model_config(router="attention")).to_dict()
    del saved["model"]["attention_score"]
    assert RunConfig.read_saved(saved).model.router_options.attention_score == "seen-by"
    assert RunConfig.from_dict(saved).model.router_options.attention_score == "neutral"
    torch.manual_seed(0)
    probs = torch.rand(2, 3, 6, 6).tril()
    probs = probs / probs.sum(-1, keepdim=True)
    expected = probs.sum(dim=2).mean(dim=1) / torch.arange(6, 0, -1)
    torch.testing.assert_close(received_attention(probs, "seen-by"), expected)
