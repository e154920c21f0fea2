"""RunConfig: a whole run (model, data, train), as a checkpoint's config.json holds it, and how a saved one is read
back: unknown keys refused, fields added since the run was saved given their old behaviour (LEGACY_DEFAULTS)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from modcli.config.data import DataConfig
from modcli.config.model import ModelConfig
from modcli.config.training import EXPERT_RECIPE, TrainConfig
from modcli.config.variant_options import variant_fields
from modcli.errors import UserError
from modcli.models.families import DEFAULT_FAMILY, FAMILIES
from modcli.models.routing.registry import ROUTER_KINDS

LEGACY_DEFAULTS: dict[str, dict[str, tuple[Any, Any]]] = {
    "model": {"expert_weight": ("probability", lambda model: model.get("experts", 0) > 0),
              "recursion_update": ("delta", lambda model: _family_owns(model, "recursion_update")),
              "attention_score": ("seen-by", lambda model: _reads_attention(model))},
    "train": {"expert_aux_sum": (False, lambda train: True),
              "expert_gate_lr_scale": (lambda train: train.get("router_lr_scale", TrainConfig.router_lr_scale),
                                       lambda train: True),
              "expert_capacity_warmup": (0, lambda train: True)},
}
"""Fields added after runs were saved whose new default changes what such a run computes: section -> field ->
(the old behaviour's value, or a function of the saved section giving it; which saved sections it applies to). A
config.json without the field (a run saved before it existed) reads it with that value (`RunConfig.read_saved`);
a new run, from flags, a preset or a TOML file, gets the field's default."""


def _family_owns(model: dict[str, Any], option: str) -> bool:
    """The saved model section's family (--arch) has `option` among its own options."""
    family = FAMILIES.get(model.get("arch", DEFAULT_FAMILY))
    return family is not None and family.options is not None and option in {f.name for f in fields(family.options)}


def _reads_attention(model: dict[str, Any]) -> bool:
    """The saved model section's router reads the attention maps of the block before (A-MoD)."""
    spec = ROUTER_KINDS.get(model.get("router", ModelConfig.router))
    return spec is not None and spec.reads_previous_attention


@dataclass
class RunConfig:
    """Everything `modcli train` needs, as saved in a checkpoint's config.json."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        # Defaults that depend on the model, resolved here so that config.json holds the value the run used (a copy:
        # the TrainConfig given may serve another model too).
        if self.train.expert_capacity_warmup is None:
            learned = self.model.experts > 0 and self.model.expert_routing == "learned"
            self.train = dataclasses.replace(
                self.train, expert_capacity_warmup=EXPERT_RECIPE["expert_capacity_warmup"] if learned else 0)

    def to_dict(self) -> dict[str, Any]:
        """The sections as config.json holds them: the model's variant options flat among its fields."""
        return {"model": self.model.flat(), "data": dataclasses.asdict(self.data),
                "train": dataclasses.asdict(self.train)}

    @classmethod
    def read_saved(cls, raw: dict[str, Any]) -> RunConfig:
        """A run config as a checkpoint's config.json holds it: a field the file lacks (saved before the field
        existed) takes its LEGACY_DEFAULTS value where there is one, so the old run computes what it computed."""
        sections = dict(raw)
        for section, legacy in LEGACY_DEFAULTS.items():
            values = sections.get(section, {})
            if isinstance(values, dict):
                sections[section] = {**{name: old(values) if callable(old) else old
                                        for name, (old, applies) in legacy.items()
                                        if name not in values and applies(values)}, **values}
        return cls.from_dict(sections)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunConfig:
        return cls(
            model=_build_model(raw.get("model", {})),
            data=_build(DataConfig, raw.get("data", {})),
            train=_build(TrainConfig, raw.get("train", {})),
        )


SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}
"""The sections of a run config (config.json's objects, a --config file's tables) and the dataclass of each."""


def _build_model(values: dict[str, Any]) -> ModelConfig:
    """The model section, flat: ModelConfig's fields and the variants' options (modcli.config.variant_options)."""
    names = {f.name for f in fields(ModelConfig)} | set(variant_fields())
    unknown = sorted(set(values) - names)
    if unknown:
        raise UserError(f"unknown ModelConfig key(s): {', '.join(unknown)}")
    return ModelConfig.of(**values)


def _build(cls: type, values: dict[str, Any]) -> Any:
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise UserError(f"unknown {cls.__name__} key(s): {', '.join(unknown)}")
    return cls(**values)
