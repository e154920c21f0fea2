"""`modcli generate`: stream text to stdout, statistics to stderr (or one JSON object)."""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from modcli.commands.common import Device, Dtype, Json, stderr, user_errors

if TYPE_CHECKING:
    from modcli.decode.generation import GenerateResult


@user_errors
def generate(
    checkpoint: Annotated[str, typer.Argument(help="Run folder (newest checkpoint) or checkpoint folder.")],
    prompt: Annotated[Optional[list[str]], typer.Option(help="Prompt text (repeat for a batch).")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Bytes to generate per prompt.")] = 200,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.8,
    top_k: Annotated[int, typer.Option(help="Sample among the k most likely bytes (0 = off).")] = 0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling threshold (1 = off).")] = 1.0,
    seed: Annotated[int, typer.Option(help="Sampler seed.")] = 1337,
    routing: Annotated[Optional[str], typer.Option(
        help="A causal mode of the model's router (topk: router or predictor); default its first.")] = None,
    device: Device = "auto",
    dtype: Dtype = "float32",
    compile: Annotated[bool, typer.Option("--compile", help=(
        "torch.compile the causal prefill and a static-shape decode step (preallocated KV cache; a CUDA graph on "
        "CUDA); compile time reported apart."))] = False,
    exit_threshold: Annotated[Optional[float], typer.Option(
        help="Early-exit models: leave the blocks at the first exit whose top probability reaches P (1 = full "
             "depth).")] = None,
    speculative: Annotated[Optional[int], typer.Option(
        help="Early-exit models: self-speculative decoding, drafting with the first E blocks (needs --temperature "
             "0).")] = None,
    draft_tokens: Annotated[int, typer.Option(help="--speculative: tokens drafted per round.")] = 4,
    json_output: Json = False,
) -> None:
    """Generate text with causal routing and a KV cache holding only the tokens each block processed."""
    from modcli.decode.generation import GenerateConfig, Utf8Stream
    from modcli.decode.generation import generate as run_generation

    config = GenerateConfig(checkpoint=checkpoint, prompts=prompt or ["def "], max_new_tokens=max_new_tokens,
                            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, routing=routing,
                            device=device, dtype=dtype, compile=compile, exit_threshold=exit_threshold,
                            speculative=speculative, draft_tokens=draft_tokens)
    stream = None
    if not json_output and len(config.prompts) == 1:
        stream = Utf8Stream(lambda text: (sys.stdout.write(text), sys.stdout.flush()), prefix=config.prompts[0])
    result = run_generation(config, on_bytes=stream)
    if json_output:
        from modcli.reports.console import print_json
        print_json(dataclasses.asdict(result))
        return
    if stream is None:
        for prompt_text, text in zip(config.prompts, result.texts, strict=True):
            sys.stdout.write(f"{prompt_text}{text}\n---\n")
    else:
        sys.stdout.write("\n")
    sys.stdout.flush()
    fractions = " ".join(f"{k}={v:.3f}" for k, v in result.processed_fraction.items()) or "dense"
    stderr.print(f"{result.new_tokens} tokens, {result.tokens_per_s:.1f} tokens/s (prefill {result.prefill_s:.3f}s, "
                 f"decode {result.decode_s:.3f}s), routing {result.routing}, processed {fractions}, "
                 f"{kv_cache_summary(result)}{exit_summary(result)}{compile_summary(result)}", highlight=False,
                 soft_wrap=True)


def compile_summary(result: GenerateResult) -> str:
    if result.compile_s is None:
        return ""
    breaks = "no graph breaks" if not result.graph_breaks else f"{result.graph_breaks} graph break(s)"
    return f"; compiled in {result.compile_s:.1f}s ({breaks}), not counted above"


def exit_summary(result: GenerateResult) -> str:
    """Decoding with exits: the acceptance rate of self-speculative decoding, or the blocks a token ran."""
    if result.acceptance_rate is not None:
        return (f"; {result.decoding}: acceptance rate {result.acceptance_rate:.1%}, {result.tokens_per_round:.2f} "
                "tokens per round")
    if result.mean_exit_block is not None:
        return f"; {result.decoding}: {result.mean_exit_block:.2f} blocks per token on average"
    return ""


def kv_cache_summary(result: GenerateResult) -> str:
    """KV cache stored (filled slots) and allocated (buffers), each against the dense model's."""
    def versus(ours: int, dense: int) -> str:
        return f"{ours:,} B vs dense {dense:,} B ({1 - ours / max(1, dense):.1%} saved)"

    return (f"KV cache stored {versus(result.kv_cache_bytes, result.dense_kv_cache_bytes)}, "
            f"allocated {versus(result.kv_cache_allocated_bytes, result.dense_kv_cache_allocated_bytes)}")
