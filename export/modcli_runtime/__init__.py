"""modcli_runtime: run a `modcli export` bundle with numpy and onnxruntime only (no PyTorch, no modcli).

    from modcli_runtime import load_bundle
    bundle = load_bundle("bundles/latest")
    out = bundle.generate(["def "], max_new_tokens=50, temperature=0)
    print(out.texts[0])

Command line: `modcli-run BUNDLE --prompt "def "` (or `python -m modcli_runtime`).
"""

from __future__ import annotations

import importlib.metadata

from modcli_runtime.bench import time_bundle
from modcli_runtime.bundle import Bundle, load_bundle, read_manifest
from modcli_runtime.cache import CacheSpec
from modcli_runtime.device import DeviceCache
from modcli_runtime.errors import BundleError, TokenizerError
from modcli_runtime.generate import Generation, generate_tokens, sample
from modcli_runtime.text import ByteTokenizer, JsonTokenizer, TextPieces, Utf8Stream

try:  # one version for modcli and its runtime, declared in modcli/__init__.py; read from the metadata, never imported
    __version__ = importlib.metadata.version("modcli")
except importlib.metadata.PackageNotFoundError:  # a source tree on the path that was never installed
    __version__ = "0+unknown"
__all__ = ["Bundle", "BundleError", "ByteTokenizer", "CacheSpec", "DeviceCache", "Generation", "JsonTokenizer",
           "TextPieces", "TokenizerError", "Utf8Stream", "generate_tokens", "load_bundle", "read_manifest", "sample",
           "time_bundle", "__version__"]
