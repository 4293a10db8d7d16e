"""Where a script's wall-clock time goes, waits included: sample the main thread's stack every few ms.

    .venv/bin/python benchmarks/wall_sampler.py --within flows/train.py:_iteration --out /tmp/rlpipe-bench/wall.json \
        benchmarks/grpo_loop.py --samples 2560 --skip-engines

cProfile sees only the calling thread's CPU-side calls; Prefect's client waits on its own event-loop
thread, so a profile of the RL loop shows those waits as lock acquisitions. This sampler counts, for the
samples whose innermost rlpipe frame (flows/, tasks/, src/rlpipe/) is ``--within`` (``file:function``), every
library frame below it once (inclusive time), and prints seconds per iteration where ``--iterations`` is
given, else seconds in all.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import runpy
import sys
import threading
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1]) + "/"
OURS = tuple(ROOT + d for d in ("flows/", "tasks/", "src/rlpipe/"))


def frames(thread_id: int) -> list[tuple[str, str, int]]:
    """The thread's stack, outermost first: (file, function, line)."""
    out, fr = [], sys._current_frames().get(thread_id)
    while fr is not None:
        out.append((fr.f_code.co_filename, fr.f_code.co_name, fr.f_lineno))
        fr = fr.f_back
    return out[::-1]


def sample_into(counts: collections.Counter, within: str, interval: float, stop: threading.Event) -> None:
    main = threading.main_thread().ident
    file, func = within.rsplit(":", 1)
    while not stop.wait(interval):
        chain = frames(main)
        ours = [i for i, (f, _, _) in enumerate(chain) if f.startswith(OURS)]
        if not ours or not chain[ours[-1]][0].endswith(file) or chain[ours[-1]][1] != func:
            continue
        counts["<all>"] += 1
        for f, name, line in {c for c in chain[ours[-1] + 1 :]}:
            counts[f"{f.split('site-packages/')[-1]}:{name}:{line}"] += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--within", required=True, help="file:function, e.g. flows/train.py:_iteration")
    ap.add_argument("--interval", type=float, default=0.005)
    ap.add_argument("--iterations", type=int, default=0, help="divide by this many iterations")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", type=Path, default=Path("/tmp/rlpipe-bench/wall.json"))
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    counts: collections.Counter = collections.Counter()
    stop = threading.Event()

    def report() -> None:
        stop.set()
        scale = a.interval / max(1, a.iterations)
        top = [(k, round(c * scale, 4)) for k, c in counts.most_common(a.top)]
        for k, s in top:
            print(f"{s:8.3f} s  {k}")
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"within": a.within, "interval_s": a.interval, "iterations": a.iterations,
                                     "seconds": top}, indent=2))

    atexit.register(report)
    threading.Thread(target=sample_into, args=(counts, a.within, a.interval, stop), daemon=True).start()
    sys.argv = [a.script, *a.args]
    runpy.run_path(a.script, run_name="__main__")


if __name__ == "__main__":
    main()
