"""`modcli sweep`, `modcli plot` and `modcli routes` on tiny grids: run folders, results.jsonl, real PNGs, resuming
trains nothing twice, bad grids exit 2 before any training, routing maps hold every token once per block."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from modcli.cli import app
from modcli.models.routing.registry import ROUTERS
from tests.conftest import tiny_model_config

PNG = b"\x89PNG\r\n\x1a\n"
BUDGET = 2.5e8
"""About 4 steps of the dense d32-L2 model at batch 4 x 64 tokens (6 for the MoD one)."""


def write_grid(path: Path, corpus: Path, budgets: str = f"[{BUDGET}]", common: str = "", size: str = "",
               variants: str = '[[variant]]\ndense = true\n[[variant]]\nrouter = "topk"\n', extra: str = "") -> Path:
    path.write_text(f"""{extra}
budgets = {budgets}

[common]
data = "{corpus}"
d_model = 32
n_layers = 2
n_heads = 2
seq_len = 64
batch_size = 4
capacity = 0.25
predictor_hidden = 16
warmup = 1
eval_every = 2
eval_batches = 1
device = "cpu"
{common}

[[size]]
{size}

{variants}

[eval]
batches = 2
batch_size = 4

[profile]
batch_size = 2
repeats = 1
warmup = 0
decode_tokens = 2
""")
    return path


@pytest.fixture(scope="module")
def swept(tmp_path_factory, corpus_file) -> tuple[Path, dict]:
    """A finished 2-point sweep (dense and topk), profiled."""
    root = tmp_path_factory.mktemp("sweep")
    grid = write_grid(root / "grid.toml", corpus_file)
    result = CliRunner().invoke(app, ["sweep", str(grid), "--out", str(root / "out"), "--profile", "--json"])
    assert result.exit_code == 0, result.output
    return root / "out", json.loads(result.stdout)


@pytest.mark.slow
def test_sweep_writes_runs_results_and_plots(swept):
    out, summary = swept
    names = [r["name"] for r in summary["runs"]]
    assert names == ["2.5e8_d32-L2_dense", "2.5e8_d32-L2_topk"]
    assert summary["trained"] == names and summary["skipped"] == []
    for name in names:
        run = out / "runs" / name
        assert (run / "metrics.jsonl").is_file() and any((p / "COMPLETE").is_file() for p in run.glob("step-*"))
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["name"] for r in records] == names
    dense, mod = records
    for record in records:
        for key in ("budget", "size", "variant", "config", "parameters", "steps", "flops", "train_loss", "causal_loss",
                    "causal_mode", "losses", "latency", "train_wall_s"):
            assert key in record, key
        assert record["flops"] >= BUDGET and record["flops"] < BUDGET + record["step_flops"]
        assert record["config"]["train"]["flops_budget"] == BUDGET
    assert dense["causal_mode"] == "dense" and dense["reference_loss"] is None and dense["latency"]["forward_ratio"] == 1
    assert mod["causal_mode"] == "router" and mod["reference_mode"] == "topk"
    assert {m: v["causal"] for m, v in mod["losses"].items()} == {"topk": False, "router": True, "predictor": True}
    assert mod["steps"] > dense["steps"]  # the same budget pays for more MoD steps
    for key in ("forward_ratio", "decode_ratio", "forward_ms", "dense_forward_ms", "decode_ms"):
        assert mod["latency"][key] > 0
    assert summary["best"]["2.5e8"]["overall"]["name"] in names
    for plot in ("isoflop.png", "frontier.png"):
        data = (out / plot).read_bytes()
        assert data.startswith(PNG) and len(data) > 5_000
        assert summary["plots"][plot.removesuffix(".png")] == str(out / plot)


@pytest.mark.slow
def test_sweep_table_and_a_finished_sweep_trains_nothing(swept, tmp_path):
    out, _ = swept
    result = CliRunner().invoke(app, ["sweep", str(out / "grid.toml"), "--out", str(out), "--profile"])
    assert result.exit_code == 0, result.output
    words = " ".join(result.stdout.split())
    assert "0 trained now, 2 already done" in words and "budget 2.5e8: best MoD" in words


def test_an_interrupted_sweep_resumes_without_training_anything_twice(tmp_path, corpus_file, monkeypatch):
    import modcli.training.loop
    from modcli.sweep.runner import SweepConfig, run_sweep

    grid = write_grid(tmp_path / "grid.toml", corpus_file)
    out = tmp_path / "out"
    real_save = modcli.training.loop.save_checkpoint
    saved: list[tuple[str, int]] = []

    def interrupt_after_first_mod_checkpoint(run_dir, step, *args, **kwargs):
        path = real_save(run_dir, step, *args, **kwargs)
        saved.append((Path(run_dir).name, step))
        if Path(run_dir).name.endswith("topk") and step == 2:
            raise KeyboardInterrupt
        return path

    monkeypatch.setattr(modcli.training.loop, "save_checkpoint", interrupt_after_first_mod_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(SweepConfig(grid=str(grid), out=str(out)), quiet=True)
    assert [json.loads(line)["name"] for line in (out / "results.jsonl").read_text().splitlines()] == \
        ["2.5e8_d32-L2_dense"]
    assert saved == [("2.5e8_d32-L2_dense", 2), ("2.5e8_d32-L2_dense", 4), ("2.5e8_d32-L2_topk", 2)]

    saved.clear()
    result = run_sweep(SweepConfig(grid=str(grid), out=str(out), plots=False), quiet=True)
    assert result.skipped == ["2.5e8_d32-L2_dense"] and result.trained == ["2.5e8_d32-L2_topk"]
    assert saved == [("2.5e8_d32-L2_topk", 4), ("2.5e8_d32-L2_topk", 6)]  # from step 2 on, the dense run untouched
    steps = [json.loads(line)["step"] for line in (out / "runs" / "2.5e8_d32-L2_topk" / "metrics.jsonl").open()]
    assert steps == [1, 2, 3, 4, 5, 6]

    # Trained but not recorded (interrupted during evaluation): evaluated again, not trained.
    losses = {r["name"]: r["causal_loss"] for r in result.runs}
    (out / "results.jsonl").unlink()
    saved.clear()
    again = run_sweep(SweepConfig(grid=str(grid), out=str(out), plots=False), quiet=True)
    assert saved == [] and again.trained == []
    assert {r["name"]: r["causal_loss"] for r in again.runs} == pytest.approx(losses)


def test_a_diverged_run_is_recorded_and_the_sweep_goes_on(tmp_path, corpus_file, monkeypatch):
    import modcli.sweep.runner
    from modcli.errors import TrainingDiverged

    real_train = modcli.sweep.runner.train

    def diverge_mod_runs(config, quiet=False):
        if not config.model.dense:
            raise TrainingDiverged("training diverged: the loss became nan at step 3")
        return real_train(config, quiet)

    monkeypatch.setattr(modcli.sweep.runner, "train", diverge_mod_runs)
    grid = write_grid(tmp_path / "grid.toml", corpus_file)
    result = CliRunner().invoke(app, ["sweep", str(grid), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "diverged" in result.stdout and "loss became nan at step 3" in result.stderr
    records = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert records[1]["diverged"] and records[1]["causal_loss"] is None and records[0]["causal_loss"] > 0
    assert (tmp_path / "out" / "isoflop.png").is_file()


BAD_GRIDS = [
    (dict(extra='colour = "red"'), "unknown key(s) 'colour'"),
    (dict(variants='[[variant]]\nroutr = "topk"\n'), "unknown key 'routr'"),
    (dict(common="max_steps = 10"), "'max_steps' is set by the sweep"),
    (dict(budgets="[1e6]"), "pays for no training step"),
    (dict(size="d_model = 30\nn_heads = 4"), "must be divisible by --n-heads"),
    (dict(variants='[[variant]]\nrouter = "topk"\ncapacity = [0.5, 1.5]\n'), "--capacity must be in (0, 1], got 1.5"),
    (dict(variants='[[variant]]\nrouter = "nope"\n'), "--router must be one of"),
    (dict(extra="preset = 3"), "preset must be a preset name"),
]


@pytest.mark.parametrize(("grid", "message"), BAD_GRIDS, ids=[m for _, m in BAD_GRIDS])
def test_a_bad_grid_exits_2_before_any_training(tmp_path, corpus_file, grid, message):
    path = write_grid(tmp_path / "grid.toml", corpus_file, **grid)
    result = CliRunner().invoke(app, ["sweep", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and result.stderr.strip().count("\n") == 0, result.stderr
    assert not (tmp_path / "out").exists()


WRONG_TYPES = [
    (("batches = 2\n", 'batches = "four"\n'), "[eval] batches must be an integer, got 'four'"),
    (("batches = 2\n", "batches = 2.5\n"), "[eval] batches must be an integer, got 2.5"),
    (("repeats = 1\n", 'repeats = "5"\n'), "[profile] repeats must be an integer, got '5'"),
    (("repeats = 1\n", "repeats = 1.5\n"), "[profile] repeats must be an integer, got 1.5"),
    (("dense = true\n", 'dense = "no"\n'), "[[variant]] 1: dense must be true or false"),
    (('router = "topk"\n', 'router = "topk"\ncapacity = [0.25, "half"]\n'),
     "[[variant]] 2: capacity must be a finite number (or a list of alternatives), got [0.25, 'half']"),
    (("d_model = 32\n", 'd_model = "32"\n'), "[common]: d_model must be an integer, got '32'"),
]


@pytest.mark.parametrize(("change", "message"), WRONG_TYPES, ids=[m for _, m in WRONG_TYPES])
@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
def test_a_key_of_the_wrong_type_is_one_line_naming_it_and_the_file(tmp_path, corpus_file, change, message, dry_run):
    path = write_grid(tmp_path / "grid.toml", corpus_file)
    text = path.read_text()
    assert change[0] in text
    path.write_text(text.replace(change[0], change[1], 1))
    result = CliRunner().invoke(app, ["sweep", str(path), "--out", str(tmp_path / "out"),
                                      *(["--dry-run"] if dry_run else [])])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and str(path) in result.stderr, result.stderr
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_missing_grid_and_missing_corpus_exit_2(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["sweep", str(tmp_path / "none.toml"), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "no such grid file" in result.stderr
    grid = write_grid(tmp_path / "grid.toml", tmp_path / "missing.txt")
    result = runner.invoke(app, ["sweep", str(grid), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "missing.txt" in result.stderr and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_plot_draws_training_curves_of_several_runs(swept, tmp_path):
    out, _ = swept
    runs = sorted(str(p) for p in (out / "runs").iterdir())
    result = CliRunner().invoke(app, ["plot", *runs, "--out", str(tmp_path / "curves.png"), "--json"])
    assert result.exit_code == 0, result.output
    drawn = json.loads(result.stdout)["runs"]
    assert set(drawn) == {"2.5e8_d32-L2_dense", "2.5e8_d32-L2_topk"} and drawn["2.5e8_d32-L2_topk"]["steps"] == 6
    assert (tmp_path / "curves.png").read_bytes().startswith(PNG)
    result = CliRunner().invoke(app, ["plot", str(tmp_path / "nothing"), "--out", str(tmp_path / "c.png")])
    assert result.exit_code == 2 and "no such run folder" in result.stderr


class _Spans(HTMLParser):
    """Per routed block of a routes page: the index and text of every token span."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks: dict[str, list[tuple[int, str]]] = {}
        self.block = None
        self.token = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section":
            self.block = attrs["data-layer"]
            self.blocks[self.block] = []
        elif tag == "span" and "data-i" in attrs:
            self.token = int(attrs["data-i"])
            self.blocks[self.block].append((self.token, ""))

    def handle_endtag(self, tag):
        if tag == "span":
            self.token = None

    def handle_data(self, data):
        if self.token is not None:
            index, text = self.blocks[self.block][-1]
            self.blocks[self.block][-1] = (index, text + data)


def _check_page(page: str, n_tokens: int, text: str, layers: list[int]) -> None:
    parser = _Spans()
    parser.feed(page)
    assert list(parser.blocks) == [str(layer) for layer in layers]
    for spans in parser.blocks.values():
        assert [i for i, _ in spans] == list(range(n_tokens))  # every token once per block
        assert "".join(piece for _, piece in spans) == text
    assert "http://" not in page and "https://" not in page and "<link" not in page  # self-contained


@pytest.mark.slow
def test_routes_html_and_png_of_a_trained_run(swept, tmp_path):
    out, _ = swept
    run = out / "runs" / "2.5e8_d32-L2_topk"
    text = 'def f(x):\n    """Return <x> & its café."""\n    return x * 2\n' * 2  # > seq_len bytes: two windows
    (tmp_path / "text.py").write_text(text)
    runner = CliRunner()
    result = runner.invoke(app, ["routes", str(run), "--text", str(tmp_path / "text.py"), "--out",
                                 str(tmp_path / "routes.html"), "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    routes = json.loads(result.stdout)
    n = len(text.encode())
    assert routes["modes"] == ["topk", "router", "predictor"] and routes["reference_mode"] == "topk"
    block = routes["blocks"][0]
    assert len(block["processed"]["topk"]) == n and len(block["probability"]["router"]) == n
    assert sum(block["processed"]["topk"]) == 16 + int(0.25 * (n - 64))  # k per window of 64 tokens
    for mode in ("router", "predictor"):
        decided = [p > 0.5 for p in block["probability"][mode]]
        assert decided == block["processed"][mode]
    _check_page((tmp_path / "routes.html").read_text(), n, text, [1])
    result = runner.invoke(app, ["routes", str(run), "--text", str(tmp_path / "text.py"), "--out",
                                 str(tmp_path / "routes.png"), "--max-tokens", "40"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "routes.png").read_bytes().startswith(PNG)
    for args, message in ((["--out", str(tmp_path / "r.txt")], "--out must end in .html or .png"),
                          (["--text", str(tmp_path / "none.txt")], "--text: no such file")):
        full = ["routes", str(run), "--text", str(tmp_path / "text.py"), *args]
        result = runner.invoke(app, full)
        assert result.exit_code == 2 and message in result.stderr, result.output
    result = runner.invoke(app, ["routes", str(out / "runs" / "2.5e8_d32-L2_dense"), "--text", str(tmp_path / "text.py")])
    assert result.exit_code == 2 and "dense model" in result.stderr


@pytest.mark.parametrize("router", list(ROUTERS))
def test_routes_work_for_every_router_kind(router):
    from modcli.data.tokenizer import ByteTokenizer
    from modcli.models.decoder import MoDDecoder
    from modcli.reports.route_map import render_html, route_tokens, token_pieces

    torch.manual_seed(0)
    model = MoDDecoder(tiny_model_config(router=router)).eval()
    text = "    if x == 1:\n        return 'é'\n" * 2  # 70 bytes: windows of 32, 32 and 6
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    pieces = token_pieces(tokenizer, text, ids)
    routes = route_tokens(model, ids, pieces)
    assert [b.layer for b in routes.blocks] == [1, 3]
    for block in routes.blocks:
        for mode in routes.modes:
            assert len(block.processed[mode]) == len(ids)
        for mode in routes.causal_modes:
            assert [p > 0.5 for p in block.probability[mode]] == block.processed[mode]
    _check_page(render_html(routes), len(ids), text, [1, 3])


def test_routes_with_a_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from modcli.data.tokenizer import JsonTokenizer
    from modcli.models.decoder import MoDDecoder
    from modcli.reports.route_map import render_html, route_tokens, token_pieces

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    lines = [f"def f_{i}(x):\n    return x * {i}  # naïve\n" for i in range(50)]
    bpe.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(str(tmp_path / "tokenizer.json"))
    tokenizer = JsonTokenizer(tmp_path / "tokenizer.json")
    text = "def f_7(x):\n    return x * 7  # naïve\n"
    ids = tokenizer.encode(text)
    pieces = token_pieces(tokenizer, text, ids)
    assert "".join(pieces) == text and len(pieces) == len(ids) < len(text)
    torch.manual_seed(0)
    routes = route_tokens(MoDDecoder(tiny_model_config(vocab_size=320)).eval(), ids, pieces, tokenizer=tokenizer.name)
    _check_page(render_html(routes), len(ids), text, [1, 3])


def test_a_run_saved_before_a_config_field_existed_is_still_the_same_point():
    from modcli.config import RunConfig
    from modcli.sweep.grid import comparable

    saved = RunConfig().to_dict()
    del saved["model"]["dropout"]  # as written by a modcli without that field; loading gives its default
    saved["train"]["out"] = "elsewhere"
    assert comparable(saved) == comparable(RunConfig().to_dict())
    saved["train"]["lr"] = 1.0
    assert comparable(saved) != comparable(RunConfig().to_dict())


def test_damaged_results_lines_are_skipped_with_a_note_naming_file_and_line(tmp_path, corpus_file):
    """Random bytes, a hand-edited list `name`, a string loss, a record that is no object: each line is skipped with
    one note naming results.jsonl and its line; the report shows the good record; no traceback."""
    grid = write_grid(tmp_path / "grid.toml", corpus_file)
    out = tmp_path / "out"
    planned = CliRunner().invoke(app, ["sweep", str(grid), "--out", str(out), "--dry-run", "--json"])
    assert planned.exit_code == 0, planned.output
    dense, topk = json.loads(planned.stdout)["runs"]
    finished = {"steps": 4, "flops": 2.4e8, "causal_mode": "dense", "causal_loss": 3.25, "latency": None}
    out.mkdir()
    (out / "grid.toml").write_text(grid.read_text())
    lines = [json.dumps({**dense, **finished}).encode(),
             bytes(b for b in range(256) if b != ord("\n")) * 2,  # not UTF-8
             json.dumps({**topk, **finished, "name": [topk["name"]]}).encode(),
             json.dumps({**topk, **finished, "causal_loss": "low"}).encode(),
             b"[1, 2, 3]",
             json.dumps({**topk, **finished, "parameters": 0}).encode(),
             b'{"name": "' + topk["name"].encode() + b'", "budget": 2.']  # cut short
    (out / "results.jsonl").write_bytes(b"\n".join(lines))
    path = out / "results.jsonl"
    for args in (["--report-only"], ["--report-only", "--json"]):
        result = CliRunner().invoke(app, ["sweep", str(grid), "--out", str(out), *args])
        assert result.exit_code == 0, result.output
        assert "Traceback" not in result.output
        notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
        assert [note.split(" skipped: ")[0] for note in notes] == [f"note: {path} line {n}" for n in (2, 3, 4, 5, 6, 7)]
        assert "causal_loss must be a finite number or null, got 'low'" in notes[2]
        assert "parameters must be positive" in notes[4]
    summary = json.loads(result.stdout)
    assert [r.get("causal_loss") for r in summary["runs"]] == [3.25, None]
    assert path.read_bytes() == b"\n".join(lines)  # --report-only writes nothing


def test_a_results_file_of_random_bytes_is_nothing_to_report(tmp_path, corpus_file):
    grid = write_grid(tmp_path / "grid.toml", corpus_file)
    out = tmp_path / "out"
    out.mkdir()
    (out / "grid.toml").write_text(grid.read_text())
    (out / "results.jsonl").write_bytes(bytes(range(256)) * 64)
    result = CliRunner().invoke(app, ["sweep", str(grid), "--out", str(out), "--report-only"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "holds no run yet" in result.stderr.splitlines()[-1]


def test_plot_drops_a_last_metrics_line_cut_short_and_names_a_damaged_one(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    steps = [json.dumps({"step": s, "loss": 5.0 - s, "flops": 1e9 * s, "val_loss": 4.5 - s}) for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("\n".join(steps) + '\n{"step": 4, "loss": 1.')
    result = CliRunner().invoke(app, ["plot", str(run), "--out", str(tmp_path / "curves.png"), "--smooth", "1"])
    assert result.exit_code == 0, result.output
    assert f"{run / 'metrics.jsonl'}: its last line, line 4, was cut short" in " ".join(result.stderr.split())
    assert "3 steps" in result.stdout and (tmp_path / "curves.png").read_bytes().startswith(PNG)

    (run / "metrics.jsonl").write_text(steps[0] + '\n{"step": "two"}\n' + steps[2] + "\n")
    result = CliRunner().invoke(app, ["plot", str(run), "--out", str(tmp_path / "again.png")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"{run / 'metrics.jsonl'}: line 2 is damaged" in result.stderr and result.stderr.strip().count("\n") == 0
    assert not (tmp_path / "again.png").exists()
