"""rlpipe's GRPO loop, at the demo size or larger: seconds per iteration by stage, overhead share, engine tokens/s.

    .venv/bin/python benchmarks/grpo_loop.py --samples 8192 --out /tmp/rlpipe-bench/rlpipe.json
    .venv/bin/python benchmarks/grpo_loop.py --model-size 100M --sft-steps 200 --prompts-per-iter 8 \
        --completions-per-step 16 --samples 2048 --skip-engines --out /tmp/rlpipe-bench/sizes-100M/rlpipe-1.json

Uses its own RLPIPE_HOME (default /tmp/rlpipe-bench/home, or …/home-<size> with ``--model-size``): trains the
SFT base there once (the demo's data and SFT recipe; ``--model-size`` builds the model from config at one of
benchmarks/scaling.py's MODELS shapes, ``--sft-steps`` bounds its training), then
  1. generation throughput of the vLLM and the HF engine on that model, same prompts and settings
     (32 prompts × 8 samples, ≤8 new tokens, T=1), 3 timed repeats after one warm-up;
  2. a GRPO run of ``--samples`` completions (``--prompts-per-iter`` × ``--num-generations`` per iteration,
     256 by default; ``--completions-per-step`` per optimizer step) with held-out accuracy before/after,
     and the per-iteration stage breakdown from the run's history (``--set KEY=VALUE`` changes the
     run's config, e.g. ``rollout.async_steps=1``; ``--skip-engines`` skips step 1).
trl_grpo.py takes the same batch options, so both sides run identical settings (run_sizes.sh).
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
sys.path.insert(0, str(ROOT))

from benchmarks.scaling import MODELS  # noqa: E402  (the model shapes compared across benchmarks)


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

        seen, stamp = -1, None
        while not self._stop.wait(0.02):
            try:  # read only when the file moved: this thread shares the run's process (and its GIL)
                now = self.progress.stat().st_mtime_ns
                if now == stamp:
                    continue
                done = json.loads(self.progress.read_text()).get("completed_iteration", -1)
                stamp = now
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


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=8192, help="completion budget, rounded down to whole iterations")
    ap.add_argument("--home", default=None, help="RLPIPE_HOME (default /tmp/rlpipe-bench/home, or home-<size>)")
    ap.add_argument("--out", default="/tmp/rlpipe-bench/rlpipe.json")
    ap.add_argument("--engine", default="vllm")
    ap.add_argument("--model-size", choices=sorted(MODELS), default=None,
                    help="build the SFT base at this shape of benchmarks/scaling.py (default: the demo's model)")
    ap.add_argument("--sft-steps", type=int, default=None, help="at most this many SFT steps (default: the config's)")
    ap.add_argument("--prompts-per-iter", type=int, default=32, help="prompts per GRPO iteration (rollout.batch_size)")
    ap.add_argument("--num-generations", type=int, default=8, help="samples per prompt (rollout.samples_per_prompt)")
    ap.add_argument("--completions-per-step", type=int, default=64, help="completions per optimizer step (train.batch_size)")
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="completions per forward/backward (train.micro_batch_size; default: min(64, a step))")
    ap.add_argument("--eval-size", type=int, default=None, help="held-out questions per evaluation (default: all 500)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override of the GRPO run (repeatable), e.g. rollout.async_steps=1")
    ap.add_argument("--skip-engines", action="store_true", help="skip the engine throughput comparison (step 1)")
    a = ap.parse_args()
    per_iter = a.prompts_per_iter * a.num_generations
    if a.sft_steps is not None and a.sft_steps < 1:
        ap.error("--sft-steps must be at least 1")
    if per_iter % a.completions_per_step or a.completions_per_step % a.num_generations:
        ap.error(f"--completions-per-step {a.completions_per_step} must divide the {per_iter} completions per "
                 f"iteration and hold whole groups of --num-generations {a.num_generations}")
    if a.samples < per_iter:
        ap.error(f"--samples {a.samples} is below one iteration ({per_iter} completions)")
    a.home = a.home or ("/tmp/rlpipe-bench/home" + (f"-{a.model_size}" if a.model_size else ""))
    return a


def size_overrides(a: argparse.Namespace) -> list[str]:
    """The base model's shape and SFT steps (both runs) as config overrides; none for the demo's defaults."""
    sets = [f"model.{k}={v}" for k, v in MODELS[a.model_size].items()] if a.model_size else []
    return sets + ([f"sft.steps={a.sft_steps}"] if a.sft_steps else [])


def rl_overrides(a: argparse.Namespace, iterations: int) -> list[str]:
    """The GRPO run's batch settings (the same ones trl_grpo.py takes), only before and after evaluations."""
    micro = a.micro_batch or min(64, a.completions_per_step)
    sets = [f"rollout.batch_size={a.prompts_per_iter}", f"rollout.samples_per_prompt={a.num_generations}",
            f"train.batch_size={a.completions_per_step}", f"train.micro_batch_size={micro}",
            f"rollout.engine={a.engine}", f"train.total_iterations={iterations}",
            f"train.eval_interval={iterations}",  # only before and after, like the TRL script
            f"train.save_interval={iterations}"]
    return sets + ([f"train.eval_size={a.eval_size}"] if a.eval_size else [])


def base_model(cfg, a: argparse.Namespace) -> tuple[str, dict]:
    """The SFT base of this home (trained once, at ``cfg``'s model shape): its folder and SFT summary."""
    from flows.sft import sft
    from rlpipe.config import settings
    from rlpipe.tracking.mlflow_utils import Tracker
    from rlpipe.training.models import fetch_source

    s = settings()
    base = Tracker(s, cfg).version_by_alias(cfg.registered_model, "base")
    if base is None:
        summary = json.loads(Path(sft(config=cfg)).read_text())
        (Path(a.home) / "bench-sft-summary.json").write_text(json.dumps(summary, indent=2))
        base = Tracker(s, cfg).version_by_alias(cfg.registered_model, "base")
    model_dir = str(fetch_source(base.source, s))
    shape = json.loads((Path(model_dir) / "config.json").read_text())
    want = {"hidden_size": cfg.model.hidden_size, "num_hidden_layers": cfg.model.num_layers}
    if any(shape.get(k) != v for k, v in want.items()):
        sys.exit(f"[bench] the base model in --home {a.home} has {({k: shape.get(k) for k in want})}, not the "
                 f"--model-size's {want}; pass another --home (one per size)")
    summary_file = Path(a.home) / "bench-sft-summary.json"
    sft_summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    keys = ("model_parameters", "sft_steps", "sft_train_s", "heldout_accuracy_before", "heldout_accuracy_after", "heldout_n")
    return model_dir, {k: sft_summary.get(k) for k in keys}


def engines(cfg, model_dir: str, skip: bool) -> dict:
    """Step 1: each engine's generation throughput on the base (none with ``--skip-engines``)."""
    from rlpipe.data import build_arithmetic
    from rlpipe.rollout.engines import close_engines
    from transformers import AutoTokenizer

    result = {}
    if not skip:
        tok = AutoTokenizer.from_pretrained(model_dir)
        rows = [r for r in build_arithmetic(cfg.data).to_pylist() if r["split"] == "train"][:32]
        prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
        for kind in ("vllm", "hf"):
            result[kind] = engine_throughput(kind, model_dir, prompts)
            print(f"[bench] {kind}: {result[kind]}", flush=True)
    close_engines()
    return result


def rl_result(a: argparse.Namespace, rl, summary: dict, history: list[dict], wall: float, cpu: CpuPerIteration) -> dict:
    """The GRPO run's figures: accuracy before/after and the steady iterations' stage means."""
    # The first iteration includes one-off warm-ups. Each iteration's total is the parent's wall between two
    # iterations' marks (flows/train.py), so the parent's work between iterations is counted too.
    # The last iteration also writes the run's final save point (seconds at ~110M): the "_excl_last" figures leave it
    # out, as TRL's timed iterations save nothing (scaling.py's window).
    steady = history[1:] or history
    inner = history[1:-1] if len(history) > 2 else steady
    per_iter = rl.rollout.batch_size * rl.rollout.samples_per_prompt

    def mean(key: str, rows: list[dict] = steady) -> float:
        return round(statistics.fmean(h.get(key, 0.0) for h in rows), 3)

    stages = ("generate_s", "verify_s", "update_s", "sync_s", "save_s")

    return {
        "engine": a.engine,
        "overrides": a.set,
        "iterations": rl.train.total_iterations,
        "completions": rl.train.total_iterations * per_iter,
        "settings": {"prompts_per_iteration": rl.rollout.batch_size, "num_generations": rl.rollout.samples_per_prompt,
                     "completions_per_iteration": per_iter, "completions_per_optimizer_step": rl.train.batch_size,
                     "micro_batch_size": rl.train.micro_batch_size, "max_new_tokens": rl.rollout.max_new_tokens,
                     "learning_rate": rl.train.lr, "eval_size": rl.train.eval_size},
        "accuracy_before": summary["heldout_accuracy_base"],
        "accuracy_after": summary["heldout_accuracy_final"],
        "run_wall_s": round(wall, 1),
        "seconds_per_iteration": mean("time/iteration_total_s"),
        "seconds_per_iteration_excl_eval": round(mean("time/iteration_total_s") - mean("time/eval_s"), 3),
        "seconds_per_iteration_excl_eval_and_last": round(mean("time/iteration_total_s", inner) - mean("time/eval_s", inner), 3),
        "stage_seconds_per_iteration": {k: mean(f"time/{k}") for k in stages}
        | {"inside_iteration_overhead_s": mean("time/overhead_s"),
           "flow_run_start_finish_s": round(mean("time/iteration_total_s") - mean("time/iteration_s"), 3)},
        "stage_seconds_per_iteration_excl_last": {k: mean(f"time/{k}", inner) for k in stages}
        | {"inside_iteration_overhead_s": mean("time/overhead_s", inner),
           "flow_run_start_finish_s": round(mean("time/iteration_total_s", inner) - mean("time/iteration_s", inner), 3)},
        "last_iteration_s": round(history[-1].get("time/iteration_total_s", 0.0) - history[-1].get("time/eval_s", 0.0), 3),
        "cpu_s_per_iteration": cpu.per_iteration(),  # the process tree's, Prefect server and verifier workers included
        "overhead_share": round(statistics.fmean(h["time/overhead_total_share"] for h in steady), 4),
        "train_tokens_per_s": mean("throughput/train_tokens_per_s"),
        "generated_ahead_s": mean("rollout/ahead_generate_s"),  # rollout.async_steps: generation beside the update
    }


def main() -> None:
    a = parse_args()
    os.environ["RLPIPE_HOME"] = a.home
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    # This checkout's code, a worktree's too, not the installed one; in the processes it starts as well.
    sys.path[:0] = [str(ROOT / "src"), str(ROOT)]
    inherited = [p for p in [os.environ.get("PYTHONPATH")] if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)] + inherited)

    from flows.train import train
    from rlpipe.config import load_config, settings
    from rlpipe.history import read_history

    cfg = load_config(None, size_overrides(a))
    model_dir, sft_summary = base_model(cfg, a)
    print(f"[bench] base model {model_dir} {sft_summary}", flush=True)
    result: dict = {"base_model": model_dir, "model_size": a.model_size or "demo", "sft": sft_summary,
                    "engines": engines(cfg, model_dir, a.skip_engines)}

    iterations = max(1, a.samples // (a.prompts_per_iter * a.num_generations))
    rl = load_config(None, size_overrides(a) + rl_overrides(a, iterations) + a.set)
    rl.task.policy_model = f"models:/{cfg.registered_model}@base"
    run_id = f"bench-{int(time.time())}"
    s = settings()
    t = time.perf_counter()
    with CpuPerIteration(s.run_dir(run_id) / "progress.json") as cpu:
        summary = json.loads(Path(train(config=rl, run_id=run_id)).read_text())
    wall = time.perf_counter() - t
    result["rl"] = rl_result(a, rl, summary, read_history(s.run_dir(run_id)), wall, cpu)
    print(json.dumps(result, indent=2))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
