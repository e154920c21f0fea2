"""Mixture-of-Experts MLPs and MoDE (staged: MoD router + MoE; integrated: no-op experts).

E = 1 with room for every token is the dense MLP; the static (training) and exact (evaluation) dispatches agree;
no-op experts never compute; the load-balancing loss matches an independent computation; the capacity drops the
right choices; the causal modes are causal; cached decoding equals the causal full forward; every command works.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

from modcli.cli import app
from modcli.config import ModelConfig, RunConfig
from modcli.models.cache import DecoderCache
from modcli.models.decoder import MoDDecoder, SwiGLU
from modcli.models.flops import counted_flops, mlp_flops
from modcli.models.moe import MoEMLP, balanced_hash_table, expert_capacity, hash_table, load_balancing_loss
from tests.conftest import tiny_model_config, tiny_run_config

ATOL = 1e-5
FAMILIES = {  # the three MoE models of the README table, tiny
    "moe": dict(experts=4, route_every=0),
    "staged": dict(experts=4, capacity=0.5),
    "integrated": dict(experts=4, router="integrated", noop_experts=2),
    "moe-hash": dict(experts=4, route_every=0, expert_routing="hash"),  # the expert: a fixed table of the token id
    "staged-hash": dict(experts=4, capacity=0.5, expert_routing="hash"),
}


def family_model(name: str, **overrides) -> MoDDecoder:
    torch.manual_seed(0)
    model = MoDDecoder(tiny_model_config(**FAMILIES[name], **overrides)).eval()
    with torch.no_grad():
        for module in model.modules():  # zero router biases: the causal rule passes about half the tokens
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.zero_()
    return model


def _moe(experts=4, top_k=1, capacity_factor=1.25, noop=0, d_model=16, hidden=24, weight="unit") -> MoEMLP:
    torch.manual_seed(0)
    moe = MoEMLP(d_model, hidden, experts, top_k, capacity_factor, noop, weight)
    with torch.no_grad():
        moe.down.normal_(std=0.1)
        moe.gate.weight.normal_(std=1.0)
    return moe


def test_one_expert_with_room_for_every_token_is_the_dense_swiglu_mlp():
    config = tiny_model_config(d_model=16, mlp_hidden=24)
    dense = SwiGLU(config)
    moe = MoEMLP(16, 24, experts=1, top_k=1, capacity_factor=1.0)
    with torch.no_grad():
        moe.gate_up[0].copy_(dense.gate_up.weight.T)
        moe.down[0].copy_(dense.down.weight.T)
    x = torch.randn(3, 10, 16)
    for training in (True, False):  # the static dispatch (training) and the exact one (evaluation)
        moe.train(training)
        torch.testing.assert_close(moe(x), dense(x), atol=ATOL, rtol=0)
        assert moe.stats.dropped.item() == 0


@pytest.mark.parametrize("top_k, noop", [(1, 0), (2, 0), (1, 3), (2, 2)])
def test_static_and_exact_dispatch_agree_when_no_choice_is_dropped(top_k, noop):
    moe = _moe(top_k=top_k, noop=noop, capacity_factor=100.0)
    x = torch.randn(2, 12, 16)
    moe.train()
    static = moe(x)
    assert moe.stats.dropped.item() == 0
    moe.eval()
    torch.testing.assert_close(static, moe(x), atol=ATOL, rtol=0)


@pytest.mark.parametrize("weight", ["unit", "probability"])
def test_the_update_is_the_chosen_experts_at_their_weight(weight):
    """--expert-weight probability: p_e x expert_e(x); unit: expert_e(x) itself (value 1)."""
    moe = _moe(top_k=2, noop=1, weight=weight).eval()
    x = torch.randn(1, 5, 16)
    probs = moe.gate(x).softmax(-1)[0]  # (5, 5)
    expected = torch.zeros(5, 16)
    for t in range(5):
        for e in probs[t].topk(2).indices.tolist():
            if e < moe.experts:  # a no-op expert adds nothing
                expected[t] += (probs[t, e] if weight == "probability" else 1.0) * moe.expert(e, x[0, t])
    torch.testing.assert_close(moe(x)[0], expected, atol=ATOL, rtol=0)


def test_the_unit_weight_passes_the_gradient_of_log_p_to_the_gate():
    """Value 1, yet the gate learns: d out / d logits equals that of p / p.detach() written out by hand."""
    unit, raw = _moe(capacity_factor=4.0, weight="unit").train(), _moe(capacity_factor=4.0, weight="probability").train()
    x = torch.randn(2, 6, 16)
    unit(x).sum().backward()
    probs, choice, weight = raw.route(x)
    by_hand = raw._static_dispatch(x, choice, weight / weight.detach(), 12)[0]  # (B, n, D), room for every token
    by_hand.sum().backward()
    assert unit.gate.weight.grad.abs().sum() > 0
    torch.testing.assert_close(unit.gate.weight.grad, raw.gate.weight.grad, atol=ATOL, rtol=1e-4)


def test_noop_experts_never_compute():
    moe = _moe(noop=2).eval()
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[moe.experts:, 0] = 1.0  # every token prefers a no-op expert when x[..., 0] > 0
    x = torch.randn(2, 10, 16)
    x[..., 0] = 5.0
    gate_flops, expert_flops = 2 * 20 * 16 * moe.pool, 2 * 16 * 2 * 24 + 2 * 24 * 16
    for training in (False, True):
        moe.train(training)
        counted = sum(counted_flops(lambda: moe(x)).values())
        if training:  # static shapes: each real expert's C slots over the batch, whoever fills them; none for no-ops
            assert counted == gate_flops + moe.experts * expert_capacity(20, 1, moe.pool, 1.25) * expert_flops
        else:  # evaluation: no expert runs at all
            assert counted == gate_flops
        assert torch.equal(moe(x), torch.zeros_like(x))
        assert moe.stats.noop.item() == 1.0
    moe.eval()
    x[0, 3, 0] = -5.0  # one token now picks a real expert: the experts do exactly one token of work
    counted = counted_flops(lambda: moe(x))
    assert sum(counted.values()) == gate_flops + expert_flops


def test_load_balancing_loss_matches_an_independent_computation():
    torch.manual_seed(1)
    logits = torch.randn(50, 6)
    probs = logits.softmax(-1)
    choice = probs.topk(2, dim=-1).indices
    share = [sum(int(e == i) for row in choice.tolist() for e in row) / (50 * 2) for i in range(6)]
    mean_prob = [sum(probs[t, i].item() for t in range(50)) / 50 for i in range(6)]
    expected = 6 * sum(f * p for f, p in zip(share, mean_prob, strict=True))
    assert load_balancing_loss(probs, choice).item() == pytest.approx(expected, rel=1e-6)
    uniform = torch.full((8, 4), 0.25)  # balanced routing gives exactly 1
    assert load_balancing_loss(uniform, torch.arange(8).remainder(4)[:, None]).item() == pytest.approx(1.0)


def test_capacity_counts_the_whole_batch():
    """Row 0's tokens all choose expert 0, row 1's expert 1: a per-sequence capacity of factor 1 (n / 2 slots per
    expert and row) would drop half the choices; over the batch (n slots per expert) none is dropped, and the
    static dispatch equals the exact one."""
    moe = _moe(experts=2, top_k=1, capacity_factor=1.0).train()
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[0, 0], moe.gate.weight[1, 0] = 1.0, -1.0
    x = torch.randn(2, 8, 16)
    x[0, :, 0], x[1, :, 0] = 3.0, -3.0
    assert expert_capacity(2 * 8, 1, 2, 1.0) == 8
    static = moe(x)
    assert moe.stats.dropped.item() == 0
    moe.eval()
    torch.testing.assert_close(static, moe(x), atol=ATOL, rtol=0)


def test_capacity_serves_positions_in_order_across_the_batch():
    """When one expert overflows, the earliest positions of every row are served first (not row 0 entirely)."""
    moe = _moe(experts=2, top_k=1, capacity_factor=0.5).train()
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[0, 0] = 1.0  # every token chooses expert 0
    x = torch.randn(2, 8, 16)
    x[..., 0] = 3.0
    assert expert_capacity(16, 1, 2, 0.5) == 4
    processed = (moe(x).abs().sum(-1) > 0).tolist()
    assert processed == [[True, True] + [False] * 6] * 2
    assert moe.stats.dropped.item() == pytest.approx(12 / 16)


def test_capacity_keeps_first_choices_first_then_earlier_positions():
    moe = _moe(experts=2, top_k=1, capacity_factor=0.5).train()
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[0, 0] = 1.0  # every token chooses expert 0
    x = torch.randn(1, 8, 16)
    x[..., 0] = 3.0
    capacity = expert_capacity(8, 1, 2, 0.5)  # ceil(0.5 * 8 / 2) = 2
    assert capacity == 2
    out = moe(x)
    processed = (out[0].abs().sum(-1) > 0).tolist()
    assert processed == [True, True] + [False] * 6  # the first two positions fill expert 0's two slots
    assert moe.stats.dropped.item() == pytest.approx(6 / 8)


@pytest.mark.parametrize("name", list(FAMILIES))
@torch.no_grad()
def test_causal_modes_are_causal(name):
    model = family_model(name)
    tokens = torch.randint(0, 256, (2, 24))
    changed = tokens.clone()
    changed[:, 15:] = torch.randint(0, 256, (2, 9))
    for mode in model.causal_modes() or ("dense",):
        a, b = model(tokens, mode), model(changed, mode)
        torch.testing.assert_close(a[:, :15], b[:, :15], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(FAMILIES))
@torch.no_grad()
def test_cached_decoding_equals_the_causal_full_forward(name):
    model = family_model(name)
    mode = (model.causal_modes() or ("dense",))[0]
    tokens = torch.randint(0, 256, (3, 30))
    full = model(tokens, mode)
    cache = DecoderCache.allocate(model.config, 3, 30, torch.device("cpu"))
    logits = [model(tokens[:, :10], mode, cache=cache)[:, -1]]
    for t in range(10, 30):
        logits.append(model.decode_step(tokens[:, t], cache, mode))
    torch.testing.assert_close(torch.stack(logits, dim=1), full[:, 9:], atol=1e-4, rtol=0)


def test_the_hash_table_is_balanced_over_the_vocabulary_and_the_same_for_every_run():
    table = hash_table(256, 4)
    assert table.dtype == torch.int64 and torch.equal(table, hash_table(256, 4))
    assert torch.bincount(table, minlength=4).tolist() == [64] * 4
    assert sorted(torch.bincount(hash_table(10, 3), minlength=3).tolist()) == [3, 3, 4]  # floor or ceil(V / E)
    assert not torch.equal(table, torch.arange(256) % 4)  # a random permutation, not neighbouring ids apart
    torch.manual_seed(5)
    first = MoDDecoder(tiny_model_config(**FAMILIES["moe-hash"]))
    torch.manual_seed(6)
    second = MoDDecoder(tiny_model_config(**FAMILIES["moe-hash"]))
    for a, b in zip(first.moe_blocks(), second.moe_blocks(), strict=True):
        assert torch.equal(a.hash_table, table) and torch.equal(b.hash_table, table)
        assert not hasattr(a, "gate")  # no gate parameters: the table decides
    assert "blocks.0.mlp.hash_table" in first.state_dict()  # it travels with the checkpoint


def test_the_balanced_table_gives_frequent_ids_their_own_experts_and_spreads_unseen_ids():
    counts = torch.tensor([50, 0, 30, 10, 10, 0, 0, 0, 5, 0])  # ids 0, 2 most frequent; five never seen
    table = balanced_hash_table(counts, 3)
    assert torch.equal(table, balanced_hash_table(counts, 3))  # deterministic: no seed, ties by id then expert
    assert table[0] != table[2]  # the two most frequent ids in different experts
    load = torch.zeros(3, dtype=torch.long).index_add_(0, table, counts).tolist()
    assert sorted(load) == [25, 30, 50]  # greedy: 50 | 30 | 10 + 10 + 5
    assert sorted(torch.bincount(table, minlength=3).tolist()) == [3, 3, 4]  # the unseen ids fill the id counts
    # the greedy bound: every expert's load is within the largest count of the mean
    counts = torch.randint(0, 1000, (300,), generator=torch.Generator().manual_seed(1))
    load = torch.zeros(4, dtype=torch.long).index_add_(0, balanced_hash_table(counts, 4), counts)
    assert (load - counts.sum() / 4).abs().max() <= counts.max()


def test_training_with_the_balanced_table_saves_it_and_resume_and_init_from_keep_it(tmp_path, corpus_file, monkeypatch):
    import numpy as np
    from safetensors.torch import load_file

    from modcli.config import DataConfig
    from modcli.data.corpus import load_corpus
    from modcli.training.loop import train

    base = tiny_run_config(corpus_file, tmp_path / "run", max_steps=2, eval_every=2)
    model = tiny_model_config(**FAMILIES["staged-hash"], hash_table="balanced")
    config = RunConfig(model=model, data=base.data, train=base.train)
    train(config, quiet=True)
    train_split = load_corpus(DataConfig(data=str(corpus_file)), model.seq_len).train
    counts = torch.from_numpy(np.bincount(train_split, minlength=model.vocab_size).astype(np.int64))
    expected = balanced_hash_table(counts, 4)
    assert not torch.equal(expected, hash_table(model.vocab_size, 4))
    saved = load_file(str(tmp_path / "run" / "step-00000002" / "model.safetensors"))
    tables = [name for name in saved if name.endswith("hash_table")]
    assert tables and all(torch.equal(saved[name], expected) for name in tables)
    assert json.loads((tmp_path / "run" / "step-00000002" / "config.json").read_text())["model"]["hash_table"] \
        == "balanced"

    def rebuild(*args):
        raise AssertionError("the table was rebuilt")

    monkeypatch.setattr("modcli.models.moe.balanced_hash_table", rebuild)
    resumed = RunConfig(model=model, data=base.data, train=dataclasses.replace(base.train, max_steps=3, resume=True))
    train(resumed, quiet=True)
    again = load_file(str(tmp_path / "run" / "step-00000003" / "model.safetensors"))  # the saved table, not rebuilt
    assert all(torch.equal(again[name], expected) for name in tables)
    # a conversion (--init-from) starts from the original's weights, its table among them
    converted = RunConfig(model=dataclasses.replace(model, capacity=0.25), data=base.data,
                          train=dataclasses.replace(base.train, max_steps=1, out=str(tmp_path / "converted"),
                                                    init_from=str(tmp_path / "run")))
    train(converted, quiet=True)
    weights = load_file(str(tmp_path / "converted" / "step-00000001" / "model.safetensors"))
    assert all(torch.equal(weights[name], expected) for name in tables)


@pytest.mark.parametrize("name", ["moe-hash", "staged-hash"])
@pytest.mark.parametrize("training", [False, True])
@torch.no_grad()
def test_hash_routing_sends_each_token_to_the_table_expert_of_its_id(name, training):
    """Every MoE block gets the ids of exactly the tokens it sees (a routed block: those it selected, gathered with
    its selection) and sends each to expert hash_table[id] at weight 1; nothing to balance (loss 0)."""
    model = family_model(name, expert_capacity_factor=100.0).train(training)  # room for every choice
    tokens = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(2))
    seen: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def remember(module, args, output, layer):
        seen[layer] = (args[0], args[1], output)

    hooks = [block.mlp.register_forward_hook(lambda m, a, o, layer=block.layer: remember(m, a, o, layer))
             for block in model.blocks]
    _, aux = model(tokens, return_aux=True)
    for hook in hooks:
        hook.remove()
    selected = {record.layer: record.selection.selected_idx for record in aux.records}
    assert (name == "staged-hash") == bool(selected)
    for block in model.blocks:
        x, ids, update = seen[block.layer]
        expected_ids = tokens.gather(1, selected[block.layer]) if block.layer in selected else tokens
        assert torch.equal(ids, expected_ids)  # (B, n): the ids of exactly the tokens in x
        moe = block.mlp
        _, choice, weight = moe.route(x, ids)
        assert torch.equal(choice[..., 0], moe.hash_table[ids]) and torch.equal(weight, torch.ones_like(weight))
        by_hand = torch.stack([torch.stack([moe.expert(int(e), x[b, t]) for t, e in enumerate(choice[b, :, 0])])
                               for b in range(x.shape[0])])  # (B, n, D)
        torch.testing.assert_close(update, by_hand, atol=ATOL, rtol=0)
        stats = aux.experts[block.layer]
        assert stats.aux_loss.item() == 0 and stats.dropped.item() == 0


def test_hash_routing_has_no_gate_flops_and_its_capacity_still_drops():
    """The table costs no gate FLOPs; capacity still holds in training: the table is balanced over the vocabulary,
    not over the data, so a batch of one id overflows its expert."""
    learned, hashed = (tiny_model_config(**FAMILIES["moe"]), tiny_model_config(**FAMILIES["moe-hash"]))
    assert mlp_flops(learned, 0, 64)[1] > 0 and mlp_flops(hashed, 0, 64)[1] == 0
    assert mlp_flops(learned, 0, 64)[0] == mlp_flops(hashed, 0, 64)[0]
    model = family_model("moe-hash").train()
    tokens = torch.full((2, 16), 7)  # every token chooses one expert: 1.25 x 32 / 4 = 10 slots of 32 choices
    _, aux = model(tokens, return_aux=True)
    assert all(stats.dropped.item() == pytest.approx(22 / 32) for stats in aux.experts.values())
    assert all(stats.load.max().item() == 1.0 for stats in aux.experts.values())


def test_a_hash_routed_moe_needs_the_token_ids():
    moe = MoEMLP(16, 24, 4, routing="hash", vocab_size=256)
    with pytest.raises(ValueError, match="needs the token ids"):
        moe(torch.randn(1, 3, 16))
    with pytest.raises(ValueError, match="top-1"):
        MoEMLP(16, 24, 4, top_k=2, routing="hash", vocab_size=256)


def test_integrated_mode_puts_noop_experts_only_in_the_routed_blocks_and_twins_drop_them():
    config = tiny_model_config(**FAMILIES["integrated"])
    model = MoDDecoder(config)
    assert config.dense and config.noop_layers() == [1, 3]  # no MoD router; no-op experts every other block
    assert [block.mlp.noop_experts for block in model.blocks] == [0, 2, 0, 2]
    assert config.kind.startswith("integrated MoDE")
    moe_twin, dense_twin = config.dense_twin(), config.dense_mlp_twin()
    assert moe_twin.kind == "MoE (E=4, top-1)" and dense_twin.kind == "dense"
    assert MoDDecoder(moe_twin).num_parameters() == model.num_parameters() - 2 * 2 * config.d_model
    # one expert's worth per token in the MoE blocks, 4/6 of one where 2 of the 6 choices are no-op experts
    per_expert = 3 * config.d_model * config.hidden
    dense_params = MoDDecoder(dense_twin).num_parameters()
    gates = 2 * config.d_model * 4 + 2 * config.d_model * 6
    assert model.active_parameters() == dense_params + gates - 2 * round(per_expert / 3)


def test_training_logs_expert_statistics_and_the_balancing_loss(tmp_path, corpus_file):
    from modcli.training.loop import train

    config = tiny_run_config(corpus_file, tmp_path / "run", max_steps=6, eval_every=6, log_every=3)
    config = RunConfig(model=tiny_model_config(**FAMILIES["integrated"]), data=config.data, train=config.train)
    result = train(config, quiet=True)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("expert_aux_loss" in r for r in records if "loss" in r)
    logged = next(r["experts"] for r in records if "experts" in r)
    assert set(logged) == {"block0", "block1", "block2", "block3"}
    assert logged["block0"]["noop"] == 0 and 0 <= logged["block1"]["noop"] <= 1
    assert 0 <= logged["block1"]["dropped"] <= 1 and len(logged["block1"]["load"]) == 6
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 6 and all(0 <= r["expert_dropped"] <= 1 for r in steps)  # every step, not every --log-every
    shares = [r["expert_dropped"] for r in steps]
    assert result.expert_dropped_mean == pytest.approx(sum(shares) / 6)
    assert result.expert_dropped_max == pytest.approx(max(shares))
    assert result.val_loss > 0


def test_the_capacity_warmup_drops_nothing_and_counts_its_flops(tmp_path, corpus_file):
    from modcli.training.loop import train
    from modcli.training.schedule import step_flops

    config = tiny_run_config(corpus_file, tmp_path / "run", max_steps=4, eval_every=4, expert_capacity_warmup=2)
    config = RunConfig(model=tiny_model_config(**FAMILIES["moe"], expert_capacity_factor=0.25), data=config.data,
                       train=config.train)
    result = train(config, quiet=True)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    dropped = [r["expert_dropped"] for r in records if "loss" in r]
    assert dropped[:2] == [0.0, 0.0] and min(dropped[2:]) > 0  # factor 0.25 must drop once the warm-up ends
    warm, steady = step_flops(config, step=1), step_flops(config)
    assert warm > steady and result.flops == 2 * warm + 2 * steady


def test_balancing_loss_is_summed_over_blocks_or_averaged_as_before():
    from modcli.config import TrainConfig
    from modcli.training.objective import training_loss

    torch.manual_seed(0)
    model = MoDDecoder(tiny_model_config(**FAMILIES["moe"])).train()
    tokens = torch.randint(0, 256, (2, 16))
    per_block = None
    for summed in (True, False):
        torch.manual_seed(1)
        objective = training_loss(model, tokens, tokens, TrainConfig(expert_aux_sum=summed))
        term = next(t for t in objective.terms if t.name == "expert_aux_loss")
        per_block = torch.stack([stats.aux_loss for stats in objective.aux.experts.values()])
        assert len(per_block) == 4 and term.weight == 0.01
        expected = per_block.sum() if summed else per_block.mean()
        torch.testing.assert_close(term.value, expected)


def test_expert_tensors_decay_and_the_gate_learns_at_its_own_lr_scale():
    from modcli.config import TrainConfig
    from modcli.training.schedule import make_optimizer

    model = MoDDecoder(tiny_model_config(**FAMILIES["staged"]))
    optimizer = make_optimizer(model, TrainConfig(router_lr_scale=0.5, expert_gate_lr_scale=0.2, weight_decay=0.1))
    names = {id(p): name for name, p in model.named_parameters()}
    group_of = {names[id(p)]: group for group in optimizer.param_groups for p in group["params"]}
    assert group_of["blocks.0.mlp.gate_up"]["weight_decay"] == 0.1 and group_of["blocks.0.mlp.down"]["weight_decay"] == 0.1
    assert group_of["blocks.0.mlp.gate_up"]["lr_scale"] == 1.0
    assert group_of["blocks.0.mlp.gate.weight"]["lr_scale"] == 0.2
    assert group_of["blocks.1.router.score.weight"]["lr_scale"] == 0.5
    assert group_of["blocks.0.attn_norm.weight"]["weight_decay"] == 0.0
    assert TrainConfig().expert_gate_lr_scale == 0.1 and TrainConfig().router_lr_scale == 1.0


def test_scales_of_one_keep_the_two_groups_and_equal_scales_share_one():
    from modcli.config import TrainConfig
    from modcli.training.schedule import make_optimizer

    model = MoDDecoder(tiny_model_config(**FAMILIES["staged"]))
    plain = make_optimizer(model, TrainConfig(expert_gate_lr_scale=1.0))
    assert [(g["weight_decay"], g["lr_scale"]) for g in plain.param_groups] == [(0.1, 1.0), (0.0, 1.0)]
    shared = make_optimizer(model, TrainConfig(router_lr_scale=0.5, expert_gate_lr_scale=0.5))
    assert [(g["weight_decay"], g["lr_scale"]) for g in shared.param_groups] == [
        (0.1, 1.0), (0.1, 0.5), (0.0, 1.0), (0.0, 0.5)]


def test_the_gate_lr_scale_flag_reaches_the_saved_config_and_the_gate_group(tmp_path, corpus_file):
    from modcli.checkpoint.store import read_config
    from modcli.training.schedule import make_optimizer

    result = CliRunner().invoke(app, [
        "train", "--data", str(corpus_file), "--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--seq-len", "32",
        "--batch-size", "2", "--max-steps", "1", "--eval-every", "1", "--eval-batches", "1", "--device", "cpu",
        "--dense", "--experts", "2", "--expert-gate-lr-scale", "0.25", "--out", str(tmp_path / "run"), "--json"])
    assert result.exit_code == 0, result.output
    saved = read_config(next((tmp_path / "run").glob("step-*")))
    assert saved.train.expert_gate_lr_scale == 0.25
    model = MoDDecoder(saved.model)
    optimizer = make_optimizer(model, saved.train)
    gate = model.blocks[0].mlp.gate.weight
    assert [group["lr_scale"] for group in optimizer.param_groups if any(p is gate for p in group["params"])] == [0.25]


def test_a_config_saved_before_the_gate_lr_scale_keeps_its_router_lr_scale_on_the_gate():
    saved = RunConfig(model=tiny_model_config(**FAMILIES["moe"])).to_dict()
    del saved["train"]["expert_gate_lr_scale"]
    assert RunConfig.read_saved(saved).train.expert_gate_lr_scale == 1.0
    saved["train"]["router_lr_scale"] = 0.3
    assert RunConfig.read_saved(saved).train.expert_gate_lr_scale == 0.3
    assert RunConfig.from_dict(saved).train.expert_gate_lr_scale == 0.1  # a new run's default


def test_a_config_saved_before_expert_weight_loads_with_the_probability_weight():
    saved = RunConfig(model=tiny_model_config(**FAMILIES["moe"])).to_dict()
    del saved["model"]["expert_weight"], saved["train"]["expert_aux_sum"]
    old = RunConfig.read_saved(saved)
    assert old.model.expert_weight == "probability" and old.train.expert_aux_sum is False
    new = RunConfig.from_dict(saved)
    assert new.model.expert_weight == "unit" and new.train.expert_aux_sum is True
    dense = RunConfig(model=tiny_model_config()).to_dict()
    del dense["model"]["expert_weight"]
    assert RunConfig.read_saved(dense).model.expert_weight == "unit"  # no experts: nothing to keep


def test_a_run_saved_before_expert_routing_loads_learned_and_computes_as_before(tmp_path):
    """A config.json without the field is a learned gate's; its checkpoint (a gate, no table) loads strictly and
    gives the logits it gave when saved."""
    from modcli.checkpoint.store import load_model_from, save_checkpoint

    model = family_model("staged")
    run = RunConfig(model=model.config)
    save_checkpoint(tmp_path, 1, model, None, run, {"step": 1}, keep=1)
    (saved_config,) = tmp_path.glob("step-*/config.json")
    saved = json.loads(saved_config.read_text())
    del saved["model"]["expert_routing"]
    saved_config.write_text(json.dumps(saved))
    loaded, config, _ = load_model_from(str(tmp_path), "cpu")
    assert config.model.expert_routing == "learned" and RunConfig.read_saved(saved).model.expert_routing == "learned"
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens, "router"), model(tokens, "router"), atol=0, rtol=0)


@pytest.fixture(scope="module")
def trained_families(tmp_path_factory, corpus_file) -> dict[str, str]:
    runs = {}
    for name in ("staged", "integrated", "staged-hash"):
        out = tmp_path_factory.mktemp("moe") / name
        args = ["train", "--data", str(corpus_file), "--out", str(out), "--d-model", "32", "--n-layers", "4",
                "--n-heads", "4", "--seq-len", "32", "--batch-size", "4", "--max-steps", "4", "--eval-every", "4",
                "--eval-batches", "1", "--device", "cpu", "--experts", "4", "--json"]
        args += {"staged": ["--capacity", "0.5"], "integrated": ["--router", "integrated", "--noop-experts", "2"],
                 "staged-hash": ["--capacity", "0.5", "--expert-routing", "hash"]}[name]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        runs[name] = str(out)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("name", ["staged", "integrated", "staged-hash"])
def test_every_command_works_with_mode(name, trained_families, tmp_path):
    runner, run = CliRunner(), trained_families[name]
    result = runner.invoke(app, ["eval", run, "--batches", "1", "--batch-size", "2", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    assert all(r["loss"] > 0 for r in json.loads(result.stdout)["results"])
    result = runner.invoke(app, ["generate", run, "--prompt", "def ", "--max-new-tokens", "5", "--device", "cpu",
                                 "--json"])
    assert result.exit_code == 0, result.output
    for compare in ("dense", "moe"):
        result = runner.invoke(app, ["profile", run, "--compare", compare, "--seq-len", "16", "--batch-size", "2",
                                     "--repeats", "1", "--warmup", "0", "--decode-tokens", "2", "--no-memory",
                                     "--device", "cpu", "--json"])
        assert result.exit_code == 0, result.output
        profiled = json.loads(result.stdout)
        baseline = profiled["baseline"]
        assert baseline["config"]["experts"] == (4 if compare == "moe" else 0)
        assert baseline["config"]["noop_experts"] == 0 and baseline["routed_layers"] == []
        assert profiled["model"]["active_parameters"] < profiled["model"]["parameters"]
        assert profiled["results"][0]["ratio"]["forward_latency"]["measured"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["staged", "integrated", "staged-hash"])
def test_onnx_graphs_equal_eager_pytorch(name, trained_families, tmp_path):
    from modcli.bundle.writer import ExportConfig, export

    result = export(ExportConfig(checkpoint=trained_families[name], out=str(tmp_path / "bundle"), provider="cpu",
                                 decode_steps=4))
    assert result.valid, result.failures
    assert {check.graph for check in result.checks} == {"forward", "decode"}


@pytest.mark.parametrize("args, message", [
    (["--noop-experts", "2", "--experts", "4"], "--noop-experts is an option of --router integrated"),
    (["--router", "integrated", "--experts", "4"], "--router integrated (integrated MoDE) needs --experts >= 1"),
    (["--router", "integrated", "--noop-experts", "1"], "needs --experts >= 1 and --noop-experts >= 1"),
    (["--experts", "4", "--expert-top-k", "5"], "--expert-top-k must be in 1..4"),
    (["--experts", "-1"], "--experts must be >= 0"),
    (["--experts", "4", "--expert-capacity-factor", "0"], "--expert-capacity-factor must be positive"),
    (["--experts", "4", "--expert-aux-weight", "-1"], "--expert-aux-weight must be >= 0"),
    (["--experts", "4", "--expert-weight", "half"], "--expert-weight must be one of unit, probability"),
    (["--experts", "4", "--expert-capacity-warmup", "-1"], "--expert-capacity-warmup must be >= 0"),
    (["--experts", "4", "--expert-gate-lr-scale", "0"], "--expert-gate-lr-scale must be positive"),
    (["--arch", "early-exit", "--expert-weight", "probability"], "--expert-weight: --arch early-exit has dense MLPs"),
    (["--experts", "4", "--expert-routing", "random"], "--expert-routing must be one of learned, hash"),
    (["--expert-routing", "hash"], "--expert-routing hash needs --experts >= 1"),
    (["--experts", "4", "--router", "integrated", "--noop-experts", "2", "--expert-routing", "hash"],
     "--expert-routing hash: integrated MoDE's gate chooses its no-op experts"),
    (["--experts", "4", "--expert-top-k", "2", "--expert-routing", "hash"],
     "--expert-routing hash chooses one expert per token: --expert-top-k must be 1"),
    (["--experts", "4", "--expert-weight", "probability", "--expert-routing", "hash"],
     "--expert-weight probability: hash routing has no gate"),
    (["--arch", "recursion", "--n-layers", "5", "--expert-routing", "hash"],
     "--expert-routing: --arch recursion has dense MLPs"),
    (["--arch", "early-exit", "--experts", "4", "--expert-routing", "hash"], "--arch early-exit has dense MLPs"),
    (["--experts", "4", "--hash-table", "balanced"], "--hash-table is an option of --expert-routing hash"),
    (["--experts", "4", "--expert-routing", "hash", "--hash-table", "sorted"],
     "--hash-table must be one of random, balanced"),
])
def test_bad_expert_flags_exit_2_with_one_line(args, message, tmp_path, corpus_file):
    result = CliRunner().invoke(app, ["train", "--data", str(corpus_file), "--out", str(tmp_path / "run"), *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_config_kind_names_each_family():
    assert ModelConfig(route_every=0).kind == "dense"
    assert ModelConfig().kind == "MoD topk, c=0.125"
    assert ModelConfig(experts=4).kind == "staged MoDE (MoD topk, c=0.125, E=4, top-1)"
    assert ModelConfig(experts=4, route_every=0, expert_routing="hash").kind == "MoE (E=4, top-1, hash)"


def test_a_new_learned_gate_run_gets_the_measured_recipe_and_hash_or_no_experts_no_warmup(tmp_path, corpus_file):
    """`modcli train --experts E` with default flags trains the gate at 0.1 x --lr with a 100-step capacity warm-up
    (docs/families.md: Switch's defaults dropped up to half the choices at a step); hash routing has no gate to
    warm up, a model without experts nothing to drop."""
    from modcli.checkpoint.store import read_config

    common = ["train", "--data", str(corpus_file), "--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--seq-len",
              "32", "--batch-size", "2", "--max-steps", "1", "--eval-every", "1", "--eval-batches", "1", "--device",
              "cpu", "--dense"]
    for name, flags, warmup in (("learned", ["--experts", "2"], 100),
                                ("hash", ["--experts", "2", "--expert-routing", "hash"], 0), ("dense", [], 0)):
        result = CliRunner().invoke(app, [*common, *flags, "--out", str(tmp_path / name), "--json"])
        assert result.exit_code == 0, result.output
        raw = json.loads(next((tmp_path / name).glob("step-*/config.json")).read_text())
        assert (raw["train"]["expert_gate_lr_scale"], raw["train"]["expert_capacity_warmup"]) == (0.1, warmup), name
        saved = read_config(next((tmp_path / name).glob("step-*")))
        assert (saved.train.expert_gate_lr_scale, saved.train.expert_capacity_warmup) == (0.1, warmup)
    assert json.loads(result.stdout)["expert_dropped_max"] is None  # the dense run
    # the flags still win
    result = CliRunner().invoke(app, [*common, "--experts", "2", "--expert-capacity-warmup", "0",
                                      "--expert-gate-lr-scale", "1", "--out", str(tmp_path / "switch")])
    assert result.exit_code == 0, result.output
    saved = read_config(next((tmp_path / "switch").glob("step-*")))
    assert (saved.train.expert_gate_lr_scale, saved.train.expert_capacity_warmup) == (1.0, 0)


def test_a_config_saved_before_the_recipe_loads_with_the_old_values():
    """A config.json without the fields (a run saved before them) reads Switch's old values: the gate at its
    --router-lr-scale, no capacity warm-up; so does modcli 0.1.0's run."""
    from pathlib import Path

    from modcli.checkpoint.store import read_config

    saved = RunConfig(model=tiny_model_config(**FAMILIES["moe"])).to_dict()
    assert (saved["train"]["expert_gate_lr_scale"], saved["train"]["expert_capacity_warmup"]) == (0.1, 100)
    del saved["train"]["expert_gate_lr_scale"], saved["train"]["expert_capacity_warmup"]
    old = RunConfig.read_saved(saved).train
    assert (old.expert_gate_lr_scale, old.expert_capacity_warmup) == (1.0, 0)
    legacy = read_config(Path(__file__).resolve().parents[1] / "fixtures" / "legacy_v0_1_0" / "run" / "step-00000003")
    assert (legacy.train.expert_gate_lr_scale, legacy.train.expert_capacity_warmup) == (1.0, 0)
