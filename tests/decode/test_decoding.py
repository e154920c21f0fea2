"""Causal routing: cached decoding equals the full forward, causality, a cache that really shrinks."""

from __future__ import annotations

import pytest
import torch

from modcli.models.cache import DecoderCache
from modcli.models.decoder import MoDDecoder
from tests.conftest import tiny_model_config

ATOL = 1e-4


def _model(**overrides) -> MoDDecoder:
    torch.manual_seed(0)
    model = MoDDecoder(tiny_model_config(**overrides)).eval()
    with torch.no_grad():  # router biases near zero make about half the tokens pass: both branches get used
        for block in model.blocks:
            if block.router is not None:
                block.router.score.bias.fill_(0.0)
    return model


@pytest.mark.parametrize("routing", ["router", "predictor"])
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("shape", [{}, {"qk_norm": True, "n_kv_heads": 2}], ids=["plain", "qk-norm"])
@torch.no_grad()
def test_cached_decoding_equals_one_full_forward(routing, dense, shape):
    model = _model(route_every=0, **shape) if dense else _model(**shape)
    tokens = torch.randint(0, 256, (3, 40))
    full = model(tokens, routing)  # (B, T, V)
    cache = DecoderCache.allocate(model.config, 3, 40, torch.device("cpu"))
    prefill_len = 12
    logits = [model(tokens[:, :prefill_len], routing, cache=cache)[:, -1]]
    for t in range(prefill_len, 40):
        logits.append(model.decode_step(tokens[:, t], cache, routing))
    stepped = torch.stack(logits, dim=1)  # (B, T - prefill + 1, V)
    torch.testing.assert_close(stepped, full[:, prefill_len - 1:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("routing", ["router", "predictor"])
@torch.no_grad()
def test_padded_prefill_equals_prefilling_each_prompt_alone_and_decodes_like_the_full_forward(routing):
    model = _model()
    lengths = [5, 17, 11]
    steps = 10
    sequences = [torch.randint(0, 256, (length + steps,)) for length in lengths]
    padded = torch.randint(0, 256, (3, max(lengths)))  # (B, T) the padding is random bytes: it must not matter
    for row, length in enumerate(lengths):
        padded[row, :length] = sequences[row][:length]
    cache = DecoderCache.allocate(model.config, 3, max(lengths) + steps, torch.device("cpu"))
    logits = model(padded, routing, cache=cache, lengths=torch.tensor(lengths))  # (B, T, V)
    assert cache.positions.tolist() == lengths
    for row, length in enumerate(lengths):
        alone = DecoderCache.allocate(model.config, 1, length + steps, torch.device("cpu"))
        expected = model(sequences[row][None, :length], routing, cache=alone)[0, -1]  # (V,)
        torch.testing.assert_close(logits[row, length - 1], expected, atol=1e-5, rtol=0)
        for layer in range(model.config.n_layers):
            assert cache.layers[layer].lengths[row] == alone.layers[layer].lengths[0], (row, layer)

    stepped = [[] for _ in lengths]
    for t in range(steps):
        next_tokens = torch.stack([sequences[row][length + t] for row, length in enumerate(lengths)])  # (B,)
        step_logits = model.decode_step(next_tokens, cache, routing)  # (B, V)
        for row in range(3):
            stepped[row].append(step_logits[row])
    for row, length in enumerate(lengths):
        full = model(sequences[row][None], routing)[0]  # (T_row, V)
        torch.testing.assert_close(torch.stack(stepped[row]), full[length:], atol=ATOL, rtol=0)


@torch.no_grad()
def test_generation_prefill_is_one_forward_for_prompts_of_different_lengths():
    from modcli.decode.generation import prefill

    model = _model()
    calls = []
    model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(args[0].shape), with_kwargs=True)
    prompts = [b"def f(x):", [105, 109, 112], b"a"]  # bytes or lists of ints, as export validation passes them
    cache = DecoderCache.allocate(model.config, 3, 16, torch.device("cpu"))
    logits = prefill(model, prompts, cache, "router", torch.device("cpu"), "float32")  # (B, V)
    assert calls == [torch.Size([3, 9])]
    for row, prompt in enumerate(prompts):
        alone = model(torch.tensor([list(prompt)]), "router")[0, -1]
        torch.testing.assert_close(logits[row], alone, atol=1e-5, rtol=0)


@torch.no_grad()
def test_generate_reports_stored_and_allocated_kv_cache_bytes():
    from modcli.commands.generate import kv_cache_summary
    from modcli.decode.generation import GenerateConfig, generate

    model = _model()
    result = generate(GenerateConfig(checkpoint="-", prompts=["def f(x):", "a"], max_new_tokens=20, device="cpu"),
                      model=model)
    assert 0 < result.kv_cache_bytes <= result.kv_cache_allocated_bytes
    assert 0 < result.dense_kv_cache_bytes <= result.dense_kv_cache_allocated_bytes
    assert result.kv_cache_bytes < result.dense_kv_cache_bytes
    config = model.config
    slot_bytes = 2 * config.n_heads * config.head_dim * 4  # K and V of one token in one layer, float32
    assert result.dense_kv_cache_allocated_bytes == 2 * (9 + 20) * slot_bytes * config.n_layers
    summary = kv_cache_summary(result)
    assert f"stored {result.kv_cache_bytes:,} B vs dense {result.dense_kv_cache_bytes:,} B" in summary
    assert f"allocated {result.kv_cache_allocated_bytes:,} B vs dense {result.dense_kv_cache_allocated_bytes:,} B" in summary


@torch.no_grad()
def test_routed_cache_length_equals_the_number_of_processed_tokens():
    model = _model()
    tokens = torch.randint(0, 256, (2, 30))
    _, aux = model(tokens, "router", return_aux=True)
    records = aux.records
    cache = DecoderCache.allocate(model.config, 2, 30, torch.device("cpu"))
    model(tokens[:, :1], "router", cache=cache)
    for t in range(1, 30):
        model.decode_step(tokens[:, t], cache, "router")
    for record in records:
        assert cache.layers[record.layer].lengths.tolist() == record.selection.counts.tolist()
    for layer in range(model.config.n_layers):
        if not model.config.is_routed(layer):
            assert cache.layers[layer].lengths.tolist() == [30, 30]
    assert cache.stored_bytes() < cache.dense_equivalent_bytes()


@torch.no_grad()
def test_a_skipped_token_does_no_attention_or_mlp_work():
    model = _model()
    routed = model.blocks[model.config.routed_layers()[0]]
    calls = {"attn": 0, "mlp": 0}
    routed.attn.register_forward_hook(lambda *a: calls.__setitem__("attn", calls["attn"] + 1))
    routed.mlp.register_forward_hook(lambda *a: calls.__setitem__("mlp", calls["mlp"] + 1))
    cache = DecoderCache.allocate(model.config, 1, 8, torch.device("cpu"))
    model(torch.tensor([[1, 2, 3]]), "router", cache=cache)
    length_before = cache.layers[routed.layer].lengths.item()
    with torch.no_grad():
        routed.router.score.bias.fill_(-1e4)  # the router now skips every token
    calls.update(attn=0, mlp=0)
    model.decode_step(torch.tensor([4]), cache, "router")
    assert calls == {"attn": 0, "mlp": 0}
    assert cache.layers[routed.layer].lengths.item() == length_before
    with torch.no_grad():
        routed.router.score.bias.fill_(1e4)  # ...and now processes it: the counter can move
    model.decode_step(torch.tensor([5]), cache, "router")
    assert calls["mlp"] == 1
    assert cache.layers[routed.layer].lengths.item() == length_before + 1


@torch.no_grad()
def test_causal_modes_do_not_see_the_future_and_topk_does():
    model = _model()
    tokens = torch.randint(0, 256, (2, 32))
    changed = tokens.clone()
    t = 15
    changed[:, t + 1:] = torch.randint(0, 256, (2, 32 - t - 1))
    for routing in ("router", "predictor"):
        torch.testing.assert_close(model(tokens, routing)[:, :t + 1], model(changed, routing)[:, :t + 1],
                                   atol=1e-5, rtol=0)
    # Top-k over the whole sequence lets later tokens change earlier logits.
    topk_diff = (model(tokens, "topk")[:, :t + 1] - model(changed, "topk")[:, :t + 1]).abs().max()
    assert topk_diff > 1e-4


@torch.no_grad()
def test_batch_decoding_with_different_prompt_lengths_matches_single_sequences():
    from modcli.decode.generation import GenerateConfig, generate

    model = _model()
    prompts = ["def f(x):", "import os\nprint", "a"]
    config = GenerateConfig(checkpoint="-", prompts=prompts, max_new_tokens=12, temperature=0, device="cpu")
    batched = generate(config, model=model)
    for i, prompt in enumerate(prompts):
        single = generate(GenerateConfig(checkpoint="-", prompts=[prompt], max_new_tokens=12, temperature=0,
                                         device="cpu"), model=model)
        assert single.texts[0] == batched.texts[i]
    assert batched.kv_cache_bytes < batched.dense_kv_cache_bytes


@torch.no_grad()
def test_decoding_with_topk_routing_is_refused():
    from modcli.errors import UserError

    model = _model()
    cache = DecoderCache.allocate(model.config, 1, 4, torch.device("cpu"))
    with pytest.raises(UserError, match="topk"):
        model.decode_step(torch.tensor([1]), cache, "topk")


@pytest.mark.parametrize("route_part", ["block", "mlp"])
@torch.no_grad()
def test_the_steps_shared_rope_tables_decode_exactly_like_tables_made_per_block(route_part):
    """decode_step makes the RoPE tables once and hands them to every block (a routed block gathers its processed
    rows'); blocks that make their own from the positions give the same logits bit for bit."""
    model = _model(route_part=route_part)
    tokens = torch.randint(0, 256, (3, 20))
    caches = [DecoderCache.allocate(model.config, 3, 20, torch.device("cpu")) for _ in range(2)]
    for cache in caches:  # prompts of different lengths: every row decodes at a position of its own
        model(tokens[:, :8], "router", cache=cache, lengths=torch.tensor([5, 8, 3]))
    routed = model.blocks[1]
    assert routed.routed
    rows_seen: list[int] = []  # rows of each routed part the routed block ran ("mlp": not the attention of every row)
    delta = routed._decode_delta

    def spy(x, cos, sin, cache, rows, part="block", token_ids=None, context=None):
        if part != "attention":
            rows_seen.append(x.shape[0])
        return delta(x, cos, sin, cache, rows, part, token_ids, context)

    routed._decode_delta = spy  # type: ignore[method-assign]
    for t in range(8, 20):
        shared = model.decode_step(tokens[:, t], caches[0], "router")
        x = model.embed(tokens[:, t])[:, None]  # (B, 1, D)
        for layer, block in enumerate(model.blocks):  # each block makes its own tables (rope=None)
            x = block.decode(x, caches[1].positions, "router", caches[1].layers[layer], tokens[:, t, None])
        caches[1].positions += 1
        assert torch.equal(shared, model.head(model.norm(x))[:, 0])
    assert 0 < sum(rows_seen) < 2 * 3 * 12  # both runs: some rows processed (the gather ran), some skipped


@pytest.mark.parametrize("route_part", ["block", "attention", "mlp"])
@pytest.mark.parametrize("batch, bias", [(1, 0.0), (3, 1e4)])
@torch.no_grad()
def test_steps_where_every_row_processes_decode_like_the_full_forward(route_part, batch, bias):
    """A routed block whose every row processes the token (each processed step at batch 1; here also batch 3 with
    the routers forced on) runs on the whole tensors, without row reads or an indexed write: still the full forward."""
    model = _model(route_part=route_part)
    for block in model.blocks:
        if block.router is not None:
            block.router.score.bias.fill_(bias)
    tokens = torch.randint(0, 256, (batch, 30))
    full = model(tokens, "router")  # (B, T, V)
    cache = DecoderCache.allocate(model.config, batch, 30, torch.device("cpu"))
    logits = [model(tokens[:, :6], "router", cache=cache)[:, -1]]
    routed = [layer for layer, block in enumerate(model.blocks) if block.routed]
    stored = [int(cache.layers[layer].lengths.sum()) for layer in routed]
    for t in range(6, 30):
        logits.append(model.decode_step(tokens[:, t], cache, "router"))
    torch.testing.assert_close(torch.stack(logits, dim=1), full[:, 5:], atol=ATOL, rtol=0)
    if route_part != "mlp":  # a routed layer's cache holds what it processed: some steps ran, and at batch 1 some not
        grown = sum(int(cache.layers[layer].lengths.sum()) - before for layer, before in zip(routed, stored, strict=True))
        if batch == 1:
            assert 0 < grown < 24 * len(routed)
        else:
            assert grown == 24 * batch * len(routed)
