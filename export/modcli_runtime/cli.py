"""`modcli-run BUNDLE --prompt TEXT`: generate text from an exported bundle without PyTorch."""

from __future__ import annotations

import argparse
import json
import sys

from modcli_runtime.bundle import PROVIDERS, load_bundle
from modcli_runtime.errors import BundleError
from modcli_runtime.generate import check_prompt_text, encode_prompt, fit_prompts
from modcli_runtime.text import TextPieces, Utf8Stream


class OneLineParser(argparse.ArgumentParser):
    """A flag that does not parse is one line on stderr and exit code 2, like every other mistake."""

    def error(self, message: str):
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="modcli-run", description="Generate text from a `modcli export` bundle "
                                "(numpy + onnxruntime; causal routing with a KV cache).")
    p.add_argument("bundle", help="Bundle folder written by `modcli export`.")
    p.add_argument("--prompt", action="append", help="Prompt text (repeat for a batch; default 'def ').")
    p.add_argument("--max-new-tokens", type=int, default=200, help="Bytes to generate per prompt.")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy.")
    p.add_argument("--top-k", type=int, default=0, help="Sample among the k most likely bytes (0 = off).")
    p.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling threshold (1 = off).")
    p.add_argument("--seed", type=int, default=1337, help="Sampler seed.")
    p.add_argument("--provider", default="cpu", choices=PROVIDERS, help="onnxruntime execution provider.")
    p.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0 = one per core).")
    p.add_argument("--allow-invalid", action="store_true", help="Run a bundle whose validation failed.")
    p.add_argument("--no-verify", action="store_true", help="Skip the sha256 check of the bundle's files.")
    p.add_argument("--json", action="store_true", help="Print exactly one JSON object on stdout.")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    prompts = args.prompt or ["def "]
    written = []  # text on stdout: an error after it starts on a line of its own

    def write(text: str) -> None:
        written.append(text)
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        for prompt in prompts:
            check_prompt_text(prompt)
        bundle = load_bundle(args.bundle, provider=args.provider, verify=not args.no_verify,
                             allow_invalid=args.allow_invalid, threads=args.threads)
        bundle.session("decode")  # a bundle that cannot decode says so before anything is written
        context = int(bundle.model["seq_len"])
        encoded, notes = fit_prompts([encode_prompt(p, bundle.vocab_size, bundle.text) for p in prompts], context)
        for note in notes:
            print(note, file=sys.stderr)
        on_token = None
        if not args.json and len(prompts) == 1:
            stream = Utf8Stream(write, prefix=prompts[0])  # the prompt goes out with the first token
            pieces = TextPieces(bundle.text)

            def on_token(row: int, token: int) -> None:
                stream(row, pieces(token))

        result = bundle.generate(encoded, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                 top_k=args.top_k, top_p=args.top_p, seed=args.seed, on_token=on_token,
                                 context=context)
    except BundleError as exc:
        if written and not written[-1].endswith("\n"):
            sys.stdout.write("\n")
            sys.stdout.flush()
        print("error: " + " ".join(str(exc).split()), file=sys.stderr)  # one line
        raise SystemExit(exc.exit_code) from None
    longest = max(len(tokens) for tokens in encoded) + args.max_new_tokens
    if longest > context and not args.json:
        print(f"note: {longest} tokens exceeded the training context of {context}; positions beyond it were never "
              "trained", file=sys.stderr)
    if args.json:
        print(json.dumps({"texts": result.texts, "tokens": result.tokens, "steps": result.steps,
                          "first_token_s": result.first_token_s, "total_s": result.total_s,
                          "tokens_per_s": result.tokens_per_s, "processed_fraction": result.processed_fraction,
                          "provider": bundle.active_provider}))
        return
    if on_token is None:
        for prompt, text in zip(prompts, result.texts, strict=True):
            sys.stdout.write(f"{prompt}{text}\n---\n")
    else:
        sys.stdout.write("\n")
    sys.stdout.flush()
    fractions = " ".join(f"{k}={v:.3f}" for k, v in result.processed_fraction.items()) or "dense"
    print(f"{len(prompts) * args.max_new_tokens} tokens, {result.tokens_per_s:.1f} tokens/s "
          f"(first token {result.first_token_s:.3f}s), {bundle.active_provider}, processed {fractions}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
