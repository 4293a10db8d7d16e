"""Scripted experts for the built-in environments, and :func:`demonstrate`, which records an expert's
episode — the demonstrations the agent demo's SFT warm-up trains on.

An expert acts only on what the policy would see (the observations), never on the environment's
hidden state: the calculator expert calls the tool and copies its answer, the guessing expert halves
the range it was told."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlpipe.envs.actions import format_action
from rlpipe.envs.base import EnvSpec
from rlpipe.envs.episode import Episode


def _calculator() -> Callable[[str], str]:
    def act(observation: str) -> str:
        return format_action("answer", observation[1:]) if observation.startswith("=") else format_action("calc", observation)

    return act


def _guess() -> Callable[[str], str]:
    state: dict[str, int] = {}

    def act(observation: str) -> str:
        if "-" in observation and observation.replace("-", "").isdigit():  # the first observation: "lo-hi"
            lo, hi = observation.split("-")
            state.update(lo=int(lo), hi=int(hi))
        elif observation == "higher":
            state["lo"] = state["last"] + 1
        elif observation == "lower":
            state["hi"] = state["last"] - 1
        state["last"] = (state["lo"] + state["hi"]) // 2
        return format_action("guess", str(state["last"]))

    return act


EXPERTS: dict[str, Callable[[], Callable[[str], str]]] = {"calculator": _calculator, "guess": _guess}


def demonstrate(spec: EnvSpec, task: dict[str, Any], seed: int) -> Episode:
    """The expert's episode on ``task``: finished, with its steps (``status`` ok, ``done`` when solved)."""
    if spec.env not in EXPERTS:
        raise KeyError(f"no expert for environment {spec.env!r}; experts: {', '.join(sorted(EXPERTS))}")
    expert = EXPERTS[spec.env]()
    episode = Episode(spec.make(), task, seed, spec.limits)
    obs = episode.start()
    while obs is not None:
        obs = episode.act(expert(obs))
    return episode
