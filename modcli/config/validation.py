"""The checks every config shares: `require` (a failed check is one UserError naming the flag) and the type check of
config values read from files (`check_field_types`: a bool is no number, a number is finite, an int is no float)."""

from __future__ import annotations

import functools
import math
import types
import typing
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from modcli.errors import UserError


def require(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)



def check_field_types(cls: type, values: dict[str, Any], label: Callable[[str], str]) -> None:
    """Each value named like a field of the dataclass `cls` has that field's annotated type (a bool is no number, a
    number is finite, an int is no float); the first that does not is one UserError, "<label(name)> must be <type>,
    got <value>". Names that are not fields are left to the caller. The one type check of config files: run configs
    (`check_config_values`), `--config` TOML files (`load_toml`), sweep grids (modcli.sweep.grid)."""
    hints = field_types(cls)
    for name, value in values.items():
        if name in hints and not value_fits(value, hints[name]):
            raise UserError(f"{label(name)} must be {describe_type(hints[name])}, got {value!r}")


def field_types(cls: type) -> dict[str, Any]:
    """The dataclass's fields and their annotated types ({} when an annotation does not resolve here: the
    dataclass's own checks are then all there is); a class that is written flat (ModelConfig: `flat_field_types`)
    gives its flat keys."""
    flat = getattr(cls, "flat_field_types", None)
    return flat() if flat is not None else declared_field_types(cls)


@functools.cache
def declared_field_types(cls: type) -> dict[str, Any]:
    try:
        hints = typing.get_type_hints(cls)
    except Exception:
        return {}
    return {f.name: hints[f.name] for f in fields(cls) if f.name in hints}


def value_fits(value: Any, hint: Any) -> bool:
    """`value` (as JSON or TOML gives it) has the type `hint` (bool, int, float, str, list[...], dict, None, unions)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(value_fits(value, arm) for arm in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    if origin is list:
        return isinstance(value, list) and (not args or all(value_fits(v, args[0]) for v in value))
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    return True


def describe_type(hint: Any) -> str:
    """The type `hint` in words: "an integer", "a finite number or null", "true or false"."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(arm) for arm in args)
    names = {type(None): "null", bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}
    if hint in names:
        return names[hint]
    if origin is list:
        return f"a list of {describe_type(args[0])}s" if args else "a list"
    if origin is dict or hint is dict:
        return "an object"
    return getattr(hint, "__name__", str(hint))
