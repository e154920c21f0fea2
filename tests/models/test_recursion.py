"""Mixture-of-Recursions: capacities 1.0 equal the unrolled shared stack, causal modes are causal, a cached decode
equals the causal full forward with a cache that shrinks with depth, FLOPs count each recursion, every command."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from modcli.cli import app
from modcli.config import ModelConfig
from modcli.models.cache import DecoderCache
from modcli.models.families.recursion import RECURSION
from modcli.models.flops import counted_flops, training_flops
from modcli.models.recursion import RecursionDecoder
from modcli.training.objective import lm_loss, routing_losses

ATOL = 1e-4


def recursion_config(**overrides) -> ModelConfig:
    values = dict(arch="recursion", d_model=32, n_layers=8, n_heads=4, seq_len=32, recursions=3,
                  predictor_hidden=16)
    values.update(overrides)
    return ModelConfig.of(**values)


def fresh(**overrides) -> RecursionDecoder:
    torch.manual_seed(0)
    model = RecursionDecoder(recursion_config(**overrides)).eval()
    with torch.no_grad():  # zero router biases: the causal rules pass about half the tokens at each step
        for router in model.routers:
            router.score.bias.zero_()
    return model


def test_sharing_counts_parameters_once_and_depth_unrolled():
    config = recursion_config()
    assert RECURSION.shared_blocks(config) == 2 and RECURSION.capacities(config) == pytest.approx([1.0, 2 / 3, 1 / 3])
    model = RecursionDecoder(config)
    assert len(model.blocks) == 4  # first, two shared, last
    block_params = sum(p.numel() for p in model.first.parameters())
    router_params = sum(p.numel() for p in model.routers.parameters())
    assert model.num_parameters() == 256 * 32 + 32 + 4 * block_params + router_params


@pytest.mark.parametrize("update", ["delta", "published"])
@torch.no_grad()
def test_capacities_one_without_gating_equal_the_unrolled_shared_stack(update):
    """Every token through every step, weight 1: `delta` is the plain recursive stack (x <- stack(x)); `published`
    scatter-adds alpha x the stack's output (x <- x + alpha stack(x)), the authors' update."""
    model = fresh(recursion_capacities=[1.0, 1.0, 1.0], router_weight="none", recursion_update=update,
                  recursion_alpha=0.3)
    tokens = torch.randint(0, 256, (2, 20))
    positions = torch.arange(20)
    from modcli.models.decoder import config_rope
    cos, sin = config_rope(model.config, positions)
    x = model.embed(tokens)
    x, _ = model.first(x, cos, sin, "dense")
    for _ in range(model.config.family_options.recursions):
        hidden = x
        for block in model.shared:
            hidden, _ = block(hidden, cos, sin, "dense")
        x = hidden if update == "delta" else x + 0.3 * hidden
    x, _ = model.last(x, cos, sin, "dense")
    expected = model.head(model.norm(x))
    torch.testing.assert_close(model(tokens, "topk"), expected, atol=ATOL, rtol=0)


def test_published_update_is_the_default_with_alpha_0_1_and_old_configs_keep_delta():
    config = recursion_config()
    assert (config.family_options.recursion_update, config.family_options.recursion_alpha) == ("published", 0.1)
    from modcli.config import RunConfig
    saved = RunConfig(model=config).to_dict()
    del saved["model"]["recursion_update"], saved["model"]["recursion_alpha"]  # a config.json saved before them
    assert RunConfig.read_saved(saved).model.family_options.recursion_update == "delta"
    assert RunConfig.from_dict(saved).model.family_options.recursion_update == "published"  # a new run from the same values


def test_the_auxiliary_bce_counts_only_the_still_active_tokens():
    """A token that left at step r - 1 is no negative example at step r: moving its router logit changes nothing."""
    model = fresh().train()
    tokens = torch.randint(0, 256, (2, 30))
    _, aux = model(tokens, "topk", return_aux=True)
    last = aux.records[-1]
    assert last.active is not None and int(last.active.sum()) == 2 * 20  # 20 of 30 tokens reached the last step
    before = model.routers[-1].losses(last)[0]
    moved = last.router_logits.masked_fill(~last.active, 50.0)  # exited tokens now look like confident positives
    last.router_logits = moved
    after = model.routers[-1].losses(last)[0]
    torch.testing.assert_close(before, after)
    labels = torch.zeros(2, 30).scatter(1, last.selection.selected_idx, 1.0)
    mask = last.active.float()
    by_hand = (torch.nn.functional.binary_cross_entropy_with_logits(moved.float(), labels, reduction="none")
               * mask).sum() / mask.sum()
    torch.testing.assert_close(after, by_hand)


@torch.no_grad()
def test_top_k_keeps_a_shrinking_nested_share():
    model = fresh()
    _, aux = model(torch.randint(0, 256, (3, 30)), "topk", return_aux=True)
    records = aux.records
    counts = [record.selection.counts.tolist() for record in records]
    assert counts == [[30] * 3, [20] * 3, [10] * 3]
    for row in range(3):
        steps = [set(records[s].selection.selected_idx[row].tolist()) for s in range(3)]
        assert steps[2] <= steps[1] <= steps[0]


@pytest.mark.parametrize("routing", ["router", "predictor"])
@torch.no_grad()
def test_causal_modes_are_causal_and_top_k_is_not(routing):
    model = fresh()
    tokens = torch.randint(0, 256, (2, 24))
    changed = tokens.clone()
    changed[:, 15:] = torch.randint(0, 256, (2, 9))
    torch.testing.assert_close(model(tokens, routing)[:, :15], model(changed, routing)[:, :15], atol=ATOL, rtol=0)
    assert not torch.allclose(model(tokens, "topk")[:, :15], model(changed, "topk")[:, :15], atol=ATOL)


@pytest.mark.parametrize("routing", ["router", "predictor"])
@torch.no_grad()
def test_cached_decoding_equals_the_causal_full_forward_and_the_cache_shrinks_with_depth(routing):
    model = fresh()
    tokens = torch.randint(0, 256, (3, 30))
    full, aux = model(tokens, routing, return_aux=True)
    records = aux.records
    cache = DecoderCache.allocate(model.config, 3, 30, torch.device("cpu"))
    logits = [model(tokens[:, :10], routing, cache=cache)[:, -1]]
    for t in range(10, 30):
        logits.append(model.decode_step(tokens[:, t], cache, routing))
    torch.testing.assert_close(torch.stack(logits, dim=1), full[:, 9:], atol=ATOL, rtol=0)
    stored = [cache.layers[model.cache_layer(step, 0)].lengths.tolist() for step in range(3)]
    assert stored == [record.selection.counts.tolist() for record in records]  # what each step processed
    assert all(a >= b for s in range(2) for a, b in zip(stored[s], stored[s + 1], strict=True))
    assert cache.layers[0].lengths.tolist() == [30] * 3 and stored[2] != [30] * 3


def test_training_flops_count_each_recursion_exactly():
    config = recursion_config()
    model = RecursionDecoder(config).train()
    tokens = torch.randint(0, 256, (2, 32))

    def step():
        logits, aux = model(tokens, return_aux=True)
        records = aux.records
        router, predictor = routing_losses(records)
        (lm_loss(logits, tokens) + router + predictor).backward()

    assert sum(counted_flops(step).values()) == 2 * training_flops(config, 32)


@pytest.mark.parametrize("args, message", [
    (["--arch", "recursion", "--recursions", "0"], "--recursions must be >= 1"),
    (["--arch", "recursion", "--n-layers", "7"], "--n-layers (7) must be 2 + --recursions (3) x the shared"),
    (["--arch", "recursion", "--recursion-capacities", "1,0.5"], "--recursion-capacities needs 3 values"),
    (["--arch", "recursion", "--recursion-capacities", "0.5,1,0.2"], "must not increase"),
    (["--recursions", "2"], "--recursions is an option of --arch recursion"),
    (["--arch", "recursion", "--recursion-update", "add"], "--recursion-update must be one of published, delta"),
    (["--arch", "recursion", "--recursion-alpha", "0"], "--recursion-alpha must be positive"),
    (["--recursion-alpha", "0.5"], "--recursion-alpha is an option of --arch recursion"),
])
def test_bad_recursion_flags_exit_2_with_one_line(args, message, tmp_path, corpus_file):
    result = CliRunner().invoke(app, ["train", "--data", str(corpus_file), "--out", str(tmp_path / "run"),
                                      "--n-layers", "8", *args] if "--n-layers" not in args else
                                ["train", "--data", str(corpus_file), "--out", str(tmp_path / "run"), *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_every_command_works_with_recursion(tmp_path, corpus_file):
    runner, run = CliRunner(), str(tmp_path / "run")
    result = runner.invoke(app, ["train", "--data", str(corpus_file), "--out", run, "--arch", "recursion",
                                 "--d-model", "32", "--n-layers", "8", "--n-heads", "4", "--seq-len", "32",
                                 "--batch-size", "4", "--max-steps", "4", "--eval-every", "4", "--eval-batches", "1",
                                 "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    trained = json.loads(result.stdout)
    assert set(trained["val_losses"]) == {"router", "predictor", "topk"} and trained["val_causal"]["router"]
    result = runner.invoke(app, ["eval", run, "--batches", "1", "--batch-size", "2", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    assert [(r["routing"], r["causal"]) for r in json.loads(result.stdout)["results"]] == [
        ("topk", False), ("router", True), ("predictor", True)]
    result = runner.invoke(app, ["generate", run, "--prompt", "def ", "--max-new-tokens", "5", "--device", "cpu",
                                 "--json"])
    assert result.exit_code == 0, result.output
    generated = json.loads(result.stdout)
    assert generated["kv_cache_bytes"] <= generated["dense_kv_cache_bytes"]
    result = runner.invoke(app, ["profile", run, "--seq-len", "16", "--batch-size", "2", "--repeats", "1",
                                 "--warmup", "0", "--decode-tokens", "2", "--no-memory", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    profiled = json.loads(result.stdout)
    assert profiled["model"]["parameters"] < profiled["baseline"]["parameters"]
    result = runner.invoke(app, ["export", run, "--out", str(tmp_path / "bundle")])
    assert result.exit_code == 2 and "--arch recursion" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "bundle").exists()


def test_the_router_parameters_are_the_routers_of_every_family():
    """One answer to "is this a router parameter" (the learning rates, --trainable, --init-from): MoR's step routers
    (`routers.N.`) as much as an MoD block's (`blocks.N.router.`)."""
    from modcli.models.decoder import MoDDecoder
    from modcli.training.loop import freeze_for
    from modcli.training.schedule import router_parameter_names
    from tests.conftest import tiny_model_config

    mor = fresh()
    names = router_parameter_names(mor)
    assert names and all(name.startswith("routers.") for name in names)
    assert names == {name for name, _ in mor.named_parameters() if name.startswith("routers.")}
    freeze_for(mor, "routers")
    assert {name for name, p in mor.named_parameters() if p.requires_grad} == names
    mod = MoDDecoder(tiny_model_config())
    assert router_parameter_names(mod) == {name for name, _ in mod.named_parameters() if ".router." in name}


def test_trainable_routers_converts_a_recursion_run_training_only_its_routers(tmp_path, corpus_file):
    from safetensors.torch import load_file

    runner = CliRunner()
    common = ["--data", str(corpus_file), "--arch", "recursion", "--n-layers", "5", "--d-model", "32", "--n-heads",
              "4", "--seq-len", "32", "--batch-size", "2", "--max-steps", "2", "--eval-every", "2", "--eval-batches",
              "1", "--device", "cpu"]
    result = runner.invoke(app, ["train", *common, "--out", str(tmp_path / "A")])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["train", "--init-from", str(tmp_path / "A"), *common, "--trainable", "routers",
                                 "--out", str(tmp_path / "B"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["steps"] == 2
    before = load_file(str(tmp_path / "A" / "step-00000002" / "model.safetensors"))
    after = load_file(str(tmp_path / "B" / "step-00000002" / "model.safetensors"))
    routers = {name for name in after if name.startswith("routers.")}
    assert routers and all(torch.equal(after[name], before[name]) for name in after if name not in routers)
    assert any(not torch.equal(after[name], before[name]) for name in routers)


def test_trainable_routers_of_a_model_without_router_parameters_is_one_line(tmp_path, corpus_file):
    runner = CliRunner()
    common = ["--data", str(corpus_file), "--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--seq-len", "32",
              "--batch-size", "2", "--max-steps", "1", "--eval-every", "1", "--eval-batches", "1", "--device", "cpu",
              "--dense"]
    assert runner.invoke(app, ["train", *common, "--out", str(tmp_path / "A")]).exit_code == 0
    result = runner.invoke(app, ["train", "--init-from", str(tmp_path / "A"), *common, "--trainable", "routers",
                                 "--out", str(tmp_path / "B")])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.stderr.strip().count("\n") == 0, result.stderr
    assert "--trainable routers: the model (dense) has no router parameters to train" in result.stderr
    assert not list((tmp_path / "B").glob("step-*"))
