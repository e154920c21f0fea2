"""Routing for Mixture-of-Depths blocks: token selection (`selection`), the Router interface (`base`) and the
registered router kinds, one module each (`topk`, `random`, `threshold`), listed in `registry`.

A new router kind is one module with a `Router` subclass plus one line in `registry.ROUTERS`; the registry-wide
tests (tests/test_routers.py) then check it through every command. Importing this package (and the registry, which
configuration reads) does not import torch; the selection helpers are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from modcli.models.routing.registry import ROUTERS, RouterSpec, router_class

_SELECTION = ("Selection", "gather_tokens", "residual_update", "scatter_tokens", "select_capped", "select_causal",
              "select_topk", "topk_labels")


def __getattr__(name: str) -> Any:
    if name in _SELECTION:
        return getattr(importlib.import_module("modcli.models.routing.selection"), name)
    raise AttributeError(f"module 'modcli.models.routing' has no attribute {name!r}")


__all__ = ["ROUTERS", "RouterSpec", "router_class", *_SELECTION]
