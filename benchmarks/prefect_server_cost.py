"""CPU-seconds the Prefect API server spends per child flow run, with and without task runs in it.

    .venv/bin/python benchmarks/prefect_server_cost.py --tasks 6 --runs 30

One parent flow calls ``--runs`` child flows (after one warm-up), each running ``--tasks`` empty tasks, on the
ephemeral server Prefect starts as a child process (or PREFECT_API_URL's, whose CPU is not seen: then it
reports 0). Prints the server's CPU-seconds per child run, measured on the process tree of this process after
a few seconds for the server to drain its event queue, and the client's own wall and CPU per child run.
The rl-iteration flow run of the demo has 4 task runs (6 at a save point).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=6, help="task runs per child flow run")
    ap.add_argument("--runs", type=int, default=30, help="child flow runs measured")
    ap.add_argument("--drain-s", type=float, default=3.0, help="wait for the server's queued events at the end")
    a = ap.parse_args()
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE

    @task(cache_policy=NO_CACHE)
    def step(i: int) -> int:
        return i

    @flow
    def child(k: int) -> int:
        for i in range(a.tasks):
            step(i)
        return k

    @flow
    def parent() -> None:
        child(-1)  # warm-up
        cpu0, wall0, own0 = server_cpu_s(), time.perf_counter(), time.process_time()
        for k in range(a.runs):
            child(k)
            print(f"child run {k + 1}/{a.runs}", flush=True)
        wall, own = time.perf_counter() - wall0, time.process_time() - own0
        time.sleep(a.drain_s)
        server = server_cpu_s() - cpu0
        print(f"RESULT {a.tasks} task runs per child run: server CPU {server / a.runs * 1000:.0f} ms per child run; "
              f"client wall {wall / a.runs * 1000:.0f} ms, client CPU {own / a.runs * 1000:.0f} ms per child run")

    parent()


if __name__ == "__main__":
    main()
