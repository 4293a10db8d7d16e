"""Episode tasks of an environment as a prompt table (``task.dataset: builtin:episodes``).

Each row is one task the environment runs: ``prompt`` holds ``{"task": …, "seed": …}`` as JSON (the
task written out by the environment's ``draw(seed)``, so a dataset shows what is in it), ``task`` is
``env:<name>``, and ``source`` the environment and its version. The test and validation tasks are
drawn first, from seeds no training task uses; a task never appears in two splits. Every row is
checked by starting its episode: a task the environment refuses is a finding naming the row.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from rlpipe.config import DataConfig
from rlpipe.storage.schemas import PROMPT_SCHEMA

DEFAULT_TRAIN = 2000
_SPLIT_SEEDS = {"test": 1_000_000, "validation": 2_000_000, "train": 0}
_MAX_MISSES = 10_000


def episode_task(row: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """``(task, seed)`` of a row of this table."""
    obj = json.loads(row["prompt"])
    return obj["task"], int(obj["seed"])


def build_episode_tasks(spec: Any, cfg: DataConfig | None = None) -> pa.Table:
    """``cfg.test_size`` / ``validation_size`` / ``train_size`` (default 2,000) distinct tasks of ``spec``'s environment."""
    cfg = cfg or DataConfig()
    env = spec.make()
    if not hasattr(env, "draw"):
        raise ValueError(f"environment {spec.env!r} has no draw(seed): it cannot make a task set; give tasks as a file")
    seen: set[str] = set()
    rows = []
    for split, size in (("test", cfg.test_size), ("validation", cfg.validation_size), ("train", cfg.train_size or DEFAULT_TRAIN)):
        seed, misses, taken = _SPLIT_SEEDS[split] + cfg.seed * 10_000_000, 0, 0
        while taken < size:
            task = env.draw(seed)
            key = json.dumps(task, sort_keys=True)
            if key in seen:
                misses += 1
                if misses > _MAX_MISSES:
                    raise ValueError(f"data: {spec.env!r} has fewer distinct tasks than the {cfg.test_size} test + "
                                     f"{cfg.validation_size} validation + train rows asked for; lower data.*_size")
            else:
                seen.add(key)
                rows.append({"id": f"{spec.env}-{split}-{seed}", "prompt": json.dumps({"task": task, "seed": seed}),
                             "chat": True, "task": f"env:{spec.env}", "ground_truth": None, "tests": None, "split": split,
                             "source": f"env/{spec.env}/v{env.version}", "solution": None})
                taken += 1
            seed += 1
    return pa.Table.from_pylist(rows, schema=PROMPT_SCHEMA)


def episode_task_findings(table: pa.Table, spec: Any) -> list[str]:
    """Rows whose task the environment refuses (starting each episode), each naming its row and field."""
    from rlpipe.envs.episode import Episode

    out = []
    for k, row in enumerate(table.to_pylist()):
        try:
            task, seed = episode_task(row)
        except (ValueError, KeyError, TypeError) as e:
            out.append(f"row {k} (id {row['id']}): prompt must be JSON {{\"task\": {{...}}, \"seed\": N}} ({type(e).__name__}: {e})")
            continue
        ep = Episode(spec.make(), task, seed, spec.limits)
        if ep.start() is None:
            out.append(f"row {k} (id {row['id']}): {ep.reason}")
    return out
