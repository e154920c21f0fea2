"""Greedy decoding of an early-exit run: full depth, confidence exit, self-speculative, and a dense run beside them.

    python bench/early_exit.py runs/small-early-exit --dense runs/small-dense --thresholds 0.9,0.8 --speculative 2,4,6

Each setting is `modcli generate`'s library call (`modcli.decode.generation.generate`, batch 1, --temperature 0) on every
prompt, the models loaded once; the settings alternate call by call for --rounds rounds, so that a machine shared
with other work disturbs them alike. Prints one Markdown row per setting (median tokens/s over rounds x prompts,
with min-max; blocks per token; acceptance rate; KV bytes; whether the text equals the full model's) and, with
--json FILE, writes every call.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from modcli.checkpoint.store import load_model_from
from modcli.decode.generation import GenerateConfig, generate

PROMPTS = ["def ", "import ", "class ", "    return ", "for i in "]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run")
    parser.add_argument("--dense", help="a dense run to decode beside it")
    parser.add_argument("--thresholds", default="0.9")
    parser.add_argument("--speculative", default="4")
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()

    model, _, _ = load_model_from(args.run)
    settings: dict[str, tuple[object, dict]] = {"full depth": (model, {})}
    for threshold in (float(t) for t in args.thresholds.split(",") if t):
        settings[f"confidence exit {threshold:g}"] = (model, {"exit_threshold": threshold})
    for blocks in (int(e) for e in args.speculative.split(",") if e):
        settings[f"speculative E={blocks}, K={args.draft_tokens}"] = (
            model, {"speculative": blocks, "draft_tokens": args.draft_tokens})
    if args.dense:
        settings["dense run, full depth"] = (load_model_from(args.dense)[0], {})

    calls: dict[str, list[dict]] = {name: [] for name in settings}
    with torch.no_grad():
        for _ in range(args.rounds):
            for prompt in PROMPTS:
                for name, (m, flags) in settings.items():
                    config = GenerateConfig.of(args.run, prompts=[prompt], max_new_tokens=args.max_new_tokens,
                                               temperature=0, device="cpu", **flags)
                    result = generate(config, model=m)
                    calls[name].append({"prompt": prompt, "tokens": result.tokens[0],
                                        "tokens_per_s": result.tokens_per_s, "decode_s": result.decode_s,
                                        "acceptance_rate": result.acceptance_rate,
                                        "tokens_per_round": result.tokens_per_round,
                                        "mean_exit_block": result.mean_exit_block,
                                        "kv_cache_bytes": result.kv_cache_bytes,
                                        "dense_kv_cache_bytes": result.dense_kv_cache_bytes})
    full = {call["prompt"]: call["tokens"] for call in calls["full depth"]}
    depth = model.config.n_layers
    print("| decoding | tokens/s, median (min-max) | vs full depth | blocks per token | acceptance rate | tokens per "
          "round | KV bytes stored | text = full depth |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    reference = statistics.median(c["tokens_per_s"] for c in calls["full depth"])
    for name, runs in calls.items():
        speeds = [c["tokens_per_s"] for c in runs]
        exits = [c["mean_exit_block"] for c in runs if c["mean_exit_block"] is not None]
        acceptance = [c["acceptance_rate"] for c in runs if c["acceptance_rate"] is not None]
        per_round = [c["tokens_per_round"] for c in runs if c["tokens_per_round"] is not None]
        same = sum(c["tokens"] == full[c["prompt"]] for c in runs)
        blocks = f"{statistics.mean(exits):.2f}" if exits else "-" if acceptance else str(depth)
        print(f"| {name} | {statistics.median(speeds):.1f} ({min(speeds):.1f}-{max(speeds):.1f}) | "
              f"{statistics.median(speeds) / reference:.2f} | "
              f"{blocks} | "
              f"{f'{statistics.mean(acceptance):.2f}' if acceptance else '-'} | "
              f"{f'{statistics.mean(per_round):.2f}' if per_round else '-'} | "
              f"{statistics.mean(c['kv_cache_bytes'] for c in runs):,.0f} | {same}/{len(runs)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(calls, f)


if __name__ == "__main__":
    main()
