"""The options a variant owns. A model family (`--arch`) and a router kind (`--router`) declare theirs as a frozen
dataclass on their spec (`Family.options`, `RouterSpec.options`): each field is a flag, with its type, its default
and its docstring as the flag's help, and the dataclass's `__post_init__` checks the values, naming the flag.

ModelConfig holds the chosen family's and router's options as typed members (`family_options`, `router_options`);
config.json, --config files, sweep grids and the command line spell them flat, beside the model's own fields. This
module is that translation: which flat key belongs to which variant (`variant_fields`), the flat values split into
ModelConfig's fields and its two members (`split_flat`), and back (`flatten`).

A family's decoding options (`Family.decoding_options`: `modcli generate`'s --exit-threshold for --arch early-exit)
go the same way into GenerateConfig's one member, `family_decoding`: flat on the command line
(`decoding_fields`, `split_decoding`), built into the owning family's dataclass (`build_decoding`) and, once the
model is loaded, checked against its family (`decoding_for`).

Torch-free: configuration imports it before any model exists.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from modcli.config.validation import require
from modcli.errors import UserError
from modcli.models.families import FAMILIES
from modcli.models.routing.registry import ROUTER_KINDS

MEMBERS = {"family_options": ("arch", "--arch"), "router_options": ("router", "--router")}
"""ModelConfig's members holding a variant's options -> (the field choosing the variant, its flag)."""
DECODING_MEMBER = "family_decoding"
"""GenerateConfig's member holding the model family's decoding options."""


def variants(member: str) -> dict[str, type | None]:
    """Every registered variant of `member` (family_options: the families; router_options: the router kinds) and
    its options dataclass (None: it has none)."""
    specs = FAMILIES if member == "family_options" else ROUTER_KINDS
    return {name: spec.options for name, spec in specs.items()}


def variant_fields() -> dict[str, tuple[str, str, dataclasses.Field]]:
    """Every option of every registered variant, by its flat name: (member, variant name, the dataclass field).
    Read on each call: a family or router registered later (a test's toy) brings its options with it."""
    found: dict[str, tuple[str, str, dataclasses.Field]] = {}
    for member in MEMBERS:
        for name, options in variants(member).items():
            for field in dataclasses.fields(options) if options else ():
                found.setdefault(field.name, (member, name, field))
    return found


def variant_field_types() -> dict[str, Any]:
    """The annotated type of every variant option, by flat name (for the type checks of files)."""
    types: dict[str, Any] = {}
    for member in MEMBERS:
        for options in variants(member).values():
            if options:
                hints = typing.get_type_hints(options)
                types.update({f.name: hints[f.name] for f in dataclasses.fields(options) if f.name not in types})
    return types


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else dataclasses.MISSING


def split_flat(values: dict[str, Any], selector_defaults: dict[str, str]) -> dict[str, Any]:
    """Flat model values (config.json's model section, flags, a --config file) -> ModelConfig's keyword arguments:
    each variant option moves into its member, as a dict for ModelConfig to build. An option of a variant other
    than the one chosen is refused, one line naming both, unless it holds that option's default (a config.json
    saved before the options moved holds every variant's options flat). `selector_defaults`: the variant chosen
    where `values` names none (ModelConfig's default --arch and --router)."""
    kwargs = {key: value for key, value in values.items() if key not in MEMBERS}
    chosen = {member: values.get(selector, selector_defaults[selector]) for member, (selector, _) in MEMBERS.items()}
    members: dict[str, dict[str, Any]] = {member: dict(values.get(member) or {}) for member in MEMBERS}
    for key, (member, owner, field) in variant_fields().items():
        if key not in kwargs:
            continue
        value = kwargs.pop(key)
        options = variants(member).get(chosen[member])
        if options is not None and key in {f.name for f in dataclasses.fields(options)}:
            members[member][key] = value
            continue
        selector, flag = MEMBERS[member]
        require(value == _default(field), f"--{key.replace('_', '-')} is an option of {flag} {owner}, not of {flag} "
                                          f"{chosen[member]}")
    return {**kwargs, **{member: given for member, given in members.items() if given}}


def build_options(member: str, variant: str, given: Any) -> Any:
    """The member's value for the chosen variant: its options dataclass from `given` (a dict of flat values, an
    instance, or None for the defaults); None when the variant has no options."""
    options = variants(member).get(variant)
    selector, flag = MEMBERS[member]
    if options is None:
        require(not given, f"{flag} {variant} has no options of its own, got {given!r}")
        return None
    if isinstance(given, options):
        return given
    if given is None:
        return options()
    require(isinstance(given, dict), f"{member} must be {options.__name__} or its values, got {given!r}")
    names = {f.name for f in dataclasses.fields(options)}
    unknown = sorted(set(given) - names)
    require(not unknown, f"{flag} {variant} has no option {', '.join(unknown)}")
    return options(**given)


def decoding_fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """Every decoding option of every registered family, by its flat name: (the family's name, the dataclass field);
    read on each call, like `variant_fields`."""
    found: dict[str, tuple[str, dataclasses.Field]] = {}
    for name, spec in FAMILIES.items():
        for field in dataclasses.fields(spec.decoding_options) if spec.decoding_options else ():
            found.setdefault(field.name, (name, field))
    return found


def split_decoding(values: dict[str, Any]) -> dict[str, Any]:
    """Flat `modcli generate` values -> GenerateConfig's keyword arguments: the families' decoding options move into
    `family_decoding`, as a dict of the values given (`build_decoding` makes it the owner's dataclass)."""
    owned = decoding_fields()
    kwargs = {key: value for key, value in values.items() if key not in owned}
    given = {key: value for key, value in values.items() if key in owned}
    if given:
        kwargs[DECODING_MEMBER] = {**dict(values.get(DECODING_MEMBER) or {}), **given}
    return kwargs


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def build_decoding(given: Any) -> Any:
    """GenerateConfig.family_decoding from what it was given: None (none), an instance of a family's decoding options
    (kept), or flat values (a dict): the dataclass of the first registered family whose decoding options hold them
    all, which checks them."""
    if given is None or not isinstance(given, dict):
        require(given is None or any(type(given) is spec.decoding_options for spec in FAMILIES.values()),
                f"{DECODING_MEMBER} must be a family's decoding options or their values, got {given!r}")
        return given
    if not given:
        return None
    for spec in FAMILIES.values():
        options = spec.decoding_options
        if options is not None and set(given) <= {f.name for f in dataclasses.fields(options)}:
            return options(**given)
    owned = decoding_fields()
    unknown = sorted(set(given) - set(owned))
    require(not unknown, f"no model family has the decoding option {', '.join(_flag(name) for name in unknown)}")
    owners = sorted({owned[name][0] for name in given})
    raise UserError(f"{' and '.join(_flag(name) for name in given)} are decoding options of different families "
                    f"({', '.join(owners)}); give one family's")


def decoding_for(family: Any, kind: str, options: Any) -> Any:
    """`options` (GenerateConfig.family_decoding) as the decoding options of the loaded model's `family` (a Family;
    `kind`: the model in words); options of another family are one line, unless this family declares the same
    fields (then they are rebuilt as its own)."""
    if options is None or type(options) is family.decoding_options:
        return options
    values = flatten(options)
    if family.decoding_options is not None and set(values) <= {f.name for f in
                                                                dataclasses.fields(family.decoding_options)}:
        return family.decoding_options(**values)
    defaults = type(options)()
    changed = [f.name for f in dataclasses.fields(options) if getattr(options, f.name) != getattr(defaults, f.name)]
    flag = " / ".join(_flag(name) for name in changed[:1] or values)
    owner = next((name for name, spec in FAMILIES.items() if spec.decoding_options is type(options)),
                 type(options).__name__)
    article = "an" if owner[:1] in "aeiou" else "a"
    raise UserError(f"{flag} needs {article} {owner} model (modcli train --arch {owner}); this one is {kind}")


def flatten(options: Any) -> dict[str, Any]:
    """A member's options as flat values (nothing for None)."""
    return dataclasses.asdict(options) if options is not None else {}
