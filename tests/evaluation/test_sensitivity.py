"""`modcli sensitivity`: removing a sublayer by hooks is the block without it (against hand-written forwards), the
drop loss is the loss of the model with that sublayer's weights zeroed, a share runs attention among the kept
tokens only, and the command's JSON, table, heatmap and bad-input lines."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from modcli.checkpoint.store import load_model_from, save_checkpoint
from modcli.cli import app
from modcli.config import DataConfig, RunConfig, TrainConfig
from modcli.data.corpus import evaluation_batches, load_corpus
from modcli.data.tokenizer import load_tokenizer
from modcli.errors import UserError
from modcli.evaluation.sensitivity import (
    blocks_from,
    dense_pass,
    kept_positions,
    removed,
    sensitivity,
    skipped_count,
)
from modcli.evaluation.sensitivity_config import PARTS, SensitivityConfig
from modcli.models.build import build_model
from modcli.models.decoder import config_rope
from modcli.models.routing.selection import gather_tokens, scatter_tokens
from modcli.training.objective import lm_loss
from tests.conftest import tiny_model_config

runner = CliRunner()
ATOL = 1e-5


def save_run(root: Path, corpus: Path, dense: bool = True) -> Path:
    """A tiny model whose sublayers matter (weights N(0, 0.15), not the 0.02 of a fresh model), saved as a run."""
    torch.manual_seed(0)
    config = tiny_model_config()
    config = config.dense_twin() if dense else config
    model = build_model(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, 0.15)
    run = RunConfig(model=config, data=DataConfig(data=str(corpus)), train=TrainConfig(out=str(root)))
    save_checkpoint(root, 0, model, None, run, {"step": 0}, keep=1)
    return root


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory, corpus_file) -> Path:
    return save_run(tmp_path_factory.mktemp("runs") / "dense", corpus_file)


@pytest.fixture(scope="module")
def windows(dense_run) -> tuple[torch.Tensor, torch.Tensor]:
    """The validation windows `sensitivity(batches=1, batch_size=2)` measures."""
    _, run_config, checkpoint = load_model_from(dense_run)
    corpus = load_corpus(run_config.data, run_config.model.seq_len, load_tokenizer(
        run_config.data.tokenizer, checkpoint.parent, run_config.model.vocab_size))
    return next(evaluation_batches(corpus.val, run_config.model.seq_len, 2, 1))


def hand_forward(model, tokens: torch.Tensor, layer: int = -1, part: str = "block") -> torch.Tensor:
    """The dense model written out (x + attn(norm(x)), then + mlp(norm(.))), without `part` of block `layer`."""
    cos, sin = config_rope(model.config, torch.arange(tokens.shape[1]))
    x = model.embed(tokens)
    for index, block in enumerate(model.blocks):
        if not (index == layer and part in ("attention", "block")):
            x = x + block.attn(block.attn_norm(x), cos[None], sin[None])
        if not (index == layer and part in ("mlp", "block")):
            x = x + block.mlp(block.mlp_norm(x))
    return model.head(model.norm(x))


@torch.no_grad()
def test_the_hand_written_forward_is_the_dense_model(dense_run, windows):
    model = load_model_from(dense_run)[0]
    inputs, _ = windows
    torch.testing.assert_close(hand_forward(model, inputs), model(inputs), atol=ATOL, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("layer", [0, 2, 3])
def test_removing_a_part_by_hooks_is_the_model_without_it(dense_run, windows, part, layer):
    model = load_model_from(dense_run)[0]
    inputs, _ = windows
    expected = hand_forward(model, inputs, layer, part)
    with removed(model.blocks[layer], part):
        hooked = model(inputs)
        _, hidden, _ = dense_pass(model, inputs)  # the states entering each block, the removal included
        from_layer = blocks_from(model, hidden[layer], layer, inputs)
    torch.testing.assert_close(hooked, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(from_layer, expected, atol=ATOL, rtol=0)
    assert (hooked - model(inputs)).abs().max() > 1e-3  # the hooks are gone, and the part mattered


@torch.no_grad()
@pytest.mark.parametrize("part", PARTS)
def test_a_share_runs_attention_among_the_kept_tokens_and_zeroes_the_others_update(dense_run, windows, part):
    model = load_model_from(dense_run)[0]
    inputs, _ = windows
    block = model.blocks[1]
    seq_len = inputs.shape[1]
    kept = kept_positions(inputs.shape[0], seq_len, 0.5, torch.Generator().manual_seed(3))  # (B, k)
    assert kept.shape[1] == seq_len - skipped_count(seq_len, 0.5) and (kept.diff(dim=1) > 0).all()
    cos, sin = config_rope(model.config, torch.arange(seq_len))
    x = torch.randn(inputs.shape[0], seq_len, model.config.d_model)
    # by hand: an MoD routed block's attention (the kept tokens at their positions), an MLP update for them only
    attention = block.attn(block.attn_norm(gather_tokens(x, kept)), cos[kept], sin[kept])  # (B, k, D)
    hidden = x + scatter_tokens(torch.zeros_like(x), kept, attention) if part != "mlp" else \
        x + block.attn(block.attn_norm(x), cos[None], sin[None])
    keep = torch.zeros(x.shape[:2]).scatter(1, kept, 1.0)[..., None]  # (B, T, 1)
    update = block.mlp(block.mlp_norm(hidden))
    expected = hidden + (update * keep if part != "attention" else update)
    with removed(block, part, kept):
        out, _ = block(x, cos, sin, "dense")
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    if part == "block":  # a skipped token leaves the block as it came, bit for bit
        skipped = keep[..., 0] == 0
        assert torch.equal(out[skipped], x[skipped])


@torch.no_grad()
@pytest.mark.parametrize("part", ["attention", "block"])
def test_a_share_with_kv_kept_runs_the_kept_queries_over_every_tokens_keys(dense_run, windows, part):
    """--keep-skipped-kv's variant: the skipped tokens keep their keys and values; only the kept tokens have a query
    and an update (a masked softmax written out: key position <= query position)."""
    import math

    from modcli.models.decoder import apply_rope

    model = load_model_from(dense_run)[0]
    inputs, _ = windows
    block, config = model.blocks[1], model.config
    batch, seq_len = inputs.shape
    kept = kept_positions(batch, seq_len, 0.5, torch.Generator().manual_seed(3))  # (B, k)
    cos, sin = config_rope(config, torch.arange(seq_len))
    x = torch.randn(batch, seq_len, config.d_model)
    heads = block.attn.qkv(block.attn_norm(x)).view(batch, seq_len, 3 * config.n_heads, config.head_dim)
    q, k = apply_rope(heads[:, :, :2 * config.n_heads], cos[None], sin[None]).split(config.n_heads, dim=2)
    v = heads[:, :, 2 * config.n_heads:]  # (B, T, H, hd) each
    q = gather_tokens(q.flatten(2), kept).view(batch, -1, config.n_heads, config.head_dim)  # (B, k, H, hd)
    scores = torch.einsum("bqhd,bthd->bhqt", q, k) / math.sqrt(config.head_dim)  # (B, H, k, T)
    visible = torch.arange(seq_len)[None, None, :] <= kept[:, :, None]  # (B, k, T)
    probs = scores.masked_fill(~visible[:, None], float("-inf")).softmax(dim=-1)
    attention = block.attn.proj(torch.einsum("bhqt,bthd->bqhd", probs, v).flatten(2))  # (B, k, D)
    hidden = x + scatter_tokens(torch.zeros_like(x), kept, attention)
    keep = torch.zeros(x.shape[:2]).scatter(1, kept, 1.0)[..., None]  # (B, T, 1)
    update = block.mlp(block.mlp_norm(hidden))
    expected = hidden + (update * keep if part == "block" else update)
    with removed(block, part, kept, keep_kv=True):
        out, _ = block(x, cos, sin, "dense")
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    with removed(block, part, kept):
        assert (block(x, cos, sin, "dense")[0] - out).abs().max() > 1e-3  # the skipped tokens' K/V mattered


def test_drop_loss_is_the_loss_of_the_model_without_that_part(dense_run, windows):
    result = sensitivity(SensitivityConfig(str(dense_run), batches=1, batch_size=2, shares=[0.125, 0.5],
                                           device="cpu"))
    model = load_model_from(dense_run)[0]
    inputs, targets = windows
    with torch.no_grad():
        assert result.dense_loss == pytest.approx(lm_loss(model(inputs), targets).item(), abs=ATOL)
        by_place = {(r.block, r.part): r for r in result.results}
        assert list(by_place) == [(block, part) for block in range(4) for part in PARTS]
        for (layer, part), measured in by_place.items():
            zeroed = load_model_from(dense_run)[0]
            block = zeroed.blocks[layer]
            if part in ("attention", "block"):
                block.attn.proj.weight.zero_()
            if part in ("mlp", "block"):
                block.mlp.down.weight.zero_()
            assert measured.drop_loss == pytest.approx(lm_loss(zeroed(inputs), targets).item(), abs=ATOL)
            assert set(measured.share_losses) == set(measured.share_losses_kv_kept) == {"0.125", "0.5"}
            if part == "mlp":  # attention runs for every token: keeping K/V changes nothing
                assert measured.share_losses_kv_kept == measured.share_losses
            else:
                assert measured.share_losses_kv_kept != measured.share_losses
            assert 0 <= measured.block_influence <= 2
        # Block Influence of block 0's attention, by hand: 1 - cos(x, x + attn(norm(x))), mean over the tokens
        block = model.blocks[0]
        x = model.embed(inputs)
        cos, sin = config_rope(model.config, torch.arange(inputs.shape[1]))
        after = x + block.attn(block.attn_norm(x), cos[None], sin[None])
        expected = 1 - torch.nn.functional.cosine_similarity(x, after, dim=-1).mean().item()
        assert by_place[0, "attention"].block_influence == pytest.approx(expected, abs=ATOL)
    assert result.skipped_tokens == {"0.125": 4, "0.5": 16} and result.kv_kept is False


def test_the_json_is_one_object_with_every_block_and_part(dense_run):
    result = runner.invoke(app, ["sensitivity", str(dense_run), "--batches", "1", "--batch-size", "2",
                                 "--shares", "0.125,0.5", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    assert result.stderr == ""  # no progress with --json
    payload = json.loads(result.stdout)
    assert isinstance(payload["dense_loss"], float)
    assert len(payload["results"]) == 4 * len(PARTS)
    for entry in payload["results"]:
        assert {"block", "part", "drop_loss", "share_losses", "share_losses_kv_kept", "block_influence"} <= set(entry)
        assert entry["part"] in PARTS and set(entry["share_losses"]) == {"0.125", "0.5"}


def test_the_table_is_sorted_by_drop_cost_with_progress_and_a_heatmap(dense_run, tmp_path):
    plot = tmp_path / "map.png"
    result = runner.invoke(app, ["sensitivity", str(dense_run), "--batches", "1", "--batch-size", "2",
                                 "--device", "cpu", "--plot", str(plot)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert [line.split("(")[0] for line in result.stderr.splitlines() if line.startswith("block ")] == [
        f"block {block}/4 measured " for block in range(1, 5)]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    drop_losses = [float(line.split("│")[3]) for line in result.stdout.splitlines()
                   if line.count("│") > 5 and line.split("│")[2].strip() in PARTS]
    assert len(drop_losses) == 4 * len(PARTS) and drop_losses == sorted(drop_losses, reverse=True)


@pytest.fixture(scope="module")
def routed_run(tmp_path_factory, corpus_file) -> Path:
    return save_run(tmp_path_factory.mktemp("runs") / "routed", corpus_file, dense=False)


@pytest.mark.parametrize("args, message", [
    (["{missing}"], "no such checkpoint or run folder"),
    (["{run}", "--shares", "0"], "--shares must each be in (0, 1)"),
    (["{run}", "--shares", "1.5"], "--shares must each be in (0, 1)"),
    (["{run}", "--shares", ""], "--shares: give at least one share"),
    (["{run}", "--shares", "0.5,x"], "--shares must be comma-separated numbers"),
    (["{run}", "--shares", "0.5,0.5"], "--shares: 0.5 given twice"),
    (["{run}", "--batches", "0"], "--batches must be >= 1"),
    (["{run}", "--plot", "map.jpg"], "--plot must name a .png file"),
    (["{run}", "--plot", "{missing}/map.png"], "--plot: the folder of"),
    (["{run}", "--seq-len", "33"], "--seq-len must be <= the run's seq_len 32"),
    (["{routed}"], "measures a dense decoder"),
    (["{run}", "--plan", "plan.txt"], "--plan must name a .toml file"),
    (["{run}", "--plan", "p.toml", "--target-flops", "1"], "--target-flops must be in (0, 1)"),
    (["{run}", "--measured", "{missing}"], "--measured: give --plan"),
    (["{run}", "--measured", "{missing}", "--plan", "{tmp}/p.toml"], "does not exist"),
    (["{run}", "--measured", "{garbage}", "--plan", "{tmp}/p.toml"], "is not a map saved by"),
])
def test_bad_input_is_one_line_and_exit_2(dense_run, routed_run, tmp_path, args, message):
    (tmp_path / "garbage.json").write_text("{}")
    values = {"run": str(dense_run), "routed": str(routed_run), "missing": str(tmp_path / "nowhere"),
              "tmp": str(tmp_path), "garbage": str(tmp_path / "garbage.json")}
    result = runner.invoke(app, ["sensitivity", *(arg.format(**values) for arg in args), "--device", "cpu"])
    assert result.exit_code == 2, (args, result.output)
    assert message in result.stderr.replace("\n", " ") or message in " ".join(result.stderr.split()), result.stderr
    assert result.stderr.strip().count("\n") == 0 and result.stderr.startswith("error:"), result.stderr


@torch.no_grad()
def test_a_static_drop_has_the_loss_sensitivity_measured_for_that_cut(dense_run, windows):
    """`train --init-from RUN --drop attention:1 --max-steps 0` is the model sensitivity measured for (1, attention)."""
    import dataclasses

    from modcli.models.decoder import MoDDecoder

    result = sensitivity(SensitivityConfig(str(dense_run), batches=1, batch_size=2, device="cpu"))
    by_place = {(r.block, r.part): r.drop_loss for r in result.results}
    model = load_model_from(dense_run)[0]
    inputs, targets = windows
    for drop, place in (("attention:1", (1, "attention")), ("mlp:2", (2, "mlp")), ("block:3", (3, "block"))):
        dropped = MoDDecoder(dataclasses.replace(model.config, drop=drop)).eval()
        dropped.load_state_dict(model.state_dict(), strict=False)
        assert lm_loss(dropped(inputs), targets).item() == pytest.approx(by_place[place], abs=ATOL)


def test_a_plan_meets_its_flop_target_with_the_cheapest_cuts_and_converts(dense_run, tmp_path):
    from modcli.config import load_toml
    from modcli.config.drops import parse_drops
    from modcli.evaluation.plan import plan_drops
    from modcli.models.flops import flops

    saved = tmp_path / "map.json"
    result = runner.invoke(app, ["sensitivity", str(dense_run), "--batches", "1", "--batch-size", "2", "--device",
                                 "cpu", "--json"])
    assert result.exit_code == 0, result.output
    saved.write_text(result.stdout)
    plan_file = tmp_path / "plan.toml"
    result = runner.invoke(app, ["sensitivity", str(dense_run), "--measured", str(saved), "--plan", str(plan_file),
                                 "--target-flops", "0.85"])
    assert result.exit_code == 0, result.output
    values = load_toml(plan_file)
    assert values["route_every"] == 0
    drops = parse_drops(values["drop"], 4)
    config = load_model_from(dense_run)[0].config
    import dataclasses
    ratio = flops(dataclasses.replace(config, drop=values["drop"]), 32).total / flops(config, 32).total
    assert ratio <= 0.85
    # greedy by cost per FLOP: the first cut is the cheapest per FLOP of all single cuts
    payload = json.loads(saved.read_text())
    plan = plan_drops(config, payload["results"], payload["dense_loss"], 32, 0.85)
    assert plan.drop == values["drop"] and plan.cuts
    first = plan.cuts[0]
    assert (first.block in drops.get(first.part, ())) and plan.predicted_loss >= payload["dense_loss"]
    # the plan converts as written
    out = tmp_path / "converted"
    result = runner.invoke(app, ["train", "--init-from", str(dense_run), "--config", str(plan_file), "--max-steps",
                                 "0", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert load_model_from(out)[0].config.drop == values["drop"]
    # a target no drops can meet: one line, exit 2
    result = runner.invoke(app, ["sensitivity", str(dense_run), "--measured", str(saved), "--plan", str(plan_file),
                                 "--target-flops", "0.05"])
    assert result.exit_code == 2 and "cannot be met by static drops" in result.stderr


def _synthetic_map(n_layers: int, routed_cost: float, drop_cost: float, kv_cost: float | None = None) -> list[dict]:
    """A map of `n_layers` blocks whose drops cost `drop_cost` and whose 0.5-share skips cost `routed_cost`."""
    results = []
    for block in range(n_layers):
        for part in ("attention", "mlp", "block"):
            scale = 2.0 if part == "block" else 1.0
            results.append({"block": block, "part": part, "drop_loss": 1.0 + scale * drop_cost,
                            "share_losses": {"0.5": 1.0 + scale * routed_cost},
                            "share_losses_kv_kept": {"0.5": 1.0 + scale * (kv_cost or routed_cost)}})
    return results


def test_a_plan_with_routing_routes_where_skipping_is_cheaper_per_flop_and_converts(dense_run, tmp_path):
    """--plan-routing 0.5: routed sublayers compete with drops by cost per FLOP; a block is dropped or routed, never
    both; the TOML (a per-block --route-part at capacity 0.5) converts; without the share in the map: one line."""
    from modcli.config import load_toml
    from modcli.evaluation.plan import plan_drops, write_plan
    from modcli.models.flops import flops

    config = load_model_from(dense_run)[0].config
    total = flops(config, 32).total
    cheap_routing = plan_drops(config, _synthetic_map(4, routed_cost=0.001, drop_cost=0.5), 1.0, 32, 0.9, 0.5)
    assert cheap_routing.cuts and all(cut.how == "route" for cut in cheap_routing.cuts)
    assert cheap_routing.route_part and cheap_routing.capacity == 0.5 and cheap_routing.drop == ""
    planned = dataclasses.replace(config, route_every=0, route_part=cheap_routing.route_part, capacity=0.5)
    assert flops(planned, 32).total / total == pytest.approx(cheap_routing.flops_ratio) and \
        cheap_routing.flops_ratio <= 0.9
    cheap_drops = plan_drops(config, _synthetic_map(4, routed_cost=0.5, drop_cost=0.001), 1.0, 32, 0.85, 0.5)
    assert all(cut.how == "drop" for cut in cheap_drops.cuts) and cheap_drops.route_part == ""
    for plan in (cheap_routing, cheap_drops):
        for block in {cut.block for cut in plan.cuts}:
            assert len({cut.how for cut in plan.cuts if cut.block == block}) == 1
    kv_kept = plan_drops(config, _synthetic_map(4, 0.001, 0.5), 1.0, 32, 0.9, 0.5, keep_skipped_kv=True)
    assert all(cut.part == "attention" for cut in kv_kept.cuts if cut.how == "route") and kv_kept.keep_skipped_kv

    plan_file = tmp_path / "plan.toml"
    write_plan(cheap_routing, plan_file, str(dense_run))
    values = load_toml(plan_file)
    assert values["route_part"] == cheap_routing.route_part and values["capacity"] == 0.5
    out = tmp_path / "converted"
    result = runner.invoke(app, ["train", "--init-from", str(dense_run), "--config", str(plan_file), "--max-steps",
                                 "0", "--out", str(out)])
    assert result.exit_code == 0, result.output
    converted = load_model_from(out)[0].config
    assert converted.route_part == cheap_routing.route_part and converted.capacity == 0.5

    with pytest.raises(UserError, match="--plan-routing 0.25: the map has no share_losses at that share"):
        plan_drops(config, _synthetic_map(4, 0.1, 0.1), 1.0, 32, 0.85, 0.25)
    older = [{key: value for key, value in r.items() if key != "share_losses_kv_kept"} for r in _synthetic_map(4, 0.1, 0.1)]
    with pytest.raises(UserError, match="no share_losses_kv_kept at that share"):  # a map saved before it was measured
        plan_drops(config, older, 1.0, 32, 0.85, 0.5, keep_skipped_kv=True)


@pytest.mark.parametrize(("args", "says"), [
    (["--plan-routing", "0.5"], "--plan-routing: give --plan"),
    (["--plan", "p.toml", "--plan-routing", "1"], "--plan-routing must be in (0, 1)"),
    (["--plan", "p.toml", "--plan-keep-skipped-kv"], "--plan-keep-skipped-kv: give --plan-routing"),
])
def test_bad_plan_routing_flags_are_one_line(dense_run, args, says):
    result = runner.invoke(app, ["sensitivity", str(dense_run), *args])
    assert result.exit_code == 2 and says in result.stderr, result.output
