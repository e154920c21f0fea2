"""Write a tiny, randomly initialised Qwen2 model folder, as `transformers` saves one, for trying `modcli import`
end to end without downloading anything (needs the dev extra: pip install -e ".[dev]").

    python examples/make_tiny_qwen2.py OUT_DIR [--tokenizer tokenizer.json]

The model has grouped-query attention (8 query heads, 2 key/value heads), q/k/v biases and tied embeddings, like
Qwen2.5; its vocabulary is the tokenizer's (train one with `modcli tokenizer train`).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--tokenizer", required=True, help="A tokenizer.json (e.g. from `modcli tokenizer train`).")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = json.loads(Path(args.tokenizer).read_text())["model"]["vocab"]
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True)
    out = Path(args.out)
    Qwen2ForCausalLM(config).save_pretrained(out)
    shutil.copyfile(args.tokenizer, out / "tokenizer.json")
    print(f"wrote {out}: Qwen2ForCausalLM, {args.layers} layers, d {args.hidden}, vocabulary {len(vocab)}")


if __name__ == "__main__":
    main()
