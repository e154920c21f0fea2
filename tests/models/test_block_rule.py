"""The routed-block rule (modcli.models.routing.block_rule) is stated once: capacity, keep-first and route part.

The execution paths call it instead of restating it, and the Hugging Face remote code (which cannot import modcli)
restates it in functions checked here against the module on every route part, keep_first value and a few lengths.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from modcli.config import ROUTE_PARTS as CONFIG_ROUTE_PARTS
from modcli.decode.graphs import capacity_from_length
from modcli.models.routing import block_rule
from modcli.models.routing.base import fraction
from modcli.models.routing.block_rule import (
    ROUTE_PARTS,
    capacity_tokens,
    capacity_tokens_in_graph,
    keep_first_decisions,
    keep_first_scores,
    route_part,
)
from modcli.models.routing.selection import select_topk
from tests.conftest import tiny_model_config

ROOT = Path(__file__).resolve().parents[2]
KEEP_FIRST = (0, 1, 3, 40)
LENGTHS = (1, 2, 7, 8, 15, 16, 33, 100)
CAPACITIES = (0.125, 0.25, 0.29, 0.5, 1 / 3, 1.0)


def _remote():
    pytest.importorskip("transformers")
    from modcli.bundle.hf.remote import modeling_modcli  # the file copied into the HF folder, as a module

    return modeling_modcli


def test_every_configurable_route_part_has_a_rule():
    assert ROUTE_PARTS == CONFIG_ROUTE_PARTS


@pytest.mark.parametrize("part", ROUTE_PARTS)
def test_route_part_names_the_routed_sublayers_and_what_every_token_runs(part):
    rule = route_part(part)
    assert rule.name == part and (rule.attention or rule.mlp)
    assert rule.before == (None if rule.attention else "attention")  # attention first, on every token
    assert rule.after == (None if rule.mlp else "mlp")  # the MLP last, on every token
    for shared in (rule.before, rule.after):  # a sublayer every token runs is a part of its own, not routed twice
        if shared is not None:
            assert not (route_part(shared).attention and rule.attention)
            assert not (route_part(shared).mlp and rule.mlp)
    config = tiny_model_config(route_part=part)
    layer = config.routed_layers()[0]
    assert config.attention_is_routed(layer) == rule.attention and config.mlp_is_routed(layer) == rule.mlp


@pytest.mark.parametrize("part", ROUTE_PARTS)
def test_the_remote_code_restates_the_route_part_rule(part):
    remote = _remote()
    assert set(remote.ROUTE_PARTS) == set(ROUTE_PARTS)
    rule = route_part(part)
    assert remote.ROUTE_PARTS[part] == (rule.attention, rule.mlp)


@pytest.mark.parametrize("keep_first", KEEP_FIRST)
@pytest.mark.parametrize("shape", [(3, 20), (3, 1), (4,)], ids=["prefill", "decode", "decode-graph"])
def test_the_remote_code_restates_keep_first(keep_first, shape):
    remote = _remote()
    generator = torch.Generator().manual_seed(keep_first)
    decisions = torch.rand(shape, generator=generator) < 0.3
    positions = (torch.arange(shape[-1]) if len(shape) == 2 and shape[1] > 1
                 else torch.randint(0, 6, shape, generator=generator))
    expected = keep_first_decisions(decisions, positions, keep_first)
    assert torch.equal(remote.keep_first_decisions(decisions, positions, keep_first), expected)
    forced = positions.expand_as(decisions) < keep_first
    assert torch.equal(expected, decisions | forced)  # the rule itself: the first positions always, else as decided


@pytest.mark.parametrize("keep_first", KEEP_FIRST)
@pytest.mark.parametrize("seq_len", (4, 16, 33))
def test_keep_first_scores_put_the_first_positions_in_every_top_k(keep_first, seq_len):
    scores = torch.randn(2, seq_len, generator=torch.Generator().manual_seed(seq_len))
    positions = torch.arange(seq_len)
    kept = keep_first_scores(scores, positions, keep_first)
    if keep_first == 0:
        assert kept is scores
    k = capacity_tokens(seq_len, 1, 4)
    chosen = select_topk(kept, k).selected_idx.tolist()
    for row in chosen:
        assert set(range(min(keep_first, k))) <= set(row)


@pytest.mark.parametrize("capacity", CAPACITIES)
def test_capacity_is_one_rule_in_python_in_the_graph_and_in_the_config(capacity):
    num, den = fraction(capacity)
    config = tiny_model_config(capacity=capacity)
    for seq_len in LENGTHS:
        k = capacity_tokens(seq_len, num, den)
        assert k == max(1, (seq_len * num) // den) and 1 <= k <= seq_len
        assert capacity_tokens_in_graph(torch.tensor(seq_len), num, den).item() == k
        assert capacity_from_length(torch.arange(seq_len), num, den) == k
        assert config.capacity_tokens(seq_len) == k


FILES_THAT_CALL_THE_RULE = ["modcli/models/decoder.py", "modcli/decode/graphs.py", "modcli/decode/static.py",
                            "modcli/bundle/hf/remote/modeling_modcli.py"]


@pytest.mark.parametrize("path", FILES_THAT_CALL_THE_RULE)
def test_execution_paths_do_not_branch_on_route_part_or_keep_first_themselves(path):
    source = (ROOT / path).read_text()
    if path.endswith("modeling_modcli.py"):  # its restatement of the rule (checked above) is the exception
        source = re.sub(r"\ndef keep_first_decisions\(.*?\n\n\n", "\n", source, flags=re.S)
    assert not re.search(r"""part\s*[!=]=\s*["']""", source), "compare route parts in block_rule only"
    assert not re.search(r"\bif\s+[\w.]*keep_first\b", source), "apply --keep-first through block_rule only"
    assert not re.search(r"<\s*[\w.]*keep_first\b", source), "apply --keep-first through block_rule only"


def test_the_rule_module_does_not_import_torch():
    """Configuration reads the rule (route parts): importing it must not cost `modcli --help` a torch import."""
    source = Path(block_rule.__file__).read_text()
    assert not re.search(r"^(import torch|from torch)", source, flags=re.M)
