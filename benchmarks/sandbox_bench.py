"""Sandbox throughput and per-execution overhead.

    python benchmarks/sandbox_bench.py [--seconds 8] [--json-only]

Measures, for a trivial program (``print(1)``):

* the baseline: plain ``/usr/bin/python3 -c 'print(1)'`` through ``subprocess.run``;
* ``run_python`` executions per second with 1 worker and with 2 concurrent workers (threads);
* the overhead per execution: sandbox latency minus baseline latency (1 worker).

Each phase runs for ``--seconds`` (default 8; whole run well under a minute). Prints a markdown
table and then one JSON line. Numbers depend on the machine and on what else it runs: the load
average is reported alongside.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from rlpipe.sandbox import isolation_report, run_python

CODE = "print(1)"
PYTHON = os.environ.get("RLPIPE_SANDBOX_PYTHON", "/usr/bin/python3")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _baseline(seconds: float) -> list[float]:
    lat = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.monotonic()
        out = subprocess.run([PYTHON, "-c", CODE], capture_output=True, text=True)
        lat.append(time.monotonic() - t)
        assert out.stdout == "1\n", out
    return lat


def _sandbox(seconds: float, workers: int) -> tuple[list[float], float]:
    lat: list[float] = []
    lock = threading.Lock()
    end = time.monotonic() + seconds
    failures = []

    def worker():
        while time.monotonic() < end:
            t = time.monotonic()
            r = run_python(CODE)
            dt = time.monotonic() - t
            with lock:
                lat.append(dt)
                if r.status != "ok" or r.stdout != "1\n":
                    failures.append(r)

    t0 = time.monotonic()
    with ThreadPoolExecutor(workers) as pool:
        for f in [pool.submit(worker) for _ in range(workers)]:
            f.result()
    elapsed = time.monotonic() - t0
    if failures:
        raise SystemExit(f"{len(failures)} sandbox runs failed, first: {failures[0]}")
    return lat, elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0, help="duration of each phase (default 8)")
    ap.add_argument("--json-only", action="store_true")
    args = ap.parse_args()

    rep = isolation_report()  # probes once; not timed
    for _ in range(3):  # warm-up (page cache, first cgroup creation)
        run_python(CODE)
        subprocess.run([PYTHON, "-c", CODE], capture_output=True)

    base = _baseline(args.seconds)
    one, one_elapsed = _sandbox(args.seconds, 1)
    two, two_elapsed = _sandbox(args.seconds, 2)

    base_ms = statistics.mean(base) * 1000
    rows = [
        ("plain python3 -c (baseline)", 1, len(base) / sum(base), base),
        ("run_python, 1 worker", 1, len(one) / one_elapsed, one),
        ("run_python, 2 workers", 2, len(two) / two_elapsed, two),
    ]
    result = {
        "isolation": rep["level"],
        "cpus": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "seconds_per_phase": args.seconds,
        "baseline_ms_mean": round(base_ms, 2),
        "overhead_ms_per_exec": round(statistics.mean(one) * 1000 - base_ms, 2),
        "phases": [
            {"phase": name, "workers": w, "execs": len(lat), "execs_per_s": round(rate, 2),
             "latency_ms_mean": round(statistics.mean(lat) * 1000, 2),
             "latency_ms_p50": round(_pct(lat, 0.5) * 1000, 2),
             "latency_ms_p95": round(_pct(lat, 0.95) * 1000, 2)}
            for name, w, rate, lat in rows
        ],
    }
    if not args.json_only:
        print(f"sandbox level: {rep['level']}  (cpus={result['cpus']}, load avg 1m={result['loadavg_1m']})\n")
        print("| phase | workers | execs | execs/s | mean ms | p50 ms | p95 ms |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for p in result["phases"]:
            print(f"| {p['phase']} | {p['workers']} | {p['execs']} | {p['execs_per_s']} | {p['latency_ms_mean']} "
                  f"| {p['latency_ms_p50']} | {p['latency_ms_p95']} |")
        print(f"\noverhead per execution (1 worker, mean): {result['overhead_ms_per_exec']} ms "
              f"over {result['baseline_ms_mean']} ms for plain python3\n")
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
