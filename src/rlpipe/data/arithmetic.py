"""Synthetic arithmetic: ``"12+34="`` → ``"46"``, with disjoint train/test splits.

The family is every (a, b) with a and b of ``digits`` digits for each operation; the test and
validation splits are seeded samples of it and train is the rest (or a sample of the rest), so no
question is in two splits.
"""

from __future__ import annotations

import random

import pyarrow as pa

from rlpipe.config import DataConfig
from rlpipe.storage.schemas import PROMPT_SCHEMA

_SYMBOL = {"add": "+", "sub": "-", "mul": "*"}
_APPLY = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b}
_MAX_ENUMERATED = 2_000_000


def _questions(cfg: DataConfig, rng: random.Random) -> list[tuple[str, int, int]]:
    lo, hi = 10 ** (cfg.digits - 1) if cfg.digits > 1 else 0, 10**cfg.digits - 1
    per_op = (hi - lo + 1) ** 2
    total = per_op * len(cfg.operations)
    wanted = cfg.test_size + cfg.validation_size + (cfg.train_size or 0)
    if total <= _MAX_ENUMERATED:
        qs = [(op, a, b) for op in cfg.operations for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
        if wanted > len(qs):
            raise ValueError(
                f"data: {wanted} questions asked for but the family has only {len(qs)}; lower test_size/train_size"
            )
        return qs
    if cfg.train_size is None:
        raise ValueError(f"data: the family has {total} questions; set data.train_size to sample from it")
    # Too many to list: draw distinct questions.
    seen: set[tuple[str, int, int]] = set()
    while len(seen) < wanted:
        seen.add((rng.choice(cfg.operations), rng.randint(lo, hi), rng.randint(lo, hi)))
    return sorted(seen)


def build_arithmetic(cfg: DataConfig | None = None, verifier: str = "math") -> pa.Table:
    """The question family as prompt rows; ``verifier`` is each row's task (``closeness`` for RLHF, where it
    is the hidden true quality)."""
    cfg = cfg or DataConfig()
    rng = random.Random(cfg.seed)
    qs = _questions(cfg, rng)
    order = list(range(len(qs)))
    rng.shuffle(order)
    test = set(order[: cfg.test_size])
    validation = set(order[cfg.test_size : cfg.test_size + cfg.validation_size])
    train_pool = order[cfg.test_size + cfg.validation_size :]
    train = set(train_pool[: cfg.train_size] if cfg.train_size else train_pool)
    rows = []
    for i, (op, a, b) in enumerate(qs):
        if i in test:
            split = "test"
        elif i in validation:
            split = "validation"
        elif i in train:
            split = "train"
        else:
            continue
        rows.append(
            {
                "id": f"{op}-{a}-{b}",
                "prompt": f"{a}{_SYMBOL[op]}{b}=",
                "chat": False,
                "task": verifier,
                "ground_truth": str(_APPLY[op](a, b)),
                "tests": None,
                "split": split,
                "source": f"arithmetic/{op}/d{cfg.digits}",
                "solution": None,
            }
        )
    return pa.Table.from_pylist(rows, schema=PROMPT_SCHEMA)


# Share of the RLHF task's SFT demonstrations that carry a sloppy habit: the right sum with a stray "0"
# appended ("120" written "1200"), an answer the hidden quality scores 0. Over half, so that the SFT
# model's greedy answer has the habit too. The tiny reward model
# learns coarse flaws like this one from the preference pairs (held-out pair accuracy ≈ 0.88), but not
# the units digit (≈ 0.5 on near misses among the policy's own samples, benchmarks/README.md), so this
# habit is what RL against the learned reward can fix — and what the hidden score shows it fixing.
SLOPPY_DEMO_SHARE = 0.6


def build_arithmetic_rlhf(cfg: DataConfig | None = None) -> pa.Table:
    """The arithmetic prompts of the RLHF task: rows name ``closeness``, the true quality evaluations report
    beside the reward model's score (the reward model never sees it). Training rows carry an SFT
    demonstration (``solution``): the sum, or for a seeded :data:`SLOPPY_DEMO_SHARE` of them the sum with
    a stray "0" appended — demonstrations with a flaw that preferences, not imitation, remove."""
    cfg = cfg or DataConfig()
    table = build_arithmetic(cfg, verifier="closeness")
    rng = random.Random(cfg.seed + 7)
    rows = table.to_pylist()
    for r in rows:
        if r["split"] == "train":
            sloppy = rng.random() < SLOPPY_DEMO_SHARE
            r["solution"] = r["ground_truth"] + "0" if sloppy else r["ground_truth"]
    return pa.Table.from_pylist(rows, schema=PROMPT_SCHEMA)
