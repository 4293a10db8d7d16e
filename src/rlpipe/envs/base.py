"""The environment protocol and its registry: what an environment is, and how it registers by name.

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

Looking an environment up by name, and the spec a run gives (:class:`rlpipe.envs.spec.EnvSpec`), live in
:mod:`rlpipe.envs.spec`, above the built-in environments, which register here when imported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel, Field

from rlpipe.envs.actions import InvalidAction, parse_action
from rlpipe.registry import Registry
from rlpipe.yamlio import Strict


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
    tool_free: ClassVar[bool]

    def reset(self, task: dict[str, Any], seed: int) -> str: ...

    def step(self, action: str) -> StepResult: ...


class NoParams(Strict):
    """An environment without parameters."""


# Environment classes by name. Look names up through rlpipe.envs.spec (env_class), which loads the built-ins.
ENVIRONMENTS: Registry[type] = Registry(
    "environment", fix="check the spelling, or import the module that registers it (@register_env) first")


def register_env(name: str, version: str, tools: tuple[str, ...] = (), tool_free: bool = False) -> Callable[[type], type]:
    """Register an environment class under ``name``; its ``Params`` model (default: none) types its
    parameters. Registering a name twice is an error.

    ``tool_free``: the environment's tasks can also be solved without calling its tools (its scripted expert
    can answer at once), so an SFT warm-up may mix in demonstrations without tool calls
    (``agent.sft_tool_share`` below 1)."""

    def deco(cls: type) -> type:
        ENVIRONMENTS.add(name, cls)  # first: a name taken twice raises before the class is changed
        cls.name, cls.version, cls.tools, cls.tool_free = name, version, tuple(tools), tool_free
        if not hasattr(cls, "Params"):
            cls.Params = NoParams
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


class EnvLimits(Strict):
    max_steps: int = Field(8, ge=1, le=1000, description="Steps (actions) per episode; an episode that reaches it is kept, flagged truncated.")
    episode_timeout_s: float = Field(
        120.0, gt=0, description="Wall-clock seconds per episode, counted from reset and checked after every step; "
        "an episode past it is kept, flagged truncated.")
