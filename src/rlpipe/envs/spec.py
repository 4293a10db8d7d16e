"""Environments as a run names them: lookup by name (with the built-ins loaded) and the environment spec, a
YAML file (``configs/envs/*.yaml``) validated like a run config.

It sits above the built-in environments (:mod:`rlpipe.envs.calculator`, :mod:`rlpipe.envs.guess`), which
register themselves in :data:`rlpipe.envs.base.ENVIRONMENTS` when imported: importing them here is what
makes their names known, with no import running back down to up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from rlpipe.envs import calculator, guess  # noqa: F401 - registering the built-ins is the import's effect
from rlpipe.envs.base import ENVIRONMENTS, EnvLimits, Environment
from rlpipe.yamlio import Strict, read_yaml, validate_model


def env_names() -> list[str]:
    """The registered environments' names."""
    return ENVIRONMENTS.names()


def env_class(name: str) -> type:
    """The environment class registered under ``name``; an unknown name is a ``KeyError`` listing the valid ones."""
    return ENVIRONMENTS.get(name)


def tool_free_envs() -> list[str]:
    """The environments whose tasks can be solved without their tools (registered with ``tool_free=True``)."""
    return [name for name in ENVIRONMENTS.names() if ENVIRONMENTS.get(name).tool_free]


class EnvSpec(Strict):
    """One environment as a run uses it: which one, its parameters and its limits."""

    env: str = Field(description="A registered environment name (`rlpipe.envs.env_names()`).")
    params: dict[str, Any] = Field(default_factory=dict, description="The environment's own parameters (its `Params` model).")
    limits: EnvLimits = Field(default_factory=EnvLimits)
    tools: list[str] | None = Field(None, description="The tools the policy may call: a subset of the environment's (default: all).")

    @model_validator(mode="after")
    def _known(self) -> "EnvSpec":
        try:
            cls = env_class(self.env)
        except KeyError as e:
            raise ValueError(f"@env@{e.args[0]}") from None
        try:
            cls.Params.model_validate(self.params)
        except ValidationError as e:  # the first problem, with its path under params
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            msg = "unknown parameter" if first["type"] == "extra_forbidden" else first["msg"].removeprefix("Value error, ")
            raise ValueError(f"@params{'.' + where if where else ''}@{msg} (environment {self.env!r})") from None
        unknown = sorted(set(self.tools or ()) - set(cls.tools))
        if unknown:
            raise ValueError(f"@tools@unknown tool(s) {unknown}; {self.env!r} offers {list(cls.tools)}")
        return self

    def make(self) -> Environment:
        """A fresh environment instance (one per episode)."""
        cls = env_class(self.env)
        env = cls(cls.Params.model_validate(self.params))
        if self.tools is not None:
            env.allowed_tools = tuple(self.tools)
        return env


def load_env_spec(path: str | Path) -> EnvSpec:
    """An environment spec from YAML (``extends:`` works as in run configs); every problem is reported
    with its YAML path, as :class:`rlpipe.yamlio.ConfigError`."""
    return validate_model(EnvSpec, read_yaml(Path(path)), str(path))
