"""Run config: one YAML file per run, parsed strictly into the Structs of this package.

* :mod:`~schemas.config.base`: the strict base Struct, :class:`ConfigError`, the named bounds;
* :mod:`~schemas.config.infra`, :mod:`~schemas.config.tasks`, :mod:`~schemas.config.training`:
  the sections, each field documented and its bounds declared as msgspec ``Meta`` constraints;
* :mod:`~schemas.config.run`: :class:`RunConfig` and the rules between values, in one list;
* :mod:`~schemas.config.parse`: YAML and ``--set`` overrides; :mod:`~schemas.config.explain`:
  msgspec's errors as one line naming the key, the value and what is allowed;
* :mod:`~schemas.config.redact`: secrets shown as ``***``.

How validation works: ``docs/architecture.md``, "Configuration and CLI". No I/O here.
"""

from schemas.config.base import (
    AboveOne,
    ConfigError,
    Device,
    FractionBelowOne,
    NonEmptyStr,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveFraction,
    PositiveInt,
    Section,
    UnitInterval,
)
from schemas.config.explain import explain_error
from schemas.config.infra import (
    KafkaSettings,
    PlacementConfig,
    ServicePlacement,
    StoreSettings,
    TrackingConfig,
)
from schemas.config.parse import apply_override, parse_config, parse_raw
from schemas.config.redact import REDACTED, SECRET_KEYS, redact_text, redact_url, redacted_dict, to_dict
from schemas.config.run import (
    RULES,
    RunConfig,
    RunSection,
    check_bounds,
    check_rules,
    check_tiny_spec,
    resolve_dtype,
)
from schemas.config.tasks import (
    REWARD_COMPONENTS,
    DataConfig,
    DomainConfig,
    EnvWorkersConfig,
    JudgeConfig,
    JudgeModelConfig,
    ModelConfig,
    RewardConfig,
    TinyModelSpec,
    reward_weights,
)
from schemas.config.training import AggMode, AlgorithmConfig, KLKind, NormType, RolloutConfig, TrainConfig

__all__ = [
    "REDACTED",
    "REWARD_COMPONENTS",
    "RULES",
    "SECRET_KEYS",
    "AboveOne",
    "AggMode",
    "AlgorithmConfig",
    "ConfigError",
    "DataConfig",
    "Device",
    "DomainConfig",
    "EnvWorkersConfig",
    "FractionBelowOne",
    "JudgeConfig",
    "JudgeModelConfig",
    "KLKind",
    "KafkaSettings",
    "ModelConfig",
    "NonEmptyStr",
    "NonNegativeFloat",
    "NonNegativeInt",
    "NormType",
    "PlacementConfig",
    "PositiveFloat",
    "PositiveFraction",
    "PositiveInt",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "RunSection",
    "Section",
    "ServicePlacement",
    "StoreSettings",
    "TinyModelSpec",
    "TrackingConfig",
    "TrainConfig",
    "UnitInterval",
    "apply_override",
    "check_bounds",
    "check_rules",
    "check_tiny_spec",
    "explain_error",
    "parse_config",
    "parse_raw",
    "redact_text",
    "redact_url",
    "redacted_dict",
    "resolve_dtype",
    "reward_weights",
    "to_dict",
]
