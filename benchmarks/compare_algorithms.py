"""Every algorithm preset on the arithmetic task, same base model, budget and seed, in one MLflow experiment.

    .venv/bin/python benchmarks/compare_algorithms.py --iterations 30 --out /tmp/rlpipe-bench/algos

Trains the demo's SFT base once in its own RLPIPE_HOME (reused on later calls), then runs
``configs/presets/<name>.yaml`` for each preset with ``train.total_iterations`` = ``--iterations``
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


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_h) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in results.items():
        hist = r["history"]
        ax_r.plot([h["iteration"] for h in hist], [h["reward_mean"] for h in hist], label=name, lw=1.4)
        pts = [(-1, r["heldout_accuracy_base"])] + [(h["iteration"], h["heldout_accuracy"]) for h in hist if "heldout_accuracy" in h]
        ax_h.plot([p[0] + 1 for p in pts], [p[1] for p in pts], marker="o", ms=3, label=name, lw=1.4)
    ax_r.set(title="training reward (first draw of each iteration)", xlabel="iteration", ylabel="mean reward")
    ax_h.set(title="held-out greedy accuracy", xlabel="iterations done", ylabel="accuracy")
    for ax in (ax_r, ax_h):
        ax.grid(alpha=0.3)
    ax_h.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(results: dict[str, dict]) -> str:
    lines = [
        "| preset | advantage · loss · aggregation | held-out before → after | Δ | after 10 it. | samples generated | s / iteration | run wall s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        parts = r["parts"]
        at10 = next((h["heldout_accuracy"] for h in r["history"] if h["iteration"] == 9 and "heldout_accuracy" in h), None)
        lines.append(
            f"| {name} | {parts['advantage']} · {parts['policy_loss']} · {parts['loss_agg_mode']} | "
            f"{100 * r['heldout_accuracy_base']:.1f}% → {100 * r['heldout_accuracy_final']:.1f}% | "
            f"{100 * (r['heldout_accuracy_final'] - r['heldout_accuracy_base']):+.1f} | "
            f"{'—' if at10 is None else f'{100 * at10:.1f}%'} | {r['samples_generated']:,} | "
            f"{r['iteration_s_mean']:.2f} | {r['wall_s']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--home", default="/tmp/rlpipe-bench/home-algos")
    ap.add_argument("--out", default="/tmp/rlpipe-bench/algos")
    ap.add_argument("--seed", type=int, default=0)
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
    sys.path.insert(0, str(ROOT))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    from flows.sft import sft
    from flows.train import train
    from rlpipe.config import load_config, settings
    from rlpipe.tracking.mlflow_utils import Tracker

    sft_cfg = load_config(ROOT / "configs/sft-arithmetic.yaml", [f"seed={a.seed}"])
    if Tracker(settings(), sft_cfg).version_by_alias(sft_cfg.registered_model, "base") is None:
        t = time.perf_counter()
        sft(config=sft_cfg)
        print(f"[bench] SFT base trained in {time.perf_counter() - t:.0f} s", flush=True)

    results_path = out / "results.json"
    results: dict[str, dict] = json.loads(results_path.read_text()) if results_path.exists() else {}
    for name in a.presets.split(","):
        cfg = load_config(ROOT / f"configs/presets/{name}.yaml", [
            f"train.total_iterations={a.iterations}", f"train.save_interval={a.iterations}",
            "train.eval_interval=5", "tracking.experiment=algorithm-comparison", f"seed={a.seed}",
        ])
        run_id = f"cmp-{name}-s{a.seed}-i{a.iterations}{'-' + a.tag if a.tag else ''}"
        print(f"[bench] {name}: {cfg.train.resolved()}", flush=True)
        t = time.perf_counter()
        summary = train(config=cfg, run_id=run_id)
        wall = time.perf_counter() - t
        progress = json.loads((settings().run_dir(run_id) / "progress.json").read_text())
        history = progress["history"]
        results[name] = {
            "parts": cfg.train.resolved(),
            "iterations": len(history),
            "heldout_accuracy_base": progress["base_accuracy"],
            "heldout_accuracy_final": progress["final_accuracy"],
            "samples_generated": int(sum(h.get("samples_generated", 256) for h in history)),
            "wall_s": wall,
            "iteration_s_mean": sum(h["time/iteration_s"] for h in history) / len(history),
            "mlflow_run_id": json.loads(Path(summary).read_text())["mlflow_run_id"],
            "history": history,
        }
        print(f"[bench] {name}: held-out {progress['base_accuracy']:.3f} -> {progress['final_accuracy']:.3f}, "
              f"{wall:.0f} s", flush=True)
        results_path.write_text(json.dumps(results, indent=1, default=float))
    (out / "table.md").write_text(table(results) + "\n")
    plot(results, out / "reward_curves.png")
    print(table(results))
    print(f"[bench] wrote {out / 'table.md'} and {out / 'reward_curves.png'}")


if __name__ == "__main__":
    main()
