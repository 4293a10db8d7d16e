"""rlpipe's GRPO loop at the demo size: seconds per iteration by stage, overhead share, engine tokens/s.

    .venv/bin/python benchmarks/grpo_loop.py --samples 8192 --out /tmp/rlpipe-bench/rlpipe.json

Uses its own RLPIPE_HOME (default /tmp/rlpipe-bench/home): trains the SFT base there once (the
demo's settings), then
  1. generation throughput of the vLLM and the HF engine on that model, same prompts and settings
     (32 prompts × 8 samples, ≤8 new tokens, T=1), 3 timed repeats after one warm-up;
  2. a GRPO run of ``--samples`` completions (256 per iteration) with held-out accuracy before/after,
     and the per-iteration stage breakdown from the run's history (``--set KEY=VALUE`` changes the
     run's config, e.g. ``rollout.async_steps=1``; ``--skip-engines`` skips step 1).
Prints and writes one JSON. Timings are only comparable on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def engine_throughput(kind: str, model_dir: str, prompts: list[list[int]], repeats: int = 3) -> dict[str, float]:
    from rlpipe.rollout.base import SamplingConfig
    from rlpipe.rollout.engines import get_engine

    t0 = time.perf_counter()
    engine = get_engine(kind, model_dir, max_model_len=64)
    start_s = time.perf_counter() - t0
    sampling = SamplingConfig(n=8, temperature=1.0, max_new_tokens=8, seed=0)
    engine.generate(prompts, sampling)  # warm-up
    rates = []
    for r in range(repeats):
        t = time.perf_counter()
        outs = engine.generate(prompts, SamplingConfig(n=8, temperature=1.0, max_new_tokens=8, seed=r + 1))
        dt = time.perf_counter() - t
        rates.append(sum(len(c.token_ids) for o in outs for c in o) / dt)
    return {"start_s": round(start_s, 2), "tokens_per_s": round(statistics.median(rates), 1),
            "seconds_per_256_completions": round(256 * 3.5 / statistics.median(rates), 3)}


class CpuPerIteration:
    """CPU-seconds of this process tree (the Prefect server and verifier workers are its children) at each
    iteration's end, read when the run's progress.json moves: work done per iteration, steadier than wall time
    on a shared machine (``cpu_s_per_iteration``: the slope between the first iteration and the last)."""

    def __init__(self, progress: Path):
        import psutil

        self.progress, self.proc, self.marks = progress, psutil.Process(), []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="bench-cpu", daemon=True)

    def _watch(self) -> None:
        from rlpipe.tracking.resources import tree_cpu_s

        seen = -1
        while not self._stop.wait(0.02):
            try:
                done = json.loads(self.progress.read_text()).get("completed_iteration", -1)
            except (OSError, ValueError):  # not written yet, or caught mid-replace
                continue
            if done > seen:
                seen = done
                self.marks.append((done, tree_cpu_s(self.proc)))

    def __enter__(self) -> "CpuPerIteration":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def per_iteration(self) -> float | None:
        if len(self.marks) < 4:
            return None
        # From the first iteration's end to the one before the last (whose held-out evaluation is not the loop's).
        (k0, c0), (k1, c1) = self.marks[1], self.marks[-2]
        return round((c1 - c0) / (k1 - k0), 3) if k1 > k0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=8192, help="completion budget (256 per iteration)")
    ap.add_argument("--home", default="/tmp/rlpipe-bench/home")
    ap.add_argument("--out", default="/tmp/rlpipe-bench/rlpipe.json")
    ap.add_argument("--engine", default="vllm")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override of the GRPO run (repeatable), e.g. rollout.async_steps=1")
    ap.add_argument("--skip-engines", action="store_true", help="skip the engine throughput comparison (step 1)")
    a = ap.parse_args()
    os.environ["RLPIPE_HOME"] = a.home
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    # This checkout's code, a worktree's too, not the installed one; in the processes it starts as well.
    sys.path[:0] = [str(ROOT / "src"), str(ROOT)]
    inherited = [p for p in [os.environ.get("PYTHONPATH")] if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)] + inherited)

    from flows.sft import sft
    from flows.train import train
    from rlpipe.config import RunConfig, load_config, settings
    from rlpipe.history import read_history
    from rlpipe.tracking.mlflow_utils import Tracker
    from rlpipe.training.models import fetch_source

    cfg = RunConfig()
    s = settings()
    base = Tracker(s, cfg).version_by_alias(cfg.registered_model, "base")
    if base is None:
        sft(config=cfg)
        base = Tracker(s, cfg).version_by_alias(cfg.registered_model, "base")
    model_dir = str(fetch_source(base.source, s))
    print(f"[bench] base model {model_dir}", flush=True)

    from rlpipe.data import build_arithmetic
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [r for r in build_arithmetic(cfg.data).to_pylist() if r["split"] == "train"][:32]
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    result: dict = {"base_model": model_dir, "engines": {}}
    for kind in () if a.skip_engines else ("vllm", "hf"):
        result["engines"][kind] = engine_throughput(kind, model_dir, prompts)
        print(f"[bench] {kind}: {result['engines'][kind]}", flush=True)
    from rlpipe.rollout.engines import close_engines

    close_engines()

    iterations = max(1, a.samples // 256)
    rl = load_config(None, a.set) if a.set else cfg.model_copy(deep=True)
    rl.task.policy_model = f"models:/{cfg.registered_model}@base"
    rl.rollout.engine = a.engine
    rl.train.total_iterations = iterations
    rl.train.eval_interval = iterations  # only before and after, like the TRL script
    rl.train.save_interval = iterations
    run_id = f"bench-{int(time.time())}"
    t = time.perf_counter()
    with CpuPerIteration(s.run_dir(run_id) / "progress.json") as cpu:
        summary = json.loads(Path(train(config=rl, run_id=run_id)).read_text())
    wall = time.perf_counter() - t
    history = read_history(s.run_dir(run_id))
    # The first iteration includes one-off warm-ups. Each iteration's total is the parent's wall between two
    # iterations' marks (flows/train.py), so the parent's work between iterations is counted too.
    steady = history[1:] or history

    def mean(key: str) -> float:
        return round(statistics.fmean(h.get(key, 0.0) for h in steady), 3)

    result["rl"] = {
        "engine": a.engine,
        "overrides": a.set,
        "iterations": iterations,
        "completions": iterations * 256,
        "accuracy_before": summary["heldout_accuracy_base"],
        "accuracy_after": summary["heldout_accuracy_final"],
        "run_wall_s": round(wall, 1),
        "seconds_per_iteration": mean("time/iteration_total_s"),
        "seconds_per_iteration_excl_eval": round(mean("time/iteration_total_s") - mean("time/eval_s"), 3),
        "stage_seconds_per_iteration": {k: mean(f"time/{k}") for k in ("generate_s", "verify_s", "update_s", "sync_s", "save_s")}
        | {"inside_iteration_overhead_s": mean("time/overhead_s"),
           "flow_run_start_finish_s": round(mean("time/iteration_total_s") - mean("time/iteration_s"), 3)},
        "cpu_s_per_iteration": cpu.per_iteration(),  # the process tree's, Prefect server and verifier workers included
        "overhead_share": round(statistics.fmean(h["time/overhead_total_share"] for h in steady), 4),
        "train_tokens_per_s": mean("throughput/train_tokens_per_s"),
        "generated_ahead_s": mean("rollout/ahead_generate_s"),  # rollout.async_steps: generation beside the update
    }
    print(json.dumps(result, indent=2))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
