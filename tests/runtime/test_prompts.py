"""Prompts that a user types wrong or too long, in `modcli-run` and `modcli generate` alike: text that is not UTF-8
and --max-new-tokens past any index are one line and exit 2; a prompt longer than the model's context keeps its
last seq_len tokens with a note (it was a prefill of minutes); an error line never follows the echoed prompt on the
same line. The runtime's side runs on a stand-in bundle (no ONNX graphs: these checks come before and around them)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from modcli_runtime import cli as runtime_cli
from modcli_runtime.errors import BundleError
from modcli_runtime.generate import MAX_NEW_TOKENS, check_prompt_text, fit_prompts, generate_tokens
from modcli_runtime.text import ByteTokenizer
from typer.testing import CliRunner

INVALID_UTF8 = b"abc\xff\xfe".decode("utf-8", errors="surrogateescape")
"""What Python makes of `--prompt $'abc\\xff\\xfe'` in argv."""
SEQ_LEN = 16


class StepCounter:
    """A decode step that predicts byte 65 ('A') and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.calls += 1
        logits = np.zeros((len(feeds["tokens"]), 256), dtype=np.float32)
        logits[:, 65] = 1.0
        return {"logits": logits}


class NoCache:
    routed_layers: list[int] = []
    n_layers = 1
    layers = [0]  # the layers with a cache

    def allocate(self, batch: int, steps: int) -> dict[str, np.ndarray]:
        return {"lengths.0": np.zeros(batch, dtype=np.int64)}

    def write_rows(self, feeds: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
        feeds["lengths.0"] += 1


class StandInBundle:
    """What modcli-run's command line uses of a Bundle; `fail_after` tokens, generate raises a BundleError."""

    model = {"seq_len": SEQ_LEN}
    vocab_size = 256
    text = ByteTokenizer()
    active_provider = "CPUExecutionProvider"

    def __init__(self, fail_after: int | None = None) -> None:
        self.fail_after = fail_after
        self.step = StepCounter()

    def session(self, name: str) -> None:
        return None

    def generate(self, prompts, on_token=None, **options):
        def counted(row: int, token: int) -> None:
            if self.fail_after is not None and self.step.calls > self.fail_after:
                raise BundleError("the decode graph failed")
            if on_token is not None:
                on_token(row, token)

        return generate_tokens(self.step, NoCache(), prompts, vocab_size=self.vocab_size, text=self.text,
                               on_token=counted, **options)


def run_cli(monkeypatch, capsys, bundle: StandInBundle, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(runtime_cli, "load_bundle", lambda *a, **k: bundle)
    capsys.readouterr()
    try:
        runtime_cli.main(["bundle", "--temperature", "0", *args])
        code = 0
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_the_prompt_rules():
    check_prompt_text("naïve café 🙂")
    with pytest.raises(BundleError, match=r"--prompt is not valid UTF-8 text \(byte 0xff at character 3\)"):
        check_prompt_text(INVALID_UTF8)
    kept, notes = fit_prompts([list(range(40)), [1, 2]], SEQ_LEN)
    assert kept == [list(range(24, 40)), [1, 2]]
    assert notes == [f"note: prompt 1 has 40 tokens, more than the model's context of {SEQ_LEN}: only its last "
                     f"{SEQ_LEN} are read"]
    assert fit_prompts([list(range(40))], None) == ([list(range(40))], [])


def test_a_long_prompt_costs_the_context_not_its_length():
    """100,000 characters on a 16-token model: 16 + 2 - 1 decode steps, not 100,001 (modcli-run had not finished
    such a prompt in 600 s)."""
    step = StepCounter()
    result = generate_tokens(step, NoCache(), ["x" * 100_000], vocab_size=256, max_new_tokens=2, temperature=0,
                             context=SEQ_LEN)
    assert step.calls == result.steps == SEQ_LEN + 1 and result.tokens == [[65, 65]]
    with pytest.raises(BundleError, match=rf"--max-new-tokens must be in 1..{MAX_NEW_TOKENS}, got {2**63}"):
        generate_tokens(step, NoCache(), ["x"], vocab_size=256, max_new_tokens=2**63)


@pytest.mark.parametrize("args, message", [
    (["--prompt", INVALID_UTF8], "error: --prompt is not valid UTF-8 text (byte 0xff at character 3)"),
    (["--max-new-tokens", str(2**63)], f"error: --max-new-tokens must be in 1..{MAX_NEW_TOKENS}, got {2**63}"),
    (["--max-new-tokens", str(2**63), "--json"], "error: --max-new-tokens must be in 1..")])
def test_modcli_run_refuses_bad_prompts_in_one_line(args, message, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, StandInBundle(), *args)
    assert code == 2 and out == "" and err.startswith(message) and len(err.strip().splitlines()) == 1, err


def test_modcli_run_reads_the_last_seq_len_tokens_of_a_long_prompt(monkeypatch, capsys):
    bundle = StandInBundle()
    code, out, err = run_cli(monkeypatch, capsys, bundle, "--prompt", "y" * 100_000, "--max-new-tokens", "3")
    assert code == 0 and out == "y" * 100_000 + "AAA\n"
    assert bundle.step.calls == SEQ_LEN + 2
    assert err.splitlines()[0] == (f"note: the prompt has 100,000 tokens, more than the model's context of {SEQ_LEN}: "
                                   f"only its last {SEQ_LEN} are read")


def test_an_error_after_the_echoed_prompt_starts_its_own_line(monkeypatch, capsys):
    """`def error: ...` before: the prompt was written to stdout before generating, and the error followed it on the
    same line of the terminal. Now the prompt goes out with the first token, and an error after output begins a
    line of its own."""
    code, out, err = run_cli(monkeypatch, capsys, StandInBundle(fail_after=0), "--prompt", "def ")
    assert code == 2 and out == "" and err == "error: the decode graph failed\n"
    code, out, err = run_cli(monkeypatch, capsys, StandInBundle(fail_after=5), "--prompt", "def ",
                             "--max-new-tokens", "8")
    assert code == 2 and out.startswith("def A") and out.endswith("\n") and err == "error: the decode graph failed\n"


def test_modcli_generate_applies_the_same_rules(trained_run):
    """`modcli generate`: the same messages, and the same cut of a long prompt (the note names the run's context)."""
    from modcli.checkpoint.store import load_model_from
    from modcli.cli import app

    runner = CliRunner()
    base = ["generate", str(trained_run), "--device", "cpu", "--temperature", "0"]
    for extra, message in ((["--prompt", INVALID_UTF8], "--prompt is not valid UTF-8 text (byte 0xff at character 3)"),
                           (["--max-new-tokens", str(2**63)], f"--max-new-tokens must be in 1..{MAX_NEW_TOKENS}")):
        result = runner.invoke(app, [*base, *extra])
        assert result.exit_code == 2 and message in result.stderr, result.output
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
    seq_len = load_model_from(trained_run, "cpu")[0].config.seq_len
    tail = "def f(x):\n    return x + 1\n" * 4
    long = runner.invoke(app, [*base, "--prompt", "#" * 50_000 + tail, "--max-new-tokens", "4", "--json"])
    short = runner.invoke(app, [*base, "--prompt", tail[-seq_len:], "--max-new-tokens", "4", "--json"])
    assert long.exit_code == short.exit_code == 0, long.output
    assert (f"note: the prompt has {50_000 + len(tail):,} tokens, more than the model's context of {seq_len}: only its "
            f"last {seq_len} are read") in long.stderr
    assert json.loads(long.stdout)["tokens"] == json.loads(short.stdout)["tokens"]


def test_a_bundle_whose_tokenizer_outgrows_its_vocabulary_is_refused_at_load(tmp_path, capsys):
    """The bundle's side of a run imported with another model's tokenizer: one line naming both sizes when the bundle
    is opened, not an index error in the decode graph."""
    from modcli_runtime.bundle import FORMAT, FORMAT_VERSION, load_bundle
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"w{i}": i for i in range(300)}, unk_token="w0")).save(str(tmp_path / "tokenizer.json"))
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "valid": True, "graphs": {}, "files": {},
                "model": {"vocab_size": 256, "seq_len": SEQ_LEN, "tokenizer": "tokenizer.json"}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="the tokenizer has 300 tokens but the model's vocabulary has 256"):
        load_bundle(tmp_path, verify=False)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        runtime_cli.main([str(tmp_path), "--no-verify"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
