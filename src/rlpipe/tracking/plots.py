"""Plots a person would rather see than read: reward and held-out accuracy by iteration."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def reward_curve(history: list[dict[str, Any]], path: str | Path, title: str, base_accuracy: float | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = [h["iteration"] for h in history]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(its, [h.get("reward_mean", math.nan) for h in history], label="training reward (sampled)", color="#4C72B0")
    ev = [(h["iteration"], h["heldout_accuracy"]) for h in history if "heldout_accuracy" in h]
    if base_accuracy is not None:
        ev = [(-1, base_accuracy)] + ev
    if ev:
        ax.plot([e[0] for e in ev], [e[1] for e in ev], "o-", label="held-out accuracy (greedy)", color="#DD8452")
    if any("episode/tool_use_share" in h for h in history):  # agent runs: does the policy call its tools?
        ax.plot(its, [h.get("episode/tool_use_share", math.nan) for h in history], "--", color="#55A868",
                label="episodes that call a tool (sampled)")
    ax.set_xlabel("iteration")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    return _save(fig, path)


def rm_vs_true_curve(history: list[dict[str, Any]], path: str | Path, title: str,
                     base: tuple[float | None, float | None] = (None, None)) -> Path | None:
    """The reward-hacking picture: held-out reward-model score and true score at each evaluation, on two
    axes (the reward model's scale is arbitrary, the true score is 0–1). None when the run had no reward model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(h["iteration"], h["heldout_rm_score"], h["heldout_true_score"]) for h in history
           if "heldout_rm_score" in h and "heldout_true_score" in h]
    if base[0] is not None and base[1] is not None:
        pts = [(-1, base[0], base[1])] + pts
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    its = [p[0] for p in pts]
    ax.plot(its, [p[2] for p in pts], "o-", color="#DD8452", label="true score (hidden closeness, 0–1)")
    ax.set_ylim(0, 1)
    ax.set_xlabel("iteration")
    ax.set_ylabel("true score")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(its, [p[1] for p in pts], "s--", color="#4C72B0", label="reward-model score (raw)")
    ax2.set_ylabel("reward-model score")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="lower right")
    ax.set_title(title)
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
