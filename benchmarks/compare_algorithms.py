"""Every algorithm preset on the arithmetic task, same base model, budget and seed, in one MLflow experiment.

    .venv/bin/python benchmarks/compare_algorithms.py --iterations 40 --seeds 0,1,2 --out /tmp/rlpipe-bench/algos

Trains the demo's SFT base once in its own RLPIPE_HOME (reused on later calls), then, for each
RL seed, runs ``configs/presets/<name>.yaml`` for each preset with ``train.total_iterations`` = ``--iterations``
(every preset: 32 prompts × 8 samples per iteration; DAPO's dynamic sampling may draw more),
one process, one vLLM engine reloaded between runs (so the first run's wall time includes the
engine start). Writes ``results.json``, a markdown table (``table.md``: final held-out accuracy,
samples generated, mean seconds per iteration, run wall time) and ``reward_curves.png``
(training reward and held-out accuracy per iteration, one line per preset). All runs are in the
MLflow experiment ``algorithm-comparison`` of that home, for side-by-side comparison in the UI.
Timings are only comparable on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ["grpo", "dr_grpo", "dapo", "gspo", "ppo", "rloo", "reinforce_pp"]


def _by_preset(results: dict[str, dict]) -> dict[str, list[dict]]:
    """results keyed "<preset>@s<seed>" → preset → its runs (in seed order)."""
    out: dict[str, list[dict]] = {}
    for key in sorted(results, key=lambda k: (PRESETS.index(k.split("@")[0]) if k.split("@")[0] in PRESETS else 99, k)):
        out.setdefault(key.split("@")[0], []).append(results[key])
    return out


def _heldout(r: dict) -> list[tuple[int, float]]:
    """(iterations done, held-out accuracy), the base included."""
    return [(0, r["heldout_accuracy_base"])] + [(h["iteration"] + 1, h["heldout_accuracy"]) for h in r["history"] if "heldout_accuracy" in h]


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax_r, ax_h) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, runs in _by_preset(results).items():
        n = min(len(r["history"]) for r in runs)
        reward = np.mean([[h["reward_mean"] for h in r["history"][:n]] for r in runs], axis=0)
        smooth = np.convolve(reward, np.ones(3) / 3, mode="valid")  # 3-iteration moving average
        (line,) = ax_r.plot(np.arange(len(smooth)) + 1, smooth, label=name, lw=1.4)
        curves = [dict(_heldout(r)) for r in runs]
        xs = sorted(set.intersection(*(set(c) for c in curves)))
        ys = np.array([[c[x] for x in xs] for c in curves])
        ax_h.plot(xs, ys.mean(0), marker="o", ms=3, lw=1.4, color=line.get_color(), label=name)
        if len(runs) > 1:
            ax_h.fill_between(xs, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.12)
    seeds = max(len(v) for v in _by_preset(results).values())
    ax_r.set(title=f"training reward (first draw; mean of {seeds} seeds, 3-iteration average)", xlabel="iteration", ylabel="mean reward")
    ax_h.set(title=f"held-out greedy accuracy (mean and range of {seeds} seeds)", xlabel="iterations done", ylabel="accuracy")
    for ax in (ax_r, ax_h):
        ax.grid(alpha=0.3)
    ax_h.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _pct(values: list[float]) -> str:
    mean = 100 * sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:.1f}%"
    return f"{mean:.1f}% ({100 * min(values):.1f}–{100 * max(values):.1f})"


def table(results: dict[str, dict]) -> str:
    lines = [
        "| preset | advantage · loss · aggregation | seeds | held-out after 10 it. | held-out final | Δ (mean) | samples generated (mean) | s / iteration (mean) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, runs in _by_preset(results).items():
        parts = runs[0]["parts"]
        at10 = [dict(_heldout(r)).get(10) for r in runs]
        final = [r["heldout_accuracy_final"] for r in runs]
        delta = sum(r["heldout_accuracy_final"] - r["heldout_accuracy_base"] for r in runs) / len(runs)
        lines.append(
            f"| {name} | {parts['advantage']} · {parts['policy_loss']} · {parts['loss_agg_mode']} | {len(runs)} | "
            f"{'—' if None in at10 else _pct(at10)} | {_pct(final)} | {100 * delta:+.1f} | "
            f"{sum(r['samples_generated'] for r in runs) / len(runs):,.0f} | "
            f"{sum(r['iteration_s_mean'] for r in runs) / len(runs):.2f} |"
        )
    base = sorted({r["heldout_accuracy_base"] for r in results.values()})
    lines.append("")
    lines.append(f"Base model held-out accuracy: {', '.join(f'{100 * b:.1f}%' for b in base)} (n=500).")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--home", default="/tmp/rlpipe-bench/home-algos")
    ap.add_argument("--out", default="/tmp/rlpipe-bench/algos")
    ap.add_argument("--seeds", default="0", help="comma-separated RL seeds (the SFT base is trained once, seed 0)")
    ap.add_argument("--tag", default="", help="suffix of the run ids (a new tag reruns presets already run)")
    ap.add_argument("--report-only", action="store_true", help="rewrite table.md and the PNG from results.json")
    a = ap.parse_args()
    if a.report_only:
        results = json.loads((Path(a.out) / "results.json").read_text())
        (Path(a.out) / "table.md").write_text(table(results) + "\n")
        plot(results, Path(a.out) / "reward_curves.png")
        print(table(results))
        return
    os.environ["RLPIPE_HOME"] = a.home
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # this checkout's code, a worktree's too (not the installed one)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    from flows.sft import sft
    from flows.train import train
    from rlpipe.config import load_config, settings
    from rlpipe.history import read_history
    from rlpipe.tracking.mlflow_utils import Tracker

    sft_cfg = load_config(ROOT / "configs/sft-arithmetic.yaml", ["seed=0"])
    if Tracker(settings(), sft_cfg).version_by_alias(sft_cfg.registered_model, "base") is None:
        t = time.perf_counter()
        sft(config=sft_cfg)
        print(f"[bench] SFT base trained in {time.perf_counter() - t:.0f} s", flush=True)

    results_path = out / "results.json"
    results: dict[str, dict] = json.loads(results_path.read_text()) if results_path.exists() else {}
    for seed in [int(x) for x in a.seeds.split(",")]:
        for name in a.presets.split(","):
            cfg = load_config(ROOT / f"configs/presets/{name}.yaml", [
                f"train.total_iterations={a.iterations}", f"train.save_interval={a.iterations}",
                "train.eval_interval=5", "tracking.experiment=algorithm-comparison", f"seed={seed}",
            ])
            run_id = f"cmp-{name}-s{seed}-i{a.iterations}{'-' + a.tag if a.tag else ''}"
            print(f"[bench] {name} seed {seed}: {cfg.train.resolved()}", flush=True)
            t = time.perf_counter()
            summary = train(config=cfg, run_id=run_id)
            wall = time.perf_counter() - t
            progress = json.loads((settings().run_dir(run_id) / "progress.json").read_text())
            history = read_history(settings().run_dir(run_id))
            results[f"{name}@s{seed}"] = {
                "parts": cfg.train.resolved(),
                "seed": seed,
                "iterations": len(history),
                "heldout_accuracy_base": progress["base_accuracy"],
                "heldout_accuracy_final": progress["final_accuracy"],
                "samples_generated": int(sum(h.get("samples_generated", 256) for h in history)),
                "wall_s": wall,
                "iteration_s_mean": sum(h["time/iteration_s"] for h in history) / len(history),
                "mlflow_run_id": json.loads(Path(summary).read_text())["mlflow_run_id"],
                "history": history,
            }
            print(f"[bench] {name} seed {seed}: held-out {progress['base_accuracy']:.3f} -> "
                  f"{progress['final_accuracy']:.3f}, {wall:.0f} s", flush=True)
            results_path.write_text(json.dumps(results, indent=1, default=float))
    (out / "table.md").write_text(table(results) + "\n")
    plot(results, out / "reward_curves.png")
    print(table(results))
    print(f"[bench] wrote {out / 'table.md'} and {out / 'reward_curves.png'}")


if __name__ == "__main__":
    main()
