"""Does the reward model rank the policy's own samples as the hidden quality does? Read off a finished RLHF run.

For each iteration of an RLHF run on the arithmetic task (the demo's), this reads the scored
trajectories from the run's store and prints, over the sampled answers:

- the hidden true score (closeness to the sum) and the share carrying the stray digit,
- pair agreement: over pairs of samples *of the same prompt* whose true qualities differ by more than
  0.05, the share the reward model (the row's reward) orders as the true quality does. GRPO learns
  only from that within-prompt order, so 0.5 means the reward model gives the policy no direction.

    python benchmarks/rlhf_agreement.py RLPIPE_HOME [ITERATIONS ...]   # default: every 10th iteration

The store is read as written by `rlpipe demo rlhf` with the default local store
(``RLPIPE_HOME/store/runs/<rl run>/iter=N/verify/``); prompt ids are ``add-A-B``.
"""

from __future__ import annotations

import math
import re
import sys
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq

_INT = re.compile(r"\d{1,18}")


def _quality(prompt_id: str, text: str) -> tuple[float, bool]:
    a, b = map(int, prompt_id.split("-")[1:3])
    t = (text or "").strip()
    if not _INT.fullmatch(t):
        return 0.0, False
    return math.exp(-abs(int(t) - (a + b)) / 5), len(t) > len(str(a + b))


def agreement(groups: dict[str, list[tuple[float, float]]]) -> tuple[float, int]:
    agree = n = 0
    for v in groups.values():
        for i in range(len(v)):
            for j in range(i + 1, len(v)):
                if abs(v[i][1] - v[j][1]) > 0.05:
                    n += 1
                    agree += (v[i][0] - v[j][0]) * (v[i][1] - v[j][1]) > 0
    return (agree / n if n else float("nan")), n


def iteration_row(folder: Path) -> dict[str, float]:
    rows = [r for f in sorted(folder.glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    groups: dict[str, list[tuple[float, float]]] = defaultdict(list)
    true, long = 0.0, 0
    for r in rows:
        q, too_long = _quality(r["prompt_id"], r["response_text"])
        true, long = true + q, long + too_long
        if r["reward_status"] == "ok":
            groups[r["prompt_id"]].append((float(r["reward"]), q))
    agree, n = agreement(groups)
    return {"samples": len(rows), "true": true / len(rows), "long": long / len(rows), "agree": agree, "pairs": n}


def main(home: str, iterations: list[int]) -> None:
    runs = sorted(Path(home, "store", "runs").glob("rl-*"))
    if not runs:
        sys.exit(f"{home}: no RL run under store/runs (run `rlpipe demo rlhf` with RLPIPE_HOME={home} first)")
    run = runs[-1]
    have = sorted(int(p.name.split("=")[1]) for p in run.glob("iter=*") if (p / "verify").is_dir())
    wanted = iterations or [i for i in have if i % 10 == 0] + ([have[-1]] if have[-1] % 10 else [])
    print(f"{run.name}")
    print("| iteration | samples | true score (sampled) | share with a stray digit | RM pair agreement (pairs) |")
    print("|---:|---:|---:|---:|---:|")
    for it in wanted:
        r = iteration_row(run / f"iter={it}" / "verify")
        print(f"| {it} | {r['samples']} | {r['true']:.3f} | {r['long']:.2f} | {r['agree']:.3f} ({r['pairs']}) |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1], [int(x) for x in sys.argv[2:]])
