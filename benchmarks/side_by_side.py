"""Summarise `run.sh`'s (or `run_sizes.sh`'s) alternating pairs: rlpipe's and TRL's seconds per sample (one
completion) and per 256, each pair's ratio, held-out accuracy after the same completions, and each side's stages
per iteration. Any number of completions per iteration (the demo's 256, or fewer at larger models).

    .venv/bin/python benchmarks/side_by_side.py /tmp/rlpipe-bench --pairs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def pair(out: Path, k: int) -> dict:
    loop = json.loads((out / f"rlpipe-{k}.json").read_text())
    rl, trl = loop["rl"], json.loads((out / f"trl-{k}.json").read_text())
    rl_per_iter = rl["completions"] / rl["iterations"]
    trl_per_iter = trl["completions_used"] / trl["iterations"]
    if rl_per_iter != trl_per_iter:
        raise SystemExit(f"pair {k}: rlpipe ran {rl_per_iter:g} completions per iteration, TRL {trl_per_iter:g}; "
                         "give both scripts the same --prompts-per-iter and --num-generations")
    # Both sides in steady state: rlpipe's iterations after the first (grpo_loop.py), TRL's likewise.
    trl_256 = trl.get("seconds_per_256_completions_excl_first") or trl["seconds_per_256_completions"]
    return {"pair": k, "completions_per_iteration": rl_per_iter, "completions": (rl["completions"], trl["completions_used"]),
            "rlpipe_s_per_sample": rl["seconds_per_iteration_excl_eval"] / rl_per_iter, "trl_s_per_sample": trl_256 / 256,
            # without rlpipe's last iteration, which also writes the run's final save point (TRL's save nothing)
            "rlpipe_s_per_sample_excl_last": rl["seconds_per_iteration_excl_eval_and_last"] / rl_per_iter
            if "seconds_per_iteration_excl_eval_and_last" in rl else None,
            "rlpipe_stages_excl_last": rl.get("stage_seconds_per_iteration_excl_last", {}),
            "rlpipe_acc": (rl["accuracy_before"], rl["accuracy_after"]), "trl_acc": (trl["accuracy_before"], trl["accuracy_after"]),
            "rlpipe_stages": rl["stage_seconds_per_iteration"], "trl_stages": trl.get("stage_seconds_per_iteration", {}),
            # CPU-seconds per sample: rlpipe's whole process tree (its Prefect server included), TRL's process
            "rlpipe_cpu_s_per_sample": rl["cpu_s_per_iteration"] / rl_per_iter if rl.get("cpu_s_per_iteration") else None,
            "trl_cpu_s_per_sample": trl["cpu_s_per_iteration"] / trl_per_iter if trl.get("cpu_s_per_iteration") else None,
            "model_size": loop.get("model_size", "demo"), "sft": loop.get("sft", {})}


def table(rows: list[dict]) -> None:
    print(f"model {rows[0]['model_size']}, {rows[0]['completions_per_iteration']:g} completions per iteration; "
          f"SFT base: {rows[0]['sft']}")
    print("| pair | completions | rlpipe s / sample | TRL s / sample | ratio | rlpipe s / sample, last iteration out | "
          "ratio | rlpipe s / 256 | TRL s / 256 | rlpipe held-out | TRL held-out | CPU-s / sample: rlpipe / TRL |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|")
    for r in rows:
        a, b, c = r["rlpipe_s_per_sample"], r["trl_s_per_sample"], r["rlpipe_s_per_sample_excl_last"]
        cpu = (f"{r['rlpipe_cpu_s_per_sample']:.4f} / {r['trl_cpu_s_per_sample']:.4f}"
               if r["rlpipe_cpu_s_per_sample"] and r["trl_cpu_s_per_sample"] else "–")
        last = f"{c:.4f} | {c / b:.2f}×" if c else "– | –"
        print(f"| {r['pair']} | {r['completions'][0]} / {r['completions'][1]} | {a:.4f} | {b:.4f} | {a / b:.2f}× | "
              f"{last} | {a * 256:.2f} | {b * 256:.2f} | {r['rlpipe_acc'][0]:.1%} → {r['rlpipe_acc'][1]:.1%} | "
              f"{r['trl_acc'][0]:.1%} → {r['trl_acc'][1]:.1%} | {cpu} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--pairs", type=int, default=1)
    a = ap.parse_args()
    if a.pairs < 1:
        ap.error("--pairs must be at least 1 (run.sh's PAIRS)")
    rows = [pair(a.out, k) for k in range(1, a.pairs + 1)]
    table(rows)
    ratios = [r["rlpipe_s_per_sample"] / r["trl_s_per_sample"] for r in rows]
    print(f"\nratio: median {statistics.median(ratios):.2f}×, range {min(ratios):.2f}–{max(ratios):.2f}× over {len(rows)} pair(s)")
    for side in ("rlpipe", "rlpipe_stages_excl_last", "trl"):
        key = side if side.endswith("last") else f"{side}_stages"
        keys = rows[0][key].keys()
        means = {k: statistics.fmean(r[key][k] for r in rows) for k in keys}
        print(f"{side} stages per iteration (mean over pairs): " + ", ".join(f"{k} {v:.3f}" for k, v in means.items()))
    (a.out / "side_by_side.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
