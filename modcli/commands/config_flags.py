"""Flags generated from config fields: a command lists which configs set its flags, and each field becomes one flag.

`@config_flags(run_flags)` gives the command, after its own parameters, one option per field of those configs:
`--field-name` (a switch `--x/--no-x` for a bool; comma-separated text for a list, or a repeated flag where the
field's `metadata["repeated"]`; the spelling in the field's `metadata["flag"]` where it differs), its help the
field's docstring, its default None ("not given": the config's own value stands). The command receives the values
given, by field name, as one dict: `flags`. A parameter the command declares itself wins over a generated one of
the same name (a CHECKPOINT argument, an --out whose help is the command's own).

A config in a torch-free module is read as a class (`flags_of`); one whose module imports torch is read as source
(`source_flags`), as its field docstrings are: `modcli --help` builds every command's flags and imports no torch.

The signature is built when the command line is read, not when the module is imported: a family or router kind
registered later (a test's toy) brings its options as flags. Typer reads a command's parameters from
`inspect.signature`, which honours `__signature__`, so the generated flags are ordinary typer options; litgpt builds
its command line from dataclasses the same way (with jsonargparse).

What is no flag: a field whose type is a mapping (rope_scaling), ModelConfig's variant-option members and
GenerateConfig's `family_decoding` (their fields are flags: `model_flags`, `decoding_flags`), and the names a group
leaves out.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from modcli.config import PRESETS, DataConfig, ModelConfig, TrainConfig, variant_fields
from modcli.config.files import list_item_type, parse_list_flag
from modcli.config.variant_options import DECODING_MEMBER, MEMBERS, decoding_fields, variants
from modcli.models.families import FAMILIES

_PRESET_FIELDS = {name for preset in PRESETS.values() for name in preset}
_PACKAGE = Path(__file__).resolve().parent.parent
_MEMBERS = {*MEMBERS, DECODING_MEMBER}
"""Fields holding a variant's options, whose own fields are the flags."""


@dataclasses.dataclass(frozen=True)
class ConfigFlag:
    """One flag generated from one config field."""

    name: str
    hint: Any
    """The field's type."""
    default: Any
    """The field's default (dataclasses.MISSING: none, or not a literal in the source)."""
    help: str
    """The field's docstring, on one line."""
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The field's metadata: `flag` (its spelling, where it differs from --field-name), `repeated` (a list given by
    repeating the flag instead of comma-separated text)."""

    def parameter(self) -> inspect.Parameter:
        """The keyword parameter typer reads: Optional[type] (text for a list), default None."""
        item = list_item_type(self.hint)
        repeated = item is not None and self.metadata.get("repeated", False)
        kind = list[item] if repeated else str if item is not None else _scalar(self.hint)
        declarations = self.metadata.get("flag") or (
            f"--{_dashed(self.name)}/--no-{_dashed(self.name)}" if kind is bool else f"--{_dashed(self.name)}")
        text = self.help
        if item is not None and not repeated:
            text += " Comma-separated."
        if self.default not in (None, dataclasses.MISSING) and self.name not in _PRESET_FIELDS and item is None:
            shown = (declarations.split("/")[0 if self.default else 1].removeprefix("--") if kind is bool and "/" in
                     declarations else self.default)
            text += f" [default: {shown}]"
        option = typer.Option(*declarations.split(" "), help=escape(text), show_default=False)
        return inspect.Parameter(self.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                 annotation=Annotated[Optional[kind], option])  # noqa: UP045 (typer reads it)


def _dashed(name: str) -> str:
    return name.replace("_", "-")


def _scalar(hint: Any) -> type:
    """The scalar type of a field (`float | None` -> float)."""
    arms = [arm for arm in typing.get_args(hint) if arm is not type(None)] if typing.get_args(hint) else [hint]
    return arms[0] if len(arms) == 1 and arms[0] in (bool, int, float, str) else str


def _is_flag(hint: Any) -> bool:
    arms = typing.get_args(hint) or (hint,)
    return not any(arm is dict or typing.get_origin(arm) is dict for arm in arms)


def flags_of(cls: type, leave_out: Iterable[str] = ()) -> list[ConfigFlag]:
    """A flag for every field of the dataclass `cls` (imported: a torch-free module) but those left out, mappings
    and the members holding a variant's options."""
    hints = typing.get_type_hints(cls)
    return [ConfigFlag(field.name, hints[field.name],
                       field.default if field.default is not dataclasses.MISSING else dataclasses.MISSING,
                       field_docstring(cls, field.name), field.metadata)
            for field in dataclasses.fields(cls)
            if field.name not in leave_out and field.name not in _MEMBERS and _is_flag(hints[field.name])]


_SOURCE_TYPES = {"list": list, "dict": dict, "str": str, "int": int, "float": float, "bool": bool, "None": None,
                 "Any": Any, "Path": Path}


def source_flags(module: str, class_name: str, leave_out: Iterable[str] = ()) -> list[ConfigFlag]:
    """`flags_of` for a config whose module imports torch (modcli/<module>): the class is read as source, not
    imported, so that `modcli --help` (which builds every command's flags) imports no torch. A field's type is its
    annotation evaluated over builtins (a name it does not know reads as text); its default and metadata are the
    literals the source gives."""
    node = next(node for node in ast.walk(_source_tree(str(_PACKAGE / module)))
                if isinstance(node, ast.ClassDef) and node.name == class_name)
    docstrings = _declared_docstrings(str(_PACKAGE / module))[class_name]
    flags = []
    for statement in node.body:
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        name = statement.target.id
        if name in leave_out or name in _MEMBERS or name not in docstrings:
            continue
        try:
            hint = eval(ast.unparse(statement.annotation), {"__builtins__": {}}, _SOURCE_TYPES)  # noqa: S307
        except (NameError, TypeError):
            hint = str
        default, metadata = _source_default(statement.value)
        if _is_flag(hint):
            flags.append(ConfigFlag(name, hint, default, " ".join(docstrings[name].split()).replace(
                "None = ", "default: "), metadata))
    return flags


def source_docstring(module: str, class_name: str, name: str) -> str:
    """The docstring of field `name` of class `class_name` in modcli/<module>, read as source, as one line of help;
    a field without one is a KeyError naming the class and file."""
    declared = _declared_docstrings(str(_PACKAGE / module)).get(class_name, {})
    if name not in declared:
        raise KeyError(f"{class_name} in modcli/{module} declares no documented field {name!r}")
    return " ".join(declared[name].split()).replace("None = ", "default: ")


def _source_default(value: ast.expr | None) -> tuple[Any, dict[str, Any]]:
    """A field's default and metadata as the source writes them: a literal, or `field(default=..., metadata=...)`."""
    if value is None:
        return dataclasses.MISSING, {}
    if isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", None)) == "field":
        keywords = {keyword.arg: keyword.value for keyword in value.keywords}
        metadata = _literal(keywords["metadata"], {}) if "metadata" in keywords else {}
        return (_literal(keywords["default"], dataclasses.MISSING) if "default" in keywords
                else dataclasses.MISSING), metadata
    return _literal(value, dataclasses.MISSING), {}


def _literal(value: ast.expr, otherwise: Any) -> Any:
    try:
        return ast.literal_eval(value)
    except ValueError:
        return otherwise


def model_flags(leave_out: Iterable[str] = ()) -> list[ConfigFlag]:
    """ModelConfig's fields and every registered family's and router kind's own options."""
    leave_out = set(leave_out)
    found = flags_of(ModelConfig, leave_out)
    for name, (member, variant, _) in variant_fields().items():
        if name not in leave_out and not any(flag.name == name for flag in found):
            found += [flag for flag in flags_of(variants(member)[variant]) if flag.name == name]
    return found


def decoding_flags() -> list[ConfigFlag]:
    """Every registered family's decoding options (`Family.decoding_options`): the flags of `modcli generate` that
    GenerateConfig gathers into `family_decoding`."""
    found: list[ConfigFlag] = []
    for name, (owner, _) in decoding_fields().items():
        found += [flag for flag in flags_of(FAMILIES[owner].decoding_options) if flag.name == name]
    return found


def run_flags() -> list[ConfigFlag]:
    """Everything `modcli train` sets: the model (with the variants' options), the data and the training."""
    return [*model_flags(), *flags_of(DataConfig), *flags_of(TrainConfig)]


@functools.cache
def _source_tree(path: str) -> ast.Module:
    return ast.parse(Path(path).read_text(encoding="utf-8"))


@functools.cache
def _declared_docstrings(path: str) -> dict[str, dict[str, str]]:
    """{class: {field: docstring}} of the classes in the source file `path`: a field is an annotated name followed
    by a string. Read with `ast`, not imported: `modcli --help` imports no torch."""
    classes = {}
    for node in ast.walk(_source_tree(path)):
        if isinstance(node, ast.ClassDef):
            classes[node.name] = {
                statement.target.id: following.value.value
                for statement, following in zip(node.body, node.body[1:], strict=False)
                if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)}
    return classes


def field_docstring(cls: type, name: str) -> str:
    """The docstring of field `name` of the dataclass `cls` as one line of help ("None = x" reads "default: x", a
    flag not given being None); a field without one is a KeyError naming the class and file."""
    for klass in cls.__mro__:
        path = inspect.getsourcefile(klass) if klass.__module__ != "builtins" else None
        declared = _declared_docstrings(path).get(klass.__name__, {}) if path else {}
        if name in declared:
            return " ".join(declared[name].split()).replace("None = ", "default: ")
    raise KeyError(f"{cls.__name__} in {inspect.getsourcefile(cls)} declares no documented field {name!r}")


class ConfigCommand:
    """A command whose signature is its own parameters and, after them, the generated flags of `groups`; called
    with them, it hands the given ones to the command as `flags` (a dict by field name)."""

    def __init__(self, command: Callable, groups: tuple[Callable[[], list[ConfigFlag]], ...]) -> None:
        functools.update_wrapper(self, command)
        self.command, self.groups = command, groups

    def flags(self) -> list[ConfigFlag]:
        own = set(inspect.signature(self.command).parameters)
        flags: dict[str, ConfigFlag] = {}
        for group in self.groups:
            for flag in group():
                if flag.name not in own:
                    flags.setdefault(flag.name, flag)
        return list(flags.values())

    @property
    def __signature__(self) -> inspect.Signature:
        own = inspect.signature(self.command, eval_str=True)
        parameters = [parameter for name, parameter in own.parameters.items() if name != "flags"]
        return own.replace(parameters=[*parameters, *(flag.parameter() for flag in self.flags())])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        given = {}
        for flag in self.flags():
            if flag.name not in kwargs:
                continue
            value = kwargs.pop(flag.name)
            if isinstance(value, (tuple, list)):  # a repeated flag: a list, and never given when empty
                value = list(value) or None
            elif isinstance(value, str) and (item := list_item_type(flag.hint)) is not None:
                value = parse_list_flag(flag.name, value, item)  # comma-separated text
            if value is not None:
                given[flag.name] = value
        return self.command(*args, **kwargs, flags=given)


def config_flags(*groups: Callable[[], list[ConfigFlag]]) -> Callable[[Callable], ConfigCommand]:
    """Decorator: the command gets one flag per field of each group (a function listing ConfigFlags, read when
    the command line is built) and receives the given ones as `flags`."""
    return lambda command: ConfigCommand(command, groups)
