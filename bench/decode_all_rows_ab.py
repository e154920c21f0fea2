"""The eager decode step when every row processes the token in a routed block (every processed step at batch 1):
whole tensors (Block.decode as it is) against row reads and an indexed write of all B rows (the code before), on
fresh small-preset MoD models, interleaved in 15 rounds of 20 steps after the same prefill; logits checked equal
bit for bit. Two routings of the same model:

- calibrated: the routers shifted to process 0.125 of the prompt's tokens, as `modcli profile` calibrates them;
- always: every router's bias raised by 1e4, so every routed block processes every step (the case the change
  touches, alone).

    python bench/decode_all_rows_ab.py 1; python bench/decode_all_rows_ab.py 8      # batch size
"""

from __future__ import annotations

import sys

import torch
from decode_rope_ab import ROUNDS, STEPS, compare_steps, prefilled  # the same models, prefill and interleaved timing

import modcli.models.decoder as decoder
from modcli.models.routing.calibration import calibrate_causal_rules
from modcli.models.routing.selection import residual_update
from modcli.models.routing.topk import shift_output_bias

AS_IS = decoder.Block.decode


def decode_rows_before(self, x, positions, routing, cache, token_ids=None, rope=None):
    """Block.decode before: a routed block reads the processed rows and writes them back by index, all B too."""
    if not self.routed or self.config.route_part != "block":
        return AS_IS(self, x, positions, routing, cache, token_ids, rope)
    router = self.router
    router_logits = router.logits(x, positions[:, None])
    decisions = router.decide(x, router_logits, routing, positions[:, None], self.config.capacity)
    if self.config.keep_first:
        decisions = decisions | (positions[:, None] < self.config.keep_first)
    rows = decisions[:, 0].nonzero().squeeze(1)
    if rows.numel():
        x_rows = x[rows]
        if rope is None:
            cos, sin = decoder.decode_rope(self.config, positions[rows])
        else:
            cos, sin = rope[0][rows], rope[1][rows]
        weight = router.weight(router_logits[rows]).unsqueeze(-1)
        row_ids = token_ids[rows] if token_ids is not None and self.mlp_reads_ids else None
        delta = self._decode_delta(x_rows, cos, sin, cache, rows, "block", row_ids)
        x = x.index_put((rows,), residual_update(x_rows, delta, weight))
    return x


def step(model, tokens, cache, routing, before: bool):
    decoder.Block.decode = decode_rows_before if before else AS_IS
    try:
        return model.decode_step(tokens, cache, routing)
    finally:
        decoder.Block.decode = AS_IS


def measure(label: str, batch: int) -> str:
    def set_routers(model, prompt):
        if label == "calibrated":
            calibrate_causal_rules(model, prompt)
            return
        with torch.no_grad():
            for block in model.blocks:
                if block.routed:
                    shift_output_bias(block.router.score, torch.tensor(-1e4))

    model, routing, _, caches = prefilled(2, batch, ("rows", "whole"), set_routers)
    stream = torch.randint(0, 256, (ROUNDS * STEPS + 1, batch))  # each call's next tokens: the same for both
    fed = {"rows": 0, "whole": 0}

    def call(name: str):
        tokens = stream[fed[name]]
        fed[name] += 1
        return step(model, tokens, caches[name], routing, name == "rows")

    calls = {"rows": lambda: call("rows"), "whole": lambda: call("whole")}
    routed = [layer for layer, block in enumerate(model.blocks) if block.routed]
    start = sum(int(caches["whole"].layers[layer].lengths.sum()) for layer in routed)
    line = compare_steps(f"mod, {label}", batch, calls, "rows", "whole")
    stored = sum(int(caches["whole"].layers[layer].lengths.sum()) for layer in routed) - start
    return f"{line}; routed blocks processed {stored / (fed['whole'] * batch * len(routed)):.3f} of the tokens"


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    for label in ("always", "calibrated"):
        print(measure(label, batch), flush=True)


if __name__ == "__main__":
    main()
