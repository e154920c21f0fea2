"""The Python API mirrors the command line: `from modcli import train` is the function, whatever was imported."""

from __future__ import annotations

import types

import torch


def test_package_names_are_functions_even_after_the_submodules_are_imported():
    import modcli.bundle.writer
    import modcli.decode.generation
    import modcli.evaluation.perplexity
    import modcli.profiling.profile
    import modcli.training.loop  # noqa: F401
    from modcli import evaluate, export, generate, profile, train

    for function in (train, evaluate, generate, export, profile):
        assert callable(function) and not isinstance(function, types.ModuleType)


def test_every_exported_name_resolves_to_what_its_module_defines():
    import importlib

    import modcli

    for name, module in modcli._EXPORTS.items():
        value = getattr(modcli, name)
        assert value is getattr(importlib.import_module(module), name) and not isinstance(value, types.ModuleType)


def test_load_model_and_call_it_in_each_routing_mode(trained_run):
    from modcli import load_model

    model = load_model(trained_run)
    tokens = torch.randint(0, 256, (2, 16))
    for routing in ("topk", "router", "predictor"):
        with torch.no_grad():
            assert model(tokens, routing=routing).shape == (2, 16, 256)
