"""One episode of a policy in an environment, with its limits, its verdict, and the completeness check.

:class:`Episode` is a small state machine the multi-turn rollout drives: ``start()`` gives the first
observation, each ``act(action)`` the next one or ``None`` once the episode is over. It never raises
on the environment's behalf:

- the environment ends it (``done``): status ``ok``, reward = the sum of the step rewards;
- it reaches ``limits.max_steps`` or runs past ``limits.episode_timeout_s`` (wall clock from
  ``start``, checked after each step): status ``ok`` with ``truncated`` set — kept, and flagged;
- the environment raises (in ``reset`` or ``step``), or returns something that is no
  :class:`StepResult`: status ``error`` with the reason, reward ``None`` — excluded from the update
  and counted, never a 0.

What this does not do: pre-empt a step that hangs. In-process, a hung ``step`` hangs the caller; the
environment service runs each episode in its own sandboxed process, which is killed on a per-step
deadline.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from rlpipe.envs.base import EnvLimits, Environment, StepResult

EpisodeStatus = Literal["running", "ok", "error"]


@dataclass(frozen=True)
class Step:
    """One turn: the action, the environment's answer, its reward, and how long the environment took."""

    action: str
    observation: str
    reward: float
    env_s: float
    info: dict[str, Any] = field(default_factory=dict)


class Episode:
    def __init__(self, env: Environment, task: dict[str, Any], seed: int, limits: EnvLimits,
                 clock: Callable[[], float] = time.monotonic):
        self.env, self.task, self.seed, self.limits, self.clock = env, task, seed, limits, clock
        self.steps: list[Step] = []
        self.status: EpisodeStatus = "running"
        self.truncated = False
        self.done = False
        self.reason = ""
        self.first_observation: str | None = None
        self._start = 0.0

    def start(self) -> str | None:
        """The first observation, or ``None`` when the environment could not start (status ``error``)."""
        self._start = self.clock()
        try:
            obs = self.env.reset(self.task, self.seed)
        except Exception as e:  # noqa: BLE001 - the environment's fault, never the model's
            return self._fail(f"reset failed: {type(e).__name__}: {e}")
        if not isinstance(obs, str):
            return self._fail(f"reset returned {type(obs).__name__}, not an observation string")
        self.first_observation = obs
        return obs

    def act(self, action: str) -> str | None:
        """Apply one action; the next observation, or ``None`` when the episode is over."""
        if self.status != "running":
            raise RuntimeError(f"episode is over ({self.status}); no more actions")
        t0 = self.clock()
        try:
            result = self.env.step(action)
        except Exception as e:  # noqa: BLE001 - the environment's fault, never the model's
            return self._fail(f"step {len(self.steps) + 1} failed: {type(e).__name__}: {e}")
        bad = _malformed(result)
        if bad:
            return self._fail(f"step {len(self.steps) + 1} returned {bad}")
        now = self.clock()
        self.steps.append(Step(action, result.observation, float(result.reward), now - t0, dict(result.info)))
        if result.done:
            self.done, self.status = True, "ok"
        elif len(self.steps) >= self.limits.max_steps:
            self._truncate(f"reached max_steps={self.limits.max_steps}")
        elif now - self._start > self.limits.episode_timeout_s:
            self._truncate(f"ran past episode_timeout_s={self.limits.episode_timeout_s:g}")
        return result.observation if self.status == "running" else None

    @property
    def reward(self) -> float | None:
        """The episode's reward (sum of step rewards) once it ended ``ok``; ``None`` otherwise."""
        return sum(s.reward for s in self.steps) if self.status == "ok" else None

    @property
    def tool_calls(self) -> int:
        return sum(1 for s in self.steps if s.info.get("tool"))

    @property
    def tool_errors(self) -> int:
        return sum(1 for s in self.steps if s.info.get("tool_error"))

    def record(self) -> list[dict[str, Any]]:
        """The steps as the trajectory table's ``steps`` column stores them."""
        return [{"action": s.action, "observation": s.observation, "reward": s.reward, "env_s": s.env_s,
                 "info": json.dumps(s.info, sort_keys=True, default=str)} for s in self.steps]

    def cut(self, why: str) -> None:
        """End a running episode from outside (e.g. the rollout's context limit): kept, flagged truncated."""
        if self.status != "running":
            raise RuntimeError(f"episode is over ({self.status}); nothing to cut")
        self._truncate(why)

    def fail(self, why: str) -> None:
        """End a running episode as ``error`` from outside (a fault that is not the model's)."""
        if self.status != "running":
            raise RuntimeError(f"episode is over ({self.status}); nothing to fail")
        self._fail(why)

    def _truncate(self, why: str) -> None:
        self.status, self.truncated, self.reason = "ok", True, f"truncated: {why}"

    def _fail(self, why: str) -> None:
        self.status, self.reason = "error", f"environment {getattr(self.env, 'name', '?')}: {why}"
        return None


def _malformed(result: Any) -> str | None:
    """What is wrong with a step's result (the environment's fault), or None."""
    if not isinstance(result, StepResult):
        return f"{type(result).__name__}, not a StepResult"
    if not isinstance(result.observation, str):
        return f"an observation of type {type(result.observation).__name__}, not a string"
    if isinstance(result.reward, bool) or not isinstance(result.reward, (int, float)) or not math.isfinite(result.reward):
        return f"reward {result.reward!r}, not a finite number"
    if not isinstance(result.info, dict):
        return f"info of type {type(result.info).__name__}, not a mapping"
    return None


def completeness_problems(steps: list[dict[str, Any]], *, done: bool, truncated: bool, max_steps: int) -> list[str]:
    """What is wrong with a stored episode (empty when nothing): every step has an action, an
    observation and a finite reward; the episode ended by ``done`` or by its limit, never cut short in
    between; and it never holds more steps than its limit. Run on every episode before training."""
    problems = []
    for k, s in enumerate(steps):
        missing = [f for f in ("action", "observation") if not isinstance(s.get(f), str)]
        if missing:
            problems.append(f"step {k}: no {' / '.join(missing)}")
        r = s.get("reward")
        if not isinstance(r, (int, float)) or not math.isfinite(r):
            problems.append(f"step {k}: reward {r!r} is not a finite number")
    if len(steps) > max_steps:
        problems.append(f"{len(steps)} steps, more than max_steps={max_steps}")
    if done and truncated:
        problems.append("both done and truncated")
    if not done and not truncated:
        problems.append(f"ended after {len(steps)} step(s) without done or a limit: cut short abnormally")
    if not steps and (done or truncated):
        problems.append("no steps")
    return problems
