"""What importing modcli costs: heavy optional dependencies load only in the commands that use them, and
`modcli --help` (which imports modcli.cli) does not import torch. Each check runs in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

HEAVY_OPTIONAL = ["onnx", "onnxruntime", "onnxscript", "matplotlib", "transformers", "tensorboard", "gguf", "lm_eval"]


def modules_loaded_by(statement: str) -> set[str]:
    """The top-level names in sys.modules after running `statement` in a new interpreter."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted({{name.split('.')[0] for name in sys.modules}})))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "export"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout.splitlines()[-1]))


def test_the_check_sees_what_an_import_loads():
    loaded = modules_loaded_by("import onnx")
    assert "onnx" in loaded and "modcli" not in loaded


@pytest.mark.parametrize("statement", ["import modcli", "import modcli.cli"])
def test_importing_modcli_loads_no_heavy_optional_dependency(statement):
    loaded = modules_loaded_by(statement)
    assert "modcli" in loaded
    assert not loaded & set(HEAVY_OPTIONAL), f"`{statement}` loads {sorted(loaded & set(HEAVY_OPTIONAL))}"


def test_modcli_help_does_not_import_torch():
    """`modcli --help` loads modcli.cli and every subcommand's module; none of them may need torch to register."""
    loaded = modules_loaded_by("import modcli.cli")
    assert "typer" in loaded
    assert "torch" not in loaded, "`import modcli.cli` (what `modcli --help` loads) imports torch"
