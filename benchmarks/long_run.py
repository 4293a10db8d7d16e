"""An iteration's fixed cost early and late in a long run (does per-iteration work grow with the run?).

    .venv/bin/python benchmarks/long_run.py --iterations 2000 --out /tmp/rlpipe-bench/long.json

One `rlpipe run` (its own temporary Prefect server, its own RLPIPE_HOME) with the smallest batch: 2 prompts
× 2 samples, ≤ 2 new tokens, one optimizer step, the HF engine, an untrained tiny model built from config;
a save point every 100 iterations, held-out accuracy only at the end. From the run's history: the time of
an iteration outside generation, scoring and the optimizer (``time/overhead_total_s``, as the parent flow
sees it) and its total, medians over iterations 10–29, 20 in the middle and the last 20; and the size of
``progress.json`` then. Progress: the run's own log, a line per iteration.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tiny_policy(folder: Path) -> Path:
    """An untrained tiny Qwen2 from the default model config (the fixed cost does not depend on its skill)."""
    from rlpipe.config import RunConfig
    from rlpipe.training.checkpoint import save_checkpoint
    from rlpipe.training.tiny import build_char_tokenizer, build_tiny_model

    if not (folder / "config.json").exists():
        tok = build_char_tokenizer()
        save_checkpoint(folder, build_tiny_model(RunConfig().model, tok, seed=0), tok, trainer_state={"kind": "init"})
    return folder


def run(home: Path, iterations: int, run_id: str) -> float:
    policy = tiny_policy(home / "policy")
    sets = [f"task.policy_model={policy}", "task.name=longrun", "tracking.experiment=longrun", "rollout.engine=hf",
            "rollout.batch_size=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=2",
            "train.batch_size=4", "train.micro_batch_size=4", f"train.total_iterations={iterations}",
            "train.save_interval=100", f"train.eval_interval={iterations}", "train.eval_size=20",
            "alerts.reward_flat.enabled=false", "tracking.system_metrics_s=null"]
    env = os.environ | {"RLPIPE_HOME": str(home), "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    start = time.perf_counter()
    cmd = [sys.executable, "-c", "import sys; from rlpipe.cli import main; sys.argv = ['rlpipe'] + sys.argv[1:]; main()",
           "run", "--run-id", run_id, *[x for s in sets for x in ("--set", s)]]
    subprocess.run(cmd, env=env, check=True, cwd=ROOT)
    return time.perf_counter() - start


def window(history: list[dict], lo: int, hi: int, key: str) -> float:
    return statistics.median(h[key] for h in history if lo <= h["iteration"] < hi and key in h)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=2000)
    ap.add_argument("--home", type=Path, default=Path("/tmp/rlpipe-bench/long-home"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/rlpipe-bench/long.json"))
    a = ap.parse_args()
    from rlpipe.history import read_history

    run_id = f"long-{a.iterations}"
    wall = run(a.home, a.iterations, run_id)
    folder = a.home / "runs" / run_id
    history, n = read_history(folder), a.iterations
    out = {"iterations": n, "wall_s": round(wall, 1), "progress_json_bytes": (folder / "progress.json").stat().st_size,
           "history_jsonl_bytes": (folder / "history.jsonl").stat().st_size}
    spans = [(10, 30), (n // 2 - 10, n // 2 + 10), (n - 20, n)]
    for key in ("time/overhead_total_s", "time/iteration_total_s"):
        medians = {f"median_iterations_{lo}_{hi - 1}": round(window(history, lo, hi, key), 4) for lo, hi in spans}
        first, last = list(medians.values())[0], list(medians.values())[-1]
        out[key] = medians | {"last_minus_first": round(last - first, 4)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
