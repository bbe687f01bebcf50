"""The resolved config as YAML text: what a run writes to `run_dir/config.yaml`."""

from __future__ import annotations

from moectl.core.config.dicts import config_to_dict
from moectl.core.config.schema import Config


def dump_config(cfg: Config) -> str:
    """The fully resolved config as YAML, readable back by `load_config`."""
    # PyYAML only when a run writes its config: the engine imports this module and must not load a YAML
    # parser just by being imported (the engine and checkpoint format stay free of the face's libraries).
    import yaml

    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=None)
