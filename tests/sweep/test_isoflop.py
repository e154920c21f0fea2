"""The isoFLOP side of `modcli sweep`: seed lists, per-size and per-variant budgets and sizes, the order points train
in, several processes sharing one sweep folder, and the analysis (minimum per curve, bracketing, parabola in log N,
seed spread, MoD against dense)."""

from __future__ import annotations

import json
import math

import pytest
from filelock import FileLock
from typer.testing import CliRunner

from modcli.cli import app
from modcli.sweep.analysis import isoflop_analysis
from modcli.sweep.grid import analysis_lines, read_results, update_results
from tests.sweep.test_sweep import BUDGET, PNG, write_grid

TWO_BUDGETS = f"[{BUDGET}, {2 * BUDGET}]"


def dry_run(grid) -> list[dict]:
    result = CliRunner().invoke(app, ["sweep", str(grid), "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["runs"]


def test_seed_lists_expand_and_every_first_seed_trains_before_any_second(tmp_path, corpus_file):
    grid = write_grid(tmp_path / "grid.toml", corpus_file, budgets=TWO_BUDGETS, variants="""
[[variant]]
dense = true
seed = [1, 2]
[[variant]]
router = "topk"
seed = [1, 2]
[[variant]]
router = "random"
budgets = [2.5e8]
""")
    runs = dry_run(grid)
    assert [r["name"] for r in runs] == [
        "2.5e8_d32-L2_dense_s1", "2.5e8_d32-L2_topk_s1", "2.5e8_d32-L2_random",
        "2.5e8_d32-L2_dense_s2", "2.5e8_d32-L2_topk_s2",
        "5e8_d32-L2_dense_s1", "5e8_d32-L2_topk_s1", "5e8_d32-L2_dense_s2", "5e8_d32-L2_topk_s2"]
    assert [r["seed"] for r in runs[:5]] == [1, 1, 1337, 2, 2]  # random keeps the default seed
    assert [r["config"]["train"]["seed"] for r in runs[:5]] == [1, 1, 1337, 2, 2]
    assert {r["variant"] for r in runs} == {"dense", "topk", "random"}  # the seed is not part of the variant


def test_a_seed_list_in_common_seeds_every_variant_without_its_own(tmp_path, corpus_file):
    grid = write_grid(tmp_path / "grid.toml", corpus_file, common="seed = [3, 4]", variants="""
[[variant]]
dense = true
[[variant]]
router = "topk"
seed = 7
""")
    assert [(r["name"], r["seed"]) for r in dry_run(grid)] == [
        ("2.5e8_d32-L2_dense_s3", 3), ("2.5e8_d32-L2_topk", 7), ("2.5e8_d32-L2_dense_s4", 4)]


def test_sizes_and_variants_run_only_at_their_budgets_and_sizes(tmp_path, corpus_file):
    grid = write_grid(tmp_path / "grid.toml", corpus_file, budgets=TWO_BUDGETS,
                      size="d_model = 32\n[[size]]\nd_model = 48\nn_heads = 2\nbudgets = [5e8]", variants="""
[[variant]]
dense = true
[[variant]]
router = "topk"
capacity = 0.5
budgets = [5e8]
sizes = ["d48-L2"]
""")
    assert [r["name"] for r in dry_run(grid)] == [
        "2.5e8_d32-L2_dense", "5e8_d32-L2_dense", "5e8_d48-L2_dense", "5e8_d48-L2_topk-c0.5"]


BAD_RESTRICTIONS = [
    (dict(variants='[[variant]]\ndense = true\nbudgets = [3e8]\n'), "budgets [3e8] are not among the grid's budgets"),
    (dict(variants='[[variant]]\ndense = true\nbudgets = 2.5e8\n'), "budgets must be a non-empty list"),
    (dict(variants='[[variant]]\ndense = true\nsizes = ["d64-L2"]\n'), "names sizes ['d64-L2'] that the grid does not"),
    (dict(size='sizes = ["d32-L2"]'), "'sizes' belongs in a [[variant]]"),
    (dict(size='seed = 3'), "seed belongs in [common] or a [[variant]]"),
    (dict(variants='[[variant]]\ndense = true\nseed = [1, 1]\n'), "seed must be an integer or a list of distinct"),
    (dict(common='seed = [1, "2"]'), "seed must be an integer or a list of distinct integers"),
]


@pytest.mark.parametrize(("grid", "message"), BAD_RESTRICTIONS, ids=[m for _, m in BAD_RESTRICTIONS])
def test_a_bad_restriction_or_seed_list_exits_2(tmp_path, corpus_file, grid, message):
    path = write_grid(tmp_path / "grid.toml", corpus_file, **grid)
    result = CliRunner().invoke(app, ["sweep", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and result.stderr.strip().count("\n") == 0, result.stderr
    assert not (tmp_path / "out").exists()


def test_two_sweep_processes_share_one_folder(tmp_path, corpus_file):
    """A point whose lock another process holds is passed, not trained twice; records of both survive."""
    from modcli.sweep.runner import SweepConfig, run_sweep

    grid = write_grid(tmp_path / "grid.toml", corpus_file)
    out = tmp_path / "out"
    (out / ".locks").mkdir(parents=True)
    other = FileLock(out / ".locks" / "2.5e8_d32-L2_dense.lock")
    other.acquire(timeout=0)
    try:
        first = run_sweep(SweepConfig(grid=str(grid), out=str(out), plots=False), quiet=True)
    finally:
        other.release()
    assert first.elsewhere == ["2.5e8_d32-L2_dense"] and first.trained == ["2.5e8_d32-L2_topk"]
    assert list(read_results(out)) == ["2.5e8_d32-L2_topk"]
    assert first.runs[0].get("causal_loss") is None and first.runs[1]["causal_loss"] > 0
    report = CliRunner().invoke(app, ["sweep", str(grid), "--out", str(out), "--report-only", "--json"])
    assert report.exit_code == 0, report.output
    summary = json.loads(report.stdout)
    assert summary["trained"] == [] and summary["skipped"] == ["2.5e8_d32-L2_topk"] and summary["report_only"]
    assert list(summary["analysis"]["2.5e8"]["curves"]) == ["topk"] and (out / "isoflop.png").is_file()
    assert list(read_results(out)) == ["2.5e8_d32-L2_topk"]  # nothing trained
    table = CliRunner().invoke(app, ["sweep", str(grid), "--out", str(out), "--report-only"])
    words = " ".join(table.stdout.split())
    assert table.exit_code == 0 and "1 finished, report only" in words
    assert "budget 2.5e8 topk: lowest" in words and "bracketed: no; too few sizes for a fit" in words
    # What the other process would write meanwhile is merged, not overwritten.
    update_results(out, {**first.runs[1], "name": "someone-else"})  # a whole record, as a sweep writes one
    second = run_sweep(SweepConfig(grid=str(grid), out=str(out), plots=False), quiet=True)
    assert second.trained == ["2.5e8_d32-L2_dense"] and second.skipped == ["2.5e8_d32-L2_topk"]
    assert set(read_results(out)) == {"2.5e8_d32-L2_topk", "someone-else", "2.5e8_d32-L2_dense"}


def test_report_only_needs_results(tmp_path, corpus_file):
    grid = write_grid(tmp_path / "grid.toml", corpus_file)
    result = CliRunner().invoke(app, ["sweep", str(grid), "--out", str(tmp_path / "out"), "--report-only"])
    assert result.exit_code == 2 and "holds no run yet: nothing to report" in result.stderr
    assert not (tmp_path / "out").exists()


def record(budget: float, size: str, parameters: int, variant: str, loss: float, seed: int = 1,
           step_flops: float = 1e9) -> dict:
    return {"name": f"{budget:g}_{size}_{variant}_s{seed}", "budget": budget, "size": size, "variant": variant,
            "parameters": parameters, "dense": variant == "dense", "seed": seed, "causal_loss": loss,
            "step_flops": step_flops}


def bowl(parameters: float, centre: float, floor: float) -> float:
    return floor + 0.3 * (math.log10(parameters) - math.log10(centre)) ** 2


SIZES = [("d16", 20_000), ("d24", 40_000), ("d32", 80_000), ("d48", 160_000), ("d64", 320_000)]


def test_the_analysis_finds_each_minimum_its_bracket_and_the_seed_spread():
    runs = []
    for seed, shift in ((1, 0.0), (2, 0.004)):
        for size, n in SIZES:
            runs.append(record(1e12, size, n, "dense", bowl(n, 70_000, 1.8) + shift, seed, step_flops=n * 6e3))
            runs.append(record(1e12, size, n, "topk", bowl(n, 150_000, 1.7) + shift, seed, step_flops=n * 3.5e3))
            runs.append(record(2e12, size, n, "dense", 2.0 - 0.1 * math.log10(n) + shift, seed))  # falls: no bracket
    runs.append(record(2e12, "d64", 320_000, "topk", 1.9))
    runs.append({**record(2e12, "d16", 20_000, "topk", 0.0), "causal_loss": None, "diverged": "nan"})
    analysis = isoflop_analysis(runs)

    dense, topk = analysis["1e12"]["curves"]["dense"], analysis["1e12"]["curves"]["topk"]
    assert dense["minimum"]["size"] == "d32" and dense["bracketed"] and topk["minimum"]["size"] == "d48"
    assert dense["minimum"]["losses"] == pytest.approx([bowl(80_000, 70_000, 1.8), bowl(80_000, 70_000, 1.8) + 0.004])
    assert dense["minimum"]["spread"] == pytest.approx(0.004) and dense["minimum"]["seeds"] == [1, 2]
    assert dense["fit"]["parameters"] == pytest.approx(70_000, rel=1e-6)  # an exact parabola in log N
    assert dense["fit"]["loss"] == pytest.approx(1.802) and dense["fit"]["inside"]
    assert topk["fit"]["parameters"] == pytest.approx(150_000, rel=1e-6)
    versus = analysis["1e12"]["versus_dense"]["topk"]
    assert versus["difference"] == pytest.approx(bowl(160_000, 150_000, 1.7) - bowl(80_000, 70_000, 1.8))
    assert versus["verdict"] == "lower beyond the seed spread" and versus["larger"]
    assert versus["parameters_ratio"] == pytest.approx(2.0) and versus["step_flops_ratio"] == pytest.approx(3.5 / 3)

    falling = analysis["2e12"]["curves"]["dense"]
    assert falling["minimum"]["size"] == "d64" and not falling["bracketed"]
    assert falling["fit"]["sizes"] == ["d32", "d48", "d64"]  # the lowest point and up to two on each side
    one = analysis["2e12"]["curves"]["topk"]  # the diverged run is left out; one point: no fit
    assert len(one["points"]) == 1 and one["fit"] is None and one["minimum"]["spread"] is None
    assert analysis["2e12"]["versus_dense"]["topk"]["verdict"] == "one seed: spread unknown"

    lines = analysis_lines(analysis)
    assert any(line.startswith("budget 1e12 dense: lowest") and "bracketed: yes" in line and "70,000 parameters"
               in line for line in lines)
    assert any(line.startswith("budget 2e12 dense") and "bracketed: no" in line for line in lines)
    assert any("vs dense" in line and "lower beyond the seed spread" in line for line in lines)


def test_one_seed_says_its_spread_is_unknown_and_overlapping_seeds_are_within_it():
    runs = [record(1e12, size, n, variant, bowl(n, 80_000, 1.8)) for size, n in SIZES[:3]
            for variant in ("dense", "topk")]
    versus = isoflop_analysis(runs)["1e12"]["versus_dense"]["topk"]
    assert versus["verdict"] == "one seed: spread unknown" and versus["difference"] == 0.0
    assert versus["at_sizes"] == {"d16": 0.0, "d24": 0.0, "d32": 0.0}
    runs += [record(1e12, "d32", 80_000, "dense", bowl(80_000, 80_000, 1.8) + 0.01, seed=2),
             record(1e12, "d32", 80_000, "topk", bowl(80_000, 80_000, 1.8) - 0.005, seed=2)]
    versus = isoflop_analysis(runs)["1e12"]["versus_dense"]["topk"]
    assert versus["verdict"] == "within the seed spread" and versus["difference"] == pytest.approx(-0.0075)
    runs[-1] = record(1e12, "d32", 80_000, "topk", bowl(80_000, 80_000, 1.8) + 0.02, seed=2)
    assert isoflop_analysis(runs)["1e12"]["versus_dense"]["topk"]["verdict"] == "within the seed spread"
    higher = [record(1e12, "d32", 80_000, "dense", loss, seed) for seed, loss in ((1, 1.80), (2, 1.79))]
    higher += [record(1e12, "d32", 80_000, "topk", loss, seed) for seed, loss in ((1, 1.81), (2, 1.83))]
    versus = isoflop_analysis(higher)["1e12"]["versus_dense"]["topk"]
    assert versus["verdict"] == "higher beyond the seed spread" and versus["difference"] == pytest.approx(0.025)


def test_the_isoflop_figure_draws_every_budget(tmp_path):
    from modcli.reports.plots import isoflop_plot

    runs = [record(budget, size, n, variant, bowl(n, 80_000 * budget / 1e12, 1.8), seed)
            for budget in (1e12, 2e12) for size, n in SIZES for variant in ("dense", "topk") for seed in (1, 2)]
    path = isoflop_plot(isoflop_analysis(runs), tmp_path / "isoflop.png")
    data = (tmp_path / "isoflop.png").read_bytes()
    assert path == str(tmp_path / "isoflop.png") and data.startswith(PNG) and len(data) > 10_000
