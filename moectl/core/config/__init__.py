"""The typed config and its checked conversion from plain data (YAML files: `moectl.core.config.load`)."""

from moectl.core.config.dicts import config_from_dict, config_to_dict
from moectl.core.config.dump import dump_config
from moectl.core.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    MixedPrecisionConfig,
    ModelConfig,
    MoEConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig", "Config", "DataConfig", "LoggingConfig", "MixedPrecisionConfig", "ModelConfig",
    "MoEConfig", "OptimizerConfig", "ParallelConfig", "TrainConfig", "config_from_dict", "config_to_dict",
    "dump_config",
]
