"""A real `prefect server start` on 127.0.0.1 with its own PREFECT_HOME (database), for tests that need
what the test harness lacks: a worker's view, automations acting on events."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

from tests.helpers.s3server import free_port

ROOT = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).with_name("prefect"))


class PrefectServer:
    def __init__(self, api: str, env: dict[str, str]):
        self.api, self.env = api, env

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.api}{path}", timeout=60) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict[str, Any]) -> Any:
        req = urllib.request.Request(f"{self.api}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    def events(self, prefix: str) -> list[dict[str, Any]]:
        """Every stored event whose name starts with ``prefix``, oldest first."""
        page = self.post("/events/filter", {"filter": {"event": {"prefix": [prefix]}, "order": "ASC"}, "limit": 50})
        out = list(page["events"])
        while page.get("next_page"):
            with urllib.request.urlopen(page["next_page"], timeout=60) as r:
                page = json.loads(r.read())
            out += page["events"]
        return out

    def wait_events(self, prefix: str, until: Any, timeout: float = 60) -> list[dict[str, Any]]:
        """``events(prefix)`` once ``until(events)`` holds: the server persists events in batches, a second or
        more after they arrive."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.events(prefix)
            if until(got) or time.monotonic() > deadline:
                return got
            time.sleep(0.5)

    def flow_run(self, flow_run_id: str) -> dict[str, Any]:
        return self.get(f"/flow_runs/{flow_run_id}")


def wait_healthy(health_url: str, proc: subprocess.Popen, what: str, timeout: float = 180,
                 log: Path | None = None) -> None:
    """Poll ``health_url`` until it answers 200; fail at once if ``proc`` exits (with ``log``'s tail)."""
    def tail() -> str:
        return "\n" + log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}{tail()}")
        try:
            with urllib.request.urlopen(health_url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"{what} at {health_url} not healthy after {timeout} s{tail()}")


@contextlib.contextmanager
def prefect_server(home: Path, extra_env: dict[str, str] | None = None) -> Iterator[PrefectServer]:
    """Start the server (~20 s), yield it, stop it by its process group. ``extra_env`` reaches the server
    and the clients (e.g. the scheduler's loop interval)."""
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")
           and k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE")} | {
        "PREFECT_HOME": str(home / "prefect"), "PREFECT_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "INFO", "PWD": str(ROOT), "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}",
    } | (extra_env or {})
    log = (home / "server.log").open("w")
    server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(f"{api}/health", server, "prefect server")
        yield PrefectServer(api, env)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()
