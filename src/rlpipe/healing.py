"""Runs that heal themselves: what a crashed or failed RL run's flow run says about its failure, and whether to
relaunch it (the same run id, so it resumes after its last save point), pause its deployment, or leave it.

The orchestration side (``flows/heal.py``, started by the automation ``rlpipe-heal-failed-run``) reads the
failed ``rl-train`` flow run and the chain of relaunches before it, and acts; this module decides, without
Prefect, from the final state's type and message alone:

- **Crashed** (the process died; a process worker reports "Flow run infrastructure exited with non-zero status
  code N"): ``oom`` for 137 / 247 (a container's OOM kill, Prefect's hint for both); ``killed`` for -9 (SIGKILL:
  the kernel's OOM killer, a person, a preemption — a process worker cannot tell which, so -9 is not called an
  OOM); ``terminated`` for -15 / 143; ``exit:N`` for another code; ``crashed`` without one. All resumable.
- **Failed** (the flow raised): ``error:<Type>`` of the exception the message names; ``oom`` for a
  ``MemoryError``, torch's ``OutOfMemoryError`` or a "CUDA out of memory" message. Resumable unless the type
  is one a restart can only repeat (:data:`NOT_RESUMABLE`: a refused resume, a config or dataset error, a
  guard that stopped the run on purpose).

:func:`decide` then relaunches with exponential backoff, at most ``max_attempts`` times in a row, and pauses the
deployment once ``pause_after`` failures of the chain are of the same kind: a run that runs out of memory three
times will do so a fourth time, and the deployment's schedule and triggers would keep starting it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from rlpipe.yamlio import Strict

__all__ = ["NOT_RESUMABLE", "Decision", "Failure", "HealPolicy", "backoff_s", "classify", "decide"]

# Exceptions after which a relaunch can only fail the same way: a person must change something first.
NOT_RESUMABLE = {
    "ResumeRefused": "the resume was refused (the config or dataset changed): resume with allow_config_change, "
                     "or start a new run id",
    "ConfigError": "the config is invalid",
    "ValidationError": "the config or a parameter is invalid",
    "ParameterTypeError": "the flow's parameters are invalid",
    "SignatureMismatchError": "the flow's parameters do not match its signature",
    "DatasetInvalid": "the prompt set is invalid",
    "PromptFileError": "the prompt file is invalid",
    "PreferenceFileError": "the preference file is invalid",
    "NonFiniteUpdate": "a guard stopped the run (non-finite updates)",
    "RewardCircuitOpen": "a guard stopped the run (too many samples not scored)",
}
_OOM_TYPES = {"MemoryError", "OutOfMemoryError"}
_OOM_CODES = {137, 247}
_SIGNAL_CODES = {-9: "killed", -15: "terminated", 143: "terminated"}
_EXIT = re.compile(r"non-zero status code (-?\d+)")
_EXC = re.compile(r"encountered an exception:?\s*([A-Za-z_][\w.]*)(?::|\s|$)")
_OOM_TEXT = re.compile(r"out of memory|OutOfMemoryError|MemoryError", re.IGNORECASE)


class HealPolicy(Strict):
    """How a failed RL run is healed: the parameters of the heal flow (its deployment's defaults, prefect.yaml)."""

    max_attempts: int = Field(3, ge=0, description="Relaunches of one run in a row (each after a failure of the "
                              "relaunch before it); then the run is left failed. 0: never relaunch.")
    backoff_s: float = Field(30.0, ge=0, description="Delay before the first relaunch; each further one waits "
                             "twice as long as the one before …")
    backoff_max_s: float = Field(600.0, ge=0, description="… up to this delay.")
    pause_after: int | None = Field(3, ge=1, description="Pause the run's deployment, instead of relaunching, once "
                                    "this many failures of the chain are of the same kind (out of memory, killed, "
                                    "one exception type). null: never pause.")


@dataclass(frozen=True)
class Failure:
    """One failed flow run: its ``kind`` (``oom``, ``killed``, ``error:KeyError``…), whether a relaunch can resume
    it, and why, in words."""

    kind: str
    resumable: bool
    reason: str


@dataclass(frozen=True)
class Decision:
    """``relaunch`` (attempt ``attempt`` of the chain, after ``delay_s``), ``pause`` the deployment, ``give_up``
    (attempts spent), or ``skip`` (not resumable); ``reason`` says which rule decided."""

    action: Literal["relaunch", "pause", "give_up", "skip"]
    reason: str
    attempt: int = 0
    delay_s: float = 0.0


def classify(state_type: str, message: str | None) -> Failure:
    """The failure a flow run's final state (``CRASHED`` or ``FAILED``, and its message) records."""
    state_type, message = state_type.upper(), message or ""
    if state_type == "CRASHED":
        return _crashed(message)
    if state_type == "FAILED":
        return _failed(message)
    raise ValueError(f"state {state_type!r} is not a failure: only CRASHED and FAILED runs are healed")


def _crashed(message: str) -> Failure:
    m = _EXIT.search(message)
    code = int(m.group(1)) if m else None
    if code in _OOM_CODES:
        return Failure("oom", True, f"the process exited with {code} (out of memory)")
    if code in _SIGNAL_CODES:
        return Failure(_SIGNAL_CODES[code], True, f"the process exited with {code} (a signal)")
    if _OOM_TEXT.search(message):
        return Failure("oom", True, f"the run crashed out of memory: {_first_line(message)}")
    if code is not None:
        return Failure(f"exit:{code}", True, f"the process exited with {code}")
    return Failure("crashed", True, f"the run crashed: {_first_line(message) or 'no message'}")


def _failed(message: str) -> Failure:
    m = _EXC.search(message)
    name = m.group(1).rsplit(".", 1)[-1] if m else None
    if name in _OOM_TYPES or _OOM_TEXT.search(message):
        return Failure("oom", True, f"out of memory: {_first_line(message)}")
    if name in NOT_RESUMABLE:
        return Failure(f"error:{name}", False, f"{NOT_RESUMABLE[name]}: {_first_line(message)}")
    if name is None:
        return Failure("error", True, f"the run failed: {_first_line(message) or 'no message'}")
    return Failure(f"error:{name}", True, f"the run failed: {_first_line(message)}")


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:300] if text.strip() else ""


def backoff_s(attempt: int, policy: HealPolicy) -> float:
    """The delay before relaunch number ``attempt`` (1, 2, …): ``backoff_s`` × 2^(attempt−1), at most
    ``backoff_max_s``."""
    return min(policy.backoff_s * 2.0 ** max(attempt - 1, 0), policy.backoff_max_s)


def decide(chain: list[Failure], policy: HealPolicy) -> Decision:
    """What to do after the last failure of ``chain``: the failures of one run in a row, oldest first, each after
    the relaunch of the one before (``len(chain) - 1`` relaunches made so far)."""
    if not chain:
        raise ValueError("decide() needs the failure to act on: the chain is empty")
    last, made = chain[-1], len(chain) - 1
    if not last.resumable:
        return Decision("skip", f"not resumable: {last.reason}")
    same = sum(f.kind == last.kind for f in chain)
    if policy.pause_after is not None and same >= policy.pause_after:
        return Decision("pause", f"{same} of the run's {len(chain)} failures in a row were {last.kind} "
                        f"(pause_after={policy.pause_after}): {last.reason}")
    if made >= policy.max_attempts:
        return Decision("give_up", f"{made} relaunch(es) made, max_attempts={policy.max_attempts}: {last.reason}")
    attempt = made + 1
    return Decision("relaunch", f"{last.kind}: {last.reason}", attempt, backoff_s(attempt, policy))
