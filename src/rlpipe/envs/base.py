"""The environment protocol, its registry, and environment specs (YAML files validated like run configs).

An environment is a class registered by name with :func:`register_env`. It is built from its
``Params`` (a strict pydantic model: an unknown or mistyped parameter is an error naming its YAML path)
and answers two calls:

- ``reset(task, seed) -> observation``: start an episode on ``task`` (a mapping of the
  environment's own task fields, e.g. ``{"expression": "1234*5678"}``; empty means "draw one from
  ``seed``"). The same task and seed give the same episode.
- ``step(action) -> StepResult``: the policy's action text (see :mod:`rlpipe.envs.actions`) in; the
  next observation, this step's reward, whether the episode is over, and ``info`` out.

**The verdict rule, for episodes.** An action the environment cannot use (bad syntax, an unknown
tool, a tool error on the model's input) is the *model's* fault: it becomes an observation saying
what was wrong, and the episode goes on. An environment that raises is *its own* fault:
:class:`rlpipe.envs.episode.Episode` ends the episode with status ``error`` (excluded from the
update and counted), never reward 0. A task the environment cannot run raises :class:`TaskError`
from ``reset``, naming the field and the fix — also ``error``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rlpipe.envs.actions import InvalidAction, parse_action


class TaskError(ValueError):
    """A task an environment cannot run (the task's fault, not the model's): the episode is ``error``."""


@dataclass(frozen=True)
class StepResult:
    """What one ``step`` gives back. ``reward`` is this step's; an episode's reward is their sum."""

    observation: str
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    name: ClassVar[str]
    version: ClassVar[str]
    tools: ClassVar[tuple[str, ...]]

    def reset(self, task: dict[str, Any], seed: int) -> str: ...

    def step(self, action: str) -> StepResult: ...


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NoParams(_Strict):
    """An environment without parameters."""


_REGISTRY: dict[str, type] = {}


def register_env(name: str, version: str, tools: tuple[str, ...] = ()) -> Callable[[type], type]:
    """Register an environment class under ``name``; its ``Params`` model (default: none) types its
    parameters. Registering a name twice is an error."""

    def deco(cls: type) -> type:
        if name in _REGISTRY:
            raise ValueError(f"environment {name!r} is registered twice ({_REGISTRY[name].__qualname__}, {cls.__qualname__})")
        cls.name, cls.version, cls.tools = name, version, tuple(tools)
        if not hasattr(cls, "Params"):
            cls.Params = NoParams
        _REGISTRY[name] = cls
        return cls

    return deco


class ToolEnvironment:
    """A base for environments whose every action is a call in the one action format
    (:mod:`rlpipe.envs.actions`): it parses the action, answers a malformed one or a tool the spec does
    not offer with an ``error:`` observation (the model's mistake; the episode goes on), and hands the
    rest to ``call(tool, argument)`` or, where the environment takes final answers, ``answer(argument)``."""

    takes_answer: ClassVar[bool] = False

    def __init__(self, params: BaseModel):
        self.params = params
        self.allowed_tools: tuple[str, ...] = self.tools
        self.started = False

    def step(self, action: str) -> StepResult:
        if not self.started:
            raise RuntimeError(f"{self.name}: step() before reset()")
        try:
            act = parse_action(action)
        except InvalidAction as e:
            return StepResult(str(e), info={"tool_error": True})
        if act.name == "answer" and self.takes_answer:
            return self.answer(act.argument)
        if act.name not in self.allowed_tools:
            offered = ", ".join(self.allowed_tools + (("answer",) if self.takes_answer else ()))
            return StepResult(f"error: unknown tool {act.name!r}; tools: {offered}", info={"tool": act.name, "tool_error": True})
        return self.call(act.name, act.argument)

    def call(self, tool: str, argument: str) -> StepResult:
        raise NotImplementedError

    def answer(self, argument: str) -> StepResult:
        raise NotImplementedError


def env_names() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def env_class(name: str) -> type:
    _load_builtins()
    if name not in _REGISTRY:
        raise KeyError(f"unknown environment {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def _load_builtins() -> None:
    from rlpipe.envs import calculator, guess  # noqa: F401 - registering is the import's effect


class EnvLimits(_Strict):
    max_steps: int = Field(8, ge=1, le=1000, description="Steps (actions) per episode; an episode that reaches it is kept, flagged truncated.")
    episode_timeout_s: float = Field(
        120.0, gt=0, description="Wall-clock seconds per episode, counted from reset and checked after every step; "
        "an episode past it is kept, flagged truncated.")


class EnvSpec(_Strict):
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
    with its YAML path, as :class:`rlpipe.config.ConfigError`."""
    from rlpipe.config import read_yaml, validate_model

    return validate_model(EnvSpec, read_yaml(Path(path)), str(path))
