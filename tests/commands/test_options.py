"""The command line's flags are declared once (modcli/commands/options.py): a flag has one default and one help text
in every command that takes it, commands gather their flags by name (never `locals()`), and the CLI layer imports
no torch until a command runs."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Annotated

import pytest
import typer
import typer.main
from typer.testing import CliRunner

import modcli
from modcli.cli import app
from modcli.commands import options
from modcli.config import ModelConfig

COMMANDS = Path(modcli.__file__).parent / "commands"
CLI_FILES = sorted(COMMANDS.glob("*.py")) + [Path(modcli.__file__).parent / "cli.py"]


def leaf_commands(command, path: str = "modcli"):
    """(path, command) of every command under `command` (typer's click), subgroups walked (`modcli tokenizer
    train`)."""
    if hasattr(command, "commands"):
        for name, sub in command.commands.items():
            yield from leaf_commands(sub, f"{path} {name}")
    else:
        yield path, command


def declarations(root) -> dict[str, dict[str, tuple]]:
    """{flag: {command: (default, help)}}: an option by its first spelling (--json), an argument by its name."""
    found: dict[str, dict[str, tuple]] = defaultdict(dict)
    for path, command in leaf_commands(root):
        for param in command.params:
            key = param.opts[0] if param.param_type_name == "option" else param.name
            found[key][path] = (param.default, getattr(param, "help", None))
    return found


def disagreements(root) -> dict[str, dict[str, tuple]]:
    return {flag: uses for flag, uses in declarations(root).items() if len(set(uses.values())) > 1}


OWN_IN_EACH_COMMAND = {"--out", "--text", "checkpoint"}
"""What each command writes (--out) or reads (routes' and export's --text) is its own, so is its help; CHECKPOINT is
runs/latest by default except in profile, where none means a fresh model."""


def test_a_flag_has_one_default_and_one_help_in_every_command():
    root = typer.main.get_command(app)
    assert set(disagreements(root)) == OWN_IN_EACH_COMMAND
    shared = {flag: len(uses) for flag, uses in declarations(root).items() if len(uses) > 1}
    # the common flags are shared where they apply, so the check above compares something
    assert shared["--json"] == 10 and shared["--device"] >= 6 and shared["--dtype"] >= 7
    assert shared["--seed"] >= 4 and shared["--out"] >= 7 and shared["--compile"] >= 4 and shared["--config"] == 2
    assert shared["--capacity"] == 2 and shared["checkpoint"] >= 5
    checkpoints = {help for command, (_, help) in declarations(root)["checkpoint"].items() if command != "modcli profile"}
    assert len(checkpoints) == 1  # eval, generate, export, routes: one text


OUT_DEFAULTS = {"modcli train": "runs/latest", "modcli import": "required", "modcli export": "bundles/latest",
                "modcli sweep": "runs/sweeps/GRID-NAME", "modcli plot": "curves.png", "modcli routes": "routes.html",
                "modcli tokenizer train": "tokenizer.json"}


def test_each_commands_out_help_names_its_own_default_only():
    """`modcli export --help` describes export's --out, not train's, sweep's and plot's too (issue 50, item 14)."""
    uses = declarations(typer.main.get_command(app))["--out"]
    assert set(uses) == set(OUT_DEFAULTS)
    for command, (_, help) in uses.items():
        own = OUT_DEFAULTS[command]
        assert own in help, (command, help)
        others = [default for other, default in OUT_DEFAULTS.items() if other != command and default not in own]
        assert not [default for default in others if default in help], (command, help)
        assert not any(name in help for name in ("train's", "import's", "export's", "sweep's", "plot's", "routes'")), help
    shown = CliRunner().invoke(app, ["export", "--help"], env={"COLUMNS": "400"}).output
    out_line = next(line for line in shown.splitlines() if "--out" in line)
    assert "bundles/latest" in out_line and "curves.png" not in shown and "runs/sweeps" not in shown


def test_the_check_sees_a_flag_that_drifted():
    drifted = typer.Typer()

    @drifted.command("a")
    def a(seed: Annotated[int, typer.Option(help="Random seed.")] = 1) -> None: ...

    @drifted.command("b")
    def b(seed: Annotated[int, typer.Option(help="Random seed.")] = 1337) -> None: ...

    assert set(disagreements(typer.main.get_command(drifted))) == {"--seed"}


def test_every_flag_has_help():
    for path, command in leaf_commands(typer.main.get_command(app)):
        for param in command.params:
            assert getattr(param, "help", None), (path, param.name)


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_no_command_gathers_its_flags_with_locals():
    for path in CLI_FILES:
        calls = [node for node in ast.walk(_tree(path)) if isinstance(node, ast.Call)
                 and isinstance(node.func, ast.Name) and node.func.id in ("locals", "vars")]
        assert not calls, f"{path.name}:{calls[0].lineno} gathers flags with {calls[0].func.id}()"


def test_only_the_options_module_declares_flags():
    for path in CLI_FILES:
        if path.name == "options.py":
            continue
        declared = [node for node in ast.walk(_tree(path)) if isinstance(node, ast.Attribute)
                    and node.attr in ("Option", "Argument") and isinstance(node.value, ast.Name)
                    and node.value.id == "typer"]
        assert not declared, f"{path.name}:{declared[0].lineno} declares a flag outside options.py"


def test_no_imports_inside_the_functions_of_the_cli_layer():
    for path in CLI_FILES:
        for function in ast.walk(_tree(path)):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = [node for node in ast.walk(function) if isinstance(node, (ast.Import, ast.ImportFrom))]
                assert not inner, f"{path.name}:{inner[0].lineno} imports inside {function.name}()"


def test_the_cli_and_its_help_import_no_torch():
    script = ("import sys\nfrom modcli.cli import app\nassert 'torch' not in sys.modules\n"
              "for args in (['--help'], ['train', '--help'], ['profile', '--help']):\n"
              "    try:\n        app(args)\n    except SystemExit as exc:\n        assert exc.code == 0\n"
              "print(sorted(name for name in ('torch', 'numpy', 'onnx', 'onnxruntime') if name in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_help_comes_from_the_config_field_docstrings():
    runner = CliRunner()
    train = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "400"})
    assert "k = max(1, floor(capacity x T))" in train.output  # ModelConfig.capacity
    assert "Micro-batches per optimiser step. [default: 1]" in train.output  # TrainConfig.grad_accum
    assert "[default: 300]" not in train.output  # --max-steps: the preset's, not the dataclass default
    evaluate = runner.invoke(app, ["eval", "--help"], env={"COLUMNS": "400"})
    assert "Validation batches. [default: 16]" in evaluate.output  # EvalConfig.batches
    profile = runner.invoke(app, ["profile", "--help"], env={"COLUMNS": "400"})
    assert "[default: memory]" in profile.output  # ProfileConfig.memory, a switch shown by its spelling
    assert options.field_help(options.PROFILE, "seq_lens") == "Sequence lengths to profile; default: the model's seq_len."


def test_a_field_the_config_does_not_declare_is_named():
    with pytest.raises(KeyError, match="ModelConfig in modcli/config/model.py declares no documented field 'wingspan'"):
        options.field_help(options.MODEL, "wingspan")


def test_flags_map_onto_a_config_by_name_and_the_rest_keep_its_defaults():
    probe = typer.Typer()
    built = []

    @probe.command()
    def command(ctx: typer.Context, prompts: options.Prompts = None, seed: options.Seed = None,
                d_model: options.DModel = None) -> None:
        built.append(options.build(ModelConfig, options.given(ctx)))
        built.append(options.given(ctx))

    assert CliRunner().invoke(probe, ["--d-model", "64", "--prompt", "a", "--prompt", "b"]).exit_code == 0
    model, values = built
    assert model == ModelConfig(d_model=64)  # prompts and seed are no ModelConfig fields
    assert values == {"d_model": 64, "prompts": ["a", "b"]}  # seed not given; a repeated flag is a list
    built.clear()
    assert CliRunner().invoke(probe, []).exit_code == 0
    assert built == [ModelConfig(), {}]  # a repeatable flag never given is not given


def test_a_seed_not_given_is_the_configs(tmp_path, corpus_file):
    """--seed follows the rule of every flag: not given, the config's value (TrainConfig's 1337)."""
    runner = CliRunner()
    tiny = ["--data", str(corpus_file), "--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--seq-len", "16",
            "--batch-size", "2", "--max-steps", "1", "--eval-every", "1", "--eval-batches", "1", "--device", "cpu",
            "--warmup", "0", "--json"]
    for extra, seed in (([], 1337), (["--seed", "7"], 7)):
        out = tmp_path / f"run{seed}"
        result = runner.invoke(app, ["train", *tiny, "--out", str(out), *extra])
        assert result.exit_code == 0, result.output
        assert json.loads((out / "step-00000001" / "config.json").read_text())["train"]["seed"] == seed
