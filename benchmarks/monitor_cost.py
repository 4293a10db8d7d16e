"""What rlpipe's resource monitor costs a run on a busy host (issue 43): the run's own thread per iteration (the
iteration's mark, one stage, its metrics) and the sampling thread's CPU, with ``--processes`` extra processes on
the machine (``sleep``, not descendants of this one, killed by PID at the end).

    .venv/bin/python benchmarks/monitor_cost.py                      # this checkout
    .venv/bin/python benchmarks/monitor_cost.py --root <worktree>    # another checkout's src/ first on the path

Listing a process's descendants scans every process on the machine (psutil reads each one's parent), so its cost
grows with the host, not with the run: a GPU node's data loaders, services and agents.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=1000)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    a = ap.parse_args()
    sys.path.insert(0, str(a.root / "src"))
    import psutil
    import torch  # noqa: F401 - as in a run: imported before the monitor's first stage

    from rlpipe.tracking.resources import ResourceMonitor

    made = subprocess.run(["sh", "-c", f"for i in $(seq {a.processes}); do sleep 600 >/dev/null 2>&1 & echo $!; done"],
                          capture_output=True, text=True, check=True)
    pids = [int(x) for x in made.stdout.split()]
    try:
        mon = ResourceMonitor().start()
        time.sleep(0.5)
        me, own = psutil.Process(), 0.0
        cpu0, wall0 = sum(me.cpu_times()[:2]), time.perf_counter()
        for _ in range(a.iterations):
            t = time.perf_counter()
            mark = mon.begin()
            with mon.stage("update"):
                time.sleep(0.5)
            mon.metrics(mark)
            own += time.perf_counter() - t - 0.5
        cpu, wall = sum(me.cpu_times()[:2]) - cpu0, time.perf_counter() - wall0
        print(f"{a.root}: {len(psutil.pids())} processes on the machine; the run's thread "
              f"{1e3 * own / a.iterations:.1f} ms per iteration; the process's CPU meanwhile {100 * cpu / wall:.1f}% of a core")
    finally:
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    main()
