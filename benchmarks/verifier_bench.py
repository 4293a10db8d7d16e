"""Verifier throughput: math verifications per second (pool of 1 and 2 workers), and the verifier
service under concurrent load from a second process (loopback only, bounded in count and time).

    .venv/bin/python benchmarks/verifier_bench.py [--seconds 10] [--clients 4] [--batch 16]

Prints a markdown table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LOAD = r'''
import json, random, sys, threading, time, httpx
url, seconds, clients, batch = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(0)
def items():  # fresh values each request: no verifier-side caching helps
    return [{"verifier": "math", "response": f"\\boxed{{{rng.randint(0, 10**6)}}}", "ground_truth": str(rng.randint(0, 10**6))}
            for _ in range(batch)]
lat, codes, lock = [], {}, threading.Lock()
stop = time.monotonic() + seconds
def client():
    with httpx.Client(timeout=60) as c:
        while time.monotonic() < stop:
            t = time.perf_counter()
            r = c.post(url + "/verify", json={"items": items()})
            with lock:
                codes[r.status_code] = codes.get(r.status_code, 0) + 1
                if r.status_code == 200:
                    lat.append(time.perf_counter() - t)
                else:
                    time.sleep(0.05)
ts = [threading.Thread(target=client) for _ in range(clients)]
start = time.monotonic()
[t.start() for t in ts]; [t.join() for t in ts]
wall = time.monotonic() - start
lat.sort()
print(json.dumps({"wall_s": wall, "ok": codes.get(200, 0), "rejected_429": codes.get(429, 0), "codes": codes,
                  "requests_per_s": codes.get(200, 0) / wall, "items_per_s": codes.get(200, 0) * batch / wall,
                  "p50_s": lat[len(lat) // 2] if lat else None, "p99_s": lat[int(0.99 * (len(lat) - 1))] if lat else None}))
'''


def pool_rate(workers: int, n: int, kind: str) -> float:
    """``plain``: numbers on both sides (the demo; exact decimal fast path). ``latex``: fractions in LaTeX
    against decimals, which go through math-verify's parsing and comparison."""
    from rlpipe.rewards.pool import VerifierPool, VerifyItem

    rng = random.Random(0)
    if kind == "plain":
        items = [VerifyItem("math", f"\\boxed{{{rng.randint(0, 200)}}}", str(rng.randint(0, 200))) for _ in range(n)]
    else:
        items = [VerifyItem("math", f"so \\boxed{{\\frac{{{rng.randint(1, 9)}}}{{{rng.choice((2, 4, 5, 8))}}}}}",
                            str(rng.randint(1, 9) / 4)) for _ in range(n)]
    with VerifierPool(workers=workers, grace_s=10) as pool:
        pool.score(items[:50])  # warm-up: imports in the workers
        t = time.perf_counter()
        pool.score(items)
        return n / (time.perf_counter() - t)


def code_latency(n: int = 10) -> dict[str, float]:
    """Median seconds per verdict of the sandboxed code verifier, in-process (one sandbox run each)."""
    import statistics

    from rlpipe.rewards import get_verifier

    code = get_verifier("code")
    func, script = "def add(a, b):\n    return a + b\n", "print(sum(map(int, input().split())))\n"
    cases = {
        "tests_1": {"tests": ["assert add(1, 2) == 3"]},
        "tests_10": {"tests": [f"assert add({i}, {i}) == {2 * i}" for i in range(10)]},
        "io_1": {"io": [{"input": "1 2\n", "output": "3\n"}]},
        "io_20": {"io": [{"input": f"{i} {i}\n", "output": f"{2 * i}\n"} for i in range(20)]},
    }
    out = {}
    for name, gt in cases.items():
        times = []
        for _ in range(n):
            t = time.perf_counter()
            res = code(script if name.startswith("io") else func, json.dumps(gt))
            times.append(time.perf_counter() - t)
            assert (res.status, res.reward) == ("ok", 1.0), res
        out[name] = round(statistics.median(times), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="math items per pool measurement")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", default="/tmp/rlpipe-bench/verifier.json")
    a = ap.parse_args()
    sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # this checkout's code, a worktree's too (not the installed one)
    result: dict = {"code_s": code_latency(), "math_per_s": {k: {w: round(pool_rate(w, a.n if k == "plain" else a.n // 4, k), 1) for w in (1, 2)}
                                   for k in ("plain", "latex")}}

    from tests.helpers.s3server import free_port

    port = free_port()
    env = os.environ | {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    code = "import sys; from rlpipe.cli import main; sys.argv = ['rlpipe'] + sys.argv[1:]; main()"
    server = subprocess.Popen([sys.executable, "-c", code, "serve", "verifier", "--port", str(port), "--workers", "2",
                               "--max-queue", "8"], env=env, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        for _ in range(100):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        load = subprocess.run([sys.executable, "-c", LOAD, url, str(a.seconds), str(a.clients), str(a.batch)],
                              capture_output=True, text=True, timeout=a.seconds + 120)
        result["service"] = json.loads(load.stdout) | {"clients": a.clients, "batch": a.batch}
        result["service_metrics"] = httpx.get(f"{url}/stats").json()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(10)
    s = result["service"]
    print("| measurement | value |\n|---|---|")
    for k, v in result["code_s"].items():
        print(f"| code verdict, {k.replace('_', ' ')} (median s) | {v:.3f} |")
    for k in ("plain", "latex"):
        for w in (1, 2):
            print(f"| math verifications/s, {k}, {w} worker(s) | {result['math_per_s'][k][w]:.0f} |")
    print(f"| service: items/s ({a.clients} clients × batches of {a.batch}) | {s['items_per_s']:.0f} |")
    print(f"| service: latency p50 / p99 | {s['p50_s']:.3f} s / {s['p99_s']:.3f} s |")
    print(f"| service: 429 answers / ok requests | {s['rejected_429']} / {s['ok']} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
