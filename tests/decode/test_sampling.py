"""One sampling rule, implemented twice: torch (`modcli generate`) and numpy (`modcli-run`), token for token."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from modcli_runtime.generate import sample as numpy_sample
from modcli_runtime.generate import sampling_uniforms

from modcli.decode.generation import sample as torch_sample

SETTINGS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),
    (0.8, 0, 0.95),
    (0.7, 40, 1.0),
    (1.3, 20, 0.9),
    (2.0, 0, 0.5),
    (0.5, 1, 1.0),
    (0.0, 0, 1.0),
]


def reference_sample(row: list[float], temperature: float, top_k: int, top_p: float, u: float) -> int:
    """The rule written out for one row in plain Python: what both implementations must agree with."""
    if temperature == 0:
        return max(range(len(row)), key=lambda i: (row[i], -i))  # first of the largest
    scaled = [float(np.float32(x)) / temperature for x in row]
    if top_k:
        kth = sorted(scaled, reverse=True)[min(top_k, len(row)) - 1]
        scaled = [x if x >= kth else -math.inf for x in scaled]
    if top_p < 1:
        order = sorted(range(len(row)), key=lambda i: -scaled[i])  # Python's sort is stable
        top = scaled[order[0]]
        weights = [math.exp(scaled[i] - top) for i in order]
        total = sum(weights)
        before = 0.0
        for i, weight in zip(order, weights, strict=True):
            if before >= top_p:
                scaled[i] = -math.inf
            before += weight / total
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    total = sum(weights)
    cdf = 0.0
    below = 0
    for weight in weights:
        cdf += weight / total
        below += cdf < u
    return min(below, len(row) - 1)


def random_logits(rows: int, vocab: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((rows, vocab)) * rng.uniform(0.5, 4.0, (rows, 1))).astype(np.float32)
    logits[: rows // 4] = np.round(logits[: rows // 4])  # exact ties, as repeated bytes give
    return logits


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SETTINGS)
def test_torch_and_numpy_samplers_pick_the_same_tokens(temperature, top_k, top_p):
    logits = random_logits(400, 256, seed=3)
    uniforms = sampling_uniforms(11, 1, logits.shape[0])[0]  # (B,)
    from_numpy = numpy_sample(logits, temperature, top_k, top_p, uniforms)
    from_torch = torch_sample(torch.from_numpy(logits), temperature, top_k, top_p, torch.from_numpy(uniforms))
    assert from_torch.dtype == torch.long
    assert from_torch.tolist() == from_numpy.tolist()
    sample_rows = range(0, logits.shape[0], 4)  # the plain-Python rule is slow: every 4th row
    expected = [reference_sample(logits[r].tolist(), temperature, top_k, top_p, float(uniforms[r])) for r in sample_rows]
    assert [int(from_numpy[r]) for r in sample_rows] == expected
    if temperature == 0:
        assert from_numpy.tolist() == logits.argmax(axis=-1).tolist()
    elif top_k == 1:  # top-1 is greedy where the largest logit is unique (not in the rounded rows)
        assert from_numpy[100:].tolist() == logits[100:].argmax(axis=-1).tolist()
    else:
        assert len(set(from_numpy.tolist())) > 50  # really sampled: many different tokens


def test_the_uniform_stream_is_seeded_and_indexed_by_new_token_then_row():
    uniforms = sampling_uniforms(5, 7, 3)
    assert uniforms.shape == (7, 3) and uniforms.dtype == np.float64
    np.testing.assert_array_equal(uniforms, np.random.default_rng(5).random((7, 3)))
    assert not np.array_equal(uniforms, sampling_uniforms(6, 7, 3))


def test_both_samplers_resolve_the_cdf_in_float64():
    """Uniforms 1e-12 either side of a cdf step: float32 anywhere would move many tokens by one."""
    logits = random_logits(200, 256, seed=4)[50:]  # no exact ties
    cdf = np.cumsum(np.exp(logits.astype(np.float64)) / np.exp(logits.astype(np.float64)).sum(-1, keepdims=True), -1)
    step = np.random.default_rng(0).integers(10, 200, logits.shape[0])  # (B,) a cdf step in the body of each row
    at_step = cdf[np.arange(logits.shape[0]), step]  # (B,)
    for offset, expected in ((-1e-12, step), (1e-12, step + 1)):
        uniforms = at_step + offset
        assert numpy_sample(logits, 1.0, 0, 1.0, uniforms).tolist() == expected.tolist()
        chosen = torch_sample(torch.from_numpy(logits), 1.0, 0, 1.0, torch.from_numpy(uniforms))
        assert chosen.tolist() == expected.tolist()
