"""A LoRA run's weight sync to a rollout replica: the adapter alone against the merged weights (issue 43).

    .venv/bin/python benchmarks/adapter_stream.py --out /tmp/rlpipe-bench/adapter-stream
    .venv/bin/python benchmarks/adapter_stream.py --model 3M --repeats 3                   # a quick look

The model of ``--model`` (scaling.py's configs, untrained; ``100M`` is hidden 768 × 12 layers, ~113M) is built
once under --out; one ``rlpipe serve rollout --lora-rank R`` replica (vLLM, its own process on 127.0.0.1) serves
it. A LoRA trainer in this process (rank ``--rank``, on ``--targets``) makes one update; then each repeat times
the two ways a sync can put its policy on the replica:

  adapter  what a run with rollout.lora_sync: adapter does: ``export_adapter`` (peft's files, written to a
           scratch folder) and ``ReplicatedEngine.load_adapter`` (one POST /adapter body; the replica checks it,
           writes it and hands it to vLLM). Bytes: the body sent.
  merged   what rollout.lora_sync: merged does with an in-process trainer: ``load_tensors`` of the merged
           weights and their hash already at hand (buckets streamed, decoded, hashed and reloaded). Bytes: the
           tensors' bytes.

The adapter runs first (the replica then holds the start model the adapter applies to) and its first load is
proven with the probe's float32 tolerance against the trainer's log-probs. After every sync the probe's forward is
timed too (vLLM reads an adapter from its folder only at the first request that uses it: that cost lands there). Medians of ``--repeats``; writes
results.json in --out and prints a table. Timings are only comparable on an otherwise idle machine: the load
average at the start and end is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT), str(ROOT / "benchmarks")]  # this checkout's code, not the installed one

from disaggregated import CLI, _env, _start, _stop  # noqa: E402 - the service processes, as that benchmark starts them
from scaling import MODELS, policy  # noqa: E402 - the model configs of the scaling benchmark

PROMPTS, CONTS = [[5, 6, 7, 8], [9, 10], [20, 21, 22]], [[11, 12, 13], [14, 15], [30, 31, 32, 33]]


def start_replica(out: Path, folder: Path, rank: int, store_uri: str):
    """One vLLM rollout service with LoRA support on ``folder``: (process, URL)."""
    from tests.helpers.s3server import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-c", CLI, "serve", "rollout", str(folder), "--port", str(port), "--max-model-len", "64",
           "--lora-rank", str(rank)]
    return _start(cmd, _env(out / "homes" / "replica", store_uri), out / "replica.log", [url], timeout_s=600), url


def trained(folder: Path, rank: int, targets: list[str]):
    """A LoRA trainer one update past the start model."""
    from rlpipe.config import TrainConfig
    from rlpipe.training.trainer import PolicyTrainer
    from tests.helpers.dist_update import fixed_batch

    cfg = TrainConfig(batch_size=16, micro_batch_size=8, lr=1e-2, lora={"r": rank, "alpha": 2.0 * rank,
                                                                       "target_modules": targets})
    trainer = PolicyTrainer(model_dir=str(folder), cfg=cfg, seed=0, max_new_tokens=5)
    trainer.update(fixed_batch(16), 0)
    return trainer


def adapter_sync(trainer, engine, scratch: Path, version: str) -> dict[str, float]:
    """One adapter sync: (export seconds, send seconds, bytes sent); checks the replica read the trainer's adapter."""
    t0 = time.perf_counter()
    sha = trainer.export_adapter(scratch)
    t1 = time.perf_counter()
    got = engine.load_adapter(scratch, version)
    t2 = time.perf_counter()
    if got != sha or engine.weights_sha256() != version:
        raise RuntimeError(f"the replica read adapter {got[:12]}, the trainer holds {sha[:12]}")
    return {"export_s": t1 - t0, "send_s": t2 - t1, "total_s": t2 - t0, "bytes": engine.replicas[0].last_sent,
            "probe_s": _first_use(engine)}


def _first_use(engine) -> float:
    """Seconds of the probe's forward right after a sync: vLLM reads an adapter only at the first request."""
    t0 = time.perf_counter()
    engine.sequence_logprobs(PROMPTS, CONTS)
    return time.perf_counter() - t0


def merged_sync(engine, tensors: dict, version: str) -> dict[str, float]:
    """One merged-weights stream of the trainer's tensors (hash at hand)."""
    t0 = time.perf_counter()
    if engine.load_tensors(tensors, version) != version:
        raise RuntimeError("the replica does not hold the merged weights after the stream")
    return {"total_s": time.perf_counter() - t0, "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "probe_s": _first_use(engine)}


def measure(out: Path, name: str, rank: int, targets: list[str], repeats: int) -> dict:
    from rlpipe.rollout.probe import default_tolerance, max_gap
    from rlpipe.rollout.remote import RemoteEngine, ReplicatedEngine
    from rlpipe.storage import open_store

    folder, params = policy(out, name)
    store = open_store(str(out / "store"))
    proc, url = start_replica(out, folder, rank, store.uri)
    try:
        engine = ReplicatedEngine([RemoteEngine(url, store, "bench", timeout_s=1800)], adapters=True)
        trainer = trained(folder, rank, targets)
        version, tensors = trainer.policy_tensors()
        adapter = [adapter_sync(trainer, engine, out / "handoff", version) for _ in range(repeats)]
        gap = max_gap(engine.sequence_logprobs(PROMPTS, CONTS), trainer.sequence_logprobs(PROMPTS, CONTS))
        if gap > default_tolerance(engine.dtype):
            raise RuntimeError(f"the replica with the adapter is {gap:.2e} from the trainer's log-probs")
        merged = [merged_sync(engine, tensors, version) for _ in range(repeats)]
    finally:
        _stop(proc)
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    row = {"model": name, "params": params, "rank": rank, "targets": targets, "repeats": repeats, "probe_gap": gap,
           "adapter_bytes": med(adapter, "bytes"), "adapter_export_s": med(adapter, "export_s"),
           "adapter_send_s": med(adapter, "send_s"), "adapter_s": med(adapter, "total_s"),
           "adapter_probe_s": med(adapter, "probe_s"), "merged_bytes": med(merged, "bytes"), "merged_s": med(merged, "total_s"),
           "merged_probe_s": med(merged, "probe_s"), "all": {"adapter": adapter, "merged": merged}}
    print(json.dumps({k: v for k, v in row.items() if k != "all"}), flush=True)
    return row


def table(r: dict) -> str:
    return "\n".join([
        "| model (params) | LoRA | adapter sync: bytes, s (export + send) | merged stream: bytes, s | bytes ÷ | s ÷ "
        "| probe forward after: adapter s, merged s |",
        "|---|---|---:|---:|---:|---:|---:|",
        f"| {r['model']} ({r['params'] / 1e6:.0f}M) | r={r['rank']} on {','.join(r['targets'])} | "
        f"{r['adapter_bytes'] / 1e6:.2f} MB, {r['adapter_s']:.3f} ({r['adapter_export_s']:.3f} + {r['adapter_send_s']:.3f}) | "
        f"{r['merged_bytes'] / 1e6:.0f} MB, {r['merged_s']:.2f} | {r['merged_bytes'] / r['adapter_bytes']:.0f}× | "
        f"{r['merged_s'] / r['adapter_s']:.1f}× | {r['adapter_probe_s']:.3f}, {r['merged_probe_s']:.3f} |"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/rlpipe-bench/adapter-stream"))
    ap.add_argument("--model", default="100M", choices=list(MODELS))
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default="q_proj,v_proj", help="comma-separated LoRA target modules")
    ap.add_argument("--repeats", type=int, default=3, help="syncs per way (the median is reported)")
    a = ap.parse_args()
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = {"date": str(date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
               "load_average_at_start": os.getloadavg(), "args": {k: str(v) for k, v in vars(a).items()}}
    row = measure(out, a.model, a.rank, a.targets.split(","), a.repeats)
    results |= {"row": row, "load_average_at_end": os.getloadavg()}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(row))
    print(f"load average at start {results['load_average_at_start']}, at end {results['load_average_at_end']}")


if __name__ == "__main__":
    main()
