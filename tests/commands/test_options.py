"""The command line's flags are declared once: generated from the config field each sets (its docstring the help,
modcli/commands/config_flags.py) or, for the few no field holds, in modcli/commands/options.py; commands receive
them by name (never `locals()` or ctx.params), and the CLI layer imports no torch until a command runs."""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import typer
import typer.main
from typer.testing import CliRunner

import modcli
from modcli.cli import app
from modcli.commands import config_flags, options
from modcli.config import ModelConfig
from modcli.errors import UserError

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


def generated_flags():
    """(command path, its ConfigFlags) of every command whose flags are generated from config fields."""
    for path, command in leaf_commands(typer.main.get_command(app)):
        function = inspect.unwrap(command.callback, stop=lambda f: isinstance(f, config_flags.ConfigCommand))
        if isinstance(function, config_flags.ConfigCommand):
            yield path, command, function.flags()


def test_a_generated_flag_is_its_config_field_help_and_default():
    """Each command's flag says what it does in that command: the docstring of the field it sets (so --seed, --dtype
    and --batch-size each describe their own command), and defaults to None, "not given"."""
    seen = set()
    for path, command, flags in generated_flags():
        seen.add(path)
        params = {param.name: param for param in command.params}
        for flag in flags:
            param = params[flag.name]
            assert param.default is None, (path, flag.name)
            assert param.help.startswith(flag.help[:60].replace("[", "\\[")) or flag.help[:40] in param.help, \
                (path, flag.name, param.help)
    assert seen == {"modcli train", "modcli eval", "modcli generate", "modcli export", "modcli profile",
                    "modcli import", "modcli routes", "modcli sweep", "modcli tokenizer train", "modcli sensitivity"}


def test_each_flag_is_declared_once_in_each_command():
    for path, command in leaf_commands(typer.main.get_command(app)):
        names = [opt for param in command.params for opt in param.opts]
        assert len(names) == len(set(names)), (path, sorted(n for n in names if names.count(n) > 1))


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
        if path.name in ("options.py", "config_flags.py"):  # the flags no field holds; those generated from fields
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
    assert config_flags.source_docstring("profiling/config.py", "ProfileConfig", "seq_lens") == \
        "Sequence lengths to profile; default: the model's seq_len."


def test_a_field_the_config_does_not_declare_is_named():
    with pytest.raises(KeyError, match=r"ModelConfig in \S+/modcli/config/model.py declares no documented field 'wingspan'"):
        config_flags.field_docstring(ModelConfig, "wingspan")
    with pytest.raises(KeyError, match="EvalConfig in modcli/evaluation/perplexity.py declares no documented field"):
        config_flags.source_docstring("evaluation/perplexity.py", "EvalConfig", "wingspan")


def test_flags_map_onto_a_config_by_name_and_the_rest_keep_its_defaults():
    probe = typer.Typer()
    built = []

    @probe.command()
    @config_flags.config_flags(lambda: config_flags.flags_of(ModelConfig),
                               lambda: config_flags.source_flags("decode/generation.py", "GenerateConfig"))
    def command(json_output: options.Json = False, flags: dict | None = None) -> None:
        built.append(flags)

    result = CliRunner().invoke(probe, ["--d-model", "64", "--prompt", "a", "--prompt", "b", "--qkv-bias",
                                        "--route-layers", "1,3"])
    assert result.exit_code == 0, result.output
    [flags] = built
    # the flags given, and only they: a repeated flag is a list, a comma-separated one is parsed to its items
    assert flags == {"d_model": 64, "qkv_bias": True, "route_layers": [1, 3], "prompts": ["a", "b"]}
    model = {name: value for name, value in flags.items() if name != "prompts"}
    assert ModelConfig.of(**model) == ModelConfig(d_model=64, qkv_bias=True, route_layers=[1, 3])
    built.clear()
    assert CliRunner().invoke(probe, []).exit_code == 0
    assert built == [{}]  # a flag never given (a repeatable one included) is not given
    result = CliRunner().invoke(probe, ["--route-layers", "1,x"])  # a command turns it into one line and exit 2
    assert isinstance(result.exception, UserError) and "--route-layers must be comma-separated integers" in str(
        result.exception)


def test_a_generated_signature_follows_the_registries():
    """The flags are built when the command line is read: a family registered afterwards brings its options."""
    names = {flag.name for flag in config_flags.run_flags()}
    assert {"layer_dropout_max", "recursions", "threshold", "attention_score"} <= names
    assert "family_options" not in names and "rope_scaling" not in names  # a member, a mapping: no flags


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
