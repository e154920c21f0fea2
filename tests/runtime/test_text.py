"""modcli_runtime.text: the tokenizers and the streamed UTF-8 output, one definition for the runtime and modcli."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from modcli_runtime.errors import TokenizerError
from modcli_runtime.text import ByteTokenizer, JsonTokenizer, TextPieces, Utf8Stream

from modcli.data.tokenizer import load_tokenizer
from modcli.errors import UserError


def byte_level_tokenizer(folder: Path) -> Path:
    """A byte-level BPE learned from ASCII text only, so that é and 😀 are split into several byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(["hello world, def f(x): return x\n"] * 50, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def streamed(tokenizer, ids: list[int], prefix: str = "") -> list[str]:
    """What a Utf8Stream writes, piece by piece, when one row's tokens arrive one at a time."""
    written: list[str] = []
    stream, pieces = Utf8Stream(written.append, prefix=prefix), TextPieces(tokenizer)
    for token in ids:
        stream(0, pieces(token))
    return written


def test_a_tokenizer_json_streams_characters_whose_bytes_span_tokens(tmp_path):
    tokenizer = JsonTokenizer(byte_level_tokenizer(tmp_path))
    text = "hello é😀 world, wörld"
    ids = tokenizer.encode(text)
    assert any(tokenizer.decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids)))  # a split character
    written = streamed(tokenizer, ids)
    assert "".join(written) == tokenizer.decode(ids) == text  # nothing after the split character is lost
    assert not any("\ufffd" in piece for piece in written)


def test_byte_tokens_stream_whole_characters_after_the_prompt():
    tokenizer = ByteTokenizer()
    written = streamed(tokenizer, tokenizer.encode("é😀 ok"), prefix="def ")
    assert written[:2] == ["def ", "é"]  # the prompt goes out with the first token, é once its second byte came
    assert "".join(written) == "def é😀 ok"
    assert not any("\ufffd" in piece for piece in written)
    assert streamed(tokenizer, [0xC3, 300]) == []  # an unfinished character and a token beyond the bytes: nothing yet


def test_the_training_side_reads_text_with_the_runtime_tokenizers(tmp_path):
    import modcli.data.tokenizer as training_side

    assert training_side.ByteTokenizer is ByteTokenizer and training_side.JsonTokenizer is JsonTokenizer
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer)
    path = byte_level_tokenizer(tmp_path)
    loaded = load_tokenizer("tokenizer.json", tmp_path)
    assert isinstance(loaded, JsonTokenizer) and loaded.name == str(path)
    assert loaded.decode(loaded.encode("wörld")) == "wörld"


def test_an_unreadable_tokenizer_json_or_no_tokenizers_package_is_one_error(tmp_path, monkeypatch):
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(TokenizerError, match="not a readable tokenizer.json"):
        JsonTokenizer(tmp_path / "bad.json")
    with pytest.raises(UserError, match="bad.json: not a readable tokenizer.json"):
        load_tokenizer("bad.json", tmp_path)
    good = byte_level_tokenizer(tmp_path / "good")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as where the package is not installed
    with pytest.raises(UserError, match="needs the `tokenizers` package"):
        load_tokenizer(str(good))
