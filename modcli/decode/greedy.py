"""The one token-by-token decoding loop after a prefill: `modcli generate` (modcli.decode.generation), the lm-eval
harness's generate_until (modcli.evaluation.harness) and export validation's eager reference (modcli.bundle.validation)
all run it. Each caller brings what differs: how a step runs (the eager cached `decode_step`, the compiled static
step, a family's own step such as early exit's confidence exit, through `modcli.decode.generation.DecodeRun.steps`),
how a token is chosen (greedy by default; `generate` passes its sampler) and what it keeps of each step (the tokens,
streamed text, the logits, a stop-string check)."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor


def argmax_tokens(logits: Tensor, index: int) -> Tensor:
    """Greedy choice: logits (B, V) -> each row's most likely token (B,); ties go to the lower id."""
    return logits.argmax(dim=-1)


def greedy_decode(logits: Tensor, max_new_tokens: int, step: Callable[[Tensor], Tensor],
                  emit: Callable[[int, Tensor, Tensor], bool | None] | None = None,
                  choose: Callable[[Tensor, int], Tensor] = argmax_tokens) -> Tensor:
    """Decode up to `max_new_tokens` tokens per row from the prefill's next-token `logits` (B, V).

    Each round chooses a token per row, `choose(logits, index)` -> (B,), hands it to `emit(index, tokens, logits)`
    and feeds it to `step(tokens)` -> the next logits (B, V). The last round's tokens are never fed (nothing would read
    their logits); `emit` returning True ends decoding after that round (e.g. every row holds a stop string). Nothing
    here syncs with the device: a caller that wants the tokens on the host moves them in `emit`. Returns the logits
    the last tokens were chosen from (the prefill's when `max_new_tokens` is 0)."""
    for index in range(max_new_tokens):
        tokens = choose(logits, index)  # (B,)
        stop = emit(index, tokens, logits) if emit is not None else False
        if index + 1 == max_new_tokens or stop:
            break
        logits = step(tokens)  # (B, V)
    return logits
