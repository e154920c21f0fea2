"""Every registered router kind through every mechanism: a new router gets all of these checks for free.

Causal modes are causal; cached decoding equals the causal full forward; capacity 1 (threshold 0) without gating
equals the dense twin; the exported ONNX graphs equal eager PyTorch; a resumed run equals the uninterrupted one;
every command accepts the router and bad router flags exit 2.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from modcli.cli import app
from modcli.config import RunConfig
from modcli.models.cache import DecoderCache
from modcli.models.decoder import MoDDecoder, rope_tables
from modcli.models.routing.registry import ROUTERS
from tests.conftest import tiny_model_config, tiny_run_config

KINDS = list(ROUTERS)
ATOL = 1e-4


def router_config(kind: str, **overrides):
    """A tiny config of `kind`; routers with parameters open up so that about half the tokens pass."""
    values = dict(router=kind, capacity=0.5)
    if kind not in ("topk", "attention"):  # only these decode with a predictor
        values["predictor_hidden"] = 0
    values.update(overrides)
    return tiny_model_config(**values)


def fresh_model(kind: str, **overrides) -> MoDDecoder:
    torch.manual_seed(0)
    model = MoDDecoder(router_config(kind, **overrides)).eval()
    with torch.no_grad():  # zero biases: the causal rules (logit > 0, sigmoid > 0.5) pass about half the tokens
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.zero_()
    return model


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_declares_consistent_capabilities(kind):
    model = fresh_model(kind)
    caps = model.capabilities
    assert caps.modes and set(caps.causal_modes) <= set(caps.modes) and caps.static_mode in caps.modes
    assert caps.static_mode not in caps.causal_modes or kind == "threshold"
    assert model.causal_modes(), "every router must be able to decode"
    assert set(caps.notes) == set(caps.modes), "every mode is described"
    assert caps.parameters


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_causal_modes_are_causal(kind):
    model = fresh_model(kind)
    tokens = torch.randint(0, 256, (2, 32))
    changed = tokens.clone()
    changed[:, 20:] = torch.randint(0, 256, (2, 12))
    for mode in model.causal_modes():
        before, aux = model(tokens, mode, return_aux=True)
        records = aux.records
        after, changed_records_aux = model(changed, mode, return_aux=True)
        changed_records = changed_records_aux.records
        # The decisions about the first 20 tokens are identical, bit for bit; their logits agree to float rounding
        # only, since a different number of selected rows after them changes how the matrix products are blocked.
        for record, other in zip(records, changed_records, strict=True):
            for row in range(2):
                mine = record.selection.selected_idx[row, :record.selection.counts[row]]
                theirs = other.selection.selected_idx[row, :other.selection.counts[row]]
                assert torch.equal(mine[mine < 20], theirs[theirs < 20]), (mode, record.layer)
        torch.testing.assert_close(before[:, :20], after[:, :20], atol=1e-5, rtol=0, msg=mode)
        counts = torch.stack([r.selection.counts for r in records])
        assert (counts > 0).any() and (counts < 32).any(), f"{mode}: both branches must be used"


PARTS = ["attention", "mlp"]


@pytest.mark.parametrize("kind, part", [(kind, "block") for kind in KINDS] + [("topk", part) for part in PARTS])
@torch.no_grad()
def test_cached_decoding_equals_the_causal_full_forward(kind, part):
    model = fresh_model(kind, route_part=part)
    tokens = torch.randint(0, 256, (3, 30))
    for mode in model.causal_modes():
        full, aux = model(tokens, mode, return_aux=True)
        records = aux.records
        cache = DecoderCache.allocate(model.config, 3, 30, torch.device("cpu"))
        steps = [model(tokens[:, :9], mode, cache=cache)[:, -1]]
        steps += [model.decode_step(tokens[:, t], cache, mode) for t in range(9, 30)]
        torch.testing.assert_close(torch.stack(steps, dim=1), full[:, 8:], atol=ATOL, rtol=0)
        for record in records:  # the cache holds exactly what was computed: the routed attention's tokens, or all
            want = [30, 30, 30] if part == "mlp" else record.selection.counts.tolist()
            assert cache.layers[record.layer].lengths.tolist() == want


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_processing_every_token_without_gating_equals_the_dense_twin(kind):
    overrides = dict(router_weight="none", capacity=1.0)
    if kind == "threshold":
        overrides["threshold"] = 0.0  # sigmoid(logit) > 0 holds for every token
    model = fresh_model(kind, **overrides)
    dense = MoDDecoder(model.config.dense_twin()).eval()
    dense.load_state_dict(model.state_dict(), strict=False)
    tokens = torch.randint(0, 256, (2, 24))
    reference = dense(tokens)
    everything = []  # the modes that process every token at this capacity (a learnt causal rule may not)
    for mode in model.routing_modes():
        logits, aux = model(tokens, mode, return_aux=True)
        records = aux.records
        if all(record.selection.counts.tolist() == [24, 24] for record in records):
            everything.append(mode)
            torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0, msg=mode)
    assert model.capabilities.static_mode in everything


@pytest.mark.parametrize("kind", KINDS)
def test_a_resumed_run_equals_the_uninterrupted_one(kind, tmp_path, corpus_file):
    from modcli.training.loop import train

    config = tiny_run_config(corpus_file, tmp_path / "full", max_steps=6, eval_every=3, eval_batches=1)
    config = RunConfig(model=router_config(kind, dropout=0.1), data=config.data, train=config.train)
    train(config, quiet=True)
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "step-00000006")
    resumed = dataclasses.replace(config, train=dataclasses.replace(config.train, out=str(tmp_path / "resumed"),
                                                                    resume=True))
    train(resumed, quiet=True)
    want = load_file(tmp_path / "full" / "step-00000006" / "model.safetensors")
    got = load_file(tmp_path / "resumed" / "step-00000006" / "model.safetensors")
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=0, rtol=0, msg=name)


@pytest.fixture(scope="module")
def trained_kinds(tmp_path_factory, corpus_file):
    """One tiny run per router kind (a few steps), shared by the command tests below."""
    from modcli.training.loop import train

    runs = {}
    for kind in KINDS:
        out = tmp_path_factory.mktemp("routers") / kind
        config = tiny_run_config(corpus_file, out, max_steps=4, eval_every=4, eval_batches=1)
        train(RunConfig(model=router_config(kind), data=config.data, train=config.train), quiet=True)
        runs[kind] = out
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_every_command_works_with_the_router(kind, trained_kinds, tmp_path):
    runner, run = CliRunner(), str(trained_kinds[kind])
    model = MoDDecoder(router_config(kind))

    result = runner.invoke(app, ["eval", run, "--batches", "1", "--batch-size", "2", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["router"] == kind
    assert [(r["routing"], r["causal"]) for r in report["results"]] == [
        (mode, mode in model.causal_modes()) for mode in model.routing_modes()]

    for mode in model.causal_modes():
        result = runner.invoke(app, ["generate", run, "--prompt", "def ", "--prompt", "x = 1", "--max-new-tokens", "6",
                                     "--routing", mode, "--device", "cpu", "--json"])
        assert result.exit_code == 0, result.output
        generated = json.loads(result.stdout)
        assert generated["routing"] == mode and generated["kv_cache_bytes"] < generated["dense_kv_cache_bytes"] or \
            generated["processed_fraction"] and max(generated["processed_fraction"].values()) == 1.0

    result = runner.invoke(app, ["profile", run, "--seq-len", "16", "--batch-size", "2", "--repeats", "1",
                                 "--warmup", "0", "--decode-tokens", "2", "--no-memory", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    profiled = json.loads(result.stdout)["results"][0]
    assert profiled["ratio"]["forward_latency"]["measured"] > 0 and profiled["model"]["processed_fraction"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_onnx_graphs_equal_eager_pytorch(kind, trained_kinds, tmp_path):
    from modcli.bundle.writer import ExportConfig, export

    result = export(ExportConfig(checkpoint=str(trained_kinds[kind]), out=str(tmp_path / "bundle"), provider="cpu",
                                 decode_steps=4))
    assert result.valid, result.failures
    graphs = {check.graph for check in result.checks}
    assert graphs == {"forward", "decode"}
    assert all(check.passed and not check.ambiguous for check in result.checks)


@pytest.mark.parametrize("args, message", [
    (["--router", "sideways"], "--router must be one of topk, random, threshold"),
    (["--threshold", "0.5"], "--threshold is an option of --router threshold, not of --router topk"),
    (["--router", "threshold", "--threshold", "1.5"], "--threshold must be in [0, 1), got 1.5"),
    (["--router", "threshold", "--capacity-max", "0"], "--capacity-max must be in (0, 1], got 0.0"),
    (["--router", "random", "--router-hidden", "8"], "--router-hidden: the random router has no parameters"),
    (["--router-hidden", "-1"], "--router-hidden must be >= 0"),
    (["--router-lr-scale", "0"], "--router-lr-scale must be positive"),
    (["--capacity-warmup", "-3"], "--capacity-warmup must be >= 0"),
])
def test_bad_router_flags_exit_2_with_one_line(args, message, tmp_path, corpus_file):
    result = CliRunner().invoke(app, ["train", "--data", str(corpus_file), "--out", str(tmp_path / "run"), *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_from_before_the_router_interface_loads_and_gives_the_same_logits(tmp_path):
    """Old checkpoints: no `router` key in config.json, router and predictor tensors named on the block."""
    from safetensors.torch import save_file

    from modcli.checkpoint.store import load_model_from, save_checkpoint
    from modcli.config import TrainConfig

    model = fresh_model("topk")
    new = save_checkpoint(tmp_path / "new", 1, model, None, RunConfig(model=model.config, train=TrainConfig()),
                          {"step": 1}, keep=1)
    old = tmp_path / "old" / "step-00000001"
    shutil.copytree(new, old)
    renamed = {name.replace(".router.score.", ".router.").replace(".router.predictor.", ".predictor."): tensor
               for name, tensor in load_file(new / "model.safetensors").items()}
    assert "blocks.1.router.weight" in renamed and "blocks.1.predictor.net.0.weight" in renamed
    save_file(renamed, old / "model.safetensors")
    config = json.loads((old / "config.json").read_text())
    for key in ("router", "router_hidden", "threshold", "capacity_max"):
        config["model"].pop(key, None)  # a topk run saves no threshold options now
    (old / "config.json").write_text(json.dumps(config))
    (old / "COMPLETE").write_text("ok")  # the marker of those days recorded no file checksums
    loaded, run_config, _ = load_model_from(old)
    assert run_config.model.router == "topk"
    tokens = torch.randint(0, 256, (2, 20))
    with torch.no_grad():
        for mode in ("topk", "router", "predictor"):
            torch.testing.assert_close(loaded(tokens, mode), model(tokens, mode), atol=0, rtol=0)


def test_capacity_warmup_anneals_from_one_to_the_capacity_with_k_fixed_within_a_step(tmp_path, corpus_file):
    from modcli.config import TrainConfig
    from modcli.training.loop import train
    from modcli.training.schedule import capacity_at

    model_config, train_config = router_config("topk", capacity=0.25), TrainConfig(capacity_warmup=4)
    assert [capacity_at(step, model_config, train_config) for step in (1, 2, 3, 4, 5)] == [0.8125, 0.625, 0.4375,
                                                                                          0.25, 0.25]
    config = tiny_run_config(corpus_file, tmp_path / "run", max_steps=5, eval_every=5, eval_batches=1,
                             capacity_warmup=4, log_every=1)
    train(RunConfig(model=router_config("topk", capacity=0.25), data=config.data, train=config.train), quiet=True)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["capacity"] for r in records] == [0.8125, 0.625, 0.4375, 0.25, 0.25]
    model = fresh_model("topk", capacity=0.25)
    with torch.no_grad():  # the capacity in force sets k of the step: floor(capacity x T)
        _, aux = model(torch.randint(0, 256, (2, 32)), "topk", return_aux=True, capacity=0.8125)
        records = aux.records
    assert [r.selection.selected_idx.shape[1] for r in records] == [26, 26]


def test_router_parameters_learn_at_their_own_rate():
    from modcli.config import TrainConfig
    from modcli.training.schedule import make_optimizer

    model = fresh_model("topk")
    scaled = make_optimizer(model, TrainConfig(router_lr_scale=0.1))
    by_group = {id(p): group["lr_scale"] for group in scaled.param_groups for p in group["params"]}
    for name, param in model.named_parameters():
        assert by_group[id(param)] == (0.1 if ".router." in name else 1.0), name
    plain = make_optimizer(model, TrainConfig())
    assert len(plain.param_groups) == 2  # the same two groups as before the flag: old optimizer states load


@pytest.mark.parametrize("part", PARTS)
@torch.no_grad()
def test_route_part_routes_only_its_part(part):
    """Capacity 1 without gating is the dense twin; a skipped token still gets the part that is not routed."""
    full = fresh_model("topk", route_part=part, router_weight="none", capacity=1.0)
    dense = MoDDecoder(full.config.dense_twin()).eval()
    dense.load_state_dict(full.state_dict(), strict=False)
    tokens = torch.randint(0, 256, (2, 24))
    torch.testing.assert_close(full(tokens, "topk"), dense(tokens), atol=1e-5, rtol=0)

    block = fresh_model("topk", route_part=part).blocks[1]
    x = torch.randn(2, 16, 32)
    cos, sin = rope_tables(torch.arange(16), block.config.head_dim, block.config.rope_base)
    out, record = block(x, cos, sin, "topk")
    chosen = torch.zeros(2, 16, dtype=torch.bool).scatter(1, record.selection.selected_idx, True)
    # A skipped token gets exactly the part that is not routed: with part mlp, attention over every token; with
    # part attention, the MLP on the token as it left the (skipped) attention, i.e. on x.
    expected = x + block.delta(x, cos[None], sin[None], part="attention" if part == "mlp" else "mlp")
    torch.testing.assert_close(out[~chosen], expected[~chosen], atol=1e-5, rtol=0)
    assert not torch.allclose(out[~chosen], x[~chosen])  # the part that is not routed still ran


@pytest.mark.slow
@pytest.mark.parametrize("part", PARTS)
def test_route_part_exports_to_onnx_equal_to_eager(part, tmp_path, corpus_file):
    from modcli.bundle.writer import ExportConfig, export
    from modcli.training.loop import train

    config = tiny_run_config(corpus_file, tmp_path / "run", max_steps=4, eval_every=4, eval_batches=1)
    train(RunConfig(model=router_config("topk", route_part=part), data=config.data, train=config.train), quiet=True)
    result = export(ExportConfig(checkpoint=str(tmp_path / "run"), out=str(tmp_path / "bundle"), provider="cpu",
                                 decode_steps=4))
    assert result.valid, result.failures


def test_route_layers_routes_exactly_the_named_blocks(tmp_path, corpus_file):
    runner = CliRunner()
    common = ["train", "--data", str(corpus_file), "--d-model", "32", "--n-layers", "4", "--n-heads", "4",
              "--seq-len", "32", "--batch-size", "2", "--max-steps", "1", "--eval-every", "1", "--eval-batches", "1",
              "--device", "cpu", "--json"]
    result = runner.invoke(app, [*common, "--route-layers", "0,2,3", "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    config = json.loads(next((tmp_path / "run").glob("step-*/config.json")).read_text())["model"]
    assert config["route_layers"] == [0, 2, 3]
    model = MoDDecoder(router_config("topk", route_layers=[3, 0, 2]))
    assert [block.routed for block in model.blocks] == [True, False, True, True]
    for layers, message in (("1,9", "--route-layers must name distinct blocks in 0..3"),
                            ("1,x", "--route-layers must be comma-separated integers")):
        result = runner.invoke(app, [*common, "--route-layers", layers, "--out", str(tmp_path / "bad")])
        assert result.exit_code == 2 and message in result.stderr, result.output
    result = runner.invoke(app, [*common, "--router", "attention", "--route-layers", "1,2", "--out",
                                 str(tmp_path / "bad")])
    assert result.exit_code == 2 and "--router attention reads the attention maps" in result.stderr
