"""Run-level guards on rewards: the sandbox floor and the circuit breaker.

- **Sandbox floor.** A run whose prompts are scored by a verifier that executes model code
  (``Verifier.sandboxed``) refuses to start when this machine's sandbox is below
  ``reward.sandbox_min_level``, and a verdict produced below it (e.g. by a remote service, or after
  a component was switched off) stops the iteration. Lowering the floor is an explicit config
  change, recorded in the config fingerprint.
- **Circuit breaker.** When more than ``reward.max_invalid_share`` of an iteration's samples are
  not ``ok`` for ``reward.max_invalid_iterations`` iterations in a row, the run stops with an error
  naming the verifier(s), the share and the last reasons, instead of training on almost nothing.
  It trips before the iteration's scores are stored, so the resumed run scores that iteration
  again once the cause is fixed.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any


class SandboxFloorError(RuntimeError):
    """Model code would be scored below the configured sandbox isolation level."""


class RewardCircuitOpen(RuntimeError):
    """Too many samples could not be scored for too many iterations in a row."""


def level_components(level: str | None) -> set[str]:
    return set((level or "").split("+")) - {"", "none"}


def sandboxed_verifiers(names: Iterable[str]) -> list[str]:
    """The verifiers among ``names`` that run model code in the sandbox (unknown names are skipped)."""
    from rlpipe.rewards import get_verifier

    out = []
    for n in sorted(set(names)):
        try:
            if get_verifier(n).sandboxed:
                out.append(n)
        except KeyError:
            continue
    return out


def check_sandbox_floor(level: str | None, required: Sequence[str], where: str) -> None:
    """Raise :class:`SandboxFloorError` when ``level`` lacks a required component."""
    missing = [c for c in required if c not in level_components(level)]
    if missing:
        raise SandboxFloorError(
            f"{where}: sandbox level {level or 'none'!r} lacks {'+'.join(missing)} required by "
            f"reward.sandbox_min_level ({'+'.join(required)}). Fix the machine (see `rlpipe sandbox report`), or "
            f"lower the floor explicitly, e.g. --set reward.sandbox_min_level={'+'.join(c for c in required if c not in missing) or 'rlimits'}"
        )


def check_rows_isolation(rows: Sequence[dict[str, Any]], required: Sequence[str]) -> dict[str, float]:
    """Every sandboxed verdict met the floor; returns the share of scored rows per isolation level."""
    levels = Counter(r.get("isolation") for r in rows if r.get("isolation"))
    for level in levels:
        check_sandbox_floor(level, required, f"{levels[level]} verdict(s)")
    n = max(len(rows), 1)
    # MLflow metric names allow no "+": the components are joined with "-" there.
    return {f"sandbox/level/{lv.replace('+', '-')}": c / n for lv, c in levels.items()}


def invalid_share(rows: Sequence[dict[str, Any]]) -> float:
    return sum(r["reward_status"] != "ok" for r in rows) / max(len(rows), 1)


def describe_invalid(rows: Sequence[dict[str, Any]], last: int = 3) -> str:
    """Which verifiers failed to score, with which statuses and their last reasons."""
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["reward_status"] != "ok":
            by[r.get("verifier") or "?"].append(r)
    parts = []
    for name, bad in sorted(by.items(), key=lambda kv: -len(kv[1])):
        statuses = Counter(r["reward_status"] for r in bad)
        reasons = list(dict.fromkeys(r.get("reward_reason") or "" for r in reversed(bad)))[:last]
        parts.append(f"verifier {name!r}: {len(bad)} not ok ({', '.join(f'{s} {c}' for s, c in statuses.most_common())}); "
                     f"last reasons: {' | '.join(reasons)}")
    return "; ".join(parts) or "all samples ok"


def check_circuit(previous_shares: Sequence[float], share: float, rows: Sequence[dict[str, Any]],
                  max_share: float, max_iterations: int, iteration: int) -> None:
    """Trip when this iteration and the ``max_iterations - 1`` before it were all above ``max_share``."""
    if share <= max_share:
        return
    streak = 1
    for s in reversed(previous_shares):
        if s <= max_share:
            break
        streak += 1
    if streak >= max_iterations:
        raise RewardCircuitOpen(
            f"iteration {iteration}: {share:.0%} of samples not scored 'ok' (limit reward.max_invalid_share="
            f"{max_share:g}), {streak} iterations in a row (reward.max_invalid_iterations={max_iterations}). "
            f"{describe_invalid(rows)}. Fix the cause and rerun with the same --run-id: the run resumes here and "
            f"scores this iteration again."
        )
