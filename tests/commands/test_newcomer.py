"""What a newcomer meets (issue 50, items 10-16): the README's tour reads only what it wrote, commands find the run
train just wrote, train says what to run next, the routes PNG is text a person can read, the first install needs
no dev extra, and what the tour writes is ignored by git."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from modcli.cli import app
from modcli.reports.route_map import PNG_MAX_TOKENS, PNG_WINDOW, layout_rows
from tests.commands.test_cli import TINY

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def one_error_line(result) -> str:
    """The exit code is 2 and stderr is one `error:` line, no traceback; returns it."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


# ------------------------------------------------------------------------------------------------- routes' PNG


def test_layout_wraps_rows_at_the_width_and_keeps_every_token_in_order():
    pieces = list("def f(x):\n    return x\n") + ["", ""] + ["a" * 25, "\t", "b"] + list("c" * 30)
    rows = layout_rows(pieces, columns=12)
    assert all(1 <= len(row) <= 12 for row in rows)
    assert all([column for _, column, _ in row] == list(range(len(row))) for row in rows)  # cells side by side
    order = [index for row in rows for index, _, _ in row]
    assert order == sorted(order) and set(order) == set(range(len(pieces)))  # each token drawn, in order
    text = ["".join(char for _, _, char in row) for row in rows]
    assert text[:3] == ["def f(x):↵", "    return x", "↵"]  # a newline ends its row; a full row wraps
    assert text[3].startswith("··a")  # continuation bytes keep a cell each
    assert "aaaaaaaaaaaa" in text and "→b" in "".join(text)  # a long token continues on the next row
    assert layout_rows([], columns=5) == [[]]


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    return struct.unpack(">II", data[16:24])


def test_routes_png_draws_a_readable_window_by_default_and_the_html_the_whole_text(trained_run, tmp_path):
    text = "".join(f"def f_{i}(x):\n    return x * {i}  # a line of text\n" for i in range(30))  # ~1400 tokens
    (tmp_path / "text.py").write_text(text)
    base = ["routes", str(trained_run), "--text", str(tmp_path / "text.py"), "--device", "cpu", "--json"]
    runner = CliRunner()

    result = runner.invoke(app, [*base, "--out", str(tmp_path / "routes.png")])
    assert result.exit_code == 0, result.output
    window = json.loads(result.stdout)
    assert len(window["tokens"]) == PNG_WINDOW and window["start"] == 0 and window["text_tokens"] == len(text)
    width, height = _png_size(tmp_path / "routes.png")
    assert width < 2000 and height < 3000  # rows of text, not one 16,000-token strip

    html = runner.invoke(app, [*base, "--out", str(tmp_path / "routes.html")])
    assert html.exit_code == 0, html.output
    whole = json.loads(html.stdout)
    assert len(whole["tokens"]) == len(text) and whole["start"] == 0

    # another window: the same decisions as the whole text's, token for token (windows of seq_len from the start)
    result = runner.invoke(app, [*base, "--out", str(tmp_path / "later.png"), "--start", "70", "--max-tokens", "50"])
    assert result.exit_code == 0, result.output
    later = json.loads(result.stdout)
    assert later["start"] == 70 and later["tokens"] == whole["tokens"][70:120]
    for part, full in zip(later["blocks"], whole["blocks"], strict=True):
        for mode, chosen in part["processed"].items():
            assert chosen == full["processed"][mode][70:120]
        for mode, probability in part["probability"].items():
            assert probability == pytest.approx(full["probability"][mode][70:120], abs=1e-5)


@pytest.mark.parametrize(("args", "message"), [
    (["--out", "r.png", "--max-tokens", str(PNG_MAX_TOKENS + 1)], f"a PNG draws at most {PNG_MAX_TOKENS} tokens"),
    (["--out", "r.png", "--start", "100000"], "--start 100000 is past the end of"),
    (["--out", "r.png", "--start", "-1"], "--start must be >= 0"),
    (["--out", "r.html", "--text"], "--text is required"),
])
def test_a_bad_routes_window_is_one_line(trained_run, tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "text.py").write_text("def f(x):\n    return x\n" * 10)
    command = ["routes", str(trained_run), "--text", "text.py", "--device", "cpu", *args]
    if args[-1] == "--text":  # no --text at all
        command = ["routes", str(trained_run), *args[:-1]]
    line = one_error_line(CliRunner().invoke(app, command))
    assert message in line
    assert not list(tmp_path.glob("r.*"))


# ------------------------------------------------------------------------------------------- runs/latest default


def test_commands_read_runs_latest_without_a_checkpoint(trained_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    for command in (["eval"], ["generate"], ["export", "--onnx"], ["routes", "--text", "x.txt"]):
        line = one_error_line(runner.invoke(app, command))
        assert "no CHECKPOINT given and no runs/latest here" in line and f"{command[0]} --help)" in line
    assert not (tmp_path / "bundles").exists()
    shutil.copytree(trained_run, tmp_path / "runs" / "latest")
    result = runner.invoke(app, ["eval", "--batches", "1", "--batch-size", "2", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["checkpoint"].startswith(str(Path("runs") / "latest"))
    result = runner.invoke(app, ["generate", "--max-new-tokens", "3", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["new_tokens"] == 3
    shown = runner.invoke(app, ["export", "--help"], env={"COLUMNS": "400"}).output
    assert "default runs/latest where it exists" in shown


# ------------------------------------------------------------------------------------------ train: what next


def test_train_ends_by_printing_the_next_commands_with_the_runs_path(tmp_path, corpus_file):
    out = tmp_path / "my run"
    args = ["train", "--data", str(corpus_file), "--out", str(out), "--max-steps", "2", "--eval-every", "2", *TINY]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    after = result.stderr.split("next:\n", 1)[1].splitlines()
    quoted = shlex.quote(str(out))
    assert after[0] == f"  modcli eval {quoted}"
    assert f"  modcli generate {quoted} --prompt \"def \" --max-new-tokens 16 --temperature 0.6" in after
    assert f"  modcli export {quoted}" in after and any(line.startswith(f"  modcli routes {quoted}") for line in after)
    for line in after:  # each line runs as printed: the path parses back whole
        assert shlex.split(line)[2] == str(out)

    result = CliRunner().invoke(app, [*args[:4], str(tmp_path / "json run"), *args[5:], "--json"])
    assert result.exit_code == 0, result.output
    assert "next:" not in result.stderr and json.loads(result.stdout)["steps"] == 2


# --------------------------------------------------------------------------------------------- the README tour


def _bash_lines(markdown: str) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", markdown, flags=re.S)
    return [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def _first_positional(words: list[str]) -> str | None:
    for word in words:
        if not word.startswith("-"):
            return word
    return None


def _flag(words: list[str], name: str) -> str | None:
    return words[words.index(name) + 1] if name in words else None


def test_the_readme_tour_reads_only_what_it_wrote():
    """Each command of the README's tour reads a run or bundle an earlier line wrote (issue 50, item 11: the tour
    wrote runs/latest and read runs/tiny)."""
    runs, bundles = set(), set()
    for line in _bash_lines(README.read_text()):
        for part in line.split("&&"):
            words = shlex.split(part)
            if not words or words[0] not in ("modcli", "modcli-run"):
                continue
            if words[0] == "modcli-run":
                assert words[1] in bundles, f"modcli-run reads {words[1]}, which no earlier line wrote"
                continue
            command, rest = words[1], words[2:]
            if command == "train":
                runs.add(_flag(rest, "--out") or "runs/latest")
            elif command == "import":
                runs.add(_flag(rest, "--out"))
            elif command in ("eval", "generate", "profile", "export", "plot", "routes"):
                run = _first_positional(rest) or "runs/latest"
                assert run in runs, f"`{part.strip()}` reads {run}, which no earlier line wrote (wrote {runs})"
                if command == "export":
                    bundles.add(_flag(rest, "--out") or "bundles/latest")
    assert "runs/latest" in runs and bundles


def test_the_readme_decoding_examples_fit_the_tiny_presets_context():
    """The README's `generate` and `modcli-run` lines decode from the tiny preset's run: prompt + new tokens within
    its context (issue 50, item 12: 200 new tokens from a 128-token context gave a line of underscores)."""
    from modcli.config import PRESETS

    lines = [shlex.split(line) for line in _bash_lines(README.read_text())
             if line.startswith(("modcli generate", "modcli-run"))]
    assert len(lines) >= 2
    for words in lines:
        new_tokens = _flag(words, "--max-new-tokens")
        assert new_tokens is not None, words  # the default (200) does not fit the tiny preset
        prompt = _flag(words, "--prompt") or "def "
        assert len(prompt.encode()) + int(new_tokens) <= PRESETS["tiny"]["seq_len"], words
        assert float(_flag(words, "--temperature") or 0.8) > 0, words  # greedy loops on one byte at this size


def test_the_first_readme_command_installs_the_package_alone_and_the_test_command_the_dev_extra():
    lines = [line for line in _bash_lines(README.read_text()) if "pip install" in line]
    train, tests = lines[0], lines[1]
    assert "pip install -e . " in train and "[dev]" not in train and "modcli train" in train
    assert 'pip install -e ".[dev]"' in tests and "pytest" in tests


DEV_ONLY = ["pytest", "hypothesis", "transformers", "gguf", "lm_eval", "ruff", "xdist"]
"""What pip install -e ".[dev]" adds (import names)."""


@pytest.mark.slow
def test_training_imports_nothing_of_the_dev_extra(tmp_path, corpus_file):
    """`modcli train` as the README's first command runs it (`pip install -e .`, no dev extra): in a fresh interpreter
    a whole training run imports none of the dev extra's packages."""
    script = (
        "import json, sys\n"
        "from modcli.cli import main\n"
        "sys.argv = ['modcli', *sys.argv[1:]]\n"
        "try:\n    main()\nexcept SystemExit as exc:\n    assert not exc.code, exc.code\n"
        "print(json.dumps(sorted({name.split('.')[0] for name in sys.modules})))\n")
    args = ["train", "--data", str(corpus_file), "--out", str(tmp_path / "run"), "--max-steps", "2",
            "--eval-every", "2", *TINY, "--json"]
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    summary, loaded = done.stdout.strip().splitlines()[-2:]
    assert json.loads(summary)["steps"] == 2
    assert not set(json.loads(loaded)) & set(DEV_ONLY), sorted(set(json.loads(loaded)) & set(DEV_ONLY))


# ------------------------------------------------------------------------------------------------- .gitignore

WRITTEN_BY_THE_TOUR = ["runs/latest/step-00000300/model.safetensors", "bundles/tiny/manifest.json",
                       "hf/tiny/config.json", "curves.png", "routes.png", "routes.html", "tok.json", "tokenizer.json"]


def test_what_the_readme_commands_write_is_ignored_by_git():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    for path in WRITTEN_BY_THE_TOUR:
        done = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT)
        assert done.returncode == 0, f"{path} is not in .gitignore"
    for path in ("docs/sweep/routes.png", "modcli/bundle/hf/writer.py"):  # tracked files stay tracked
        assert subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT).returncode == 1
