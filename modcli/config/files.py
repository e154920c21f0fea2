"""Config files: the type check of a run config read from disk (`check_config_values`), the keys and types a
--config TOML file or a sweep grid's table may hold (`flag_types`, `check_flag_types`), reading a --config file
(`load_toml`), and the merge preset < TOML file < flags into a validated RunConfig (`resolve_run_config`)."""

from __future__ import annotations

import tomllib
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from modcli.config.presets import PRESETS
from modcli.config.run import SECTIONS, RunConfig
from modcli.config.validation import check_field_types, describe_type, field_types, value_fits
from modcli.errors import UserError


def check_config_values(raw: Any, where: str | None = None) -> None:
    """Every value of a run config in dict form (RunConfig.to_dict, or a config.json) has its field's type, and
    every number is finite. `where` names the file in messages; without it, values are named as flags.

    The dataclasses' own checks (their __post_init__) then judge ranges; this catches what they let through (a
    string where a number belongs, NaN or infinity).
    """
    prefix = f"{where}: " if where else ""
    if not isinstance(raw, dict):
        raise UserError(f"{prefix}expected an object with model, data and train sections")
    for section, cls in SECTIONS.items():
        values = raw.get(section, {})
        if not isinstance(values, dict):
            raise UserError(f"{prefix}{section} must be an object, got {values!r}")
        check_field_types(cls, values, lambda name, section=section: f"{where}: {section}.{name}" if where
                          else f"--{name.replace('_', '-')}")


def _section_of(key: str) -> str:
    for section, cls in SECTIONS.items():
        if key in field_types(cls):
            return section
    raise UserError(f"unknown option {key!r} (flags and config keys use the same names)")


FLAG_ONLY_KEYS: dict[str, Any] = {"dense": bool, "preset": str}
"""Keys of a --config file that set no config field themselves: --dense (routing off) and --preset (the values the
file and the flags start from); a sweep grid's tables take dense."""


def list_item_type(hint: Any) -> type | None:
    """The item type of a list field (`list[int] | None` -> int), None for any other type."""
    arms = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    for arm in arms:
        if typing.get_origin(arm) is list:
            return (typing.get_args(arm) or (str,))[0]
    return None


def list_flags() -> dict[str, type]:
    """Flat keys of list fields, which a flag (and so a config file) may also spell as comma-separated text,
    "1,3,5": name -> item type."""
    hints = {name: hint for cls in SECTIONS.values() for name, hint in field_types(cls).items()}
    return {name: item for name, hint in hints.items() if (item := list_item_type(hint)) is not None}


def flag_types() -> dict[str, Any]:
    """Every key a --config file or a sweep grid's table may hold, and its type: the fields of the model (its
    variants' options flat among them), data and train configs, and FLAG_ONLY_KEYS. Read on each call: a variant
    registered later brings its options."""
    hints = {name: hint for cls in SECTIONS.values() for name, hint in field_types(cls).items()}
    for name in list_flags():
        hints[name] = typing.Union[hints[name], str]  # noqa: UP007 (a runtime union of a generic alias)
    return {**hints, **FLAG_ONLY_KEYS}


def parse_list_flag(name: str, text: str, item: type) -> list[Any]:
    """A list flag's comma-separated text ("1,3,5") as a list of its items: one line naming the flag if one is
    not of the item type."""
    try:
        return [item(part.strip()) for part in text.split(",") if part.strip()]
    except ValueError:
        kind = {int: "integers", float: "numbers"}.get(item, "values")
        raise UserError(f"--{name.replace('_', '-')} must be comma-separated {kind}, got {text!r}") from None


def check_flag_types(values: dict[str, Any], label: Callable[[str], str], alternatives: bool = False) -> None:
    """Each value of a flag-named key (`flag_types`) has its type; with `alternatives` (a sweep's [[variant]]), a
    list of values of that type lists alternatives. Keys that are no flag are left to the caller."""
    hints = flag_types()
    for name, value in values.items():
        hint = hints.get(name)
        if hint is None or value_fits(value, hint):
            continue
        if alternatives and isinstance(value, list) and value and all(value_fits(v, hint) for v in value):
            continue
        listed = " (or a list of alternatives)" if alternatives else ""
        raise UserError(f"{label(name)} must be {describe_type(hint)}{listed}, got {value!r}")


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config: flat keys named like the flags (dashes or underscores), or [model]/[data]/[train] tables
    of them, and `preset`. Every key must be a flag's, with that flag's type: one UserError naming the file and key."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config: no such file: {p}")
    try:
        raw = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"--config: {p} is not valid TOML: {exc}") from None
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            if key not in SECTIONS:
                raise UserError(f"--config {p}: unknown table [{key}]; the tables are [model], [data] and [train] "
                                "(or put the keys at the top)")
            flat.update({k.replace("-", "_"): v for k, v in value.items()})
        else:
            flat[key.replace("-", "_")] = value
    unknown = sorted(set(flat) - set(flag_types()))
    if unknown:
        raise UserError(f"--config {p}: unknown option {unknown[0]!r} (flags and config keys use the same names)")
    check_flag_types(flat, lambda name: f"--config {p}: {name}")
    if "preset" in flat and flat["preset"] not in PRESETS:
        raise UserError(f"--config {p}: preset must be one of {', '.join(PRESETS)}, got {flat['preset']!r}")
    return flat


def resolve_run_config(
    preset: str | None = "tiny", config_file: str | None = None, overrides: dict[str, Any] | None = None,
    default_preset: str | None = None,
) -> RunConfig:
    """Merge preset < TOML file < flags (flags win) into a validated RunConfig. `preset` is the command line's
    --preset (None: not given); without it the file's `preset` key chooses, then `default_preset` (None: no preset,
    the dataclasses' defaults)."""
    from_file = load_toml(config_file) if config_file else {}
    file_preset = from_file.pop("preset", None)
    if preset is None:
        preset = file_preset if file_preset is not None else default_preset
    merged: dict[str, Any] = {}
    if preset is not None:
        if preset not in PRESETS:
            raise UserError(f"--preset must be one of {', '.join(PRESETS)}, got {preset!r}")
        merged.update(PRESETS[preset])
    merged.update(from_file)
    merged.update({k: v for k, v in (overrides or {}).items() if v is not None})
    dense = merged.pop("dense", False)
    if not isinstance(dense, bool):  # a file's types are checked in load_toml; this is the library's caller
        raise UserError(f"--dense must be true or false, got {dense!r}")
    if dense:
        merged["route_every"], merged["route_layers"] = 0, None
    for name, item in list_flags().items():
        if isinstance(merged.get(name), str):  # the flag: "1,3,5"
            merged[name] = parse_list_flag(name, merged[name], item)
    merged.pop("preset", None)
    sections: dict[str, dict[str, Any]] = {"model": {}, "data": {}, "train": {}}
    for key, value in merged.items():
        sections[_section_of(key)][key] = value
    check_config_values(sections)  # a string where a number belongs (a TOML file), NaN, infinity: one line
    return RunConfig.from_dict(sections)
