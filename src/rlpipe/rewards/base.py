"""The verifier protocol: ``verify(response, ground_truth, **options) -> VerifyResult``; never raises on model output.

**The verdict rule.** ``ok`` means the verifier judged the *model's output*: a wrong answer, a
program that crashes, loops past its own budget or prints garbage is ``reward 0 / ok``. Whatever
is the fault of the reference, the verifier, the sandbox or a service — an unparseable or empty
ground truth, an internal timeout or exception, a sandbox that is unavailable or lost its
launcher, a service that is down — is ``error`` / ``timeout`` / ``skipped`` with a reason, never
a 0 reward. An empty or unreadable model answer is the model's failure too (0 / ``ok``): were it
excluded, a policy could escape every penalty by answering nothing. The built-in verifiers never
use ``unparseable``; it stays in the schema for plugins and old data.

Each verifier declares:

- ``budget_s(ground_truth, **options)``: the longest it may legitimately take on that item. The
  pool's hard per-sample deadline is this plus a grace period, so the pool never pre-empts a
  verdict the verifier would have given.
- ``check_reference(ground_truth, **options)``: ``None`` when the reference is usable, else what
  is wrong with it and how to fix it (``rlpipe data validate`` runs this on every row).
- ``options``: the keyword options it accepts (e.g. ``code``'s ``scoring``); anything else is an
  error when the pool is built, not a silent no-op.
- ``sandboxed``: it executes model-written code in :mod:`rlpipe.sandbox`; a run that uses it must
  meet its ``reward.sandbox_min_level`` and records the level on every row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from rlpipe.registry import Registry

Status = Literal["ok", "unparseable", "timeout", "error", "skipped"]

DEFAULT_BUDGET_S = 5.0


@dataclass(frozen=True)
class VerifyResult:
    """``reward`` is meaningful only when ``status == "ok"``; other statuses are left out of updates.

    ``isolation`` is the sandbox level the verdict was produced at (verifiers that run code), else None.
    """

    reward: float | None
    status: Status
    reason: str = ""
    isolation: str | None = None


class Verifier(Protocol):
    name: str
    version: str
    options: frozenset[str]
    sandboxed: bool

    def __call__(self, response: str, ground_truth: str | None, **options: Any) -> VerifyResult: ...

    def budget_s(self, ground_truth: str | None, **options: Any) -> float: ...

    def check_reference(self, ground_truth: str | None, **options: Any) -> str | None: ...


VERIFIERS: Registry[Verifier] = Registry(
    "verifier", fix="check the spelling, or list the module that registers it (@register_verifier) in reward.plugins")


def _no_check(ground_truth: str | None, **options: Any) -> str | None:
    return None


def register_verifier(
    name: str,
    version: str,
    budget_s: float | Callable[..., float] = DEFAULT_BUDGET_S,
    check_reference: Callable[..., str | None] | None = None,
    options: tuple[str, ...] = (),
    sandboxed: bool = False,
) -> Callable[[Callable[..., VerifyResult]], Verifier]:
    """Register ``fn(response, ground_truth, **options) -> VerifyResult`` under ``name``."""

    def deco(fn: Callable[..., VerifyResult]) -> Verifier:
        fn.name = name  # type: ignore[attr-defined]
        fn.version = version  # type: ignore[attr-defined]
        fn.options = frozenset(options)  # type: ignore[attr-defined]
        fn.sandboxed = sandboxed  # type: ignore[attr-defined]
        fn.budget_s = budget_s if callable(budget_s) else (lambda ground_truth, _b=float(budget_s), **o: _b)  # type: ignore[attr-defined]
        fn.check_reference = check_reference or _no_check  # type: ignore[attr-defined]
        return VERIFIERS.add(name, fn)  # type: ignore[arg-type]

    return deco


def verifier_names() -> list[str]:
    return VERIFIERS.names()


def get_verifier(name: str) -> Verifier:
    return VERIFIERS.get(name)


def check_options(options: dict[str, dict[str, Any]]) -> None:
    """Raise ValueError naming the verifier and key for any option a verifier does not accept."""
    for vname, opts in options.items():
        v = get_verifier(vname)
        unknown = set(opts) - v.options
        if unknown:
            raise ValueError(f"verifier {vname!r} has no option(s) {sorted(unknown)}; it accepts: "
                             f"{sorted(v.options) or 'none'}")
