"""The eager decode step with LayerKVCache's fast append (every row appends to equally long rows: two slice copies,
no mask) against the general path (indexed writes at per-row slots and a mask, the code before), on fresh
small-preset models, MoD and dense, interleaved in 15 rounds of 20 steps after the same prefill; logits checked
equal bit for bit:

    python bench/decode_cache_ab.py 1; python bench/decode_cache_ab.py 8      # batch size
"""

from __future__ import annotations

from decode_rope_ab import compare_steps, main, prefilled  # the same models, prefill, timing and command line


def measure(label: str, route_every: int, batch: int) -> str:
    """One model's line: both decode steps' median (min-max) ms and their ratio."""
    model, routing, new_tokens, caches = prefilled(route_every, batch, ("masked", "slice"))

    def masked_step():
        for layer in caches["masked"].layers:
            layer.full = False  # the general path: indexed writes and a mask
        return model.decode_step(new_tokens, caches["masked"], routing)

    calls = {"masked": masked_step, "slice": lambda: model.decode_step(new_tokens, caches["slice"], routing)}
    return compare_steps(label, batch, calls, "masked", "slice")


if __name__ == "__main__":
    main(measure)
