"""The guards that stop a run, and the checks that raise them.

Each is an error a person must act on, never something a retry mends: the CLI turns them into a clear
message and an exit code, and the train flow raises them as alerts first. The reward guards (the sandbox
floor, the circuit breaker) live with the rewards (:mod:`rlpipe.rewards.guards`) and are re-exported here.
"""

from __future__ import annotations

import logging
from typing import Any

from rlpipe.rewards.guards import RewardCircuitOpen, SandboxFloorError

__all__ = [
    "NonFiniteUpdate", "RewardCircuitOpen", "SandboxFloorError", "StaleBatchError", "WeightSyncError", "check_dynamic",
    "check_nonfinite", "check_staleness",
]

_LOG = logging.getLogger("rlpipe")


class WeightSyncError(RuntimeError):
    """The weights an engine holds after a reload are not the ones the trainer exported (or a transfer of them
    was not whole)."""


class NonFiniteUpdate(RuntimeError):
    """Too many optimizer steps of one iteration had a non-finite loss or gradient."""


class StaleBatchError(RuntimeError):
    """A batch sampled by a policy more updates behind the one it would train than rollout.async_steps allows."""


def check_staleness(async_steps: int, iteration: int, staleness: int, what: str) -> None:
    """``staleness`` updates between the batch's policy and the one it trains must lie in 0..``async_steps``."""
    if not 0 <= staleness <= async_steps:
        raise StaleBatchError(
            f"iteration {iteration}: {what} would be sampled by a policy {staleness} update(s) behind the one it "
            f"trains; rollout.async_steps={async_steps} allows at most {async_steps}. "
            "Generate it after the weight sync (rollout.async_steps: 0), or raise the bound")


def check_nonfinite(max_nonfinite_steps: int, iteration: int, metrics: dict[str, float], log: Any = _LOG) -> None:
    """An ALERT for each update that skipped steps; :class:`NonFiniteUpdate` at ``train.max_nonfinite_steps``."""
    skipped = int(metrics.get("nonfinite_steps", 0))
    if not skipped:
        return
    total = skipped + int(metrics.get("optimizer_steps", 0))
    log.warning("ALERT iteration %d: %d/%d optimizer step(s) skipped: non-finite loss or gradient "
                "(mismatch/abs_max %.3g)", iteration, skipped, total, metrics.get("mismatch/abs_max", float("nan")))
    if skipped >= max_nonfinite_steps:
        raise NonFiniteUpdate(
            f"iteration {iteration}: {skipped}/{total} optimizer steps had a non-finite loss or gradient "
            f"(train.max_nonfinite_steps={max_nonfinite_steps}); the run stops before saving this "
            "update. Look at the iteration's trajectories (log-probs, rewards) and lower train.lr; the same --run-id "
            "resumes from the last saved state")


def check_dynamic(batch_size: int, iteration: int, metrics: dict[str, float], draws: int, log: Any = _LOG) -> bool:
    """Dynamic sampling that kept fewer groups than the batch after every draw: an ALERT (training goes on)."""
    kept = metrics["dynamic/groups_kept"]
    if kept >= batch_size:
        return False
    log.warning("ALERT iteration %d: dynamic sampling kept %d/%d groups after %d draws (rollout.max_extra_draws caps it)",
                iteration, kept, batch_size, draws)
    return True
