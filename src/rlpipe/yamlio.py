"""YAML files validated as strict pydantic models: the floor that run configs, environment specs and eval
suites stand on.

A leaf: it imports nothing from rlpipe, so any module may use it without an import cycle; and only pydantic at
import time (PyYAML when a file is read), so it loads inside an environment's sandbox.

- :class:`Strict`: the base of every model read from YAML. Unknown keys are errors.
- :func:`read_yaml`: a file with its ``extends:`` chain merged in.
- :func:`validate_model`: a parsed mapping as a model, or a :class:`ConfigError` listing every problem
  by its YAML path (``train.lr``, ``rollout.stop_tokens[2]``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = ["ConfigError", "Strict", "deep_merge", "read_yaml", "validate_model", "yaml_path"]


class ConfigError(ValueError):
    """A config that cannot be used. ``problems`` lists ``(yaml_path, message)`` pairs."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = problems
        lines = [f"{source}: {len(problems)} problem(s)"]
        lines += [f"  {path or '<root>'}: {msg}" for path, msg in problems]
        super().__init__("\n".join(lines))


class Strict(BaseModel):
    # Unknown keys are errors: a typo ("learning_rate" for "lr") must not silently fall back to a default.
    # Assignments are validated too, so a validator's rewrite of a field is checked like the file's value.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


_M = TypeVar("_M", bound=BaseModel)


def yaml_path(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as a YAML path: ``("a", "b", 2)`` → ``a.b[2]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def validate_model(model: type[_M], raw: Any, source: str) -> _M:
    """``raw`` (a parsed YAML mapping) as ``model``, or a :class:`ConfigError` listing every problem by its
    YAML path. Shared by run configs and the other YAML files validated like them (environment specs)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(source, [("", f"the top level must be a mapping, got {type(raw).__name__}")])
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(source, [_problem(err) for err in e.errors()]) from None


def _problem(err: Any) -> tuple[str, str]:
    """One pydantic error as ``(yaml_path, message)``."""
    # Errors inside validators of a nested model carry no field name of their own.
    loc = tuple(p for p in err["loc"] if p not in ("function-after", "function-before"))
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown key (check the spelling; see `rlpipe config schema`)"
    msg = msg.removeprefix("Value error, ")
    if msg.startswith("@"):  # a model validator naming the key it refuses: "@key@message"
        key, msg = msg[1:].split("@", 1)
        loc = (*loc, key)
    return yaml_path(loc), msg


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into ``base``, section by section (``over``'s keys win)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> Any:
    """A config file with its ``extends:`` chain merged in (the extending file's keys win)."""
    import yaml  # here, not at the top: environments' sandboxes import this module and carry pydantic, not PyYAML

    source = str(path)
    if not path.exists():
        where = f" (extended by {chain[-1]})" if chain else ""
        raise ConfigError(source, [("", f"file not found{where}")])
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(source, [("", f"not valid YAML: {e}")]) from None
    if not isinstance(raw, dict) or "extends" not in raw:
        return raw
    parent = raw.pop("extends")
    if not isinstance(parent, str):
        raise ConfigError(source, [("extends", "a path to the base config, relative to this file")])
    parent_path = (path.parent / parent).resolve()
    if parent_path in chain or parent_path == path.resolve():
        raise ConfigError(source, [("extends", f"circular: {' -> '.join(map(str, chain + (path, parent_path)))}")])
    base = read_yaml(parent_path, chain + (path.resolve(),))
    if not isinstance(base, dict):
        raise ConfigError(str(parent_path), [("", "the top level must be a mapping")])
    return deep_merge(base, raw)
