"""Configuration machinery: typed sections, YAML files, dotted overrides, readable errors.

Component configs live beside their components; this package only knows how to
load, override, validate and dump them.
"""

from ferry.config.errors import ConfigError, UserError
from ferry.config.loader import apply_override_mapping, apply_overrides, dump_yaml, load_config, parse_override
from ferry.config.section import Section, check_unique_names

__all__ = [
    "ConfigError",
    "UserError",
    "Section",
    "apply_override_mapping",
    "check_unique_names",
    "apply_overrides",
    "dump_yaml",
    "load_config",
    "parse_override",
]
