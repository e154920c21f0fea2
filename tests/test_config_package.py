"""modcli/config/ is one module per concern: every name the single config.py exported still imports from
modcli.config, each module says what it holds and stays short, and the flags' help still finds every field's
docstring in the module that declares it (modcli.commands.options reads the source, not the classes)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import modcli.config
from modcli.commands import config_flags

CONFIG = Path(modcli.config.__file__).resolve().parent

# Every public name of modcli/config.py before the split: `from modcli.config import X` keeps working for each.
NAMES_BEFORE_THE_SPLIT = [
    "ATTENTION_SCORES", "DEVICES", "DTYPES", "EXPERT_FIELDS", "EXPERT_RECIPE", "EXPERT_ROUTINGS", "EXPERT_WEIGHTS",
    "FLAG_ONLY_KEYS", "HASH_TABLES", "LEGACY_DEFAULTS", "MOD_ROUTING_FIELDS", "OBJECTIVES", "PRESETS",
    "ROUTE_PARTS", "ROUTER_WEIGHTS", "ROUTING_MODES", "SECTIONS", "SHAPE_FIELDS", "TRAINABLE", "DataConfig",
    "ModelConfig", "RunConfig", "TrainConfig", "check_config_values", "check_field_types", "check_flag_types",
    "describe_type", "field_types", "flag_types", "load_toml", "require", "resolve_run_config", "value_fits",
]


@pytest.mark.parametrize("name", NAMES_BEFORE_THE_SPLIT)
def test_every_name_of_the_old_module_imports_from_modcli_config(name):
    assert name in modcli.config.__all__
    namespace: dict = {}
    exec(f"from modcli.config import {name}", namespace)
    assert namespace[name] is getattr(modcli.config, name)


def test_each_module_has_a_docstring_and_at_most_400_lines_or_says_why():
    modules = sorted(CONFIG.glob("*.py"))
    assert len(modules) >= 6, [path.name for path in modules]
    for path in modules:
        text = path.read_text()
        docstring = ast.get_docstring(ast.parse(text))
        assert docstring, f"{path.name} has no docstring saying what it holds"
        lines = len(text.splitlines())
        assert lines <= 400 or "lines" in docstring, f"{path.name}: {lines} lines and no reason at its top"


@pytest.mark.parametrize("cls", [modcli.config.ModelConfig, modcli.config.DataConfig, modcli.config.TrainConfig])
def test_the_flags_help_reads_every_field_from_the_module_that_declares_it(cls):
    for flag in config_flags.flags_of(cls):
        assert config_flags.field_docstring(cls, flag.name)  # raises KeyError naming the file when it is not there


def test_every_variant_option_is_a_documented_flag():
    flags = {flag.name: flag for flag in config_flags.model_flags()}
    for name, (_, variant, _) in modcli.config.variant_fields().items():
        assert name in flags, f"{variant}'s option {name} is no flag"
        assert flags[name].help, f"{variant}'s option {name} has no docstring"


def test_a_saved_run_config_round_trips_by_field_name():
    run = modcli.config.resolve_run_config("tiny", overrides={"route_layers": "1,3", "experts": 2})
    saved = run.to_dict()
    assert list(saved) == ["model", "data", "train"]
    assert modcli.config.RunConfig.read_saved(saved) == run
