"""One decoding loop (modcli.decode.greedy): `modcli generate`, the lm-eval harness's generate_until and export
validation's eager reference all run it, and give the tokens of the plain loop they replaced: a causal prefill,
then argmax and one cached `decode_step` per token."""

from __future__ import annotations

import pytest
import torch

from modcli.data.tokenizer import ByteTokenizer
from modcli.decode import greedy
from modcli.decode.generation import GenerateConfig, generate, prefill
from modcli.models.cache import DecoderCache
from modcli.models.decoder import MoDDecoder
from tests.conftest import tiny_model_config

PROMPTS = ["def f_3(x):\n", "    return x * 2 + 1  # line", "a"]
CPU = torch.device("cpu")


def _model(**overrides) -> MoDDecoder:
    torch.manual_seed(0)
    model = MoDDecoder(tiny_model_config(**overrides)).eval()
    with torch.no_grad():  # router biases at zero: about half the tokens pass, both branches of each block run
        for block in model.blocks:
            if getattr(block.router, "score", None) is not None:
                block.router.score.bias.fill_(0.0)
    return model


@torch.no_grad()
def plain_greedy(model: MoDDecoder, prompts: list[list[int]], steps: int, routing: str):
    """The loop each caller had before: argmax, record, and a decode step unless it was the last token."""
    cache = DecoderCache.allocate(model.config, len(prompts), max(map(len, prompts)) + steps, CPU)
    logits = prefill(model, prompts, cache, routing, CPU, "float32")
    tokens, kept = [], []
    for step in range(steps):
        chosen = logits.argmax(dim=-1)
        tokens.append(chosen.tolist())
        kept.append(logits.clone())
        if step + 1 < steps:
            logits = model.decode_step(chosen, cache, routing).float()
    return [list(row) for row in zip(*tokens, strict=True)], torch.stack(kept, dim=1)  # (B, N), (B, N, V)


class Spy:
    """Wraps greedy_decode where a caller looks it up, counting the calls."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, logits, max_new_tokens, *args, **kwargs):
        self.calls.append(max_new_tokens)
        return greedy.greedy_decode(logits, max_new_tokens, *args, **kwargs)


@pytest.mark.parametrize("overrides, routing", [
    (dict(), "router"), (dict(), "predictor"), (dict(router="threshold", predictor_hidden=0), "router"),
    (dict(router="random", predictor_hidden=0, capacity=0.5), "router"), (dict(route_every=0), "dense"),
])
def test_generate_the_harness_and_validation_run_the_one_loop_and_its_tokens(overrides, routing, monkeypatch):
    from modcli.bundle import validation
    from modcli.decode import generation
    from modcli.evaluation import harness

    model = _model(**overrides)
    prompts = [list(p.encode()) for p in PROMPTS]
    want_tokens, want_logits = plain_greedy(model, prompts, 9, routing)
    spies = {name: Spy() for name in ("generation", "harness", "validation")}
    for name, module in (("generation", generation), ("harness", harness), ("validation", validation)):
        monkeypatch.setattr(module, "greedy_decode", spies[name])

    generated = generate(GenerateConfig(checkpoint="-", prompts=PROMPTS, max_new_tokens=9, temperature=0,
                                        routing=routing, device="cpu"), model=model, tokenizer=ByteTokenizer())
    assert generated.tokens == want_tokens
    assert harness.generate_greedy(model, routing, prompts, 9, CPU, "float32") == want_tokens
    reference = validation.eager_generation(model, prompts, 9, routing)
    assert reference.tokens == want_tokens
    for row, logits in enumerate(reference.logits):
        assert torch.equal(torch.from_numpy(logits), want_logits[row])  # the very logits each token came from
    assert {name: spy.calls for name, spy in spies.items()} == {name: [9] for name in spies}


def test_the_harness_stops_after_the_step_where_every_row_is_finished():
    from modcli.evaluation.harness import generate_greedy

    model = _model()
    prompts = [list(p.encode()) for p in PROMPTS]
    full, _ = plain_greedy(model, prompts, 12, "router")
    asked: list[int] = []

    def finished(tokens: list[int]) -> bool:
        asked.append(len(tokens))
        return len(tokens) >= 4

    assert generate_greedy(model, "router", prompts, 12, CPU, "float32", finished) == [row[:4] for row in full]
    assert max(asked) == 4


@torch.no_grad()
def test_sampled_generation_draws_the_tokens_of_the_plain_sampling_loop():
    from modcli_runtime.generate import sampling_uniforms

    from modcli.decode.generation import sample

    model = _model()
    prompts = [list(p.encode()) for p in PROMPTS]
    temperature, top_k, top_p, seed, steps = 0.9, 40, 0.95, 3, 8
    uniforms = torch.from_numpy(sampling_uniforms(seed, steps, len(prompts)))  # (N, B)
    cache = DecoderCache.allocate(model.config, len(prompts), max(map(len, prompts)) + steps, CPU)
    logits = prefill(model, prompts, cache, "router", CPU, "float32")
    want = []
    for step in range(steps):
        chosen = sample(logits, temperature, top_k, top_p, uniforms[step])
        want.append(chosen.tolist())
        logits = model.decode_step(chosen, cache, "router").float()
    result = generate(GenerateConfig(checkpoint="-", prompts=PROMPTS, max_new_tokens=steps, temperature=temperature,
                                     top_k=top_k, top_p=top_p, seed=seed, routing="router", device="cpu"),
                      model=model, tokenizer=ByteTokenizer())
    assert result.tokens == [list(row) for row in zip(*want, strict=True)]


def test_the_loop_feeds_every_token_but_the_last_and_stops_when_asked():
    vocab = 5
    fed: list[list[int]] = []

    def step(tokens: torch.Tensor) -> torch.Tensor:
        fed.append(tokens.tolist())
        return torch.nn.functional.one_hot((tokens + 1) % vocab, vocab).float()  # next token: this one + 1

    start = torch.nn.functional.one_hot(torch.tensor([0, 3]), vocab).float()  # (B=2, V)
    seen: list[list[int]] = []
    last = greedy.greedy_decode(start, 4, step, lambda index, tokens, logits: seen.append(tokens.tolist()))
    assert seen == [[0, 3], [1, 4], [2, 0], [3, 1]] and fed == seen[:-1]
    assert torch.equal(last.argmax(dim=-1), torch.tensor([3, 1]))  # the logits the last tokens came from

    fed.clear()
    seen.clear()
    greedy.greedy_decode(start, 4, step, lambda index, tokens, logits: seen.append(tokens.tolist()) or index == 1)
    assert len(seen) == 2 and len(fed) == 1
    assert greedy.greedy_decode(start, 0, step) is start and len(fed) == 1  # nothing to decode, nothing fed
