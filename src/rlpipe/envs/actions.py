"""The one action format of rlpipe's environments.

An action is the whole text of one policy turn, one call::

    NAME(ARGUMENT)

``NAME`` is a tool of the environment (``calc``, ``guess``) or ``answer``, which ends the episode
with a final answer. ``ARGUMENT`` is everything between the first ``(`` and the *last* ``)``, so it
may hold parentheses of its own (``calc((12+3)*4)``). Spaces around the call are ignored; any other
text before or after it makes the action invalid. The format is short on purpose: the tiny policies
trained here spell every character as a token.

An invalid action is the model's mistake: the environment answers with an observation that starts
with ``error:`` and says what was wrong, and the episode goes on (the step is counted).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_ACTION_CHARS = 256
_CALL = re.compile(r"\s*([a-z_][a-z0-9_]*)\((.*)\)\s*", re.DOTALL)
_INT = re.compile(r"[+-]?[0-9]{1,40}")  # ASCII digits only: str.isdigit() accepts "²", which int() refuses


@dataclass(frozen=True)
class Action:
    name: str
    argument: str


class InvalidAction(ValueError):
    """Why an action text is not a call; its message is the observation the model gets."""


def parse_action(text: str) -> Action:
    """``NAME(ARGUMENT)`` → :class:`Action`; anything else raises :class:`InvalidAction`."""
    if len(text) > MAX_ACTION_CHARS:
        raise InvalidAction(f"error: action longer than {MAX_ACTION_CHARS} characters")
    m = _CALL.fullmatch(text)
    if m is None:
        raise InvalidAction("error: expected NAME(ARGUMENT), e.g. calc(12*34) or answer(408)")
    return Action(m.group(1), m.group(2).strip())


def parse_int(text: str) -> int | None:
    """The integer an argument spells (``-12``, ``+7``), or None for anything else — never an exception,
    since the text is the model's."""
    return int(text) if _INT.fullmatch(text.strip()) else None


def format_action(name: str, argument: str) -> str:
    """The action text for a call (what SFT traces and tests write)."""
    return f"{name}({argument})"
