"""The client side of rlpipe's services, the floor both a service and its callers stand on.

Every request a run makes to a verifier, reward-model, environment, rollout or trainer service goes
through :func:`post`, which adds the service's bearer token and times and counts the call, so that each
iteration can log the latency and error rate of the services it used (:func:`drain`).
:func:`post_with_retries` is the retry rule of the scoring clients (verifier, reward model).
:func:`service_token` is the credential lookup that the services (``rlpipe.services``) and their clients
share. Core code: no web framework is imported, and httpx only when a request is made.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["NoAnswer", "drain", "post", "post_with_retries", "service_token"]

_LOCK = threading.Lock()
_CALLS: dict[str, list[tuple[float, bool]]] = {}


def service_token(service: str) -> str | None:
    """The bearer credential of ``service`` (verifier, reward_model, env, rollout): ``RLPIPE_<SERVICE>_TOKEN``,
    or the file ``RLPIPE_<SERVICE>_TOKEN_FILE`` names (a mounted secret); None when neither is set. The
    service and its clients read the same variables."""
    key = f"RLPIPE_{service.upper()}_TOKEN"
    if os.environ.get(key):
        return os.environ[key]
    if path := os.environ.get(f"{key}_FILE"):
        token = Path(path).read_text().strip()
        if not token:
            raise ValueError(f"{key}_FILE={path} is empty: put the {service} service's token in it")
        return token
    return None


def post(service: str, url: str, **kwargs: Any) -> Any:
    """``httpx.post`` with the service's bearer token (when one is set) that records its latency and
    whether it succeeded (HTTP 200) under ``service``."""
    return _request("POST", service, url, **kwargs)


def get(service: str, url: str, **kwargs: Any) -> Any:
    """``httpx.get``, with the token and the record of :func:`post`."""
    return _request("GET", service, url, **kwargs)


def _request(method: str, service: str, url: str, **kwargs: Any) -> Any:
    import httpx

    if token := service_token(service):
        kwargs["headers"] = {**kwargs.get("headers", {}), "Authorization": f"Bearer {token}"}
    start = time.perf_counter()
    ok = False
    try:
        r = (httpx.post if method == "POST" else httpx.get)(url, **kwargs)
        ok = r.status_code == 200
        return r
    finally:
        with _LOCK:
            _CALLS.setdefault(service, []).append((time.perf_counter() - start, ok))


class NoAnswer(Exception):
    """A service gave no usable answer; ``status`` is the verdict status its items get: ``timeout`` (it
    did not answer in time) or ``skipped`` (unreachable, refused, or failing after the retries)."""

    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status = status


def post_with_retries(service: str, url: str, body: dict[str, Any], timeout_s: float, retries: int, who: str) -> Any:
    """POST ``body`` as JSON and return the HTTP 200 response, or raise :class:`NoAnswer` whose reason
    starts with ``who`` (e.g. ``verifier service http://…``).

    A refusal (429), a server error (5xx) or a failed connection is tried again up to ``retries`` times,
    waiting 0.5 s and doubling; another 4xx is final (the request itself is wrong), and so is a timeout:
    a service that is busy past ``timeout_s`` would be as busy on the next try."""
    import httpx

    delay, problem = 0.5, "no answer"
    for attempt in range(retries + 1):
        try:
            r = post(service, url, json=body, timeout=timeout_s)
        except httpx.TimeoutException:
            raise NoAnswer("timeout", f"{who} gave no answer within {timeout_s:g} s") from None
        except httpx.HTTPError as e:
            problem = f"{who} unreachable: {type(e).__name__}"
        else:
            if r.status_code == 200:
                return r
            problem = f"{who} answered {r.status_code}: {r.text[:120]}"
            if r.status_code != 429 and r.status_code < 500:
                break
        if attempt < retries:
            time.sleep(delay)
            delay *= 2
    raise NoAnswer("skipped", problem)


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def drain() -> dict[str, float]:
    """``service/<name>/{calls, error_rate, latency_p50_s, latency_p99_s}`` of the calls since the last drain."""
    with _LOCK:
        calls = {k: v for k, v in _CALLS.items() if v}
        _CALLS.clear()
    out = {}
    for name, got in sorted(calls.items()):
        lat = [s for s, _ in got]
        out |= {f"service/{name}/calls": float(len(got)), f"service/{name}/error_rate": sum(not ok for _, ok in got) / len(got),
                f"service/{name}/latency_p50_s": _quantile(lat, 0.5), f"service/{name}/latency_p99_s": _quantile(lat, 0.99)}
    return out
