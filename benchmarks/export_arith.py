"""Export rlpipe's arithmetic dataset to JSONL for benchmarks that run outside the project venv.

Run with the project venv (it imports rlpipe):

    .venv/bin/python benchmarks/export_arith.py --out /tmp/rlpipe-bench/arith.jsonl

Each line is {"id", "prompt", "ground_truth", "split"}; by default the train and test splits are
written (the default DataConfig: 2-digit addition, 500 test questions, seed 0).
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from rlpipe.config import DataConfig
from rlpipe.data import build_arithmetic

KEYS = ("id", "prompt", "ground_truth", "split")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSONL file to write")
    ap.add_argument("--splits", default="train,test", help="comma-separated splits to keep (default: train,test)")
    args = ap.parse_args()

    keep = {s.strip() for s in args.splits.split(",") if s.strip()}
    rows = build_arithmetic(DataConfig()).to_pylist()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    counts: collections.Counter[str] = collections.Counter()
    with out.open("w") as f:
        for row in rows:
            if row["split"] not in keep:
                continue
            if row.get("chat"):
                raise SystemExit(f"row {row['id']} is a chat prompt; the benchmark expects plain-text prompts")
            f.write(json.dumps({k: row[k] for k in KEYS}) + "\n")
            counts[row["split"]] += 1
    print(f"wrote {sum(counts.values())} rows to {out}: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))


if __name__ == "__main__":
    main()
