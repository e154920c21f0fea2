"""`modcli generate`: causal-routing decoding with a KV cache that stores only what each block processed.

After the prefill, the model decodes at full depth token by token (modcli.decode.greedy), unless its family has a
decoding of its own (`Family.decoding_options` given as GenerateConfig.family_decoding, its `decoding` hook): then the
hook's `FamilyDecoding` runs the decoding, given a `DecodeRun`, and fills GenerateResult's fields of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from modcli_runtime.errors import BundleError
from modcli_runtime.generate import MAX_NEW_TOKENS, check_prompt_text, fit_prompts, sampling_uniforms
from modcli_runtime.text import TextPieces
from torch import Tensor

from modcli.checkpoint.store import load_model_from
from modcli.config import require
from modcli.config.variant_options import build_decoding, decoding_for, split_decoding
from modcli.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from modcli.decode.greedy import greedy_decode
from modcli.decode.static import StaticDecoder
from modcli.errors import UserError
from modcli.hardware import TORCH_DTYPES, autocast, resolve_device
from modcli.models.cache import DecoderCache
from modcli.models.decoder import MoDDecoder
from modcli.packed_linear import PackedLinears, inference_linears
from modcli.reports.console import stderr_console


@dataclass
class GenerateConfig:
    """What `modcli generate` produces."""

    checkpoint: str
    """A run folder (its newest checkpoint) or one checkpoint folder."""
    prompts: list[str] = field(default_factory=lambda: ["def "], metadata={"flag": "--prompt", "repeated": True})
    """One or more prompts; several are generated as one batch. A prompt longer than the model's context (seq_len
    tokens) keeps its last seq_len tokens, with a note on stderr."""
    max_new_tokens: int = 200
    """Tokens to generate per prompt (at most 2**31 - 1)."""
    temperature: float = 0.8
    """Sampling temperature; 0 = greedy."""
    top_k: int = 0
    """Sample from the k most likely bytes only (0 = off)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of bytes whose probability reaches p (1 = off)."""
    seed: int = 1337
    """Seed of the sampler."""
    routing: str | None = None
    """A causal mode of the model's router (e.g. router or predictor for topk); None = its first causal mode."""
    device: str = "auto"
    """auto, cpu, cuda or mps."""
    dtype: str = "float32"
    """Autocast dtype; the KV cache is kept in this dtype."""
    compile: bool = False
    """torch.compile the causal prefill and a static-shape decode step (preallocated KV cache, the skip of a routed
    block in torch.cond; a CUDA graph on CUDA); the compile time is reported apart."""
    packed_linears: bool | None = None
    """Eager decoding on the CPU in float32: nn.Linear through oneDNN's prepacked kernel (`modcli.packed_linear`);
    False = PyTorch's default BLAS; None = the CPU's default (`packed_linear.packed_by_default`: AMD)."""
    family_decoding: Any = None
    """The model family's own decoding options (`Family.decoding_options`, e.g. --exit-threshold of --arch
    early-exit): an instance, or its flat values as a dict (`GenerateConfig.of` and the flags spell them flat);
    None = none given, the full-depth decoding."""

    @classmethod
    def of(cls, *args: Any, **values: Any) -> GenerateConfig:
        """A GenerateConfig from flat values, as the flags name them: each family decoding option (--exit-threshold,
        ...) goes to `family_decoding`."""
        return cls(*args, **split_decoding(values))

    def __post_init__(self) -> None:
        require(bool(self.prompts), "--prompt: give at least one prompt")
        require(all(self.prompts), "--prompt must not be empty")
        for prompt in self.prompts:
            try:
                check_prompt_text(prompt)  # the runtime's rule and message
            except BundleError as exc:
                raise UserError(str(exc)) from None
        require(1 <= self.max_new_tokens <= MAX_NEW_TOKENS,
                f"--max-new-tokens must be in 1..{MAX_NEW_TOKENS}, got {self.max_new_tokens}")
        require(self.temperature >= 0, f"--temperature must be >= 0, got {self.temperature}")
        require(self.top_k >= 0, f"--top-k must be >= 0, got {self.top_k}")
        require(0 < self.top_p <= 1, f"--top-p must be in (0, 1], got {self.top_p}")
        self.family_decoding = build_decoding(self.family_decoding)  # its own checks, naming its flags
        check_generation = getattr(self.family_decoding, "check_generation", None)
        if check_generation is not None:  # the family's options against these settings (--compile, --temperature)
            check_generation(self)


@dataclass
class GenerateResult:
    texts: list[str]
    tokens: list[list[int]]
    """The new token ids of each prompt."""
    new_tokens: int
    prefill_s: float
    decode_s: float
    tokens_per_s: float
    processed_fraction: dict[str, float]
    """Per routed block: fraction of all tokens (prompt and generated) the block processed."""
    kv_cache_bytes: int
    """Bytes of K/V stored: filled slots, the tokens each layer processed."""
    kv_cache_allocated_bytes: int
    """Bytes of the K/V buffers as allocated (routed buffers grow by doubling, so some slots stay empty)."""
    dense_kv_cache_bytes: int
    """What a dense model of the same shape would store for the same tokens."""
    dense_kv_cache_allocated_bytes: int
    """What a dense model of the same shape would allocate for the same generation."""
    routing: str
    decoding: str = "full"
    """full (every block), or the family's own decoding with its settings (early exit: confidence or speculative)."""
    acceptance_rate: float | None = None
    """A family's draft-and-verify decoding: the share of drafted tokens the full model accepted."""
    tokens_per_round: float | None = None
    """A family's draft-and-verify decoding: new tokens per round (accepted drafts + the full model's own), per row."""
    mean_exit_block: float | None = None
    """A family's decoding with exits: blocks run per decoded token, on average (the model's depth = no exit)."""
    exit_blocks: dict[str, int] | None = None
    """A family's decoding with exits: decoded tokens per exit block (the last block = the full depth)."""
    compile_s: float | None = None
    """--compile: compiling the prefill and the decode step (their first calls), not in prefill_s or decode_s."""
    graph_breaks: int | None = None
    """--compile: graph breaks torch.compile met (0: prefill and decode step are one graph each)."""
    linear_kernel: str = "aten"
    """What the eager decoding ran nn.Linear with: onednn-packed (`modcli.packed_linear`: the products where it pays;
    the rest, e.g. a small model's single-row decode steps, stay on PyTorch's default) or aten."""


@dataclass
class DecodeRun:
    """What `generate`'s loop hands a family's own decoding after the prefill."""

    logits: Tensor
    """(B, V): the prefill's next-token logits, each row's at its last prompt token."""
    cache: DecoderCache
    """Filled by the prefill, with the decoding's spare_tokens slots beyond the last token."""
    max_new_tokens: int
    steps: Callable[[Callable[[Tensor], Tensor]], list[list[int]]]
    """The token-by-token loop (modcli.decode.greedy.greedy_decode with generate's sampler, streaming and token
    store) run with the family's step, tokens (B,) -> logits (B, V) -> each row's new tokens."""
    on_token: Callable[[int, int], None] | None
    """For a decoding that makes its tokens its own way: `on_token(row, token)` for each new token in order
    (streaming); None where nobody listens."""
    autocast: Callable[[], AbstractContextManager]
    """generate's mixed precision (--dtype), to enter around the model's calls."""


class FamilyDecoding(Protocol):
    """A family's own decoding: what its `Family.decoding` hook builds from the model and its decoding options."""

    spare_tokens: int
    """KV cache slots it may write beyond the last new token (drafts that run past it)."""

    def step_rows(self, batch: int) -> int:
        """Rows one decode step runs (the products the packed kernel is prepared for: `modcli.packed_linear`)."""
        ...

    def decode(self, run: DecodeRun) -> list[list[int]]:
        """The new tokens of each row, `run.max_new_tokens` of them."""
        ...

    def result_fields(self, batch: int) -> dict[str, Any]:
        """GenerateResult's fields of what it did (decoding, and e.g. acceptance_rate or mean_exit_block)."""
        ...


def sample(logits: Tensor, temperature: float, top_k: int, top_p: float, uniforms: Tensor | None) -> Tensor:
    """logits (B, V), uniforms (B,) -> next tokens (B,), on the logits' device without a host sync.

    The same rule as the runtime's `modcli_runtime.generate.sample` (numpy), token for token: greedy (argmax)
    at temperature 0; else logits / temperature in float64 (float32 where the device has none, e.g. mps),
    keep the top-k, keep the smallest set of tokens (by stably sorted descending logit) whose probability
    reaches top-p, softmax, and token = min(#{cdf < u}, V - 1).
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    vocab = logits.shape[-1]
    dtype = torch.float32 if logits.device.type == "mps" else torch.float64
    scaled = logits.to(dtype) / temperature  # (B, V)
    if top_k:
        kth = scaled.topk(min(top_k, vocab), dim=-1).values[:, -1:]  # (B, 1)
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # ties keep vocabulary order
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # keep the token that crosses p
        scaled = scaled.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    cdf = scaled.softmax(dim=-1).cumsum(dim=-1)  # (B, V)
    below = cdf < uniforms.to(dtype)[:, None]  # (B, V)
    return below.sum(dim=-1).clamp(max=vocab - 1)


def prefill(model: MoDDecoder, prompts: Sequence[bytes | list[int]], cache: DecoderCache, routing: str,
            device: torch.device, dtype: str, static=None) -> Tensor:
    """One causal forward over the right-padded prompts that fills the cache -> each row's next logits (B, V).

    `static`: a `modcli.decode.static.StaticDecoder` whose cache is `cache`: its compiled prefill runs instead (after
    compiling it and the decode step on these prompts, which is reported apart)."""
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)  # (B,)
    tokens = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)  # (B, T) padding after each prompt
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = torch.tensor(list(prompt), dtype=torch.long)
    tokens, lengths = tokens.to(device), lengths.to(device)
    with autocast(device, dtype):
        if static is not None:
            static.warm_up(tokens, lengths)
            start = time.perf_counter()
            logits = static.prefill(tokens, lengths)  # (B, T, V)
            static.prefill_s = time.perf_counter() - start
        else:
            logits = model(tokens, routing, cache=cache, lengths=lengths)  # (B, T, V)
    rows = torch.arange(len(prompts), device=device)
    return logits[rows, lengths - 1].float()  # (B, V) each row at its own last real token


@torch.no_grad()
def generate(config: GenerateConfig, on_bytes: Callable[[int, bytes], None] | None = None,
             model: MoDDecoder | None = None, tokenizer: Tokenizer | None = None) -> GenerateResult:
    """Generate from each prompt; `on_bytes(row, new_bytes)` is called as tokens are produced (UTF-8 text)."""
    device = resolve_device(config.device)
    if model is None:
        model, run_config, checkpoint = load_model_from(config.checkpoint, device)
        tokenizer = load_tokenizer(run_config.data.tokenizer, checkpoint.parent, model.config.vocab_size)
    tokenizer = tokenizer or ByteTokenizer()
    routing = config.routing or (model.causal_modes() or ("dense",))[0]
    model.check_routing(routing, causal=True)
    family = model.config.family  # its decoding options and its decoding's own checks, before anything runs
    decoding = family.decoding_hook(model, decoding_for(family, model.config.kind, config.family_decoding))
    prompts = [tokenizer.encode(p) for p in config.prompts]
    if not all(prompts):
        raise UserError("--prompt: a prompt encodes to no tokens")
    # a prompt longer than the context keeps its last seq_len tokens, as modcli-run does (modcli_runtime.generate)
    prompts, notes = fit_prompts(prompts, model.config.seq_len)
    for note in notes:
        stderr_console.print(f"[yellow]{note}[/]", highlight=False, soft_wrap=True)
    batch = len(prompts)
    max_tokens = max(len(p) for p in prompts) + config.max_new_tokens
    if max_tokens > model.config.seq_len and on_bytes is not None:
        stderr_console.print(f"[yellow]note: {max_tokens} tokens exceed the training context of "
                             f"{model.config.seq_len}; positions beyond it were never trained[/]")
    spare = decoding.spare_tokens if decoding is not None else 0
    static = None
    if config.compile:
        static = StaticDecoder(model, batch, max_tokens, routing, device, config.dtype, compile=True)
        cache = static.cache
    else:
        cache = DecoderCache.allocate(model.config, batch, max_tokens + spare, device, TORCH_DTYPES[config.dtype])
    uniforms = None
    if config.temperature > 0:  # the runtime's stream, moved to the device once: (N, B)
        uniforms = torch.from_numpy(sampling_uniforms(config.seed, config.max_new_tokens, batch))
        if device.type == "mps":  # no float64 there
            uniforms = uniforms.float()
        uniforms = uniforms.to(device)
    new_tokens = torch.empty(config.max_new_tokens, batch, dtype=torch.long, device=device)  # (N, B)

    linears = inference_linears(model, device, config.dtype, config.packed_linears if static is None else False)
    return _decode(config, model, tokenizer, routing, prompts, cache, static, uniforms, new_tokens, on_bytes,
                   decoding, device, linears)


def _decode(config: GenerateConfig, model: MoDDecoder, tokenizer: Tokenizer, routing: str,
            prompts: list[list[int]], cache: DecoderCache, static, uniforms: Tensor | None, new_tokens: Tensor,
            on_bytes: Callable[[int, bytes], None] | None, decoding: FamilyDecoding | None, device: torch.device,
            linears: PackedLinears) -> GenerateResult:
    """`generate`'s prefill and decoding loop, timed; `linears`: the packed kernel (`modcli.packed_linear`) on the
    products that can pay, entered before each clock starts: the prefill's, then the decode steps' (B rows, or the
    family decoding's `step_rows`)."""
    batch = len(prompts)
    with linears.up_to():
        start = time.perf_counter()
        logits = prefill(model, prompts, cache, routing, device, config.dtype, static)
        _sync(device)
        prefill_s = time.perf_counter() - start if static is None else static.prefill_s
    streams = [TextPieces(tokenizer) for _ in prompts]
    step_rows = decoding.step_rows(batch) if decoding is not None else batch
    with linears.up_to(step_rows):
        outputs, decode_s = _decode_steps(config, model, routing, cache, static, uniforms, new_tokens, logits,
                                          streams, on_bytes, decoding, device)

    positions = cache.positions.sum().item()
    processed = {f"block{layer}": cache.layers[layer].lengths.sum().item() / positions
                 for layer in model.config.routed_layers() if model.config.kv_is_routed(layer)}
    return GenerateResult(
        texts=[tokenizer.decode(out) for out in outputs], tokens=outputs,
        new_tokens=batch * config.max_new_tokens, prefill_s=prefill_s, decode_s=decode_s,
        tokens_per_s=batch * config.max_new_tokens / max(prefill_s + decode_s, 1e-9),
        processed_fraction=processed, kv_cache_bytes=cache.stored_bytes(),
        kv_cache_allocated_bytes=cache.allocated_bytes(), dense_kv_cache_bytes=cache.dense_equivalent_bytes(),
        dense_kv_cache_allocated_bytes=cache.dense_equivalent_allocated_bytes(), routing=routing,
        compile_s=static.compile_stats.compile_s if static else None,
        graph_breaks=static.compile_stats.graph_breaks if static else None, linear_kernel=linears.kernel,
        **(decoding.result_fields(batch) if decoding is not None else {}))


def _decode_steps(config: GenerateConfig, model: MoDDecoder, routing: str, cache: DecoderCache, static,
                  uniforms: Tensor | None, new_tokens: Tensor, logits: Tensor, streams: list[TextPieces],
                  on_bytes: Callable[[int, bytes], None] | None, decoding: FamilyDecoding | None,
                  device: torch.device) -> tuple[list[list[int]], float]:
    """Sample and decode the new tokens after the prefill's `logits`, at full depth or by the family's `decoding`
    -> (tokens per row, seconds)."""

    def choose(logits: Tensor, index: int) -> Tensor:
        step_uniforms = uniforms[index] if uniforms is not None else None
        return sample(logits, config.temperature, config.top_k, config.top_p, step_uniforms)  # (B,)

    def emit(index: int, next_tokens: Tensor, logits: Tensor) -> None:
        new_tokens[index] = next_tokens
        if on_bytes is not None:  # streaming needs the tokens on the host now; otherwise they move once, below
            for row, token in enumerate(next_tokens.tolist()):
                on_bytes(row, streams[row](token))

    def step(next_tokens: Tensor) -> Tensor:
        with autocast(device, config.dtype):
            if static is not None:
                return static.step(next_tokens).float()
            return model.decode_step(next_tokens, cache, routing).float()

    def steps(step: Callable[[Tensor], Tensor]) -> list[list[int]]:
        greedy_decode(logits, config.max_new_tokens, step, emit, choose)
        return new_tokens.T.tolist()  # (B, N)

    start = time.perf_counter()
    if decoding is not None:
        on_token = None if on_bytes is None else (lambda row, token: on_bytes(row, streams[row](token)))
        outputs = decoding.decode(DecodeRun(logits, cache, config.max_new_tokens, steps, on_token,
                                            lambda: autocast(device, config.dtype)))
    else:
        outputs = steps(step)
    _sync(device)
    decode_s = time.perf_counter() - start
    return outputs, decode_s


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
