"""What one child flow run costs on the Prefect API server: CPU, wall, and the requests it makes.

    .venv/bin/python benchmarks/prefect_server_cost.py --tasks 0 --runs 60
    .venv/bin/python benchmarks/prefect_server_cost.py --tasks 0 --runs 60 --services-off

One parent flow calls ``--runs`` child flows (after one warm-up), each running ``--tasks`` empty tasks, on the
ephemeral server Prefect starts as a child process (or PREFECT_API_URL's, whose CPU is not seen: then it
reports 0). Each child run is called as rlpipe calls an iteration: no heartbeat of its own, a templated name.
Prints the server's CPU-seconds per child run, measured on the process tree of this process after a few
seconds for the server to drain its event queue; the client's own wall (mean and median) and CPU per child
run; and each API request a child run made, with its count per run and median wall time.
``--services-off`` starts the ephemeral server with Prefect's background services off (scheduler, foreman,
late runs, pause expirations, repossessor, cancellation cleanup, cleanup reconciler, triggers, event persister,
task-run recorder): what the services add to a flow run. rlpipe does not run its server that way.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "src"), str(Path(__file__).resolve().parents[1])]

SERVICES = ("SCHEDULER", "FOREMAN", "LATE_RUNS", "PAUSE_EXPIRATIONS", "REPOSSESSOR", "CANCELLATION_CLEANUP",
            "CLEANUP_RECONCILER", "TRIGGERS", "EVENT_PERSISTER", "TASK_RUN_RECORDER")
_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def server_cpu_s() -> float:
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


class Requests:
    """Every HTTP request the Prefect clients (sync and async) send while ``on``: (method, path) → wall times."""

    def __init__(self) -> None:
        import httpx

        self.on, self.seen = False, collections.defaultdict(list)
        sync_send, async_send = httpx.Client.send, httpx.AsyncClient.send

        def send(client, request, *args, **kwargs):
            t = time.perf_counter()
            response = sync_send(client, request, *args, **kwargs)
            self._note(request, t)
            return response

        async def asend(client, request, *args, **kwargs):
            t = time.perf_counter()
            response = await async_send(client, request, *args, **kwargs)
            self._note(request, t)
            return response

        httpx.Client.send, httpx.AsyncClient.send = send, asend

    def _note(self, request, t: float) -> None:
        if self.on:
            self.seen[(request.method, _ID.sub("{id}", request.url.path))].append(time.perf_counter() - t)

    def table(self, runs: int) -> str:
        rows = sorted(self.seen.items(), key=lambda kv: -sum(kv[1]))
        return "\n".join(f"  {m:5} {p:42} {len(v) / runs:4.1f} per run, "
                         f"median {statistics.median(v) * 1000:5.1f} ms" for (m, p), v in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=0, help="task runs per child flow run")
    ap.add_argument("--runs", type=int, default=60, help="child flow runs measured")
    ap.add_argument("--drain-s", type=float, default=3.0, help="wait for the server's queued events at the end")
    ap.add_argument("--services-off", action="store_true", help="the ephemeral server without its background services")
    a = ap.parse_args()
    if a.services_off:
        os.environ.update({f"PREFECT_SERVER_SERVICES_{s}_ENABLED": "false" for s in SERVICES})
    requests = Requests()
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE

    from flows.train import _no_heartbeat

    @task(cache_policy=NO_CACHE)
    def step(i: int) -> int:
        return i

    @flow(flow_run_name="child-{k}", validate_parameters=False)
    def child(k: int) -> int:
        for i in range(a.tasks):
            step(i)
        return k

    @flow
    def parent() -> None:
        with _no_heartbeat():
            child(-1)  # warm-up
        cpu0, own0, walls = server_cpu_s(), time.process_time(), []
        requests.on = True
        for k in range(a.runs):
            t = time.perf_counter()
            with _no_heartbeat():
                child(k)
            walls.append(time.perf_counter() - t)
            print(f"child run {k + 1}/{a.runs}", flush=True)
        requests.on = False
        own = time.process_time() - own0
        time.sleep(a.drain_s)
        server = server_cpu_s() - cpu0
        n = sum(len(v) for v in requests.seen.values()) / a.runs
        print(f"RESULT {a.tasks} task runs per child run{' (services off)' if a.services_off else ''}: server CPU "
              f"{server / a.runs * 1000:.0f} ms per child run; client wall {statistics.mean(walls) * 1000:.0f} ms "
              f"(median {statistics.median(walls) * 1000:.0f}, max {max(walls) * 1000:.0f}), client CPU "
              f"{own / a.runs * 1000:.0f} ms per child run; {n:.1f} API requests per child run:\n{requests.table(a.runs)}")

    parent()


if __name__ == "__main__":
    main()
