"""Waiting for a test's own HTTP service to come up (not named http.py: a helper script run from this folder would shadow the standard library's http)."""

from __future__ import annotations

import time

import httpx


def wait_healthy(url: str, timeout_s: float = 60.0, why: "callable | None" = None) -> None:
    """Return once ``GET url/health`` answers 200; past ``timeout_s`` raise, with ``why()`` (e.g. the log)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} did not become healthy within {timeout_s:g} s" + (f":\n{why()}" if why else ""))
