"""`modcli generate`: flags -> GenerateConfig -> modcli.generate -> text on stdout, statistics on stderr (or one
JSON object)."""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING, Any

import modcli
from modcli.commands import options
from modcli.commands.common import stderr, subcommand
from modcli.commands.config_flags import config_flags, decoding_flags, source_flags
from modcli.reports.console import print_json

if TYPE_CHECKING:
    from modcli.decode.generation import GenerateResult


@subcommand
@config_flags(lambda: source_flags("decode/generation.py", "GenerateConfig", leave_out=("checkpoint",)), decoding_flags)
def generate(
    checkpoint: options.Checkpoint = None,
    json_output: options.Json = False,
    flags: dict[str, Any] | None = None,
) -> None:
    """Generate text with causal routing and a KV cache holding only the tokens each block processed."""
    config = modcli.GenerateConfig.of(checkpoint, **flags)  # a family's decoding options into family_decoding
    stream = None
    if not json_output and len(config.prompts) == 1:
        stream = modcli.Utf8Stream(lambda text: (sys.stdout.write(text), sys.stdout.flush()), prefix=config.prompts[0])
    result = modcli.generate(config, on_bytes=stream)
    if json_output:
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
    """A family's own decoding (early exit's): the acceptance rate of draft-and-verify decoding, or the blocks a
    token ran."""
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
