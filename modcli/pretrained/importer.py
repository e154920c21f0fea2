"""`modcli import HF_DIR|FILE.gguf --out RUN`: a Hugging Face model folder, or a llama.cpp GGUF file, -> a modcli run
folder holding the dense model.

A folder: config.json, model.safetensors or the shards a model.safetensors.index.json lists (never a pickle file),
and tokenizer.json. A GGUF file (`modcli.pretrained.gguf`): its metadata as that config.json, its tensors
dequantized to float, its tokenizer as a tokenizer.json. Writes RUN/step-00000000/ (a checkpoint like any other,
the weights in --dtype) and RUN/tokenizer.json, so eval, generate and profile take RUN as they take a trained run.
Nothing is downloaded and no code from the source runs.

RUN must not exist or be an empty folder (a folder holding the user's files is refused, never written into). It is
written as `.tmp-RUN-PID/` beside RUN and renamed into place at the end, under --out's lock (modcli.checkpoint.lock,
the one every writing command takes), so a killed import leaves no RUN, and the next command writing RUN removes
what it left (and a `RUN/.modcli.lock` or `.tmp-step-*` an import killed before this rule left inside RUN).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from modcli.checkpoint import atomic
from modcli.checkpoint.lock import OutLock
from modcli.checkpoint.store import clean_stale, complete_checkpoints, save_checkpoint, slow_save_pause
from modcli.config import DataConfig, RunConfig, TrainConfig, require
from modcli.data.tokenizer import check_tokenizer_json
from modcli.errors import UserError, WriteFailed
from modcli.hardware import TORCH_DTYPES
from modcli.models.decoder import MoDDecoder
from modcli.pretrained.adapters import ADAPTERS
from modcli.pretrained.gguf import read_gguf


@dataclass
class ImportConfig:
    """What `modcli import` reads and writes."""

    source: str
    """A Hugging Face model folder (config.json, model.safetensors or its index and shards, tokenizer.json), or a
    llama.cpp GGUF file (Llama, Mistral, Qwen2, Qwen3, Gemma 3)."""
    out: str
    """Run folder to write (must not exist, or be empty)."""
    seq_len: int | None = None
    """modcli's context length for the run; default min(max_position_embeddings, 1024)."""
    dtype: str = "float32"
    """Dtype of the saved weights: float32, bfloat16 or float16."""

    def __post_init__(self) -> None:
        require(self.seq_len is None or self.seq_len >= 2, f"--seq-len must be >= 2, got {self.seq_len}")
        require(self.dtype in TORCH_DTYPES, f"--dtype must be one of {', '.join(TORCH_DTYPES)}, got {self.dtype!r}")


@dataclass
class ImportResult:
    run: str
    checkpoint: str
    architecture: str
    parameters: int
    vocab_size: int
    seq_len: int
    tokenizer: str


def import_model(config: ImportConfig, log: Callable[[str], None] | None = None) -> ImportResult:
    """Import `config.source` into `config.out`; every user mistake is a UserError and nothing is written then.
    `log` gets the notes (a stale lock taken over, what a killed import left removed)."""
    log = log or (lambda message: None)
    source, out = Path(config.source), Path(config.out)
    if not source.exists():
        raise UserError(f"no such model folder or GGUF file: {source}")
    lock = OutLock(out, "import", kind="run folder")
    for note in lock.acquire():
        log(note)
    try:
        for note in clean_stale(out):  # a killed import of an older modcli left its checkpoint's temporary folder
            log(note)
        _check_empty(out)
        return _import(config, source, out, atomic.folder_state(out))
    finally:
        lock.release()


def _check_empty(out: Path) -> None:
    """--out must not exist or be empty: an import never writes into a folder that holds anything."""
    if complete_checkpoints(out):
        raise UserError(f"--out {out} already holds checkpoints; pick another --out")
    names = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if names:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise UserError(f"--out {out} is not empty (it holds {shown}); import writes a new run folder: pick another "
                        "--out or an empty folder")


def _publish_run(out: Path, checked: tuple | None, tokenizer: str, model: MoDDecoder, run: RunConfig,
                 state_json: dict) -> Path:
    """Write the run folder beside `out` and rename it into place (over nothing but the empty folder checked)."""
    try:
        with atomic.publish_folder(out, expect=checked, pause=slow_save_pause) as tmp:
            (tmp / "tokenizer.json").write_text(tokenizer, encoding="utf-8")
            checkpoint = save_checkpoint(tmp, 0, model, None, run, state_json, keep=1)
    except WriteFailed as exc:  # it names the temporary folder: name the run
        raise WriteFailed(str(exc).replace(str(atomic.temporary_path(out, "tmp")), str(out))) from None
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise WriteFailed(f"cannot write the run {out}: {exc.strerror or exc}{where}") from None
    return out / checkpoint.name


def _import(config: ImportConfig, source: Path, out: Path, checked: tuple | None) -> ImportResult:
    if source.is_dir():
        hf, shapes, tensor, tokenizer = _read_folder(source)
        origin, field_names = str(source / "config.json"), None
    else:
        gguf_model = read_gguf(source)
        hf, shapes, tensor, tokenizer = (gguf_model.config, gguf_model.tensor_shapes, gguf_model.tensor,
                                         gguf_model.tokenizer_json)
        origin, field_names = str(source), gguf_model.field_names
    architecture = hf["architectures"][0]
    adapter = ADAPTERS[architecture]
    # the config's types and ranges, every tensor's shape and the tokenizer's ids, before anything is built
    model_config = adapter.model_config(hf, config.seq_len, shapes, origin)
    adapter.check_shapes(model_config, shapes, str(source), field_names)
    check_tokenizer_json(tokenizer, model_config.vocab_size, str(source))
    state = {name: value.to(TORCH_DTYPES[config.dtype]) for name, value in adapter.state_dict(model_config,
                                                                                               tensor).items()}
    with torch.device("meta"):
        model = MoDDecoder(model_config)
    expected = model.state_dict()
    for name, value in state.items():
        if tuple(expected[name].shape) != tuple(value.shape):
            raise UserError(f"{source}: tensor for {name} has shape {tuple(value.shape)}, the config implies "
                            f"{tuple(expected[name].shape)}")
    model.load_state_dict(state, strict=False, assign=True)
    if model_config.tie_embeddings:
        model.head.weight = model.embed.weight
    run = RunConfig(model=model_config, data=DataConfig(tokenizer="tokenizer.json"),
                    train=TrainConfig(out=str(out), dtype="float32"))
    state_json = {"step": 0, "tokens": 0, "flops": 0.0, "elapsed_s": 0.0, "imported_from": str(source.resolve()),
                  "architecture": architecture}
    checkpoint = _publish_run(out, checked, tokenizer, model, run, state_json)
    return ImportResult(str(out), str(checkpoint), architecture, model.num_parameters(), model_config.vocab_size,
                        model_config.seq_len, "tokenizer.json")


def _read_folder(source: Path) -> tuple[dict, dict[str, tuple[int, ...]], Callable[[str], torch.Tensor], str]:
    """A Hugging Face folder's (config.json, each tensor's shape by name, tensor(name), tokenizer.json text)."""
    hf = _read_json(source / "config.json")
    if not isinstance(hf, dict):
        raise UserError(f"{source / 'config.json'}: must hold a JSON object (the model's settings), got a "
                        f"{type(hf).__name__}")
    architectures = hf.get("architectures") or ["(none)"]
    if not isinstance(architectures, list) or not isinstance(architectures[0], str):
        raise UserError(f"{source / 'config.json'}: architectures must be a list of names, got {architectures!r}")
    architecture = architectures[0]
    if architecture not in ADAPTERS:
        raise UserError(f"{source}: architecture {architecture} is not supported; supported: {', '.join(ADAPTERS)}")
    files = _weight_files(source)
    if not (source / "tokenizer.json").is_file():
        raise UserError(f"{source}: no tokenizer.json (modcli reads and writes text through it)")
    handles = {path: safe_open(str(path), framework="pt") for path in set(files.values())}

    def tensor(name: str) -> torch.Tensor:
        if name not in files:
            raise UserError(f"{source}: tensor {name} is missing from {', '.join(sorted({p.name for p in handles}))}")
        return handles[files[name]].get_tensor(name)

    shapes = {}
    for name, path in files.items():
        try:
            shapes[name] = tuple(handles[path].get_slice(name).get_shape())
        except Exception:  # safetensors' own error type: a name the index lists that its shard lacks
            raise UserError(f"{path}: tensor {name} is not in the file (the index lists it there)") from None
    return hf, shapes, tensor, (source / "tokenizer.json").read_text(encoding="utf-8")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"{path.parent}: no {path.name}")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: unreadable JSON ({exc})") from None


def _weight_files(source: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (a single file, or the shards of an index)."""
    index = source / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map", {})
        missing = sorted({name for name in weight_map.values() if not (source / name).is_file()})
        if missing:
            raise UserError(f"{index}: shard(s) {', '.join(missing)} missing from {source}")
        return {name: source / shard for name, shard in weight_map.items()}
    single = source / "model.safetensors"
    if single.is_file():
        try:
            with safe_open(str(single), framework="pt") as handle:
                return dict.fromkeys(handle.keys(), single)
        except Exception as exc:  # safetensors raises several types for damaged files
            raise UserError(f"{single}: not a readable safetensors file ({exc})") from None
    if any(source.glob("pytorch_model*.bin")):
        raise UserError(f"{source}: only pickle weights (pytorch_model.bin); modcli reads safetensors only, never "
                        "pickles: convert the folder to safetensors first")
    raise UserError(f"{source}: no model.safetensors or model.safetensors.index.json")
