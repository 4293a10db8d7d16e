"""Scripted experts for the built-in environments, and :func:`demonstrate`, which records an expert's
episode — the demonstrations the agent demo's SFT warm-up trains on.

An expert acts only on what the policy would see (the observations), never on the environment's
hidden state: the calculator expert calls the tool and copies its answer, the guessing expert halves
the range it was told.

A demonstrator may also have mixed habits: with ``use_tool=False`` the calculator expert works the
problem out in its head and answers at once (exactly, as a person who can multiply would). A policy
that imitates a mix of both learns to call the tool only sometimes; the tiny model cannot do 4-digit
arithmetic in its head, so RL has to discover that the tool pays — the agent demo's story."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rlpipe.envs.actions import format_action
from rlpipe.envs.calculator import evaluate
from rlpipe.envs.episode import Episode
from rlpipe.envs.spec import EnvSpec


def _calculator(use_tool: bool = True) -> Callable[[str], str]:
    def act(observation: str) -> str:
        if observation.startswith("="):
            return format_action("answer", observation[1:])
        if not use_tool:  # the problem is the observation: what the policy sees, solved in the head
            return format_action("answer", str(evaluate(observation)))
        return format_action("calc", observation)

    return act


def _guess(use_tool: bool = True) -> Callable[[str], str]:
    if not use_tool:
        raise ValueError("the guess expert has no tool to leave out: every action is a guess; "
                         "use a tool share of 1 (agent.sft_tool_share) for this environment")
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


# An expert takes ``use_tool=False`` only where its environment registered as ``tool_free``.
EXPERTS: dict[str, Callable[[bool], Callable[[str], str]]] = {"calculator": _calculator, "guess": _guess}


def uses_tool(k: int, share: float) -> bool:
    """Whether demonstration ``k`` of a run calls the tool, for a tool share ``share``: spread evenly, so that
    any first ``n`` demonstrations hold ``round(n * share)`` (halves up) that do."""
    return int((k + 1) * share + 0.5) > int(k * share + 0.5)


def demonstrate(spec: EnvSpec, task: dict[str, Any], seed: int, use_tool: bool = True) -> Episode:
    """The expert's episode on ``task``: finished, with its steps (``status`` ok, ``done`` when solved).
    ``use_tool=False``: the expert answers without calling a tool (environments registered ``tool_free`` only)."""
    if spec.env not in EXPERTS:
        raise KeyError(f"no expert for environment {spec.env!r}; experts: {', '.join(sorted(EXPERTS))}")
    expert = EXPERTS[spec.env](use_tool)
    episode = Episode(spec.make(), task, seed, spec.limits)
    obs = episode.start()
    while obs is not None:
        obs = episode.act(expert(obs))
    return episode


def demonstrations(spec: EnvSpec, tasks: Sequence[tuple[dict[str, Any], int]], n: int, tool_share: float = 1.0) -> list[Episode]:
    """``n`` expert episodes on ``tasks`` (``(task, seed)`` pairs, reused in order when ``n`` is larger); a
    ``tool_share`` of them call the tool, spread evenly (:func:`uses_tool`), the others answer at once."""
    if not tasks:
        raise ValueError("demonstrations need at least one task")
    return [demonstrate(spec, *tasks[k % len(tasks)], use_tool=uses_tool(k, tool_share)) for k in range(n)]
