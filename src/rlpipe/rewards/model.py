"""Rewards from a reward model (RLHF): in-process or through the service, mixed with verifiers.

The verdict rule holds here too (see :mod:`rlpipe.rewards.base`): a score is ``ok`` only when the
reward model scored the model's output. A reward model that is down, refuses or runs out of time
gives ``skipped`` / ``timeout`` with the reason — excluded from the update and counted, never 0.
Every result names the reward-model version that produced it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rlpipe.rewards.base import VerifyResult
from rlpipe.rewards.remote import ScoringClient

__all__ = ["LocalRewardModel", "RMItem", "RemoteRewardModel", "RewardModelSource", "mix_rewards", "reward_hacking"]


@dataclass(frozen=True)
class RMItem:
    prompt: str  # the prompt as stored (text, or a JSON message list when chat)
    response: str
    chat: bool = False


class RewardModelSource(Protocol):
    version: str
    stats: dict[str, Any]
    last_problem: str | None

    def score(self, items: Sequence[RMItem]) -> list[VerifyResult]: ...

    def healthy(self) -> bool: ...


class LocalRewardModel:
    """A :class:`~rlpipe.training.reward_model.RewardScorer` in this process."""

    def __init__(self, scorer: Any):
        self.scorer = scorer
        self.version = scorer.version
        self.stats = scorer.stats
        self.last_problem: str | None = None

    def healthy(self) -> bool:
        return True

    def score(self, items: Sequence[RMItem]) -> list[VerifyResult]:
        self.last_problem = None
        try:
            xs = self.scorer.score_texts([(i.prompt, i.response, i.chat) for i in items])
        except Exception as e:  # noqa: BLE001 - the reward model's fault, not the sample's: never a 0
            self.last_problem = f"reward model {self.version} failed: {type(e).__name__}: {e}"
            return [VerifyResult(None, "error", self.last_problem)] * len(items)
        return [VerifyResult(x, "ok") if math.isfinite(x) else VerifyResult(None, "error", "reward model gave a non-finite score")
                for x in xs]


class RemoteRewardModel(ScoringClient):
    """Client of ``rlpipe serve reward-model`` (``RLPIPE_REWARD_MODEL_URL``); never raises on a service problem."""

    service, path, who = "reward_model", "/score", "reward-model service"

    def __init__(self, url: str, timeout_s: float = 120.0, retries: int = 3, batch: int = 512):
        super().__init__(url, timeout_s, retries, batch)
        info = self._health() or {}
        self.version = info.get("version", "unknown")
        self.stats = info.get("reward_stats", {})

    def _health(self, timeout_s: float = 5.0) -> dict[str, Any] | None:
        import httpx

        try:
            r = httpx.get(f"{self.url}/health", timeout=timeout_s)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def healthy(self) -> bool:
        info = self._health(2.0)
        return bool(info and info.get("status") == "ok")

    def _body(self, items: Sequence[RMItem]) -> dict[str, Any]:
        return {"items": [{"prompt": i.prompt, "response": i.response, "chat": i.chat} for i in items], "timeout_s": self.timeout_s}

    def _verdicts(self, r: Any, n: int) -> list[VerifyResult]:
        return self._results(r.json(), n)

    def _results(self, body: Any, n: int) -> list[VerifyResult]:
        try:
            got = body["results"]
            out = [VerifyResult(x["score"], x["status"], x.get("reason") or "")
                   if x["status"] != "ok" or isinstance(x["score"], (int, float)) and math.isfinite(x["score"])
                   else VerifyResult(None, "skipped", f"reward-model service {self.url} answered ok without a finite score")
                   for x in got]
            self.version = got[0].get("rm_version", self.version) if got else self.version
        except (KeyError, TypeError, IndexError) as e:
            return self._unanswered(n, f"reward-model service {self.url} sent an unreadable answer ({type(e).__name__}: {e})")
        if len(out) != n:
            return self._unanswered(n, f"reward-model service {self.url} answered {len(out)} scores for {n} items")
        return out


def mix_rewards(sources: dict[str, list[VerifyResult]], weights: dict[str, float]) -> list[VerifyResult]:
    """Σ weight · reward per sample, ``ok`` only when every source judged it; else the first source's
    non-ok status, its reason prefixed by the source's name."""
    names = list(weights)
    n = len(sources[names[0]])
    out = []
    for k in range(n):
        bad = next(((s, sources[s][k]) for s in names if sources[s][k].status != "ok"), None)
        if bad is not None:
            out.append(VerifyResult(None, bad[1].status, f"{bad[0] or 'verifier'}: {bad[1].reason}", bad[1].isolation))
            continue
        total = sum(weights[s] * float(sources[s][k].reward) for s in names)
        iso = next((sources[s][k].isolation for s in names if sources[s][k].isolation), None)
        parts = [f"{s or 'verifier'} {weights[s]:g}×{float(sources[s][k].reward):.4f}"
                 + (f" ({sources[s][k].reason})" if sources[s][k].reason else "") for s in names]
        out.append(VerifyResult(total, "ok", " + ".join(parts) if len(names) > 1 else sources[names[0]][k].reason, iso))
    return out


def reward_hacking(rm_scores: Sequence[float], true_scores: Sequence[float], window: int) -> str | None:
    """An alert when, over the last ``window`` evaluations, the reward model's score rose while the hidden
    true score fell (each compared first to last); None otherwise."""
    if window < 2 or len(rm_scores) < window or len(true_scores) < window:
        return None
    rm, true = list(rm_scores)[-window:], list(true_scores)[-window:]
    if rm[-1] > rm[0] and true[-1] < true[0]:
        return (f"reward hacking: over the last {window} evaluations the reward-model score rose "
                f"{rm[0]:.3f} → {rm[-1]:.3f} while the true score fell {true[0]:.3f} → {true[-1]:.3f}")
    return None


def normalise_results(results: Sequence[VerifyResult], norm: Any, clip: float | None) -> list[VerifyResult]:
    """Standardise the ``ok`` scores with a running normaliser (statistics from before this batch), clip
    them, and fold the batch into the statistics; other statuses pass through untouched."""
    ok = [k for k, r in enumerate(results) if r.status == "ok"]
    scaled = norm.normalise([float(results[k].reward) for k in ok], clip)
    out = list(results)
    for k, x in zip(ok, scaled):
        out[k] = VerifyResult(x, "ok", f"reward model {results[k].reward:.4f}, normalised", results[k].isolation)
    return out
