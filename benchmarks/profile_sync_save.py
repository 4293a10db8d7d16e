"""The weight sync and the save point, outside Prefect: through files (as every iteration did until issue 43)
and in memory (now), at the demo size and at ~110M parameters.

    .venv/bin/python benchmarks/profile_sync_save.py --sizes 3M,100M --repeats 5
    .venv/bin/python benchmarks/profile_sync_save.py --sizes 3M --engine hf

An untrained model of each size (``scaling.py``'s MODELS, built from config), an in-process engine and the
DeepSpeed trainer after one optimizer step (so that AdamW's moments exist), as a run holds them. Each repeat nudges the trainer's weights (a new policy, as after an
update) and times:

- ``files``: the resumable state written (``PolicyTrainer.save``: HF weights, DeepSpeed optimizer state, RNG,
  over the spare save point's files) and the engine reloaded from that folder (hash of what it read,
  read-back), then the probe: what every iteration paid before.
- ``memory``: the hash of the trainer's tensors, taken once (``policy_tensors``), and the engine fed those
  tensors (``load_tensors``, read-back), then the probe, one after the other.
- ``overlapped``: the same work as the update and sync tasks do it now: the hash on a thread of its own
  (``handoff``) and the trainer's side of the probe on another (``trainer_ahead``) while the engine takes the
  tensors, then the engine's side of the probe while the hash may still run: what an iteration between save
  points pays now.
- ``save point``: the part of a save the iteration waits for with ``train.async_save`` (hash, trainer state,
  RNG taken) and the writing that runs on a thread meanwhile.

Prints one JSON object per size (medians over ``--repeats``) and writes them to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _nudge(trainer) -> None:
    import torch

    with torch.no_grad():
        for p in trainer.engine.module.parameters():
            p.mul_(1.0001)
    trainer._handoff = None  # what an update does: the weights changed


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


def measure(size: str, engine_kind: str, repeats: int, home: Path, sets: tuple[str, ...] = ()) -> dict:
    from scaling import policy

    from rlpipe.config import RunConfig, load_config
    from rlpipe.data import build_arithmetic
    from rlpipe.rollout.engines import new_engine
    from rlpipe.rollout.probe import load_policy
    from rlpipe.runtime import RunServices, register_services, stop_services
    from rlpipe.runtime.assembly import start_probe
    from rlpipe.training.trainer import PolicyTrainer

    folder, params = policy(home, size)
    cfg = load_config(None, list(sets)) if sets else RunConfig()
    engine = new_engine(engine_kind, folder, max_model_len=64)
    trainer = PolicyTrainer(model_dir=str(folder), cfg=cfg.train, seed=0)
    rows = [r for r in build_arithmetic(cfg.data).to_pylist() if r["split"] == "train"][:50]
    svc = RunServices(f"bench-sync-{size}", engine, trainer, None, engine.tokenizer, rows, [], {})
    register_services(svc)
    if cfg.train.precision == "bf16_weights":  # the start weights rounded: the engine takes them (as build_services)
        load_policy(engine, None, None, -1, trainer=trainer)
    start_probe(svc, cfg)
    from tests.helpers.dist_update import fixed_batch

    trainer.update(fixed_batch(cfg.train.batch_size), 0)  # AdamW's moments exist only after a first step
    work = home / f"sync-save-{size}"
    t: dict[str, list[float]] = {k: [] for k in ("files_save", "files_sync", "files_probe", "memory_hash",
                                                 "memory_sync", "memory_probe", "overlapped", "point_wait",
                                                 "point_write")}

    def one(k: int, keep: bool) -> None:
        _nudge(trainer)
        a = time.perf_counter()
        digest = trainer.save(work / f"s{k % 2}", extra_state={}, spare=work / f"s{(k + 1) % 2}" if k else None)
        b = time.perf_counter()
        load_policy(engine, work / f"s{k % 2}", digest, k)
        c = time.perf_counter()
        svc.proof.prove(engine, trainer, f"files {k}")
        d = time.perf_counter()
        _nudge(trainer)
        digest, _ = trainer.policy_tensors()  # the hash alone, as the sync waited for it before it ran on a thread
        e = time.perf_counter()
        load_policy(engine, None, digest, k, trainer=trainer)
        f = time.perf_counter()
        svc.proof.prove(engine, trainer, f"memory {k}")
        g = time.perf_counter()
        _nudge(trainer)  # now: what the update and the sync tasks do, the hash and the trainer's probe on threads
        e2 = time.perf_counter()
        trainer.handoff()
        side = svc.proof.trainer_ahead(trainer)
        load_policy(engine, None, None, k, trainer=trainer,
                    meanwhile=lambda: svc.proof.prove(engine, trainer, f"overlapped {k}", side))  # noqa: B023
        f2 = time.perf_counter()
        _, write = trainer.plan_save(work / f"s{k % 2}", extra_state={}, spare=work / f"s{(k + 1) % 2}")
        h = time.perf_counter()
        write()
        i = time.perf_counter()
        if keep:
            for key, x in zip(t, (b - a, c - b, d - c, e - d, f - e, g - f, f2 - e2, h - f2, i - h)):
                t[key].append(x)

    one(0, keep=False)  # warm-up: first writes, DeepSpeed's first checkpoint
    for k in range(1, repeats + 1):
        one(k, keep=True)
    stop_services(svc.run_id)
    engine.close()
    m = {k: _median(v) for k, v in t.items()}
    return {"size": size, "params": params, "engine": engine_kind, "repeats": repeats, "sets": list(sets), **m,
            "files_per_iteration_s": round(m["files_save"] + m["files_sync"] + m["files_probe"], 4),
            "memory_per_iteration_s": round(m["memory_hash"] + m["memory_sync"] + m["memory_probe"], 4),
            "overlapped_per_iteration_s": m["overlapped"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="3M,100M", help="comma-separated keys of scaling.py's MODELS (3M, 30M, 100M)")
    ap.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--home", type=Path, default=Path(tempfile.gettempdir()) / "rlpipe-bench" / "sync-save")
    ap.add_argument("--out", type=Path, default=Path("/tmp/rlpipe-bench/sync_save.json"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="run config overrides (e.g. train.precision=bf16_weights)")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(2)
    results = []
    for size in a.sizes.split(","):
        r = measure(size, a.engine, a.repeats, a.home, tuple(a.set))
        print(json.dumps(r), flush=True)
        results.append(r)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
