"""Configuration: one dataclass per concern, validated in __post_init__ with messages naming the flag, the presets,
and the merge preset < TOML file < flags. Every name is importable from here (`from modcli.config import X`); the
modules hold them by concern:

- validation.py: `require` and the type check of values read from files (`check_field_types`, `value_fits`)
- model.py: ModelConfig, the decoder's shape and every model option (SHAPE_FIELDS)
- routing.py: RoutingLayout, ModelConfig's base: routing, expert and family checks and the layout they give
- data.py: DataConfig; training.py: TrainConfig, its choices and the MoE recipe (EXPERT_RECIPE)
- run.py: RunConfig (config.json), LEGACY_DEFAULTS for runs saved before a field existed, SECTIONS
- variant_options.py: a family's and a router kind's own options, flat on disk and in their members in ModelConfig
- presets.py: PRESETS
- files.py: run configs read from disk, --config TOML files, sweep-grid keys, `resolve_run_config`
"""

from __future__ import annotations

from modcli.config.data import DataConfig
from modcli.config.files import (
    FLAG_ONLY_KEYS,
    check_config_values,
    check_flag_types,
    flag_types,
    list_flags,
    load_toml,
    resolve_run_config,
)
from modcli.config.model import SHAPE_FIELDS, ModelConfig
from modcli.config.presets import PRESETS
from modcli.config.routing import (
    EXPERT_FIELDS,
    EXPERT_ROUTINGS,
    EXPERT_WEIGHTS,
    HASH_TABLES,
    MOD_ROUTING_FIELDS,
    ROUTE_PARTS,
    ROUTER_WEIGHTS,
    ROUTING_MODES,
    RoutingLayout,
)
from modcli.config.run import LEGACY_DEFAULTS, SECTIONS, RunConfig
from modcli.config.training import DEVICES, DTYPES, EXPERT_RECIPE, OBJECTIVES, TRAINABLE, TrainConfig
from modcli.config.validation import check_field_types, describe_type, field_types, require, value_fits
from modcli.config.variant_options import variant_fields
from modcli.models.routing.registry import ATTENTION_SCORES

__all__ = [
    "ATTENTION_SCORES", "DEVICES", "DTYPES", "EXPERT_FIELDS", "EXPERT_RECIPE", "EXPERT_ROUTINGS", "EXPERT_WEIGHTS",
    "FLAG_ONLY_KEYS", "HASH_TABLES", "LEGACY_DEFAULTS", "MOD_ROUTING_FIELDS", "OBJECTIVES", "PRESETS",
    "ROUTE_PARTS", "ROUTER_WEIGHTS", "ROUTING_MODES", "SECTIONS", "SHAPE_FIELDS", "TRAINABLE", "DataConfig",
    "ModelConfig", "RoutingLayout", "RunConfig", "TrainConfig", "check_config_values", "check_field_types",
    "check_flag_types", "describe_type", "field_types", "flag_types", "list_flags", "load_toml", "require", "resolve_run_config",
    "value_fits", "variant_fields",
]
