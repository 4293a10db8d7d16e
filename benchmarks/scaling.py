"""GRPO iteration time as the batch, the response length and the model grow, and which stage dominates (issue 16).

    .venv/bin/python benchmarks/scaling.py --out /tmp/rlpipe-bench/scaling.json            # all three axes
    .venv/bin/python benchmarks/scaling.py --axis model --iterations 5 --engine hf           # one axis, HF engine
    .venv/bin/python benchmarks/scaling.py --quick                                           # smoke test, minutes

Each point is one short ``rlpipe run`` (a subprocess with its own temporary Prefect server; every point in the
same ``--home``, an RLPIPE_HOME of its own) on the arithmetic task, from an untrained Qwen2 built from config
(its skill does not change the cost of an iteration, only how long its responses are: they end at EOS at
random, so the measured mean response length is reported beside ``max_new_tokens``). GRPO with 8 samples per
prompt, 4 optimizer steps per iteration (``train.batch_size`` = completions / 4, micro-batches of at most 64),
held-out accuracy (20 questions) and the one save point (resumable state, MLflow version) at the end; with
``--save-interval N`` a save point every N iterations (since issue 43 the state is written only at save points;
before, every iteration). The "sync" column includes the new weights' hash, taken once at the update's end.
With ``--save-interval`` the JSON also gives ``save_point_cost_s``: what one save point adds, read within the run
(each save point's iteration and the next, beside which its state is written and uploaded, against the others).

Axes (a point shared by two axes runs once):
  batch   the ~3.4M-parameter default model, ≤8 new tokens: 64, 256, 1024 completions per iteration
          (8, 32, 128 prompts × 8 samples);
  length  the same model, 256 completions: ≤8, 32, 128 new tokens (prompt + response stay within its 256
          positions);
  model   64 completions, ≤8 new tokens: ~3.4M (default), ~34M (hidden 512, 8 layers, 8 heads, MLP 2048) and
          ~113M parameters (hidden 768, 12 layers, 12 heads, MLP 3072); the count actually built is printed.

Per point, from the run's history: the mean over the iterations after the first (which carries one-off
warm-ups) and before the last (which carries the end-of-run evaluation and save point; with 2 iterations the
last is all there is) of the iteration as the parent flow sees it (evaluation excluded), each stage's seconds
and share — generate, verify, update, sync (weight reload + hash check), save (the trainer's resumable state),
other (Parquet, MLflow, task runs, the iteration flow run's start/finish) — the time outside generation,
scoring and the optimizer, the dominant stage, generated tokens/s and trained response tokens/s. Prints a
markdown table per axis (for benchmarks/README.md) and writes one JSON. Each run's log goes to
``<home>/logs/<run id>.log``. Timings are only comparable on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SAMPLES_PER_PROMPT = 8
STEPS_PER_ITERATION = 4
MODELS: dict[str, dict[str, int]] = {
    "3M": {},  # the default ModelConfig
    "30M": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "intermediate_size": 2048},
    "100M": {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "intermediate_size": 3072},
}
# Hub-format stand-ins (rlpipe.training.standin, as issue 17's tests use): a byte-level BPE tokenizer with the family's
# chat template, 16-bit safetensors, generation_config.json; ~105M parameters.
HUB_MODELS: dict[str, dict[str, Any]] = {
    "100M-llama": {"arch": "llama", "hidden": 768, "layers": 12, "heads": 12, "kv_heads": 4, "intermediate": 3072},
}
STAGES = ("generate", "verify", "update", "sync", "save", "other")


@dataclass(frozen=True)
class Point:
    model: str
    completions: int
    max_new_tokens: int


AXES: dict[str, tuple[str, list[Point]]] = {
    "batch": ("completions per iteration (3M model, ≤8 new tokens)", [Point("3M", c, 8) for c in (64, 256, 1024)]),
    "length": ("response length (3M model, 256 completions)", [Point("3M", 256, t) for t in (8, 32, 128)]),
    "model": ("model size (64 completions, ≤8 new tokens)", [Point(m, 64, 8) for m in [*MODELS, *HUB_MODELS]]),
}


def policy(home: Path, name: str) -> tuple[Path, int]:
    """The untrained model ``name`` as a checkpoint folder (built once per home) and its parameter count: one of
    rlpipe's own MODELS (character tokenizer, float32), or one of HUB_MODELS (a hub-format stand-in)."""
    from rlpipe.config import ModelConfig
    from rlpipe.training.checkpoint import save_checkpoint
    from rlpipe.training.tiny import build_char_tokenizer, build_tiny_model

    folder = home / "models" / name
    if name in HUB_MODELS:
        return hub_policy(folder, name)
    tok = build_char_tokenizer()
    model = build_tiny_model(ModelConfig(**MODELS[name]), tok, seed=0)
    if not (folder / "config.json").exists():
        save_checkpoint(folder, model, tok, trainer_state={"kind": "init"})
    return folder, sum(p.numel() for p in model.parameters())


def hub_policy(folder: Path, name: str) -> tuple[Path, int]:
    """The hub-format stand-in ``name`` (built once per home) and its parameter count, read from its weights."""
    from safetensors import safe_open

    from rlpipe.training.standin import build_standin

    if not (folder / "config.json").exists():
        build_standin(folder, **HUB_MODELS[name])
    with safe_open(folder / "model.safetensors", "pt") as f:
        return folder, sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def overrides(p: Point, folder: Path, iterations: int, engine: str, save_interval: int | None = None) -> list[str]:
    train_batch = p.completions // STEPS_PER_ITERATION
    return [f"task.policy_model={folder}", "task.name=scaling", "tracking.experiment=scaling", f"rollout.engine={engine}",
            f"rollout.batch_size={p.completions // SAMPLES_PER_PROMPT}", f"rollout.samples_per_prompt={SAMPLES_PER_PROMPT}",
            f"rollout.max_new_tokens={p.max_new_tokens}", f"train.batch_size={train_batch}",
            f"train.micro_batch_size={min(64, train_batch)}", f"train.total_iterations={iterations}",
            f"train.save_interval={save_interval or iterations}", f"train.eval_interval={iterations}", "train.eval_size=20",
            # An untrained model scores 0 on every answer: that alert (critical) would hold the run.
            "alerts.reward_flat.enabled=false", "tracking.system_metrics_s=null"]


def run(sets: list[str], env: dict[str, str], run_id: str, log: Path) -> float:
    """One ``rlpipe run`` with its output in ``log``; its wall time in seconds (exits with the log's tail on failure)."""
    cmd = [sys.executable, "-c", "import sys; from rlpipe.cli import main; sys.argv = ['rlpipe'] + sys.argv[1:]; main()",
           "run", "--run-id", run_id, *[x for s in sets for x in ("--set", s)]]
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with log.open("w") as out:
        rc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        print("".join(log.read_text().splitlines(keepends=True)[-40:]), file=sys.stderr)
        sys.exit(f"[scaling] rlpipe run {run_id} failed (exit {rc}); whole log: {log}")
    return time.perf_counter() - start


def measure(history: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over the steady iterations (see the module docstring) of the history's timings and throughputs."""
    window = history[1:-1] if len(history) > 2 else history[-1:]

    def mean(key: str) -> float:
        return statistics.fmean(h.get(key, 0.0) for h in window)

    total = mean("time/iteration_total_s") - mean("time/eval_s")
    seconds = {k: mean(f"time/{k}_s") for k in STAGES[:-1]}
    seconds["sync"] += mean("trainer/hash_s")  # the new weights' hash, taken once at the update's end (since issue 43)
    seconds["other"] = total - sum(seconds.values())
    overhead = total - seconds["generate"] - seconds["verify"] - seconds["update"]
    return {
        "iterations_measured": [h["iteration"] for h in window],
        "mean_response_tokens": round(mean("response_length_mean"), 2),
        "truncated_share": round(mean("truncated_share"), 3),
        "seconds_per_iteration": round(total, 3),
        "stage_seconds": {k: round(v, 3) for k, v in seconds.items()},
        "stage_share": {k: round(v / total, 3) for k, v in seconds.items()},
        "overhead_s": round(overhead, 3),
        "overhead_share": round(overhead / total, 3),
        "flow_run_start_finish_s": round(mean("time/iteration_total_s") - mean("time/iteration_s"), 3),
        "dominant": max(seconds, key=seconds.__getitem__),
        "generate_tokens_per_s": round(mean("throughput/generate_tokens_per_s"), 1),
        "train_tokens_per_s": round(mean("throughput/train_tokens_per_s"), 1),
    }


def save_point_cost(history: list[dict[str, Any]], save_interval: int | None) -> float | None:
    """Seconds a save point adds, read within one run: each steady save point's iteration and the one after it
    (its state is written and uploaded beside that one) against twice the mean of the other steady iterations
    (evaluation left out). None without a save point inside the steady window."""
    if not save_interval:
        return None
    totals = {h["iteration"]: h["time/iteration_total_s"] - h.get("time/eval_s", 0.0) for h in history[1:-1]}
    points = [k for k in totals if (k + 1) % save_interval == 0 and k + 1 in totals]
    rest = [v for k, v in totals.items() if k not in {j for p in points for j in (p, p + 1)}]
    if not points or not rest:
        return None
    base = statistics.fmean(rest)
    return round(statistics.fmean(totals[p] + totals[p + 1] - 2 * base for p in points), 3)


def table(title: str, results: list[dict[str, Any]]) -> str:
    """One axis as a markdown table: seconds per iteration, each stage's seconds (share), the dominant stage."""
    head = (["params", "completions", "max new tokens", "mean response tokens", "s / iteration"] + list(STAGES)
            + ["outside generate/verify/update", "dominant", "generated tok/s", "trained tok/s"])
    align = ["---" if h == "dominant" else "---:" for h in head]
    lines = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for r in results:
        cells = [f"{r['params'] / 1e6:.1f}M", str(r["completions"]), str(r["max_new_tokens"]),
                 f"{r['mean_response_tokens']:.1f}", f"{r['seconds_per_iteration']:.3f}"]
        cells += [f"{r['stage_seconds'][k]:.3f} ({100 * r['stage_share'][k]:.0f}%)" for k in STAGES]
        cells += [f"{r['overhead_s']:.3f} ({100 * r['overhead_share']:.0f}%)", r["dominant"],
                  f"{r['generate_tokens_per_s']:,.0f}", f"{r['train_tokens_per_s']:,.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plan(axes: list[str], quick: bool) -> dict[str, list[Point]]:
    """The points of each chosen axis (``--quick``: its smallest only)."""
    return {a: AXES[a][1][:1] if quick else AXES[a][1] for a in axes}


def measure_point(p: Point, home: Path, iterations: int, engine: str, env: dict[str, str],
                  save_interval: int | None = None, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """Build (once) the point's model, run it, and read its history."""
    from rlpipe.config import settings
    from rlpipe.history import read_history

    folder, params = policy(home, p.model)
    run_id = f"scaling-{p.model}-c{p.completions}-t{p.max_new_tokens}-{int(time.time())}"
    wall = run(overrides(p, folder, iterations, engine, save_interval) + list(extra), env, run_id,
               home / "logs" / f"{run_id}.log")
    history = read_history(settings(env).run_dir(run_id))
    return (asdict(p) | {"params": params, "run_id": run_id, "run_wall_s": round(wall, 1), "sets": list(extra)} | measure(history)
            | {"save_interval": save_interval, "save_point_cost_s": save_point_cost(history, save_interval)})


def run_all(points: list[Point], home: Path, iterations: int, engine: str,
            env: dict[str, str], save_interval: int | None = None, extra: tuple[str, ...] = ()) -> dict[Point, dict[str, Any]]:
    """Each point once, in order, with a progress line before and after."""
    done: dict[Point, dict[str, Any]] = {}
    start, n = time.perf_counter(), len(points)
    for k, p in enumerate(points, 1):
        print(f"[scaling] point {k}/{n}: {p.model} model, {p.completions} completions, ≤{p.max_new_tokens} new tokens, "
              f"{iterations} iterations ({time.perf_counter() - start:.0f} s elapsed)", flush=True)
        done[p] = r = measure_point(p, home, iterations, engine, env, save_interval, extra)
        cost = f", a save point adds {r['save_point_cost_s']:.2f} s" if r["save_point_cost_s"] is not None else ""
        print(f"[scaling] point {k}/{n} done: {r['params']:,} params, {r['seconds_per_iteration']:.3f} s/iteration, "
              f"dominant {r['dominant']}{cost}, run {r['run_wall_s']:.0f} s ({time.perf_counter() - start:.0f} s elapsed)",
              flush=True)
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--axis", choices=[*AXES, "all"], default="all")
    ap.add_argument("--iterations", type=int, default=5, help="iterations per point (at least 2)")
    ap.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    ap.add_argument("--home", type=Path, default=Path("/tmp/rlpipe-bench/scaling"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/rlpipe-bench/scaling.json"))
    ap.add_argument("--quick", action="store_true", help="smoke test: 2 iterations, the smallest point of each axis")
    ap.add_argument("--models", default=None, help="only the points of these MODELS keys (comma-separated, e.g. 100M)")
    ap.add_argument("--save-interval", type=int, default=None,
                    help="train.save_interval (default: the run's length, so the one save point is its last iteration)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="more run config overrides, after the point's own (e.g. train.precision=bf16_weights)")
    a = ap.parse_args()
    iterations = 2 if a.quick else max(2, a.iterations)
    env = os.environ | {"RLPIPE_HOME": str(a.home), "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    env = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"} | env
    points = plan(list(AXES) if a.axis == "all" else [a.axis], a.quick)
    if a.models:  # only these model sizes' points
        points = {axis: [p for p in ps if p.model in a.models.split(",")] for axis, ps in points.items()}
    start = time.perf_counter()
    done = run_all(list(dict.fromkeys(p for ps in points.values() for p in ps)), a.home, iterations, a.engine, env,
                   a.save_interval, tuple(a.set))
    wall = round(time.perf_counter() - start, 1)
    out = {"engine": a.engine, "iterations": iterations, "cpus": os.cpu_count(), "wall_s": wall,
           "axes": {axis: [done[p] for p in ps] for axis, ps in points.items()}}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2))
    for axis, results in out["axes"].items():
        print(f"\n{table(f'Seconds per iteration by {AXES[axis][0]}', results)}")
    print(f"\n[scaling] {len(done)} runs in {out['wall_s']:.0f} s; JSON: {a.out}")


if __name__ == "__main__":
    main()
