"""A `modcli export` bundle on disk: manifest.json, config.json and the ONNX graphs, run through onnxruntime.

Only numpy and onnxruntime are imported here (never torch or modcli), so a bundle runs where PyTorch is not
installed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from modcli_runtime.cache import CacheSpec
from modcli_runtime.device import WRITER_GRAPH, DeviceCache
from modcli_runtime.errors import BundleError, TokenizerError
from modcli_runtime.generate import Generation, generate_tokens
from modcli_runtime.text import ByteTokenizer, JsonTokenizer

FORMAT = "modcli-bundle"
FORMAT_VERSION = 3
"""3: a local (sliding-window) layer's decode inputs include slot_positions.L, each cache slot's original position,
which the runtime stores beside the K/V (manifest graphs.decode.cache.local_layers); 2: the decode graph reads the
KV cache and returns only the new token's K/V (the runtime writes them in place); 1: it returned the whole updated
cache every step (its decode graph is refused, its forward graph still runs)."""
DECODE_FORMAT_VERSION = 2
"""The oldest bundle format whose decode graph this runtime runs."""
PROVIDERS = ("auto", "cpu", "cuda")
ORT_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
MAX_THREADS = 1024
"""Most onnxruntime intra-op threads a bundle may ask for (0 = one per core)."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(path: str | Path) -> dict[str, Any]:
    folder = Path(path)
    manifest_path = folder / "manifest.json"
    if not manifest_path.is_file():
        raise BundleError(f"{folder} is not a modcli export bundle (no manifest.json)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleError(f"{manifest_path}: unreadable manifest ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise BundleError(f"{manifest_path}: not a {FORMAT} manifest")
    version = manifest.get("format_version", 0)
    if not isinstance(version, int):
        raise BundleError(f"{manifest_path}: format_version must be an integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise BundleError(f"{manifest_path}: format version {version} is newer than this runtime ({FORMAT_VERSION}); "
                          "upgrade modcli_runtime")
    _check_manifest(manifest, manifest_path)
    return manifest


def _check_manifest(manifest: dict[str, Any], path: Path) -> None:
    """The fields the runtime reads have their types; a manifest edited into something else is a BundleError."""
    model, graphs, files = manifest.get("model"), manifest.get("graphs"), manifest.get("files", {})
    if not isinstance(model, dict) or not all(isinstance(model.get(key), int) and not isinstance(model.get(key), bool)
                                              and model.get(key) > 0 for key in ("vocab_size", "seq_len")):
        raise BundleError(f"{path} is damaged: model.vocab_size and model.seq_len must be positive integers")
    if not isinstance(graphs, dict) or not all(isinstance(info, dict) for info in graphs.values()):
        raise BundleError(f"{path} is damaged: graphs must be an object of graph descriptions")
    if not isinstance(files, dict) or not all(isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
                                              for entry in files.values()):
        raise BundleError(f"{path} is damaged: files must map each file to its sha256")
    decode = graphs.get("decode")
    if decode is not None and manifest.get("format_version", 0) >= DECODE_FORMAT_VERSION:
        try:
            CacheSpec.from_manifest(decode)
            [spec["name"] for spec in decode["inputs"]] + [spec["name"] for spec in decode["outputs"]]
        except (KeyError, TypeError, ValueError):
            raise BundleError(f"{path} is damaged: the decode graph's cache, inputs or outputs are incomplete") from None


def session_providers(provider: str) -> list[str]:
    """--provider -> the onnxruntime execution providers to ask for, in order of preference."""
    import onnxruntime as ort

    if provider not in PROVIDERS:
        raise BundleError(f"--provider must be one of {', '.join(PROVIDERS)}, got {provider!r}")
    available = ort.get_available_providers()
    if provider == "cpu":
        return ["CPUExecutionProvider"]
    if provider == "cuda":
        if "CUDAExecutionProvider" not in available:
            raise BundleError("--provider cuda: this onnxruntime build has no CUDAExecutionProvider")
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def session_settings(threads: int = 0, spinning: bool = True, stop_spinning: bool = False) -> dict[str, object]:
    """The onnxruntime session settings `create_session` uses, as recorded in profile output."""
    return {"graph_optimization_level": "ORT_ENABLE_ALL", "intra_op_threads": threads or "onnxruntime default",
            "allow_spinning": spinning, "force_spinning_stop": stop_spinning}


def create_session(path: Path, providers: list[str], strict_provider: str | None = None, threads: int = 0,
                   spinning: bool = True, stop_spinning: bool = False):
    """An onnxruntime session; with `strict_provider`, a BundleError unless that provider really runs it.

    `threads`: intra-op threads of the CPU provider (0 = onnxruntime's default, one per core). Every graph
    optimisation is on (ORT_ENABLE_ALL, onnxruntime's default, stated). `spinning`: whether idle intra-op threads
    spin waiting for work between the operators of a call (onnxruntime's default, fastest when the process has the
    cores to itself). `stop_spinning`: the threads stop spinning as soon as a call returns
    (`session.force_spinning_stop`), for processes that do other work on the same cores between calls, e.g.
    PyTorch timed beside it in `modcli profile`, which threads still spinning after a call slow down (measured 2x
    on 2 cores); turning spinning off altogether instead costs every call a thread wake-up per operator (7-11%
    on the small preset, Intel Xeon, 2 threads).
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: the CUDA provider's fallback warning is reported by us
    options.intra_op_num_threads = threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    options.add_session_config_entry("session.force_spinning_stop", "1" if stop_spinning else "0")
    try:
        session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
    except Exception as exc:  # onnxruntime raises its own exception types (NOT_IMPLEMENTED, INVALID_GRAPH, ...)
        raise BundleError(f"onnxruntime cannot load {path.name} with {providers[0]}: {exc}") from None
    if strict_provider is not None and strict_provider not in session.get_providers():
        raise BundleError(f"{strict_provider} is not usable on this machine (onnxruntime fell back to "
                          f"{session.get_providers()[0]})")
    return session


class Bundle:
    """A loaded bundle: `decode_step` (causal routing, KV cache), `forward` (top-k, non-causal), `generate`."""

    def __init__(self, path: str | Path, provider: str = "cpu", verify: bool = True, allow_invalid: bool = False,
                 threads: int = 0, device_cache: bool | None = None) -> None:
        """`device_cache`: keep the KV cache in device OrtValues written in place (modcli_runtime.device); None =
        when the decode graph runs on the CUDA provider and the bundle has cache_write.onnx."""
        if not 0 <= threads <= MAX_THREADS:
            raise BundleError(f"--threads must be in [0, {MAX_THREADS}], got {threads}")
        self.path = Path(path)
        self.threads = threads
        self.device_cache = device_cache
        self.manifest = read_manifest(self.path)
        if not self.manifest.get("valid", False) and not allow_invalid:
            raise BundleError(f"{self.path}: the bundle failed validation at export time (manifest valid=false); "
                              "pass --allow-invalid to run it anyway")
        if verify:
            self.verify()
        self.model = self.manifest["model"]
        self.vocab_size = int(self.model["vocab_size"])
        tokenizer = self.model.get("tokenizer")
        try:
            self.text = JsonTokenizer(self.path / tokenizer) if tokenizer else ByteTokenizer()
        except TokenizerError as exc:
            raise BundleError(str(exc)) from None
        if self.text.vocab_size > self.vocab_size:  # its ids past the model's vocabulary have no embedding
            raise BundleError(f"{self.path}: the tokenizer has {self.text.vocab_size:,} tokens but the model's "
                              f"vocabulary has {self.vocab_size:,} (the tokenizer is not the model's)")
        self.providers = session_providers(provider)
        self._strict = ORT_PROVIDERS[provider] if provider in ORT_PROVIDERS else None
        self._sessions: dict[str, Any] = {}
        graphs = self.manifest.get("graphs", {})
        self.forward_info = graphs.get("forward")
        self.decode_info = graphs.get("decode")
        self.format_version = int(self.manifest.get("format_version", 0))
        self.decode_refused: str | None = None
        """Why this runtime will not run the bundle's decode graph (None when it will)."""
        if self.decode_info is not None and self.format_version < DECODE_FORMAT_VERSION:
            self.decode_refused = (f"{self.path}: its decode graph is bundle format {self.format_version} (it returns "
                                   f"the whole KV cache every step); this runtime needs format "
                                   f"{DECODE_FORMAT_VERSION}: re-export it with `modcli export`")
        elif self.decode_info is not None:
            self.cache_spec = CacheSpec.from_manifest(self.decode_info)
            self.decode_inputs = [spec["name"] for spec in self.decode_info["inputs"]]
            self.decode_outputs = [spec["name"] for spec in self.decode_info["outputs"]]

    def verify(self) -> None:
        """Check every file listed in the manifest against its sha256."""
        for name, entry in self.manifest.get("files", {}).items():
            file = self.path / name
            if not file.is_file():
                raise BundleError(f"{self.path}: {name} is missing")
            try:
                digest = sha256_of(file)
            except OSError as exc:
                raise BundleError(f"{self.path}: cannot read {name}: {exc.strerror or exc}") from None
            if digest != entry["sha256"]:
                raise BundleError(f"{self.path}: {name} does not match its sha256 in manifest.json (damaged bundle)")

    def session(self, graph: str):
        if graph == "decode" and self.decode_refused:
            raise BundleError(self.decode_refused)
        if graph not in self._sessions:
            info = self.manifest["graphs"].get(graph)
            if info is None or info.get("kind") != "onnx":
                raise BundleError(f"{self.path}: no ONNX {graph} graph in this bundle")
            self._sessions[graph] = create_session(self.path / info["file"], self.providers, self._strict, self.threads)
        return self._sessions[graph]

    @property
    def active_provider(self) -> str:
        decode = self.decode_info is not None and not self.decode_refused
        return self.session("decode" if decode else "forward").get_providers()[0]

    def decode_step(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One token per row: feeds `tokens`, `positions` and the (read-only) cache -> logits, this step's K/V per
        layer (new_keys.L, new_values.L) and processed flags; `cache_spec.write_rows(feeds, outputs)` stores them."""
        outputs = self.session("decode").run(self.decode_outputs, {name: feeds[name] for name in self.decode_inputs})
        return dict(zip(self.decode_outputs, outputs, strict=True))

    def decoder(self):
        """(step, cache) for `generate_tokens`: the decode graph and the cache it reads and the runtime writes.

        numpy buffers (`decode_step`, `cache_spec`), or with the device cache a `DeviceCache` (its `step`, itself).
        """
        session = self.session("decode")
        on_cuda = session.get_providers()[0] == ORT_PROVIDERS["cuda"]
        has_writer = self.manifest["graphs"].get(WRITER_GRAPH, {}).get("kind") == "onnx"
        wanted = self.device_cache if self.device_cache is not None else (on_cuda and has_writer)
        if not wanted:
            return self.decode_step, self.cache_spec
        if not has_writer:
            raise BundleError(f"{self.path}: no cache_write.onnx for a device-resident KV cache; re-export it with "
                              "`modcli export`")
        cache = DeviceCache(self.cache_spec, session, self.session(WRITER_GRAPH), "cuda" if on_cuda else "cpu")
        return cache.step, cache

    def forward(self, tokens: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """tokens (B, T) int64 -> logits (B, T, V) and each routed block's selected positions (B, k).

        This graph uses the training-time top-k routing, which sees the whole sequence (non-causal): use it to
        score text, not to decode.
        """
        session = self.session("forward")
        outputs = session.run(None, {session.get_inputs()[0].name: np.asarray(tokens, dtype=np.int64)})
        return outputs[0], outputs[1:]

    def generate(self, prompts: list[str | bytes | list[int]], **options) -> Generation:
        """Generate from each prompt (one batch); see modcli_runtime.generate.generate_tokens for the options."""
        step, cache = self.decoder()  # a clear error when the bundle has no ONNX decode graph
        options.setdefault("context", int(self.model["seq_len"]))
        return generate_tokens(step, cache, prompts, vocab_size=self.vocab_size, text=self.text, **options)


def load_bundle(path: str | Path, provider: str = "cpu", verify: bool = True, allow_invalid: bool = False,
                threads: int = 0, device_cache: bool | None = None) -> Bundle:
    """Open a bundle: checks its manifest (and the files' sha256 with `verify`); sessions start on first use."""
    return Bundle(path, provider=provider, verify=verify, allow_invalid=allow_invalid, threads=threads,
                  device_cache=device_cache)
