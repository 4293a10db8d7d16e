"""Reading a run config: the YAML file (with its ``extends:`` chain), ``--set dotted.key=value`` overrides, and
validation into a :class:`RunConfig` with every problem named by its YAML path."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from rlpipe.config.run import RunConfig
from rlpipe.yamlio import ConfigError, read_yaml, validate_model


def _parse_scalar(text: str) -> Any:
    # YAML rules, so `--set train.lr=1e-5` and `--set data.operations=[add,mul]` read as in the file.
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: list[str] | None, source: str = "--set") -> dict[str, Any]:
    """Apply ``dotted.key=value`` overrides to a raw config dict (before validation)."""
    raw = json.loads(json.dumps(raw))  # deep copy of plain data
    problems = []
    for item in overrides or []:
        if "=" not in item:
            problems.append((item, "an override is 'dotted.key=value'"))
            continue
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node = raw
        for p in parts[:-1]:
            if not isinstance(node.get(p, {}), dict):
                problems.append((key, f"'{p}' is not a section"))
                break
            node = node.setdefault(p, {})
        else:
            node[parts[-1]] = _parse_scalar(value)
    if problems:
        raise ConfigError(source, problems)
    return raw


def validate_raw(raw: Any, source: str = "<config>") -> RunConfig:
    return validate_model(RunConfig, raw, source)


def load_config(path: str | os.PathLike[str] | None, overrides: list[str] | None = None) -> RunConfig:
    """Read, override and validate a config. ``path=None`` gives the embedded defaults.

    A file may start from another with ``extends: base.yaml`` (relative to itself); its own keys
    are merged over the base's, section by section."""
    source = str(path) if path else "<defaults>"
    raw: Any = read_yaml(Path(path)) if path else {}
    if overrides:
        if not isinstance(raw, dict):
            raise ConfigError(source, [("", "the top level must be a mapping")])
        raw = apply_overrides(raw, overrides)
    return validate_raw(raw, source)
