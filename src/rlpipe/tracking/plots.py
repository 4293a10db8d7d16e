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
    ax.set_xlabel("iteration")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
