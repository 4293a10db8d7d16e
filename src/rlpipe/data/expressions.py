"""Synthetic code task: "write a Python expression whose value is N" (``expr 46:`` → ``40+6``).

Rewards come from running the expression in the sandbox (verifier ``python_expr``), so any
correct expression counts, not only the reference. Each row carries one reference expression
(``solution``) for the SFT warm-up; train and test targets are disjoint. Use ``data.digits: 4``
(9,000 targets).
"""

from __future__ import annotations

import random

import pyarrow as pa

from rlpipe.config import DataConfig
from rlpipe.storage.schemas import PROMPT_SCHEMA


def _reference(n: int, rng: random.Random) -> str:
    # "a+b" with a one-digit b: copy the leading digits, adjust the last ones. Learnable by a tiny
    # character-level model; RL may then find any other expression with the same value.
    b = rng.randint(1, 9)
    return f"{n - b}+{b}"


def build_expressions(cfg: DataConfig | None = None) -> pa.Table:
    cfg = cfg or DataConfig()
    lo, hi = 10 ** (cfg.digits - 1), 10**cfg.digits - 1
    targets = list(range(lo, hi + 1))
    rng = random.Random(cfg.seed)
    rng.shuffle(targets)
    n_test = min(cfg.test_size, len(targets) // 4)
    n_val = min(cfg.validation_size, len(targets) // 8)
    split = {t: "test" for t in targets[:n_test]} | {t: "validation" for t in targets[n_test : n_test + n_val]}
    rows = [{
        "id": f"expr-{n}", "prompt": f"expr {n}:", "chat": False, "task": "python_expr", "ground_truth": str(n),
        "tests": None, "split": split.get(n, "train"), "source": f"expressions/d{cfg.digits}",
        "solution": _reference(n, rng),
    } for n in sorted(targets)]
    return pa.Table.from_pylist(rows, schema=PROMPT_SCHEMA)
