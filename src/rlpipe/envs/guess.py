"""``guess``: find a secret integer with higher/lower feedback — an environment that needs several steps.

Episode: the observation is the range (``1-100``). Each ``guess(N)`` is answered ``higher``, ``lower`` or
``correct``; ``correct`` ends the episode with reward 1. Halving the range is the skill to learn: it
needs ⌈log2(hi − lo + 1)⌉ guesses at most (7 for 1–100) and about 5.8 on average, so a policy that
succeeds takes well over 3 steps per episode. An episode that runs out of steps is truncated with
reward 0. ``step_penalty`` (default 0) is subtracted per guess, as a per-step reward.
"""

from __future__ import annotations

import random
from typing import Any

from pydantic import Field

from rlpipe.envs.actions import parse_int
from rlpipe.envs.base import StepResult, TaskError, ToolEnvironment, register_env
from rlpipe.yamlio import Strict


class GuessParams(Strict):
    lo: int = Field(1, description="Smallest possible secret.")
    hi: int = Field(100, description="Largest possible secret.")
    step_penalty: float = Field(0.0, ge=0, le=1, description="Reward subtracted per guess (a per-step reward).")

    def model_post_init(self, _: Any) -> None:
        if self.hi <= self.lo:
            raise ValueError(f"hi ({self.hi}) must be above lo ({self.lo})")


@register_env("guess", version="1", tools=("guess",))
class Guess(ToolEnvironment):
    Params = GuessParams

    def draw(self, seed: int) -> dict[str, Any]:
        """The task ``reset(task={}, seed)`` would run, written out."""
        return {"secret": random.Random(seed).randint(self.params.lo, self.params.hi)}

    def reset(self, task: dict[str, Any], seed: int) -> str:
        lo, hi = self.params.lo, self.params.hi
        secret = task.get("secret")
        if secret is None:
            secret = random.Random(seed).randint(lo, hi)
        if type(secret) is not int or not lo <= secret <= hi:
            raise TaskError(f"task field 'secret' = {secret!r}: must be an integer in {lo}..{hi}")
        self.secret, self.started = secret, True
        return f"{lo}-{hi}"

    def call(self, tool: str, argument: str) -> StepResult:
        info = {"tool": "guess", "tool_error": False}
        n, penalty = parse_int(argument), -self.params.step_penalty
        if n is None:
            return StepResult(f"error: guess needs an integer, got {argument!r}", info=info | {"tool_error": True})
        if n == self.secret:
            return StepResult("correct", reward=1.0 + penalty, done=True, info=info)
        return StepResult("higher" if n < self.secret else "lower", reward=penalty, info=info)
