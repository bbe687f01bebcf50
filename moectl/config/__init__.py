"""Config schema and loading: `load_config(path, overrides) -> Config`."""

from moectl.config.load import config_from_dict, config_to_dict, dump_config, load_config
from moectl.config.schema import (
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
    "MoEConfig", "OptimizerConfig", "ParallelConfig", "TrainConfig",
    "config_from_dict", "config_to_dict", "dump_config", "load_config",
]
