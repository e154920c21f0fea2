"""`modcli generate`: causal-routing decoding with a KV cache that stores only what each block processed."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from modcli_runtime.errors import BundleError
from modcli_runtime.generate import MAX_NEW_TOKENS, check_prompt_text, fit_prompts, sampling_uniforms
from modcli_runtime.text import TextPieces
from torch import Tensor

from modcli.checkpoint.store import load_model_from
from modcli.config import require
from modcli.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from modcli.decode.greedy import greedy_decode
from modcli.decode.static import StaticDecoder
from modcli.errors import UserError
from modcli.hardware import TORCH_DTYPES, autocast, resolve_device
from modcli.models.cache import DecoderCache
from modcli.models.decoder import MoDDecoder
from modcli.models.early_exit import ExitStats, check_exit_decoding, speculative_decode
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
    exit_threshold: float | None = None
    """Early-exit models: each new token leaves the blocks at the first exit whose top probability reaches this
    (modcli.models.early_exit; 1.0 = the full model); None = full depth."""
    speculative: int | None = None
    """Early-exit models: self-speculative decoding, drafting with the first E blocks (greedy only); None = off."""
    draft_tokens: int = 4
    """--speculative: tokens drafted per round."""

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
        require(self.exit_threshold is None or 0 < self.exit_threshold <= 1,
                f"--exit-threshold must be in (0, 1], got {self.exit_threshold}")
        require(self.speculative is None or self.speculative >= 1,
                f"--speculative must be >= 1 (draft blocks), got {self.speculative}")
        require(self.draft_tokens >= 1, f"--draft-tokens must be >= 1, got {self.draft_tokens}")
        require(self.speculative is None or self.exit_threshold is None,
                "give --exit-threshold or --speculative, not both")
        require(not (self.compile and (self.exit_threshold is not None or self.speculative is not None)),
                "--compile decodes at full depth with a static cache; it does not combine with --exit-threshold or "
                "--speculative")
        require(self.speculative is None or self.temperature == 0,
                "--speculative decodes greedily (its output is the full model's greedy output): pass --temperature 0")


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
    """full (every block), confidence (--exit-threshold) or speculative (--speculative), with its settings."""
    acceptance_rate: float | None = None
    """--speculative: the share of drafted tokens the full model accepted."""
    tokens_per_round: float | None = None
    """--speculative: new tokens per draft-and-verify round (accepted drafts + the full model's own), per row."""
    mean_exit_block: float | None = None
    """--exit-threshold: blocks run per decoded token, on average (the model's depth = no exit)."""
    exit_blocks: dict[str, int] | None = None
    """--exit-threshold: decoded tokens per exit block (the last block = the full depth)."""
    compile_s: float | None = None
    """--compile: compiling the prefill and the decode step (their first calls), not in prefill_s or decode_s."""
    graph_breaks: int | None = None
    """--compile: graph breaks torch.compile met (0: prefill and decode step are one graph each)."""
    linear_kernel: str = "aten"
    """What the eager decoding ran nn.Linear with: onednn-packed (`modcli.packed_linear`: the products where it pays;
    the rest, e.g. a small model's single-row decode steps, stay on PyTorch's default) or aten."""


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
    exits = config.exit_threshold is not None or config.speculative is not None
    if exits:  # the family's capability (modcli.models.families: exit_decoding), checked first
        check_exit_decoding(model, config.exit_threshold, config.speculative)
        stats = ExitStats(f"confidence (exit at top probability >= {config.exit_threshold:g})"
                          if config.exit_threshold is not None else "")
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
    spare = config.draft_tokens + 1 if config.speculative else 0  # a round's drafts may run past the last token
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
                   stats if exits else None, device, linears)


def _decode(config: GenerateConfig, model: MoDDecoder, tokenizer: Tokenizer, routing: str,
            prompts: list[list[int]], cache: DecoderCache, static, uniforms: Tensor | None, new_tokens: Tensor,
            on_bytes: Callable[[int, bytes], None] | None, stats, device: torch.device,
            linears: PackedLinears) -> GenerateResult:
    """`generate`'s prefill and decoding loop, timed; `linears`: the packed kernel (`modcli.packed_linear`) on the
    products that can pay, entered before each clock starts: the prefill's, then the decode steps' (B rows, or a
    speculative round's B x (drafts + 1))."""
    batch = len(prompts)
    exits = stats is not None
    with linears.up_to():
        start = time.perf_counter()
        logits = prefill(model, prompts, cache, routing, device, config.dtype, static)
        _sync(device)
        prefill_s = time.perf_counter() - start if static is None else static.prefill_s
    streams = [TextPieces(tokenizer) for _ in prompts]
    step_rows = batch * (config.draft_tokens + 1 if config.speculative else 1)
    with linears.up_to(step_rows):
        outputs, stats, decode_s = _decode_steps(config, model, routing, cache, static, uniforms, new_tokens,
                                                 logits, streams, on_bytes, stats, device)

    positions = cache.positions.sum().item()
    processed = {f"block{layer}": cache.layers[layer].lengths.sum().item() / positions
                 for layer in model.config.routed_layers() if model.config.attention_is_routed(layer)}
    return GenerateResult(
        texts=[tokenizer.decode(out) for out in outputs], tokens=outputs,
        new_tokens=batch * config.max_new_tokens, prefill_s=prefill_s, decode_s=decode_s,
        tokens_per_s=batch * config.max_new_tokens / max(prefill_s + decode_s, 1e-9),
        processed_fraction=processed, kv_cache_bytes=cache.stored_bytes(),
        kv_cache_allocated_bytes=cache.allocated_bytes(), dense_kv_cache_bytes=cache.dense_equivalent_bytes(),
        dense_kv_cache_allocated_bytes=cache.dense_equivalent_allocated_bytes(), routing=routing,
        compile_s=static.compile_stats.compile_s if static else None,
        graph_breaks=static.compile_stats.graph_breaks if static else None, linear_kernel=linears.kernel,
        **(_exit_fields(stats, batch) if exits else {}))


def _decode_steps(config: GenerateConfig, model: MoDDecoder, routing: str, cache: DecoderCache, static,
                  uniforms: Tensor | None, new_tokens: Tensor, logits: Tensor, streams: list[TextPieces],
                  on_bytes: Callable[[int, bytes], None] | None, stats, device: torch.device):
    """Sample and decode the new tokens after the prefill's `logits` -> (tokens per row, exit statistics, seconds)."""

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
            if config.exit_threshold is not None:
                logits, exit_block = model.decode_step_exit(next_tokens, cache, config.exit_threshold)
                for block in exit_block.tolist():
                    stats.exit_layers[f"block{block}"] = stats.exit_layers.get(f"block{block}", 0) + 1
                return logits.float()
            if static is not None:
                return static.step(next_tokens).float()
            return model.decode_step(next_tokens, cache, routing).float()

    start = time.perf_counter()
    if config.speculative:  # drafts and verifies from the prefill's logits: rounds of several tokens, not this loop
        on_token = None if on_bytes is None else (lambda row, token: on_bytes(row, streams[row](token)))
        with autocast(device, config.dtype):
            outputs, stats = speculative_decode(model, logits, cache, config.max_new_tokens, config.speculative,
                                                config.draft_tokens, on_token)
    else:
        greedy_decode(logits, config.max_new_tokens, step, emit, choose)
        outputs = new_tokens.T.tolist()  # (B, N)
    _sync(device)
    decode_s = time.perf_counter() - start
    return outputs, stats, decode_s


def _exit_fields(stats, batch: int) -> dict:
    """GenerateResult's fields of decoding with exits (modcli.models.early_exit.ExitStats)."""
    return dict(decoding=stats.decoding, acceptance_rate=stats.acceptance_rate,
                tokens_per_round=None if not stats.rounds else
                (stats.accepted + batch * stats.rounds) / (batch * stats.rounds),
                mean_exit_block=stats.mean_exit_block, exit_blocks=dict(sorted(stats.exit_layers.items())) or None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
