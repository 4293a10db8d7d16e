"""Client of the verifier service (``RLPIPE_VERIFIER_URL``), a drop-in for :class:`VerifierPool`.

It never raises on a service problem: when the service is down, refuses (429 after retries) or
does not answer in time, every item gets status ``skipped`` or ``timeout`` — excluded from the
update and counted, never scored 0 — and the reason says what happened.
"""

from __future__ import annotations

from typing import Any

from rlpipe.http_client import NoAnswer, post_with_retries
from rlpipe.rewards.base import VerifyResult
from rlpipe.rewards.pool import VerifyItem


class RemoteVerifier:
    def __init__(self, url: str, timeout_s: float = 120.0, retries: int = 3, batch: int = 1024,
                 options: dict[str, dict[str, Any]] | None = None):
        self.url = url.rstrip("/")
        self.options = options  # sent with every request (the run's reward options), None: the service's
        self.timeout_s = timeout_s
        self.retries = retries
        self.batch = batch
        self.restarts = 0
        self.last_problem: str | None = None
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

    def _post(self, items: list[VerifyItem]) -> list[VerifyResult]:
        body = {"items": [{"verifier": i.verifier, "response": i.response, "ground_truth": i.ground_truth} for i in items],
                "timeout_s": self.timeout_s, "options": self.options}
        try:
            r = post_with_retries("verifier", f"{self.url}/verify", body, self.timeout_s + 10, self.retries,
                                  f"verifier service {self.url}")
        except NoAnswer as e:
            self.last_problem = str(e)
            return [VerifyResult(None, e.status, self.last_problem)] * len(items)
        return self._results(r, len(items))

    def _results(self, r: Any, n: int) -> list[VerifyResult]:
        """The service's verdicts, ``isolation`` (the sandbox level the verdict came from) included."""
        try:
            got = [VerifyResult(x["reward"], x["status"], x.get("reason") or "", x.get("isolation"))
                   for x in r.json()["results"]]
        except (ValueError, KeyError, TypeError) as e:
            got = []
            self.last_problem = f"verifier service {self.url}/verify sent an unreadable answer ({type(e).__name__}: {e})"
        if len(got) != n:
            self.last_problem = self.last_problem or f"verifier service {self.url}/verify answered {len(got)} verdicts for {n} items"
            return [VerifyResult(None, "skipped", self.last_problem)] * n
        return got

    def score(self, items: list[VerifyItem]) -> list[VerifyResult]:
        self.last_problem = None
        out: list[VerifyResult] = []
        for i in range(0, len(items), self.batch):
            out += self._post(items[i : i + self.batch])
        return out

    def close(self) -> None:
        pass
