"""`modcli import HF_DIR|FILE.gguf --out RUN`: a Hugging Face model folder, or a llama.cpp GGUF file, -> a modcli run
folder holding the dense model.

A folder: config.json, model.safetensors or the shards a model.safetensors.index.json lists (never a pickle file),
and tokenizer.json. A GGUF file (`modcli.pretrained.gguf`): its metadata as that config.json, its tensors
dequantized to float, its tokenizer as a tokenizer.json. Writes RUN/step-00000000/ (a checkpoint like any other,
the weights in --dtype) and RUN/tokenizer.json, so eval, generate and profile take RUN as they take a trained run,
under the run folder's lock (as `modcli train` takes it). Nothing is downloaded and no code from the source runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from modcli.checkpoint.lock import RunLock, run_lock_path
from modcli.checkpoint.store import complete_checkpoints, save_checkpoint
from modcli.config import DataConfig, RunConfig, TrainConfig, require
from modcli.errors import UserError
from modcli.hardware import TORCH_DTYPES
from modcli.models.decoder import MoDDecoder
from modcli.pretrained.adapters import ADAPTERS
from modcli.pretrained.gguf import read_gguf


@dataclass
class ImportConfig:
    """What `modcli import` reads and writes."""

    source: str
    """A Hugging Face model folder (config.json, model.safetensors or its index and shards, tokenizer.json), or a
    llama.cpp GGUF file (Llama, Mistral, Qwen2)."""
    out: str
    """Run folder to write (must hold no checkpoint)."""
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


def import_model(config: ImportConfig) -> ImportResult:
    """Import `config.source` into `config.out`; every user mistake is a UserError and nothing is written then."""
    source, out = Path(config.source), Path(config.out)
    if not source.exists():
        raise UserError(f"no such model folder or GGUF file: {source}")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a run folder")
    lock = RunLock(run_lock_path(out), "import", out)
    if not out.exists():
        lock.remove_empty = out
    lock.acquire()
    try:
        if complete_checkpoints(out):
            raise UserError(f"--out {out} already holds checkpoints; pick another --out")
        return _import(config, source, out)
    finally:
        lock.release()


def _import(config: ImportConfig, source: Path, out: Path) -> ImportResult:
    if source.is_dir():
        hf, tensor_names, tensor, tokenizer = _read_folder(source)
    else:
        gguf_model = read_gguf(source)
        hf, tensor_names, tensor, tokenizer = (gguf_model.config, gguf_model.tensor_names, gguf_model.tensor,
                                               gguf_model.tokenizer_json)
    architecture = hf["architectures"][0]
    adapter = ADAPTERS[architecture]
    model_config = adapter.model_config(hf, config.seq_len, tensor_names)
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
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tokenizer, encoding="utf-8")
    state_json = {"step": 0, "tokens": 0, "flops": 0.0, "elapsed_s": 0.0, "imported_from": str(source.resolve()),
                  "architecture": architecture}
    checkpoint = save_checkpoint(out, 0, model, None, run, state_json, keep=1)
    return ImportResult(str(out), str(checkpoint), architecture, model.num_parameters(), model_config.vocab_size,
                        model_config.seq_len, "tokenizer.json")


def _read_folder(source: Path) -> tuple[dict, set[str], Callable[[str], torch.Tensor], str]:
    """A Hugging Face folder's (config.json, tensor names, tensor(name), tokenizer.json text)."""
    hf = _read_json(source / "config.json")
    architecture = (hf.get("architectures") or ["(none)"])[0]
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

    return hf, set(files), tensor, (source / "tokenizer.json").read_text(encoding="utf-8")


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
