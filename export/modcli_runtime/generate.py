"""Decoding with the exported decode-step graph: prompt, KV cache, sampling, streaming. numpy only.

The KV cache lives in preallocated numpy buffers (`CacheSpec.allocate`); the graph only reads them and returns
this step's K/V, which `CacheSpec.write_rows` stores at each row's next slot in place, so a step copies nothing
in the size of the cache (onnxruntime's CPU provider reads numpy inputs where they are).

The prompt is fed through the same decode graph one token per step, so the cache is filled by exactly the
causal router/predictor decisions `modcli generate` makes (its PyTorch prefill is one causal forward; the two
agree to float rounding). Every row of a batch moves one token per step: a row still reading its prompt feeds
its next prompt byte, a row that has finished its prompt feeds the token it sampled last, so prompts of
different lengths share one batch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from modcli_runtime.cache import CacheSpec
from modcli_runtime.errors import BundleError
from modcli_runtime.text import ByteTokenizer, Tokenizer

StepFunction = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]

MAX_NEW_TOKENS = 2**31 - 1
"""The most --max-new-tokens can ask for (in `modcli generate` too): more could not be indexed, let alone stored."""


def check_prompt_text(prompt: str) -> None:
    """A prompt must be text that UTF-8 can spell: bytes of another encoding on the command line arrive as lone
    surrogates (Python's surrogateescape), which no tokenizer can encode."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = prompt[exc.start]
        what = f"byte 0x{ord(char) - 0xDC00:02x}" if 0xDC80 <= ord(char) <= 0xDCFF else f"U+{ord(char):04X}"
        raise BundleError(f"--prompt is not valid UTF-8 text ({what} at character {exc.start}); give the prompt "
                          "in UTF-8") from None


def fit_prompts(encoded: list[list[int]], context: int | None) -> tuple[list[list[int]], list[str]]:
    """Prompts longer than the model's context keep their last `context` tokens (the model never read more at once,
    and every token fed costs a step) -> (the prompts, one note per prompt cut, for stderr). The one rule of
    `modcli generate` and `modcli-run`."""
    if context is None:
        return encoded, []
    notes = []
    for row, tokens in enumerate(encoded):
        if len(tokens) > context:
            which = "the prompt" if len(encoded) == 1 else f"prompt {row + 1}"
            notes.append(f"note: {which} has {len(tokens):,} tokens, more than the model's context of {context}: "
                         f"only its last {context} are read")
    return [tokens[-context:] for tokens in encoded], notes


def sampling_uniforms(seed: int, max_new_tokens: int, batch: int) -> np.ndarray:
    """The sampler's random stream, (max_new_tokens, B) in [0, 1): u[i, r] draws row r's i-th new token.

    `modcli generate` uses this same array, so both pick the same tokens for the same --seed. It is indexed by
    new-token number, not by step: here prompts of different lengths reach their i-th token at different steps.
    """
    if seed < 0:
        raise BundleError(f"--seed must be >= 0, got {seed}")
    try:
        return np.random.default_rng(seed).random((max_new_tokens, batch))
    except MemoryError:
        raise BundleError(f"--max-new-tokens {max_new_tokens}: not enough memory for the sampler's random "
                          "numbers") from None


def sample(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
           uniforms: np.ndarray | np.random.Generator) -> np.ndarray:
    """logits (B, V), uniforms (B,) -> next tokens (B,). The one sampling rule, also in `modcli.decode.generation.sample`:

    greedy (argmax) at temperature 0; else logits / temperature in float64, keep the top-k, keep the smallest
    set of tokens (by stably sorted descending logit) whose probability reaches top-p, softmax, and
    token = min(#{cdf < u}, V - 1). A Generator in place of `uniforms` draws them from it.
    """
    if temperature == 0:
        return logits.argmax(axis=-1)
    if isinstance(uniforms, np.random.Generator):
        uniforms = uniforms.random(logits.shape[0])
    vocab = logits.shape[-1]
    scaled = logits.astype(np.float64) / temperature  # (B, V)
    if top_k:
        kth = np.sort(scaled, axis=-1)[:, -min(top_k, vocab)][:, None]  # (B, 1)
        scaled = np.where(scaled < kth, -np.inf, scaled)
    if top_p < 1.0:
        order = np.argsort(-scaled, axis=-1, kind="stable")  # (B, V) ties keep vocabulary order
        sorted_logits = np.take_along_axis(scaled, order, axis=-1)
        probs = _softmax(sorted_logits)
        drop = np.cumsum(probs, axis=-1) - probs >= top_p  # keep the token that crosses p
        np.put_along_axis(scaled, order, np.where(drop, -np.inf, sorted_logits), axis=-1)
    cdf = np.cumsum(_softmax(scaled), axis=-1)  # (B, V)
    below = cdf < np.asarray(uniforms, dtype=np.float64).reshape(-1, 1)
    return np.minimum(below.sum(axis=-1), vocab - 1)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@dataclass
class Generation:
    """What one call of `generate_tokens` produced."""

    tokens: list[list[int]]
    """New tokens per prompt."""
    texts: list[str]
    """The new tokens of each prompt decoded as UTF-8 (bytes that are not valid UTF-8 become U+FFFD)."""
    steps: int
    """Decode-graph calls (prompt and generated tokens of the longest row)."""
    first_token_s: float
    """Seconds until every row has read its prompt and sampled its first token."""
    total_s: float
    tokens_per_s: float
    """New tokens (all rows) per second of the whole call."""
    processed_tokens: dict[int, list[int]]
    """Per routed layer, per row: tokens the layer processed among those the row fed (prompt + generated)."""
    fed_tokens: list[int]
    """Per row: tokens fed through the graph (prompt + all generated tokens but the last)."""
    logits: list[np.ndarray] | None = field(default=None, repr=False)
    """With `return_logits`: per row, (max_new_tokens, V) logits each new token was sampled from."""
    cache_lengths: dict[int, list[int]] = field(default_factory=dict)
    """Per layer, per row: tokens held in the row's KV cache once its `fed_tokens` were fed (what the cache of
    `modcli generate` holds at its end; rows that finish early keep feeding their last token, not counted here)."""

    @property
    def processed_fraction(self) -> dict[str, float]:
        total = max(1, sum(self.fed_tokens))
        return {f"block{layer}": sum(rows) / total for layer, rows in self.processed_tokens.items()}


def encode_prompt(prompt: str | bytes | list[int], vocab_size: int, text: Tokenizer | None = None
                  ) -> list[int]:
    if isinstance(prompt, str):
        check_prompt_text(prompt)
    tokens = (text or ByteTokenizer()).encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not tokens:
        raise BundleError("--prompt must not be empty")
    if min(tokens) < 0 or max(tokens) >= vocab_size:
        raise BundleError(f"prompt tokens must be in [0, {vocab_size}), got {min(tokens)}..{max(tokens)}")
    return tokens


def generate_tokens(step: StepFunction, cache_spec: CacheSpec, prompts: list[str | bytes | list[int]], *,
                    vocab_size: int, max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 0,
                    top_p: float = 1.0, seed: int = 1337, on_token: Callable[[int, int], None] | None = None,
                    return_logits: bool = False, text: Tokenizer | None = None,
                    context: int | None = None) -> Generation:
    """Run the decode graph `step` over a batch of prompts and sample `max_new_tokens` new tokens per prompt.
    `context`: a prompt longer keeps its last `context` tokens (`fit_prompts`; `Bundle.generate` gives the model's).

    `cache_spec` allocates the KV cache and stores each step's rows (`allocate`, `write_rows`): a CacheSpec (numpy
    buffers) or a modcli_runtime.device.DeviceCache (device OrtValues; `Bundle.decoder()` gives the pair).
    `on_token(row, token)` is called as soon as a token is sampled (streaming). `text` encodes string prompts and
    decodes the outputs (default: bytes).
    """
    text = text or ByteTokenizer()
    if not prompts:
        raise BundleError("--prompt: give at least one prompt")
    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise BundleError(f"--max-new-tokens must be in 1..{MAX_NEW_TOKENS}, got {max_new_tokens}")
    if not (math.isfinite(temperature) and temperature >= 0) or top_k < 0 or not 0 < top_p <= 1:
        raise BundleError(f"--temperature must be a finite number >= 0 (got {temperature}), --top-k >= 0 (got "
                          f"{top_k}) and --top-p in (0, 1] (got {top_p})")
    encoded, _ = fit_prompts([encode_prompt(p, vocab_size, text) for p in prompts], context)
    batch = len(encoded)
    lengths = np.array([len(p) for p in encoded])
    steps = int(lengths.max()) + max_new_tokens - 1  # the last sampled token is never fed
    try:
        feeds = cache_spec.allocate(batch, steps)
    except (MemoryError, ValueError):
        raise BundleError(f"--max-new-tokens {max_new_tokens}: not enough memory for a KV cache of {steps} "
                          "tokens") from None
    uniforms = sampling_uniforms(seed, max_new_tokens, batch)  # (N, B)
    new_tokens: list[list[int]] = [[] for _ in encoded]
    kept_logits: list[list[np.ndarray]] = [[] for _ in encoded]
    processed = {layer: np.zeros(batch, dtype=np.int64) for layer in cache_spec.routed_layers}
    cache_lengths = np.zeros((cache_spec.n_layers, batch), dtype=np.int64)  # (L, B)
    last = np.zeros(batch, dtype=np.int64)

    start = time.perf_counter()
    first_token_s = 0.0
    for position in range(steps):
        reading = position < lengths  # (B,) rows still feeding their prompt
        prompt_tokens = np.array([p[position] if position < len(p) else 0 for p in encoded], dtype=np.int64)
        feeds["tokens"] = np.where(reading, prompt_tokens, last)
        feeds["positions"] = np.full(batch, position, dtype=np.int64)
        outputs = step(feeds)
        cache_spec.write_rows(feeds, outputs)  # this step's K/V into the cache buffers, in place
        active = position < lengths + max_new_tokens - 1  # (B,) rows whose fed token counts
        for layer in processed:
            processed[layer] += outputs[f"processed.{layer}"].astype(np.int64) * active
        for layer in cache_spec.layers:  # a layer without a cache (a static drop) stores nothing
            cache_lengths[layer] = np.where(active, feeds[f"lengths.{layer}"], cache_lengths[layer])
        sampling = (position >= lengths - 1) & (position < lengths + max_new_tokens - 1)  # (B,)
        if not sampling.any():
            continue
        logits = outputs["logits"].astype(np.float32)  # (B, V)
        rows = np.flatnonzero(sampling)  # (n,)
        token_index = position - (lengths[rows] - 1)  # (n,) which new token of its row each one samples
        chosen = np.zeros(batch, dtype=np.int64)
        chosen[rows] = sample(logits[rows], temperature, top_k, top_p, uniforms[token_index, rows])
        for row in rows:
            token = int(chosen[row])
            new_tokens[row].append(token)
            if return_logits:
                kept_logits[row].append(logits[row])
            if on_token is not None:
                on_token(int(row), token)
        last = np.where(sampling, chosen, last)
        if not first_token_s and all(new_tokens):
            first_token_s = time.perf_counter() - start
    total_s = time.perf_counter() - start
    return Generation(
        tokens=new_tokens,
        texts=[text.decode(row) for row in new_tokens],
        steps=steps, first_token_s=first_token_s or total_s, total_s=total_s,
        tokens_per_s=batch * max_new_tokens / max(total_s, 1e-9),
        processed_tokens={layer: counts.tolist() for layer, counts in processed.items()},
        fed_tokens=[len(p) + max_new_tokens - 1 for p in encoded],
        logits=[np.stack(rows) for rows in kept_logits] if return_logits else None,
        cache_lengths={layer: cache_lengths[layer].tolist() for layer in range(cache_spec.n_layers)})
