"""Recipe configuration: the typed schema and its loader (see ``schema`` and ``loader``)."""

from polyrl.core.config.checks import check_config
from polyrl.core.config.loader import (
    PACKAGED_RECIPES,
    apply_overrides,
    config_from_dict,
    dump_config,
    load_config,
    load_recipe_dict,
    packaged_recipes,
    resolve_recipe,
)
from polyrl.core.config.schema import (
    AlgorithmConfig,
    BackendConfig,
    DataConfig,
    DynamicSamplingConfig,
    LoraConfig,
    ModelConfig,
    OptimizerConfig,
    OverlongConfig,
    RolloutConfig,
    RolloutCorrectionConfig,
    RunConfig,
    ShardingConfig,
    TrainerConfig,
)

__all__ = [
    "PACKAGED_RECIPES",
    "AlgorithmConfig",
    "BackendConfig",
    "DataConfig",
    "DynamicSamplingConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimizerConfig",
    "OverlongConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "RunConfig",
    "ShardingConfig",
    "TrainerConfig",
    "apply_overrides",
    "check_config",
    "config_from_dict",
    "dump_config",
    "load_config",
    "load_recipe_dict",
    "packaged_recipes",
    "resolve_recipe",
]
