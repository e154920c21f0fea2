"""--arch early-exit (LayerSkip): training (layer dropout, exit loss), decoding with exits, and the commands."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from modcli.cli import app
from modcli.config import ModelConfig, TrainConfig
from modcli.decode.generation import GenerateConfig, generate
from modcli.errors import UserError
from modcli.models.cache import DecoderCache
from modcli.models.decoder import MoDDecoder, config_rope
from modcli.models.early_exit import EarlyExitDecoder
from modcli.models.flops import counted_flops, training_flops
from modcli.training.objective import training_loss

ATOL = 1e-4
PROMPTS = ["def f(x):", "import os", "a"]  # different lengths: a right-padded batch


def early_exit_config(**overrides) -> ModelConfig:
    values = dict(arch="early-exit", d_model=32, n_layers=4, n_heads=4, seq_len=64)
    values.update(overrides)
    return ModelConfig.of(**values)


def _model(**overrides) -> EarlyExitDecoder:
    """A random model whose blocks matter: weights larger than at initialisation, so that early exits and the full
    model often disagree (fresh weights barely move the residual stream, and every exit would say the same)."""
    torch.manual_seed(0)
    model = EarlyExitDecoder(early_exit_config(**overrides)).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                param.normal_(0.0, 0.3)
    return model


def _generate(model, **settings):
    return generate(GenerateConfig.of("unused", prompts=PROMPTS, max_new_tokens=24, temperature=0, **settings),
                    model=model)


@torch.no_grad()
def test_causal_and_cached_decoding_equals_the_full_forward():
    model = _model()
    tokens = torch.randint(0, 256, (3, 40))
    full = model(tokens)  # (B, T, V)
    changed = tokens.clone()
    changed[:, 25:] = torch.randint(0, 256, (3, 15))
    torch.testing.assert_close(model(changed)[:, :25], full[:, :25], atol=0, rtol=0)
    exits = model.exit_layer_logits(tokens)  # (L, B, T, V)
    torch.testing.assert_close(model.exit_layer_logits(changed)[:, :, :25], exits[:, :, :25], atol=0, rtol=0)
    torch.testing.assert_close(exits[-1], full, atol=ATOL, rtol=0)

    cache = DecoderCache.allocate(model.config, 3, 40, torch.device("cpu"))
    stepped = [model(tokens[:, :12], cache=cache)[:, -1]]
    stepped += [model.decode_step(tokens[:, t], cache) for t in range(12, 40)]
    torch.testing.assert_close(torch.stack(stepped, dim=1), full[:, 11:], atol=ATOL, rtol=0)

    # A speculative draft through blocks 0..E-1 is the exit after block E-1, at every drafted position.
    cache = DecoderCache.allocate(model.config, 3, 40, torch.device("cpu"))
    model(tokens[:, :12], cache=cache)
    start = cache.positions.clone()
    for i in range(4):
        hidden = model.draft_step(tokens[:, 12 + i], cache, start + i, 2)  # (B, 1, D)
        draft = model.head(model.norm(hidden[:, 0]))  # (B, V)
        torch.testing.assert_close(draft, exits[1, :, 12 + i], atol=ATOL, rtol=0)


@torch.no_grad()
def test_exit_threshold_one_is_the_full_model_and_exits_fill_the_cache_from_the_exit_state():
    model = _model()
    tokens = torch.randint(0, 256, (2, 30))
    full = model(tokens)
    cache = DecoderCache.allocate(model.config, 2, 30, torch.device("cpu"))
    stepped = [model(tokens[:, :10], cache=cache)[:, -1]]
    for t in range(10, 30):
        logits, exit_block = model.decode_step_exit(tokens[:, t], cache, 1.0)
        assert exit_block.tolist() == [3, 3]
        stepped.append(logits)
    torch.testing.assert_close(torch.stack(stepped, dim=1), full[:, 9:], atol=ATOL, rtol=0)

    # Every token exits after block 0 (any top probability reaches 1e-9): its logits are that exit's, and each
    # skipped block holds K/V projected from the block-0 hidden state (CALM), which, block 0 being always run, is
    # the full forward's block-0 output.
    cache = DecoderCache.allocate(model.config, 2, 30, torch.device("cpu"))
    model(tokens[:, :10], cache=cache)
    for t in range(10, 30):
        logits, exit_block = model.decode_step_exit(tokens[:, t], cache, 1e-9)
        assert exit_block.tolist() == [0, 0]
        torch.testing.assert_close(logits, model.exit_layer_logits(tokens[:, :t + 1])[0, :, -1], atol=ATOL, rtol=0)
    cos, sin = config_rope(model.config, torch.arange(30))
    hidden, _ = model.blocks[0](model.embed(tokens), cos, sin, "dense")  # (B, T, D)
    for layer in (1, 3):
        block = model.blocks[layer]
        _, keys, values = block.attn._heads(block.attn_norm(hidden), cos[None], sin[None])  # (B, Hkv, T, hd)
        torch.testing.assert_close(cache.layers[layer].keys[:, :, 10:30], keys[:, :, 10:], atol=ATOL, rtol=0)
        torch.testing.assert_close(cache.layers[layer].values[:, :, 10:30], values[:, :, 10:], atol=ATOL, rtol=0)


def test_generate_with_exits_and_speculative_decoding_equal_the_full_greedy_output():
    model = _model()
    full = _generate(model)
    assert full.decoding == "full" and full.acceptance_rate is None
    assert _generate(model, exit_threshold=1.0).tokens == full.tokens
    rates = []
    for draft_blocks, draft_tokens in ((1, 4), (2, 1), (3, 3)):
        result = _generate(model, speculative=draft_blocks, draft_tokens=draft_tokens)
        assert result.tokens == full.tokens, (draft_blocks, draft_tokens)
        assert result.kv_cache_bytes == full.kv_cache_bytes  # rolled back: the same tokens cached as plain decoding
        rates.append(result.acceptance_rate)
    assert all(0 < rate < 1 for rate in rates)  # drafts were both accepted and rejected
    early = _generate(model, exit_threshold=0.2)
    assert early.mean_exit_block < 4 and sum(early.exit_blocks.values()) == 3 * 23


def test_layer_dropout_is_off_in_eval_and_skips_whole_rows_in_training():
    model = EarlyExitDecoder(early_exit_config(layer_dropout_max=0.5))
    assert [model.config.family.layer_dropout(model.config, layer) for layer in range(4)] == [0.0, 0.5 / 3, 1.0 / 3, 0.5]
    seen: dict[int, list[int]] = {layer: [] for layer in range(4)}
    for layer, block in enumerate(model.blocks):
        block.register_forward_hook(lambda module, args, out, layer=layer: seen[layer].append(args[0].shape[0]))
    tokens = torch.randint(0, 256, (64, 8))
    model.eval()
    with torch.no_grad():
        (first, aux), second = model(tokens, return_aux=True), model(tokens)
    torch.testing.assert_close(first, second, atol=0, rtol=0)
    assert all(sizes == [64, 64] for sizes in seen.values()) and aux.exit_logits is None
    seen = {layer: [] for layer in range(4)}
    model.train()
    torch.manual_seed(0)
    _, aux = model(tokens, return_aux=True)
    assert seen[0] == [64] and 64 > seen[3][0] > 16  # block 3 runs only its kept rows (64 x 0.5 expected)
    assert aux.exit_logits.shape == (3, 64, 8, 256)


def test_early_exit_loss_matches_an_independent_computation_and_the_flop_count():
    model = EarlyExitDecoder(early_exit_config(layer_dropout_max=0.0, exit_loss_scale=0.7)).train()
    tokens = torch.randint(0, 256, (2, 16))
    targets = tokens.roll(-1, dims=1)
    objective = training_loss(model, tokens, targets, TrainConfig())
    [term] = objective.terms
    loss, read = term.value, objective.readers["exit_losses"]
    assert term.name == "exit_loss" and term.weight == 1.0
    torch.testing.assert_close(objective.total, objective.lm + loss)
    cos, sin = config_rope(model.config, torch.arange(16))
    x, expected = model.embed(tokens), []
    for block in model.blocks[:-1]:
        x, _ = block(x, cos, sin, "dense")
        expected.append(F.cross_entropy(model.head(model.norm(x)).flatten(0, 1), targets.flatten()))
    weights = torch.tensor([1, 2, 3]) / 6  # (l + 1) / sum(j + 1), rising with depth
    torch.testing.assert_close(loss, 0.7 * (weights * torch.stack(expected)).sum(), atol=1e-5, rtol=0)
    assert list(read()) == ["block0", "block1", "block2"]
    model.eval()
    assert training_loss(model, tokens, targets, TrainConfig()).terms == []  # evaluation returns no exits

    model.train()

    def step() -> None:  # the exits' heads count in the training FLOPs (--flops-budget)
        training_loss(model, tokens, targets, TrainConfig()).total.backward()

    assert sum(counted_flops(step).values()) == 2 * training_flops(model.config, 16)


@pytest.fixture(scope="module")
def early_exit_run(tmp_path_factory, corpus_file):
    out = tmp_path_factory.mktemp("runs") / "early-exit"
    result = CliRunner().invoke(app, [
        "train", "--arch", "early-exit", "--layer-dropout-max", "0.2", "--data", str(corpus_file), "--out", str(out),
        "--d-model", "32", "--n-layers", "3", "--n-heads", "4", "--seq-len", "32", "--batch-size", "4",
        "--max-steps", "4", "--eval-every", "4", "--eval-batches", "1", "--warmup", "1", "--log-every", "2",
        "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout)


@pytest.mark.slow
def test_train_eval_generate_profile_from_the_command_line(early_exit_run):
    out, summary = early_exit_run
    assert summary["steps"] == 4 and summary["val_loss"] > 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["exit_loss"] > 0 for r in records) and set(records[-1]["exit_losses"]) == {"block0", "block1"}
    runner = CliRunner()

    result = runner.invoke(app, ["eval", str(out), "--batches", "1", "--batch-size", "2", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [r["causal"] for r in report["results"]] == [True]
    assert list(report["exit_losses"]) == ["block0", "block1", "block2"]
    assert report["exit_losses"]["block2"] == pytest.approx(report["results"][0]["loss"], abs=1e-4)
    result = runner.invoke(app, ["eval", str(out), "--batches", "1", "--batch-size", "2", "--device", "cpu"])
    assert result.exit_code == 0 and "early exits" in result.stdout

    common = ["generate", str(out), "--prompt", "def ", "--max-new-tokens", "12", "--temperature", "0",
              "--device", "cpu"]
    plain = json.loads(runner.invoke(app, [*common, "--json"]).stdout)
    result = runner.invoke(app, [*common, "--speculative", "1", "--json"])
    assert result.exit_code == 0, result.output
    speculative = json.loads(result.stdout)
    assert speculative["tokens"] == plain["tokens"] and 0 <= speculative["acceptance_rate"] <= 1
    assert speculative["tokens_per_s"] > 0 and speculative["decoding"].startswith("speculative")
    result = runner.invoke(app, [*common, "--exit-threshold", "0.5"])
    assert result.exit_code == 0 and result.stdout.startswith("def ") and "blocks per token" in result.stderr

    result = runner.invoke(app, ["profile", str(out), "--compare", "dense", "--batch-size", "1", "--seq-len", "16",
                                 "--repeats", "1", "--warmup", "0", "--decode-tokens", "2", "--no-memory",
                                 "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    profile = json.loads(result.stdout)
    assert profile["baseline"]["config"]["arch"] == "mod" and profile["model"]["config"]["arch"] == "early-exit"
    assert profile["model"]["parameters"] == profile["baseline"]["parameters"]
    assert profile["results"][0]["ratio"]["decode_latency"]["measured"] > 0


def test_bad_flags_are_one_line_and_exit_2(early_exit_run, corpus_file, tmp_path):
    out, _ = early_exit_run
    runner = CliRunner()
    generate_cases = [
        (["--exit-threshold", "1.5"], "--exit-threshold must be in (0, 1]"),
        (["--speculative", "0", "--temperature", "0"], "--speculative must be >= 1"),
        (["--speculative", "3", "--temperature", "0"], "--speculative must be in 1..2"),
        (["--speculative", "1"], "--temperature 0"),
        (["--speculative", "1", "--exit-threshold", "0.5", "--temperature", "0"], "not both"),
    ]
    for args, message in generate_cases:
        result = runner.invoke(app, ["generate", str(out), "--device", "cpu", *args])
        assert result.exit_code == 2 and message in result.stderr, (args, result.output)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    with pytest.raises(UserError, match="needs an early-exit model"):
        generate(GenerateConfig.of("unused", max_new_tokens=2, exit_threshold=0.5),
                 model=MoDDecoder(early_exit_config(arch="mod", route_every=0)).eval())
    train_cases = [
        (["--arch", "nope"], "--arch must be one of mod, early-exit"),
        (["--layer-dropout-max", "0.3"], "--layer-dropout-max is an option of --arch early-exit"),
        (["--arch", "early-exit", "--layer-dropout-max", "1.5"], "--layer-dropout-max must be in [0, 1)"),
        (["--arch", "early-exit", "--capacity", "0.5"], "--capacity is a Mixture-of-Depths option"),
        (["--arch", "early-exit", "--experts", "2"], "--arch early-exit has dense MLPs"),
    ]
    for args, message in train_cases:
        result = runner.invoke(app, ["train", "--data", str(corpus_file), "--out", str(tmp_path / "bad"), *args])
        assert result.exit_code == 2 and message in result.stderr, (args, result.output)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_resume_repeats_the_layer_dropout_of_the_uninterrupted_run(tmp_path, corpus_file):
    import shutil

    from modcli.config import DataConfig, RunConfig, TrainConfig
    from modcli.training.loop import train

    def config(out, resume=False) -> RunConfig:
        return RunConfig(model=early_exit_config(n_layers=3, seq_len=32, layer_dropout_max=0.6),
                         data=DataConfig(data=str(corpus_file)),
                         train=TrainConfig(batch_size=4, max_steps=6, eval_every=3, eval_batches=1, warmup=1,
                                           log_every=1, device="cpu", out=str(out), resume=resume))

    def losses(out) -> list[float]:
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [value for r in records for value in (r["loss"], r["exit_loss"])]

    reference = tmp_path / "reference"
    train(config(reference), quiet=True)
    resumed = tmp_path / "resumed"
    shutil.copytree(reference, resumed)
    shutil.rmtree(resumed / "step-00000006")
    train(config(resumed, resume=True), quiet=True)
    assert losses(resumed) == pytest.approx(losses(reference), abs=1e-6)
