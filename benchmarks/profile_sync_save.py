"""The weight sync and the per-iteration save point at the demo size, outside Prefect.

    .venv/bin/python benchmarks/profile_sync_save.py --repeats 10

The untrained demo-size model (3.4M parameters, built from config): an in-process vLLM engine and the
DeepSpeed trainer, as a run holds them. Each repeat nudges the trainer's weights, saves the resumable state
(``PolicyTrainer.save``: HF weights + hash, DeepSpeed optimizer checkpoint, RNG) and syncs it into the engine
(``tasks.rl.sync_weights``: in-place reload, read-back, hash, probe on engine and trainer). Prints the median
seconds of each, then milliseconds per call of their parts from one cProfile of ``--repeats`` more.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PARTS = {  # (file suffix, function) → label
    ("vllm_engine.py", "load_weights"): "sync: reload, re-pack, read-back, hash",
    ("probe.py", "prove"): "sync: probe (engine + trainer)",
    ("vllm_engine.py", "sequence_logprobs"): "sync: probe on the engine",
    ("trainer.py", "sequence_logprobs"): "sync: probe on the trainer",
    ("saving.py", "export_weights"): "save: HF weights, config, hash",
    ("engine.py", "save_checkpoint"): "save: DeepSpeed checkpoint",
    ("weights.py", "weights_sha256"): "save + sync: sha256 of the weights",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("/tmp/rlpipe-bench/sync_save.json"))
    a = ap.parse_args()
    import torch
    from profile_update import untrained_policy
    from rlpipe.config import RunConfig
    from rlpipe.data import build_arithmetic
    from rlpipe.rollout.vllm_engine import VLLMEngine
    from rlpipe.runtime import RunServices, register_services
    from rlpipe.training.trainer import PolicyTrainer
    from rlpipe.runtime.assembly import start_probe
    from rlpipe.stages import UpdateDone
    from tasks.rl import sync_weights

    cfg = RunConfig()
    folder = untrained_policy(cfg)
    engine = VLLMEngine(folder, max_model_len=64)
    trainer = PolicyTrainer(model_dir=str(folder), cfg=cfg.train, seed=0)
    rows = [r for r in build_arithmetic(cfg.data).to_pylist() if r["split"] == "train"][:50]
    svc = RunServices("bench-sync", engine, trainer, None, engine.tokenizer, rows, [], {})
    register_services(svc)
    start_probe(svc, cfg)
    work = a.out.parent / "sync_save_state"

    def one(k: int) -> tuple[float, float]:
        with torch.no_grad():
            for p in trainer.engine.module.parameters():
                p.mul_(1.0001)  # a new policy each time, as after an update
        start = time.perf_counter()
        digest = trainer.save(work / f"s{k % 2}", extra_state={})
        saved = time.perf_counter() - start
        sync_weights.fn(cfg, "bench-sync", k, UpdateDone(metrics={}, update_s=0.0, save_s=0.0, read_s=0.0,
                                                          state_dir=str(work / f"s{k % 2}"), weights_sha256=digest))
        return saved, time.perf_counter() - start - saved

    one(0)  # warm-up
    runs = [one(k) for k in range(1, a.repeats + 1)]
    prof = cProfile.Profile()
    prof.enable()
    for k in range(a.repeats):
        one(100 + k)
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, function) → (calls, _, own, cumulative, _)
    parts = {label: round(1000 * sum(v[3] for (f, _, fn), v in stats.items() if f.endswith(suffix) and fn == func)
                          / a.repeats, 1) for (suffix, func), label in PARTS.items()}
    summary = {"save_s_median": round(statistics.median(r[0] for r in runs), 4),
               "sync_s_median": round(statistics.median(r[1] for r in runs), 4),
               "ms_per_iteration_under_cprofile": parts}
    print(json.dumps(summary, indent=1))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
