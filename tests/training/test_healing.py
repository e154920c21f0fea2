"""Healing a conversion: --objective distill (KL from the original; blockwise local distillation first with
--local-steps), --trainable lora (adapters merged into every checkpoint) and --trainable blocks:A-B."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from modcli.checkpoint.store import load_model
from modcli.cli import app
from modcli.config import TrainConfig
from modcli.errors import UserError
from modcli.models.build import build_model
from modcli.models.decoder import config_rope
from modcli.training.loop import freeze_for
from modcli.training.lora import (
    ADAPTERS_FILE,
    adapted_layers,
    adapter_state,
    add_adapters,
    load_adapters,
    merge_adapters,
    merged_state,
)
from modcli.training.objective import check_objective, distill_loss, oracle_labels, router_warmup_loss, training_loss
from tests.conftest import tiny_model_config

DISTILL = TrainConfig(objective="distill", init_from="original")


def _tokens(seed: int = 0, batch: int = 2, seq_len: int = 32) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def _converted(original, **changes):
    """A model of `original`'s config with `changes`, holding its weights (what --init-from does)."""
    model = build_model(dataclasses.replace(original.config, **changes))
    model.load_state_dict({name: tensor for name, tensor in original.state_dict().items()
                           if name in model.state_dict()}, strict=False)
    return model


@pytest.mark.parametrize("changes", [{}, {"route_every": 2, "capacity": 1.0, "router_weight": "unit"}],
                         ids=["dense", "routed-capacity-1"])
def test_distillation_loss_is_zero_for_an_identity_conversion(trained_dense_run, changes):
    original = load_model(trained_dense_run)
    student = _converted(original, **changes)
    tokens = _tokens()
    objective = training_loss(student, tokens, tokens.roll(-1, 1), DISTILL, teacher=original, step=1)
    (distill,) = [term for term in objective.terms if term.name == "distill_loss"]
    assert distill.value.item() == pytest.approx(0.0, abs=1e-6)
    others = sum(term.weight * term.value.item() for term in objective.terms)  # the routers' own losses besides
    assert objective.total.item() == pytest.approx(others, abs=1e-6)  # --distill-weight 1: no LM loss


def test_distillation_loss_is_the_kl_at_a_temperature():
    logits, teacher = torch.randn(2, 3, 7), torch.randn(2, 3, 7)
    for temperature in (1.0, 2.0):
        p = torch.softmax(teacher / temperature, -1)
        want = (p * (p.log() - torch.log_softmax(logits / temperature, -1))).sum(-1).mean() * temperature ** 2
        torch.testing.assert_close(distill_loss(logits, teacher, temperature), want, atol=1e-6, rtol=1e-5)
    mixed = dataclasses.replace(DISTILL, distill_weight=0.25)
    model = build_model(tiny_model_config().dense_twin())
    tokens = _tokens()
    objective = training_loss(model, tokens, tokens.roll(-1, 1), mixed, teacher=build_model(model.config), step=1)
    (distill,) = objective.terms
    torch.testing.assert_close(objective.total, 0.75 * objective.lm + 0.25 * distill.value)


def test_blockwise_distillation_reaches_only_the_modified_blocks(trained_dense_run):
    """--local-steps: each modified block (a dropped sublayer, or routed) matches the original's block on the
    original's input, so the gradient reaches the modified blocks' weights and nothing else."""
    original = load_model(trained_dense_run)
    student = _converted(original, drop="attention:1,mlp:2", route_every=0, route_layers=(3,), capacity=0.5)
    local = dataclasses.replace(DISTILL, local_steps=1)
    objective = training_loss(student, _tokens(), _tokens(), local, teacher=original, step=1)
    assert set(objective.readers["block_match"]()) == {"block1", "block2", "block3"}
    objective.total.backward()
    for name, param in student.named_parameters():
        layer = int(name.split(".")[1]) if name.startswith("blocks.") else None
        if layer in (1, 2, 3) and name.endswith("weight") and ".predictor." not in name:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
        elif layer not in (1, 2, 3):
            assert param.grad is None, name
    # after the local stage the same config trains on the KL (a full forward: the embedding gets its gradient)
    student.zero_grad()
    objective = training_loss(student, _tokens(), _tokens(), local, teacher=original, step=2)
    assert [term.name for term in objective.terms][0] == "distill_loss"
    objective.total.backward()
    assert student.embed.weight.grad is not None


def test_oracle_labels_are_the_largest_own_updates(trained_dense_run):
    """Each sequence's k tokens with the largest |f(x_t)|^2 of the routed part, by hand; --keep-first forced in."""
    original = load_model(trained_dense_run)
    tokens = _tokens(seq_len=16)
    x = original.embed(tokens)  # block 0's input, (B, T, D)
    cos, sin = config_rope(original.config, torch.arange(16))  # (T, hd/2)
    for part in ("block", "attention", "mlp"):
        block = _converted(original, route_every=0, route_layers=(0,), route_part=part, keep_first=1).blocks[0]
        with torch.no_grad():
            labels = oracle_labels(block, x, cos, sin, tokens, 5)  # (B, T)
            mid = x + block.delta(x, cos[None], sin[None], part="attention") if part == "mlp" else x
            size = block.delta(mid, cos[None], sin[None], part=part).pow(2).sum(-1)  # (B, T)
        size[:, 0] = float("inf")
        want = torch.zeros_like(labels).scatter(1, size.topk(5, dim=1).indices, 1.0)
        torch.testing.assert_close(labels, want, atol=0, rtol=0, msg=part)


def test_router_warmup_trains_the_routers_alone_towards_the_oracle(trained_dense_run):
    original = load_model(trained_dense_run)
    student = _converted(original, route_every=2, capacity=0.25, predictor_hidden=8)
    warm = dataclasses.replace(DISTILL, router_warmup=2, local_steps=1)
    tokens = _tokens()
    objective = training_loss(student, tokens, tokens.roll(-1, 1), warm, teacher=original, step=1)
    routed = [block.layer for block in student.blocks if block.router is not None]
    assert set(objective.readers["router_warmup"]()) == {f"block{layer}" for layer in routed}
    objective.total.backward()
    trained = {name for name, param in student.named_parameters() if param.grad is not None}
    assert trained and all(".router." in name for name in trained), trained
    assert any(".predictor." in name for name in trained)
    # the stages in order: warm-up (steps 1-2), local (3), then the KL
    stages = [set(training_loss(student, tokens, tokens, warm, teacher=original, step=step).readers)
              | {term.name for term in training_loss(student, tokens, tokens, warm, teacher=original,
                                                     step=step).terms} for step in (2, 3, 4)]
    assert "router_warmup" in stages[0] and "block_match" in stages[1] and "distill_loss" in stages[2]
    # a few steps of it teach the routers the oracle's ranking: their top-k agrees with it more than at the start
    optimizer = torch.optim.AdamW([param for param in student.parameters() if param.grad is not None], lr=0.1)
    before = _oracle_overlap(student, original, tokens)
    first = router_warmup_loss(student, tokens, reference=original)[0].item()
    for _ in range(60):
        optimizer.zero_grad()
        router_warmup_loss(student, tokens, reference=original)[0].backward()
        optimizer.step()
    assert router_warmup_loss(student, tokens, reference=original)[0].item() < 0.7 * first
    assert _oracle_overlap(student, original, tokens) > before + 0.25  # 0.22 -> 0.59 here (chance: 0.25)


@pytest.mark.parametrize("router", ["random", "attention"])
def test_router_warmup_refuses_routers_it_cannot_teach(router):
    model = build_model(tiny_model_config(route_every=2, router=router))
    with pytest.raises(UserError, match="--router-warmup"):
        check_objective(model, TrainConfig(router_warmup=2))


def _oracle_overlap(student, original, tokens) -> float:
    """The share of each routed block's top-k by router logit that the oracle labels choose, mean over blocks."""
    seq_len = tokens.shape[1]
    cos, sin = config_rope(original.config, torch.arange(seq_len))
    shares, x = [], original.embed(tokens)
    with torch.no_grad():
        for block, reference in zip(student.blocks, original.blocks, strict=True):
            if block.router is not None:
                k = block.router.static_tokens(seq_len, student.config.capacity)
                labels = oracle_labels(reference, x, cos, sin, tokens, k)  # (B, T)
                chosen = block.router.logits(x, torch.arange(seq_len)).topk(k, dim=1).indices  # (B, k)
                shares.append(labels.gather(1, chosen).mean().item())
            x = x + reference.delta(x, cos[None], sin[None])
    return sum(shares) / len(shares)


def test_adapters_start_at_the_model_and_merge_to_what_they_compute():
    torch.manual_seed(0)
    model = build_model(tiny_model_config(drop="attention:2")).eval()
    tokens = _tokens()
    before = model(tokens, "topk")
    names = add_adapters(model, rank=4, alpha=8.0, targets=("qkv", "proj", "gate_up", "down"))
    assert "blocks.2.attn.qkv" not in names and "blocks.2.mlp.down" in names  # a dropped sublayer has none
    torch.testing.assert_close(model(tokens, "topk"), before, atol=0, rtol=0)  # B = 0: the same model
    with torch.no_grad():
        for module in adapted_layers(model).values():
            module.parametrizations.weight[0].lora_b.normal_(std=0.05)
    unmerged = model(tokens, "topk")
    assert (unmerged - before).abs().max() > 1e-3
    plain = build_model(model.config).eval()
    plain.load_state_dict(merged_state(model))
    torch.testing.assert_close(plain(tokens, "topk"), unmerged, atol=1e-5, rtol=0)  # merged = unmerged
    # what --resume does: the merged weights and the adapters give back the unmerged model
    again = build_model(model.config).eval()
    again.load_state_dict(merged_state(model))
    add_adapters(again, rank=4, alpha=8.0, targets=("qkv", "proj", "gate_up", "down"))
    load_adapters(again, adapter_state(model), "adapters.safetensors")
    torch.testing.assert_close(again(tokens, "topk"), unmerged, atol=1e-5, rtol=0)
    merge_adapters(model)
    assert not adapted_layers(model)
    torch.testing.assert_close(model(tokens, "topk"), unmerged, atol=1e-5, rtol=0)


def test_trainable_lora_and_blocks_freeze_the_rest():
    model = build_model(tiny_model_config(route_every=2))
    add_adapters(model, 2, 4.0, ("qkv", "down"))
    freeze_for(model, "lora")
    training = {name for name, param in model.named_parameters() if param.requires_grad}
    assert training and all(".lora_" in name or ".router." in name for name in training)
    assert any(".lora_" in name for name in training) and any(".router." in name for name in training)
    model = build_model(tiny_model_config(route_every=0))
    freeze_for(model, "blocks:2-3")
    training = {name for name, param in model.named_parameters() if param.requires_grad}
    assert training == {name for name, _ in model.named_parameters()
                        if name.startswith(("blocks.2.", "blocks.3.", "norm.", "embed."))}  # tied head: embed


@pytest.mark.slow
def test_train_distill_with_lora_saves_a_plain_model_and_resumes_as_uninterrupted(trained_dense_run, corpus_file,
                                                                                   tmp_path):
    runner = CliRunner()
    common = ["train", "--init-from", str(trained_dense_run), "--dense", "--drop", "attention:1", "--data",
              str(corpus_file), "--batch-size", "2", "--eval-every", "2", "--eval-batches", "1", "--log-every", "1",
              "--objective", "distill", "--local-steps", "1", "--trainable", "lora", "--lora-rank", "2",
              "--device", "cpu"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    result = runner.invoke(app, [*common, "--max-steps", "3", "--out", str(straight)])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert "block_match" in records[0] and "distill_loss" in records[1] and "distill_loss" not in records[0]
    checkpoint = straight / "step-00000003"
    assert not [name for name in load_file(str(checkpoint / "model.safetensors")) if "lora" in name or "param" in name]
    adapters = load_file(str(checkpoint / ADAPTERS_FILE))
    assert adapters and all(name.endswith((".lora_a", ".lora_b")) for name in adapters)
    assert any(name.endswith(".lora_b") and tensor.abs().sum() > 0 for name, tensor in adapters.items())
    saved = json.loads((checkpoint / "config.json").read_text())
    assert saved["train"]["trainable"] == "lora" and saved["model"]["drop"] == "attention:1"

    result = runner.invoke(app, [*common, "--max-steps", "3", "--out", str(resumed)])  # the same 3 steps...
    assert result.exit_code == 0, result.output
    for step in ("step-00000003",):  # ...then resumed from step 2 of a second copy
        (resumed / step / "COMPLETE").unlink()
    result = runner.invoke(app, [*common, "--max-steps", "3", "--out", str(resumed), "--resume"])
    assert result.exit_code == 0, result.output
    want = load_model(straight).state_dict()
    got = load_model(resumed).state_dict()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-5, rtol=0, msg=name)
    assert result.output.count("\n") < 40


@pytest.mark.parametrize(("args", "says"), [
    (["--objective", "distill"], "--objective distill needs --init-from"),
    (["--init-from", "RUN", "--local-steps", "2"], "--local-steps is the local stage of --objective distill"),
    (["--init-from", "RUN", "--trainable", "blocks:2-9"], "--trainable blocks: block 9 is out of range"),
    (["--init-from", "RUN", "--trainable", "blocks:"], "--trainable blocks: no block named"),
    (["--init-from", "RUN", "--trainable", "lora", "--lora-targets", "q"], "--lora-targets must name some of"),
    (["--init-from", "RUN", "--trainable", "lora", "--lora-rank", "0"], "--lora-rank must be >= 1"),
    (["--init-from", "RUN", "--objective", "distill", "--distill-weight", "2"], "--distill-weight must be in [0, 1]"),
    (["--init-from", "RUN", "--objective", "distill", "--local-steps", "1"], "needs routed blocks or dropped"),
    (["--init-from", "RUN", "--router-warmup", "-1"], "--router-warmup must be >= 0"),
    (["--init-from", "RUN", "--router-warmup", "2"], "--router-warmup trains the routers of routed blocks"),
])
def test_bad_healing_flags_are_one_line_and_write_nothing(trained_dense_run, corpus_file, tmp_path, args, says):
    bad = tmp_path / "bad"
    args = [str(trained_dense_run) if arg == "RUN" else arg for arg in args]
    result = CliRunner().invoke(app, ["train", "--dense", "--data", str(corpus_file), "--max-steps", "1",
                                      "--out", str(bad), *args])
    assert result.exit_code == 2, result.output
    assert says in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not bad.exists()
