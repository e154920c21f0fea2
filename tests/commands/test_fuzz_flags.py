"""Property-based tests of every command's flags (hypothesis): whatever values a user types, a command either
succeeds or refuses with exit code 2 and one line on stderr; never a traceback, never exit code 1 for a mistake.

The flags of each command are read from its signature, so a new flag is fuzzed as soon as it exists. Each example
adds one to three drawn flags (numbers out of range, negative, zero, huge, NaN and infinity strings, unknown
choices, empty strings, paths that do not exist) to a tiny, fast base command line; a flag given twice takes its
last value, so the drawn value wins. Values that are valid but only make a run long (a huge --max-steps) are not
drawn for the flags listed in `small_only`; flags whose valid use is slow by nature (`--compile`, `--memory`) are
left to their own tests. `MODCLI_FUZZ_EXAMPLES` raises the number of examples for a longer search.
"""

from __future__ import annotations

import inspect
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.models import ArgumentInfo, OptionInfo
from typer.testing import CliRunner

from modcli.cli import app
from modcli.commands import (
    evaluate,
    export,
    generate,
    import_command,
    plot,
    profile,
    routes,
    sensitivity,
    sweep,
    tokenizer,
    train,
)

EXAMPLES = int(os.environ.get("MODCLI_FUZZ_EXAMPLES", "0"))


def fuzz_settings(examples: int):
    return settings(max_examples=EXAMPLES or examples, deadline=None, derandomize=not EXAMPLES, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@dataclass(frozen=True)
class Flag:
    """One option of a command: how to spell it and what kind of value it takes."""

    option: str
    kind: str
    """int, float, text, bool (a switch; `off` is its negative spelling, if any) or list (repeatable text)."""
    off: str | None = None


def command_flags(function) -> dict[str, Flag]:
    """The options of a typer command function, by parameter name, from its signature as typer reads it (the flags
    generated from config fields included: modcli.commands.config_flags)."""
    flags = {}
    for name, parameter in inspect.signature(function, eval_str=True).parameters.items():
        hint = parameter.annotation
        if typing.get_origin(hint) is not Annotated:
            continue
        base, *extras = typing.get_args(hint)
        info = next((e for e in extras if isinstance(e, (OptionInfo, ArgumentInfo))), None)
        if not isinstance(info, OptionInfo):
            continue
        decls = [d for d in (info.param_decls or ()) if isinstance(d, str)]
        if isinstance(info.default, str) and info.default.startswith("-"):
            decls.insert(0, info.default)
        spelling = decls[0] if decls else "--" + name.replace("_", "-")
        on, _, off = spelling.partition("/")
        arms = [arm for arm in typing.get_args(base) if arm is not type(None)] or [base]
        kind = arms[0]
        if typing.get_origin(kind) is list:
            flags[name] = Flag(on, "list")
        elif kind is bool:
            flags[name] = Flag(on, "bool", off or None)
        else:
            flags[name] = Flag(on, {int: "int", float: "float"}.get(kind, "text"))
    return flags


INTS = ["-1", "0", "1", "2", "3", "17", "1000000000000", "-99999999999999999999", "1.5", "abc", "", " 3"]
FLOATS = ["-1", "0", "-0.0", "1e-30", "0.25", "0.5", "1", "1.5", "2", "1e30", "1e309", "nan", "inf", "-inf", "abc",
          ""]
SMALL_INTS = ["-1", "0", "1", "2", "abc", ""]
SMALL_FLOATS = ["-1", "0", "1e6", "nan", "inf", "-inf", "abc", ""]
TEXTS = ["", " ", "abc", "0", "-1", "1,3", "0,0", "topk", "router", "predictor", "dense", "none", "threshold",
         "random", "attention", "cpu", "cuda", "auto", "float16", "bfloat16", "forward", "decode", "all", "routers",
         "tiny", "small", "no-such-dir/", "no/such/file.toml", "no-such.bin"]
"""Paths among them are relative: every example runs in a fresh empty folder, so a drawn --out stays inside it."""


def value_strategy(flag: Flag, small: bool):
    if flag.kind == "bool":
        return st.sampled_from([flag.option] + ([flag.off] if flag.off else []))
    if flag.kind == "int":
        values = st.sampled_from(SMALL_INTS if small else INTS)
    elif flag.kind == "float":
        values = st.sampled_from(SMALL_FLOATS if small else FLOATS)
    else:
        typed = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\0"), max_size=6)  # argv has no NUL
        values = st.one_of(st.sampled_from(TEXTS), typed.map(
            lambda text: text.lstrip("/").replace("..", "__")))  # never a path outside the example's folder
    return values.map(lambda value: [flag.option, value])


def drawn_flags(flags: dict[str, Flag], small_only: frozenset[str] = frozenset()):
    """One to three distinct flags of `flags` with drawn values, as extra command-line arguments."""
    names = sorted(flags)
    return st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True).flatmap(
        lambda chosen: st.tuples(*[value_strategy(flags[n], n in small_only) for n in chosen])).map(
        lambda parts: [arg for part in parts for arg in (part if isinstance(part, list) else [part])])


def check(result, args: list[str], allowed: tuple[int, ...] = (0, 2)) -> None:
    """Succeeded, or refused with exit code 2 and one "error:" line on stderr (after any progress lines);
    never a traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), (args, repr(result.exception))
    assert result.exit_code in allowed, (args, result.exit_code, result.output)
    assert "Traceback" not in result.output, (args, result.output)
    if result.exit_code != 0:
        lines = result.stderr.strip().splitlines()
        errors = [line for line in lines if line.startswith("error")]
        assert len(errors) == 1 and lines[-1] == errors[0], (args, result.stderr)


def invoke(tmp_path_factory, args: list[str]):
    """Run `modcli ARGS` in a fresh empty working folder (a drawn --out lands there)."""
    folder = tmp_path_factory.mktemp("fuzz")
    runner = CliRunner()
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        return runner.invoke(app, args)
    finally:
        os.chdir(cwd)


def without(flags: dict[str, Flag], *names: str) -> dict[str, Flag]:
    return {name: flag for name, flag in flags.items() if name not in names}


# ----------------------------------------------------------------------------------------------- the commands


TRAIN_FLAGS = without(command_flags(train.train), "compile")
TRAIN_WORKLOAD = frozenset({"max_steps", "eval_batches", "grad_accum", "flops_budget", "eval_every"})


@pytest.mark.slow
@fuzz_settings(24)
@given(extra=drawn_flags(TRAIN_FLAGS, TRAIN_WORKLOAD))
def test_train_flags(extra, corpus_file, tmp_path_factory):
    base = ["train", "--data", str(corpus_file), "--out", "run", "--d-model", "32", "--n-layers", "2", "--n-heads",
            "4", "--seq-len", "16", "--batch-size", "2", "--max-steps", "1", "--eval-every", "1", "--eval-batches",
            "1", "--device", "cpu", "--warmup", "0"]
    # a diverging run (an absurd --lr) stops with its own exit code, 3, by design
    check(invoke(tmp_path_factory, base + extra), base + extra, allowed=(0, 2, 3))


@fuzz_settings(16)
@given(extra=drawn_flags(command_flags(evaluate.eval_command), frozenset({"batches", "batch_size"})),
       where=st.integers(0, 6))
def test_eval_flags(extra, where, trained_run, tmp_path_factory):
    target = [str(trained_run)] * 4 + ["", "no-such-run", str(trained_run / "metrics.jsonl")]
    args = ["eval", target[where], "--batches", "1", "--batch-size", "1", "--device", "cpu", *extra]
    check(invoke(tmp_path_factory, args), args)


PROMPTS = [[], ["--prompt", "abc\udcff\udcfe"], ["--prompt", "x" * 5000], ["--max-new-tokens", str(2**63)]]
"""Besides the drawn flags: a prompt that is not UTF-8 (argv's bytes \\xff\\xfe as Python gives them), one far
longer than the model's context, a --max-new-tokens past int64 (tracebacks or minutes of prefill before)."""


@fuzz_settings(16)
@given(extra=drawn_flags(without(command_flags(generate.generate), "compile")), where=st.integers(0, 6),
       prompt=st.sampled_from(PROMPTS))
def test_generate_flags(extra, where, prompt, trained_run, tmp_path_factory):
    target = [str(trained_run)] * 4 + ["", "no-such-run", str(trained_run / "metrics.jsonl")]
    args = ["generate", target[where], "--max-new-tokens", "2", "--device", "cpu", *prompt, *extra]
    check(invoke(tmp_path_factory, args), args)


PROFILE_WORKLOAD = frozenset({"repeats", "warmup", "decode_tokens", "batch_size", "seq_len"})


@pytest.mark.slow
@fuzz_settings(16)
@given(extra=drawn_flags(without(command_flags(profile.profile), "compile", "backends", "memory", "seq_lens"), PROFILE_WORKLOAD))
def test_profile_flags(extra, tmp_path_factory):
    args = ["profile", "--preset", "tiny", "--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--seq-len", "16",
            "--batch-size", "1", "--repeats", "1", "--warmup", "0", "--measure", "forward", "--decode-tokens", "2",
            "--no-memory", "--compare", "none", "--device", "cpu", *extra]
    check(invoke(tmp_path_factory, args), args)


@pytest.fixture
def no_lowering(monkeypatch):
    """Everything `modcli export` checks before lowering runs; the lowering and validation themselves (seconds per
    bundle) are tested in test_export.py, so here a bundle that passed every check is written as an empty one."""
    import modcli.bundle.writer as export_bundle

    def write_nothing(tmp, out, config, *args, **kwargs):
        (tmp / "manifest.json").write_text("{}")
        return export_bundle.ExportResult(bundle=str(out), valid=True, atol=float(config.atol), dtype=config.dtype,
                                          routing=config.routing, files=[], checks=[], seconds=0.0, failures=[])

    monkeypatch.setattr(export_bundle, "_write_bundle", write_nothing)


@fuzz_settings(16)
@given(extra=drawn_flags(without(command_flags(export.export), "compile")), where=st.integers(0, 6))
def test_export_flags(extra, where, trained_run, no_lowering, tmp_path_factory):
    target = [str(trained_run)] * 4 + ["", "no-such-run", str(trained_run / "metrics.jsonl")]
    args = ["export", target[where], "--out", "bundle", *extra]
    check(invoke(tmp_path_factory, args), args)


@pytest.fixture(scope="module")
def malformed_models(tmp_path_factory) -> list[str]:
    """A model folder whose config.json is a list, and a .gguf file that is text."""
    folder = tmp_path_factory.mktemp("malformed")
    (folder / "hf").mkdir()
    (folder / "hf" / "config.json").write_text("[1, 2]")
    (folder / "model.gguf").write_text("not a GGUF file\n")
    return [str(folder / "hf"), str(folder / "model.gguf")]


@fuzz_settings(8)
@given(extra=drawn_flags(command_flags(import_command.import_command)), where=st.integers(0, 4))
def test_import_flags(extra, where, malformed_models, tmp_path_factory):
    source = ["", "nowhere", ".", *malformed_models][where]
    args = ["import", source, "--out", "run", *extra]
    check(invoke(tmp_path_factory, args), args)


@fuzz_settings(10)
@given(extra=drawn_flags(command_flags(tokenizer.train_tokenizer)))
def test_tokenizer_train_flags(extra, corpus_file, tmp_path_factory):
    args = ["tokenizer", "train", "--vocab-size", "300", "--data", str(corpus_file), "--max-bytes", "20000",
            "--out", "tok.json", *extra]
    check(invoke(tmp_path_factory, args), args)


@pytest.mark.slow
@fuzz_settings(8)
@given(extra=drawn_flags(command_flags(sweep.sweep)))
def test_sweep_flags(extra, tmp_path_factory):
    """With --dry-run (a switch the drawn flags cannot turn off) a sweep checks its grid and trains nothing."""
    grid = tmp_path_factory.mktemp("grid") / "grid.toml"
    grid.write_text('preset = "tiny"\nbudgets = [1e9]\n[common]\nseq_len = 16\nbatch_size = 2\n'
                    '[[size]]\nd_model = 32\nn_layers = 2\nn_heads = 4\n[[variant]]\ndense = true\n')
    args = ["sweep", str(grid), "--dry-run", *extra]
    check(invoke(tmp_path_factory, args), args)


@pytest.mark.slow
@fuzz_settings(8)
@given(extra=drawn_flags(command_flags(plot.plot)), where=st.integers(0, 4))
def test_plot_flags(extra, where, trained_run, tmp_path_factory):
    target = [str(trained_run)] * 3 + ["", "no-such-run"]
    args = ["plot", target[where], "--out", "curves.png", *extra]
    check(invoke(tmp_path_factory, args), args)


@fuzz_settings(8)
@given(extra=drawn_flags(command_flags(routes.routes), frozenset({"max_tokens"})), where=st.integers(0, 4))
def test_routes_flags(extra, where, trained_run, corpus_file, tmp_path_factory):
    target = [str(trained_run)] * 3 + ["", "no-such-run"]
    args = ["routes", target[where], "--text", str(corpus_file), "--out", "routes.html", "--max-tokens", "16",
            "--device", "cpu", *extra]
    check(invoke(tmp_path_factory, args), args)


@fuzz_settings(8)
@given(extra=drawn_flags(command_flags(sensitivity.sensitivity), frozenset({"batches", "batch_size", "seq_len"})),
       where=st.integers(0, 4))
def test_sensitivity_flags(extra, where, trained_run, tmp_path_factory):
    target = [str(trained_run)] * 3 + ["", "no-such-run"]
    args = ["sensitivity", target[where], "--batches", "1", "--batch-size", "1", "--seq-len", "8", "--device", "cpu",
            *extra]
    check(invoke(tmp_path_factory, args), args)


# ----------------------------------------------------------------------------------------------- modcli-run


@pytest.fixture(scope="module")
def bundle(trained_run, tmp_path_factory) -> Path:
    from tests.bundle.test_export import exported_bundle

    return exported_bundle(trained_run, tmp_path_factory.mktemp("bundles"))


def runtime_flags() -> dict[str, Flag]:
    from modcli_runtime.cli import parser

    flags = {}
    for action in parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        kind = "bool" if action.nargs == 0 else {int: "int", float: "float"}.get(action.type, "text")
        flags[action.dest] = Flag(action.option_strings[0], kind)
    return flags


@pytest.mark.slow
@fuzz_settings(16)
@given(extra=drawn_flags(runtime_flags(), frozenset({"max_new_tokens"})), where=st.integers(0, 5))
def test_modcli_run_flags(extra, where, bundle, capsys):
    from modcli_runtime.cli import main

    target = [str(bundle)] * 4 + ["", "no-such-bundle"]
    args = [target[where], "--max-new-tokens", "2", *extra]
    capsys.readouterr()
    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code in (0, 2), (args, code, err)
    if code:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, err)


# ----------------------------------------------------------------------------------------------- the files commands read


TOML_VALUES = ['"four"', '"5"', '""', '"no"', '"false"', "2.5", "1.5", "0", "-1", "0.0", "1e309", "nan", "inf", "true",
               "[]", "[1, 2]", '["a"]', "{}", "{ x = 1 }", "1979-05-27"]
GRID_KEYS = [("", "preset"), ("", "budgets"), ("", "seeds"), ("common", "seq_len"), ("common", "batch_size"),
             ("common", "lr"), ("eval", "batches"), ("profile", "repeats"), ("profile", "batch_size"),
             ("size", "d_model"), ("size", "n_layers"), ("size", "n_heads"), ("variant", "dense"),
             ("variant", "capacity"), ("variant", "router"), ("variant", "no_such_key")]
GRID = {"": ['preset = "tiny"', "budgets = [1e9]"], "common": ["seq_len = 16", "batch_size = 2"],
        "eval": ["batches = 2"], "profile": ["repeats = 1"], "size": ["d_model = 32", "n_layers = 2", "n_heads = 4"],
        "variant": ["dense = true"]}


def grid_text(changes: list[tuple[tuple[str, str], str]]) -> str:
    """The base grid above with each drawn key set to its drawn value (added when the base lacks it)."""
    tables = {table: {line.split(" = ")[0]: line.split(" = ")[1] for line in lines} for table, lines in GRID.items()}
    for (table, key), value in changes:
        tables[table][key] = value
    header = {"": "", "size": "[[size]]\n", "variant": "[[variant]]\n"}
    return "".join(header.get(table, f"[{table}]\n") + "".join(f"{k} = {v}\n" for k, v in keys.items())
                   for table, keys in tables.items())


@pytest.mark.slow
@fuzz_settings(10)
@given(changes=st.lists(st.tuples(st.sampled_from(GRID_KEYS), st.sampled_from(TOML_VALUES)), min_size=1, max_size=3),
       dry_run=st.booleans())
def test_sweep_grid_values(changes, dry_run, tmp_path_factory):
    """Whatever a grid's keys hold, `modcli sweep` checks them when it loads the grid, with --dry-run and with
    --report-only (which loads the grid as a training sweep does, then trains nothing): it plans or reports, or
    names the key and file in one line."""
    grid = tmp_path_factory.mktemp("grid") / "grid.toml"
    grid.write_text(grid_text(changes))
    args = ["sweep", str(grid), "--out", "sweep", "--dry-run" if dry_run else "--report-only"]
    check(invoke(tmp_path_factory, args), args)


RESULT_LINES = [b"", b"{", b"[]", b"null", b'"text"', bytes(range(1, 10)), b"\xff\xfe\xfd", b'{"name": 3}',
                b'{"name": ["a"], "budget": 1e9}', b'{"name": "x", "budget": "big"}', b'{"causal_loss": "low"}',
                b'{"name": "x", "budget": -1, "parameters": 0}', b'{"budget": NaN}', b'{"name": "x"' * 50]


@pytest.mark.slow
@fuzz_settings(10)
@given(lines=st.lists(st.one_of(st.sampled_from(RESULT_LINES), st.binary(max_size=40)), min_size=1, max_size=5))
def test_sweep_results_files(lines, tmp_path_factory):
    """A sweep folder's results.jsonl holding anything: `--report-only` reports what it can, never a traceback."""
    grid = tmp_path_factory.mktemp("grid") / "grid.toml"
    grid.write_text(grid_text([]))
    folder = tmp_path_factory.mktemp("sweep")
    (folder / "grid.toml").write_text(grid.read_text())
    (folder / "results.jsonl").write_bytes(b"\n".join(lines))
    args = ["sweep", str(grid), "--out", str(folder), "--report-only"]
    check(invoke(tmp_path_factory, args), args)


TASKS = Path(__file__).resolve().parents[1] / "fixtures" / "lm_eval_tasks"
YAML_VALUES = ["", "[", "]", "{", "!function data.nosuch", "!function nosuch.module", "42", "null", "no_such_metric",
               "loglikelihood", "generate_until", "'{{ nosuch }}'", "'{{'", "choices", "- 1", "train", "validation"]


@pytest.mark.slow
@fuzz_settings(8)
@given(edits=st.lists(st.tuples(st.integers(0, 40), st.sampled_from(["delete", "value", "cut"]),
                                st.sampled_from(YAML_VALUES)), min_size=1, max_size=2),
       fewshot=st.sampled_from([None, "0", "3", "9", "-1"]))
def test_eval_task_files(edits, fewshot, trained_run, tmp_path_factory):
    """A task YAML edited into anything (a line deleted, a value replaced, the file cut short) and any few-shot
    count: `modcli eval --tasks FILE` evaluates it or names the task and file in one line, never a traceback."""
    lines = (TASKS / "tiny_choice.yaml").read_text().splitlines()
    for position, edit, value in edits:
        at = position % len(lines)
        if edit == "delete":
            del lines[at]
        elif edit == "cut":
            lines = lines[:at]
        else:
            key, sep, _ = lines[at].partition(":")
            lines[at] = f"{key}: {value}" if sep else value
        if not lines:
            lines = [""]
    folder = tmp_path_factory.mktemp("tasks")
    (folder / "data.py").write_text((TASKS / "data.py").read_text())
    (folder / "fuzzed.yaml").write_text("\n".join(lines) + "\n")
    args = ["eval", str(trained_run), "--device", "cpu", "--tasks", str(folder / "fuzzed.yaml"), "--limit", "2",
            *(["--num-fewshot", fewshot] if fewshot is not None else [])]
    check(invoke(tmp_path_factory, args), args)
