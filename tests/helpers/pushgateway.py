"""A real Prometheus Pushgateway for tests: Debian's ``prometheus-pushgateway`` binary on 127.0.0.1, and a reader of
what it holds. ``make test`` installs the package (scripts/install.sh); without it the tests that need it skip."""

from __future__ import annotations

import math
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlpipe.net import free_port
from rlpipe.procs import stop_group

BINARY = shutil.which("prometheus-pushgateway")
needs_pushgateway = pytest.mark.skipif(
    BINARY is None, reason="prometheus-pushgateway is not installed (Debian: apt-get install prometheus-pushgateway; "
                           "`make test` installs it through scripts/install.sh)")


@dataclass
class Pushgateway:
    url: str
    proc: subprocess.Popen
    log: Path

    def samples(self, name: str, **labels: str) -> dict[str, float]:
        """``key`` label (or "" where the sample has none) → value of every sample ``name`` whose labels include
        ``labels``, read from the gateway's /metrics as Prometheus scrapes it."""
        r = httpx.get(f"{self.url}/metrics", timeout=10)
        r.raise_for_status()
        return {s.labels.get("key", ""): s.value for fam in text_string_to_metric_families(r.text) for s in fam.samples
                if s.name == name and labels.items() <= s.labels.items()}

    def stop(self) -> None:
        stop_group(self.proc, grace_s=10)  # started in a session of its own


def start_pushgateway(workdir: Path, timeout: float = 30.0) -> Pushgateway:
    """Start the gateway on a free loopback port (in memory: no persistence file) and wait for /-/ready."""
    workdir.mkdir(parents=True, exist_ok=True)
    port, log = free_port(), workdir / "pushgateway.log"
    proc = subprocess.Popen([BINARY, f"--web.listen-address=127.0.0.1:{port}"], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    gw = Pushgateway(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus-pushgateway exited with {proc.returncode}; see {log}:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{gw.url}/-/ready", timeout=2).status_code == 200:
                return gw
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    gw.stop()
    raise RuntimeError(f"prometheus-pushgateway not ready after {timeout} s; see {log}")


def same(a: float, b: float) -> bool:
    """Equal, NaN equal to NaN (a pushed NaN must come back NaN)."""
    return (math.isnan(a) and math.isnan(b)) or a == b
