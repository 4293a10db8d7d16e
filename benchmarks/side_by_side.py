"""Summarise `run.sh`'s alternating pairs: rlpipe's and TRL's seconds per 256 completions, each pair's ratio,
held-out accuracy after the same completions, and each side's stages per iteration.

    .venv/bin/python benchmarks/side_by_side.py /tmp/rlpipe-bench --pairs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def pair(out: Path, k: int) -> dict:
    rl = json.loads((out / f"rlpipe-{k}.json").read_text())["rl"]
    trl = json.loads((out / f"trl-{k}.json").read_text())
    per = 256 / (rl["completions"] / rl["iterations"])
    # Both sides in steady state: rlpipe's iterations after the first (grpo_loop.py), TRL's likewise.
    trl_s = trl.get("seconds_per_256_completions_excl_first") or trl["seconds_per_256_completions"]
    return {"pair": k, "rlpipe_s": rl["seconds_per_iteration_excl_eval"] * per, "trl_s": trl_s,
            "rlpipe_acc": (rl["accuracy_before"], rl["accuracy_after"]), "trl_acc": (trl["accuracy_before"], trl["accuracy_after"]),
            "rlpipe_stages": rl["stage_seconds_per_iteration"], "trl_stages": trl.get("stage_seconds_per_iteration", {}),
            # CPU-seconds per 256 completions: rlpipe's whole process tree (its Prefect server included), TRL's process
            "rlpipe_cpu_s": rl["cpu_s_per_iteration"] * per if rl.get("cpu_s_per_iteration") else None,
            "trl_cpu_s": trl["cpu_s_per_iteration"] * 256 / (trl["completions_used"] / trl["iterations"])
            if trl.get("cpu_s_per_iteration") else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--pairs", type=int, default=1)
    a = ap.parse_args()
    if a.pairs < 1:
        ap.error("--pairs must be at least 1 (run.sh's PAIRS)")
    rows = [pair(a.out, k) for k in range(1, a.pairs + 1)]
    print("| pair | rlpipe s / 256 | TRL s / 256 | ratio | rlpipe held-out | TRL held-out |")
    print("|---:|---:|---:|---:|---|---|")
    for r in rows:
        print(f"| {r['pair']} | {r['rlpipe_s']:.3f} | {r['trl_s']:.3f} | {r['rlpipe_s'] / r['trl_s']:.2f}× | "
              f"{r['rlpipe_acc'][0]:.1%} → {r['rlpipe_acc'][1]:.1%} | {r['trl_acc'][0]:.1%} → {r['trl_acc'][1]:.1%} |")
    cpu = [(r["rlpipe_cpu_s"], r["trl_cpu_s"]) for r in rows if r["rlpipe_cpu_s"] and r["trl_cpu_s"]]
    if cpu:
        print("CPU-seconds per 256 completions (rlpipe's process tree, TRL's process): "
              + "; ".join(f"{a:.2f} against {b:.2f}" for a, b in cpu))
    ratios = [r["rlpipe_s"] / r["trl_s"] for r in rows]
    print(f"\nratio: median {statistics.median(ratios):.2f}×, range {min(ratios):.2f}–{max(ratios):.2f}× over {len(rows)} pair(s)")
    for side in ("rlpipe", "trl"):
        keys = rows[0][f"{side}_stages"].keys()
        means = {k: statistics.fmean(r[f"{side}_stages"][k] for r in rows) for k in keys}
        print(f"{side} stages per iteration (mean over pairs): " + ", ".join(f"{k} {v:.3f}" for k, v in means.items()))
    (a.out / "side_by_side.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
