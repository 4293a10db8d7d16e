"""The verifier protocol: ``verify(response, ground_truth) -> VerifyResult``; never raises on model output."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

Status = Literal["ok", "unparseable", "timeout", "error", "skipped"]


@dataclass(frozen=True)
class VerifyResult:
    """``reward`` is meaningful only when ``status == "ok"``; other statuses are left out of updates."""

    reward: float | None
    status: Status
    reason: str = ""


class Verifier(Protocol):
    name: str
    version: str

    def __call__(self, response: str, ground_truth: str | None) -> VerifyResult: ...


_REGISTRY: dict[str, Verifier] = {}


def register_verifier(name: str, version: str) -> Callable[[Callable[[str, str | None], VerifyResult]], Verifier]:
    def deco(fn: Callable[[str, str | None], VerifyResult]) -> Verifier:
        if name in _REGISTRY:
            raise ValueError(f"verifier {name!r} is already registered")
        fn.name = name  # type: ignore[attr-defined]
        fn.version = version  # type: ignore[attr-defined]
        _REGISTRY[name] = fn  # type: ignore[assignment]
        return fn  # type: ignore[return-value]

    return deco


def verifier_names() -> list[str]:
    return sorted(_REGISTRY)


def get_verifier(name: str) -> Verifier:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown verifier {name!r}; known: {', '.join(verifier_names())}") from None
