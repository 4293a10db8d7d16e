"""Environment calls: in-process, sandboxed on this machine, and through `rlpipe serve env`.

Runs calculator episodes (reset, calc, answer) three ways and prints calls/s and per-call latency
p50/p99. The service runs in this process (uvicorn in a thread) with ``--workers`` sandboxes; the
clients are ``--clients`` threads, each playing whole episodes.

    .venv/bin/python benchmarks/env_service.py --episodes 24 --workers 2 --clients 8   # ~1 min
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from rlpipe.envs import Episode, load_env_spec
from rlpipe.envs.experts import EXPERTS
from rlpipe.envs.sandboxed import SandboxOptions, remote_env, sandboxed_env


def play(make_env, spec, seed: int, times: list[float]) -> bool:
    expert = EXPERTS[spec.env]()
    env = make_env()
    ep = Episode(_Timed(env, times), {}, seed, spec.limits)
    obs = ep.start()
    while obs is not None:
        obs = ep.act(expert(obs))
    return ep.status == "ok" and ep.reward == 1.0


class _Timed:
    def __init__(self, env, times):
        self.env, self.times, self.name = env, times, getattr(env, "name", "?")

    def reset(self, task, seed):
        t = time.perf_counter()
        try:
            return self.env.reset(task, seed)
        finally:
            self.times.append(time.perf_counter() - t)

    def step(self, action):
        t = time.perf_counter()
        try:
            return self.env.step(action)
        finally:
            self.times.append(time.perf_counter() - t)


def measure(label: str, make_env, spec, episodes: int, clients: int) -> None:
    times: list[float] = []
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        ok = list(pool.map(lambda s: play(make_env, spec, s, times), range(episodes)))
    wall = time.perf_counter() - start
    q = sorted(times)
    print(f"| {label} | {len(times) / wall:,.1f} | {statistics.median(q) * 1000:.1f} | {q[int(0.99 * (len(q) - 1))] * 1000:.1f} | "
          f"{sum(ok)}/{episodes} |")


def main() -> None:
    import uvicorn

    from rlpipe.services.env import EnvService, create_app
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=24)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--clients", type=int, default=8)
    args = ap.parse_args()
    spec = load_env_spec("configs/envs/calculator.yaml")
    opts = SandboxOptions()
    sandboxed_env(spec, opts).reset({}, 0)  # build the sandbox's library copy once, outside the timings
    import socket

    with socket.socket() as probe:  # a free port on the loopback
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    service = EnvService(opts, workers=args.workers, max_queue=256)
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            httpx.get(f"{url}/health", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    print("| where | calls/s | p50 ms | p99 ms | episodes solved |")
    print("|---|---:|---:|---:|---:|")
    measure("in-process (agent.executor: local)", spec.make, spec, args.episodes * 20, 1)
    measure(f"sandboxed here, {args.clients} threads (executor: sandbox)", lambda: sandboxed_env(spec, opts), spec,
            args.episodes, args.clients)
    measure(f"service, {args.workers} sandboxes, {args.clients} clients", lambda: remote_env(spec, url), spec,
            args.episodes, args.clients)
    print("service /stats:", httpx.get(f"{url}/stats").json())
    server.should_exit = True


if __name__ == "__main__":
    main()
