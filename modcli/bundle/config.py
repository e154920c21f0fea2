"""ExportConfig: what `modcli export` writes and how it is checked; read by the writer and by the validation."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from modcli_runtime.bundle import PROVIDERS

from modcli.bundle.lowering import MIN_OPSET
from modcli.config import DTYPES, require

GRAPHS = ("forward", "decode")
DEFAULT_ATOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 1e-1}
"""Default --atol per dtype: logits of the exported graph against eager PyTorch in the same dtype."""
GGUF_DTYPES = ("float32", "float16", "bfloat16")
"""--gguf-dtype: how a GGUF file stores the matrices (1-D tensors, the norms, stay float32 as llama.cpp expects)."""
DEFAULT_GGUF_ATOL = 1e-3
"""Default --atol with --gguf: the file's logits against modcli's, its weights rounded to --gguf-dtype alike."""


@dataclass
class ExportConfig:
    """What `modcli export` writes and how it is checked."""

    checkpoint: str
    """A run folder (its newest checkpoint) or one checkpoint folder."""
    out: str = "bundles/latest"
    """Folder to write: the ONNX bundle or, with --hf, the Hugging Face folder; with --gguf, the .gguf file (must not
    exist unless --force)."""
    onnx: bool | None = None
    """Export the ONNX graphs (forward.onnx, decode.onnx) that the PyTorch-free runtime runs; None = on, unless
    --hf or --gguf."""
    hf: bool = False
    """Write a Hugging Face folder instead of a bundle (config.json with auto_map, modeling_modcli.py,
    model.safetensors, tokenizer): transformers loads it; a dense Llama/Mistral/Qwen2-shaped model needs no remote
    code."""
    gguf: bool = False
    """Write one GGUF file for llama.cpp instead of a bundle: a dense Llama/Mistral/Qwen2/Qwen3-shaped model, or one
    with attention drops (as deci); checked against modcli with transformers' GGUF loader where installed."""
    gguf_dtype: str = "float32"
    """--gguf: how the file stores the matrices: float32, float16 or bfloat16 (norms stay float32)."""
    compile: bool = False
    """Also save torch.export ExportedPrograms (.pt2) and AOTInductor packages (.aoti.pt2) of both graphs."""
    graphs: list[str] = field(default_factory=lambda: list(GRAPHS), metadata={"flag": "--graph", "repeated": True})
    """Which graphs to export: forward (top-k, scoring) and/or decode (causal, what the runtime generates with)."""
    routing: str | None = None
    """Causal routing of the decode graph: a causal mode of the model's router (topk: router or predictor);
    None = its first."""
    dtype: str = "float32"
    """Weights and activations of the exported graphs: float32, float16 or bfloat16."""
    provider: str = "auto"
    """onnxruntime providers to validate on: cpu, cuda, or auto (cpu, plus cuda when it really works)."""
    opset: int = MIN_OPSET
    """ONNX opset of the exported graphs (>= 18)."""
    opset_only: bool = False
    """Graphs of standard ONNX operators only, for runtimes other than onnxruntime; default: RMSNorm fused into
    onnxruntime's SimplifiedLayerNormalization (which only onnxruntime runs; the manifest's `operators` says which)."""
    atol: float | None = None
    """Largest |logit difference| against eager PyTorch; default 1e-4 (float32), 2e-2 (float16), 1e-1 (bfloat16);
    --gguf: 1e-3, against modcli's weights rounded to --gguf-dtype."""
    decode_steps: int = 16
    """Greedy tokens generated per prompt when the decode graph is compared with `modcli generate`."""
    text: str | None = None
    """UTF-8 text file the real-text checks read; default: the standard library's textwrap.py."""
    seed: int = 1337
    """Seed of the random validation tokens."""
    force: bool = False
    """Replace an existing bundle at --out."""

    def __post_init__(self) -> None:
        if self.onnx is None:
            self.onnx = not (self.hf or self.gguf)
        require(not (self.gguf and self.hf),
                "--gguf writes one GGUF file and --hf a Hugging Face folder: they do not combine (export twice, to "
                "two --out paths)")
        require(not (self.gguf and (self.onnx or self.compile)),
                "--gguf writes one GGUF file, not graphs: it does not combine with --onnx or --compile (export twice)")
        require(self.gguf_dtype in GGUF_DTYPES,
                f"--gguf-dtype must be one of {', '.join(GGUF_DTYPES)}, got {self.gguf_dtype!r}")
        require(self.gguf or self.gguf_dtype == "float32", "--gguf-dtype is about the GGUF file; it needs --gguf")
        require(not (self.gguf and self.dtype != "float32"),
                f"--gguf stores the weights as --gguf-dtype (float32, float16 or bfloat16); --dtype {self.dtype} is "
                "for the ONNX and Hugging Face exports")
        require(not self.gguf or Path(self.out).suffix == ".gguf",
                f"--gguf: --out must name a .gguf file, got {self.out!r}")
        require(not (self.hf and (self.onnx or self.compile)),
                "--hf writes a Hugging Face folder, not graphs: it does not combine with --onnx or --compile (export "
                "twice, into two --out folders)")
        require(self.hf or self.gguf or self.onnx or self.compile, "nothing to export: give --onnx and/or --compile")
        require(not (self.opset_only and not self.onnx), "--opset-only is about the ONNX graphs; it needs --onnx")
        require(Path(self.out).name not in ("", ".."), f"--out must name a bundle folder, got {self.out!r}")
        require(bool(self.graphs) and all(g in GRAPHS for g in self.graphs),
                f"--graph must be among {', '.join(GRAPHS)}, got {', '.join(map(repr, self.graphs)) or 'none'}")
        self.graphs = [g for g in GRAPHS if g in self.graphs]
        require(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        require(self.provider in PROVIDERS, f"--provider must be one of {', '.join(PROVIDERS)}, got {self.provider!r}")
        require(not (self.onnx and self.dtype == "bfloat16"),
                "--dtype bfloat16 cannot be exported to ONNX: onnxruntime has no bfloat16 kernels on the CPU provider "
                "and TopK has no bfloat16 type at opset 18; use --dtype float16 or float32, or --no-onnx --compile "
                "for a bfloat16 ExportedProgram/AOTInductor package")
        require(self.opset >= MIN_OPSET, f"--opset must be >= {MIN_OPSET} for the dynamo exporter, got {self.opset}")
        if self.atol is None and self.gguf:
            self.atol = DEFAULT_GGUF_ATOL
        if self.atol is None:
            self.atol = DEFAULT_ATOL[self.dtype] if self.dtype in DEFAULT_ATOL else 1e-4
        require(self.atol > 0, f"--atol must be positive, got {self.atol}")
        require(1 <= self.decode_steps <= 4096, f"--decode-steps must be in [1, 4096], got {self.decode_steps}")
