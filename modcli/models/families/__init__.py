"""Model families (`--arch`): the one extension point for a decoder family, in the manner of torchtitan's ModelSpec.

A family is a `Family` (modcli.models.families.base) registered here by name. The spec (torch-free) owns the
family's decoder class, its own ModelConfig fields and their validation, its routing layout and FLOP-relevant token
counts, its description, which auxiliary losses its objective adds, how it decodes and what `modcli export` does
with it. Its decoder (a MoDDecoder subclass) returns its auxiliary outputs from `forward` (`ForwardAux`), which the
training objective turns into the declared losses. Adding a family is a spec module, a decoder module and one
`register` call; tests/models/test_families.py registers a toy family in the test alone.
"""

from __future__ import annotations

from modcli.models.families.base import Family
from modcli.models.families.early_exit import EARLY_EXIT
from modcli.models.families.recursion import RECURSION

FAMILIES: dict[str, Family] = {}
"""Every --arch value, the default first."""


def register(spec: Family) -> Family:
    """Add a family under its name (a later registration of the same name replaces it)."""
    FAMILIES[spec.name] = spec
    return spec


def family(name: str) -> Family:
    return FAMILIES[name]


MOD = register(Family(
    "mod", "modcli.models.decoder:MoDDecoder",
    "Mixture-of-Depths decoder (dense with --dense / --route-every 0; MoE and MoDE with --experts)",
    static_drops=True, gemma_traits=True))
register(EARLY_EXIT)
register(RECURSION)
DEFAULT_FAMILY = MOD.name


