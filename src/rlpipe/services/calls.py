"""The client side of rlpipe's services: every request a run makes to a verifier, reward-model or
environment service is timed and counted here, so that each iteration can log the latency and error rate
of the services it used (:func:`drain`). Core code: no web framework is imported."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

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
    import httpx

    if token := service_token(service):
        kwargs["headers"] = {**kwargs.get("headers", {}), "Authorization": f"Bearer {token}"}
    start = time.perf_counter()
    ok = False
    try:
        r = httpx.post(url, **kwargs)
        ok = r.status_code == 200
        return r
    finally:
        with _LOCK:
            _CALLS.setdefault(service, []).append((time.perf_counter() - start, ok))


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
