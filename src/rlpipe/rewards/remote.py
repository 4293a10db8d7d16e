"""Clients of the scoring services: :class:`RemoteVerifier` for the verifier service
(``RLPIPE_VERIFIER_URL``), a drop-in for :class:`VerifierPool`, and :class:`ScoringClient`, what it shares
with the reward-model client (:class:`rlpipe.rewards.model.RemoteRewardModel`).

They never raise on a service problem: when the service is down, refuses (429 after retries) or
does not answer in time, every item gets status ``skipped`` or ``timeout`` — excluded from the
update and counted, never scored 0 — and the reason says what happened.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlpipe.http_client import NoAnswer, post_with_retries
from rlpipe.rewards.base import VerifyResult
from rlpipe.rewards.pool import VerifyItem


class ScoringClient:
    """Items sent to a scoring service in batches of ``batch``, each batch retried by the rule of
    :func:`rlpipe.http_client.post_with_retries` and given a verdict per item even when no answer came.
    A subclass names the service and says what it sends (:meth:`_body`) and how it reads the answer
    (:meth:`_verdicts`)."""

    service = ""  # the name its calls are counted under (rlpipe.http_client.drain)
    path = ""  # the scoring endpoint
    who = ""  # how a reason names the service: "<who> <url> …"

    def __init__(self, url: str, timeout_s: float, retries: int, batch: int):
        self.url, self.timeout_s, self.retries, self.batch = url.rstrip("/"), timeout_s, retries, batch
        self.last_problem: str | None = None

    def _body(self, items: Sequence[Any]) -> dict[str, Any]:
        raise NotImplementedError

    def _verdicts(self, r: Any, n: int) -> list[VerifyResult]:
        """The verdicts of an HTTP 200 answer to ``n`` items."""
        raise NotImplementedError

    def _unanswered(self, n: int, reason: str, status: str = "skipped") -> list[VerifyResult]:
        self.last_problem = reason
        return [VerifyResult(None, status, reason)] * n

    def _post(self, items: Sequence[Any]) -> list[VerifyResult]:
        try:
            # the service's own deadline is timeout_s; 10 s more for the queue and the transport
            r = post_with_retries(self.service, f"{self.url}{self.path}", self._body(items), self.timeout_s + 10,
                                  self.retries, f"{self.who} {self.url}")
        except NoAnswer as e:
            return self._unanswered(len(items), str(e), e.status)
        return self._verdicts(r, len(items))

    def score(self, items: Sequence[Any]) -> list[VerifyResult]:
        self.last_problem = None
        return [r for i in range(0, len(items), self.batch) for r in self._post(items[i : i + self.batch])]


class RemoteVerifier(ScoringClient):
    """The verifier service as a drop-in for :class:`~rlpipe.rewards.pool.VerifierPool` (``score``,
    ``healthy``, ``close``); the run's verifier options travel with every request."""

    service, path, who = "verifier", "/verify", "verifier service"

    def __init__(self, url: str, timeout_s: float = 120.0, retries: int = 3, batch: int = 1024,
                 options: dict[str, dict[str, Any]] | None = None):
        super().__init__(url, timeout_s, retries, batch)
        self.options = options  # sent with every request (the run's reward options), None: the service's
        self.restarts = 0
        self.health_problem: str | None = None

    @property
    def size(self) -> int:
        return 0

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """One short ``GET /health``: cheap enough to call every iteration; never raises.

        When it answers False, :attr:`health_problem` says why (unreachable, slow, degraded)."""
        import httpx

        try:
            r = httpx.get(f"{self.url}/health", timeout=timeout_s)
            status = r.json().get("status") if r.status_code == 200 else f"HTTP {r.status_code}"
        except httpx.TimeoutException:
            status = f"no answer within {timeout_s:g} s"
        except (httpx.HTTPError, ValueError, AttributeError) as e:
            status = f"unreachable ({type(e).__name__})"
        self.health_problem = None if status == "ok" else f"verifier service {self.url}/health: {status}"
        return status == "ok"

    def _body(self, items: Sequence[VerifyItem]) -> dict[str, Any]:
        return {"items": [{"verifier": i.verifier, "response": i.response, "ground_truth": i.ground_truth} for i in items],
                "timeout_s": self.timeout_s, "options": self.options}

    def _verdicts(self, r: Any, n: int) -> list[VerifyResult]:
        """The service's verdicts, ``isolation`` (the sandbox level the verdict came from) included."""
        try:
            got = [VerifyResult(x["reward"], x["status"], x.get("reason") or "", x.get("isolation"))
                   for x in r.json()["results"]]
        except (ValueError, KeyError, TypeError) as e:
            got = []
            self.last_problem = f"verifier service {self.url}/verify sent an unreadable answer ({type(e).__name__}: {e})"
        if len(got) != n:
            return self._unanswered(n, self.last_problem or f"verifier service {self.url}/verify answered {len(got)} verdicts for {n} items")
        return got

    def close(self) -> None:
        pass
