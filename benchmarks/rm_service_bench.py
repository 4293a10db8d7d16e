"""Reward-model service throughput: items/s and p50/p99 latency under concurrent clients.

The service (`rlpipe serve reward-model`) runs in its own process on the demo-size model (3.4M
parameters, a fresh scalar head: speed does not depend on training); clients in a second process
send `/score` requests of `--batch` (prompt, response) items for `--seconds` each setting.

    .venv/bin/python benchmarks/rm_service_bench.py [--seconds 10] [--out rm_bench.json]

Prints a markdown table; writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LOAD = r'''
import json, random, sys, threading, time, httpx
url, seconds, clients, batch = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(0)
def items():
    out = []
    for _ in range(batch):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append({"prompt": f"{a}+{b}=", "response": str(a + b + rng.choice([0, 0, 1, -3, 10]))})
    return out
lat, codes, lock = [], {}, threading.Lock()
stop = time.monotonic() + seconds
def client():
    with httpx.Client(timeout=60) as c:
        while time.monotonic() < stop:
            t = time.perf_counter()
            r = c.post(url + "/score", json={"items": items()})
            with lock:
                codes[r.status_code] = codes.get(r.status_code, 0) + 1
                if r.status_code == 200:
                    lat.append(time.perf_counter() - t)
start = time.monotonic()
ts = [threading.Thread(target=client) for _ in range(clients)]
[t.start() for t in ts]; [t.join() for t in ts]
wall = time.monotonic() - start
lat.sort()
print(json.dumps({"clients": clients, "batch": batch, "requests": len(lat), "items_per_s": len(lat) * batch / wall,
                  "p50_s": lat[len(lat) // 2] if lat else None, "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
                  "codes": codes}))
'''


def _model(folder: Path) -> None:
    from rlpipe.config import ModelConfig
    from rlpipe.training.checkpoint import save_checkpoint
    from rlpipe.training.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    save_checkpoint(folder, build_tiny_model(ModelConfig(), tok, seed=0), tok, trainer_state={"kind": "bench"})


def _serve(folder: Path, port: int, log: Path) -> subprocess.Popen:
    import httpx

    code = "import sys; from rlpipe.cli import main; sys.argv = ['rlpipe'] + sys.argv[1:]; main()"
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "reward-model", str(folder), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=log.open("w"), start_new_session=True)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(log.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--out", type=Path, default=Path("rm_bench.json"))
    args = ap.parse_args()
    sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # this checkout's code, a worktree's too (not the installed one)
    from tests.helpers.s3server import free_port

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "rm"
        _model(folder)
        port = free_port()
        proc = _serve(folder, port, Path(tmp) / "serve.log")
        try:
            for clients, batch in ((1, 1), (1, 64), (4, 64), (16, 64), (4, 512)):
                out = subprocess.run([sys.executable, "-c", LOAD, f"http://127.0.0.1:{port}", str(args.seconds),
                                      str(clients), str(batch)], capture_output=True, text=True, timeout=args.seconds + 120)
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"clients {clients:>2} × batch {batch:>3}: {rows[-1]['items_per_s']:.0f} items/s", file=sys.stderr)
            import httpx

            metrics = httpx.get(f"http://127.0.0.1:{port}/stats").json()
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(20)
    print("| clients | items per request | items/s | p50 latency | p99 latency | non-200 |")
    print("|---:|---:|---:|---:|---:|---|")
    for r in rows:
        other = {k: v for k, v in r["codes"].items() if k != "200"}
        print(f"| {r['clients']} | {r['batch']} | {r['items_per_s']:,.0f} | {1000 * r['p50_s']:.1f} ms | "
              f"{1000 * r['p99_s']:.1f} ms | {other or 'none'} |")
    print(f"\nservice: {metrics['batches']} forward batches, {metrics['mean_batch_items']:.1f} items each on average "
          "(concurrent requests share a batch)")
    args.out.write_text(json.dumps({"rows": rows, "metrics": metrics}, indent=2))


if __name__ == "__main__":
    main()
