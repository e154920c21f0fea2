"""The folder's tokenizer.json and tokenizer_config.json, for `AutoTokenizer.from_pretrained(folder)`.

A run's tokenizer.json is copied as it is. A bytes run (token = byte) gets a tokenizer.json that maps byte b to id b:
a BPE model without merges over the 256 byte-level characters (GPT-2's byte-to-unicode table), a ByteLevel
pre-tokenizer without its regex split or prefix space, and the ByteLevel decoder, so encode is UTF-8's bytes and
decode gives them back (invalid UTF-8 as U+FFFD, as modcli's ByteTokenizer). Its padding token is byte 0 (NUL),
which text rarely holds; the attention mask, not the id, tells transformers where the padding is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def byte_characters() -> list[str]:
    """GPT-2's bytes_to_unicode: the printable character that stands for each byte 0..255 in ByteLevel tokenizers."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    characters, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            characters[byte] = chr(byte)
        else:
            characters[byte] = chr(256 + extra)
            extra += 1
    return [characters[byte] for byte in range(256)]


def bytes_tokenizer_json() -> dict:
    vocab = {character: byte for byte, character in enumerate(byte_characters())}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


def write_tokenizer(folder: Path, tokenizer_file: Path | None, seq_len: int) -> dict:
    """Write tokenizer.json (copied, or the bytes one when `tokenizer_file` is None) and tokenizer_config.json;
    returns the tokenizer_config."""
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": seq_len,
                        "clean_up_tokenization_spaces": False}
    if tokenizer_file is None:
        (folder / "tokenizer.json").write_text(json.dumps(bytes_tokenizer_json(), ensure_ascii=False, indent=1),
                                               encoding="utf-8")
        tokenizer_config["pad_token"] = byte_characters()[0]
    else:
        shutil.copyfile(tokenizer_file, folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, ensure_ascii=False, indent=2),
                                                  encoding="utf-8")
    return tokenizer_config
