"""Rollback: put a run's aliases back on one of its save points, and start a new run from there.

``rlpipe rollback RUN --to K`` (an iteration of RUN) or ``--to vN`` (a model version of RUN) resolves the
registered version of that save point, then:

1. marks the rollback on the registered model (tag ``rlpipe.rolled_back.<RUN>`` = the iteration): from then on
   a registration of RUN past that iteration (a redone iteration, a resume of RUN) moves no alias
   (``tasks/tracking.py`` ``_held_back``), so the rollback is not undone behind the operator's back;
2. moves back each alias of the model that holds a *later* version of RUN (``latest``, and ``best`` or any other
   alias only when it points past the save point within RUN: an alias on another run's version is not RUN's to
   move), each move in the audit log first (action ``alias.rollback``);
3. starts a new run, ``<RUN>-rb<K>`` by default, with RUN's config (its MLflow run's ``config.json``), the
   policy ``models:/NAME/VERSION`` of the save point, the KL reference RUN had (``task.ref_model``, else its
   starting policy, an alias pinned to the version RUN started from: :func:`reference`), and the same dataset version (checked before anything moves). Its MLflow run and its model
   versions carry ``rlpipe.parent_*`` / ``rollback_parent_*`` tags naming RUN, the iteration and the version;
   its first version's ``parent_version`` is the save point's version.

The new run starts from the save point's weights, not its full resumable state: the optimizer, KL controller
and RNG start fresh (a resume of RUN itself is ``rlpipe run --run-id RUN``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rlpipe.config import RunConfig

__all__ = ["ROLLBACK_TAG", "RollbackError", "RollbackPlan", "lineage_tags", "move_back", "plan_rollback", "reference",
           "rolled_back_to", "run_versions"]

ROLLBACK_TAG = "rlpipe.rolled_back."  # + run id, on the registered model: the iteration the run was rolled back to
_TO = re.compile(r"^(?:(\d+)|v(\d+))$")


class RollbackError(LookupError):
    """The rollback cannot be planned: the message names what is missing and what to do."""


@dataclass(frozen=True)
class RollbackPlan:
    run_id: str
    name: str  # the registered model
    version: str  # the save point's version
    iteration: int
    weights_sha256: str
    dataset_version: str
    mlflow_run_id: str  # RUN's MLflow run (where its config is)
    new_run_id: str
    config: RunConfig  # the new run's
    moves: list[tuple[str, str]] = field(default_factory=list)  # (alias, version it leaves)

    def describe(self) -> list[str]:
        out = [f"roll back run {self.run_id} to iteration {self.iteration}: {self.name} v{self.version} "
               f"(weights {self.weights_sha256[:12]}, dataset {self.dataset_version[:12]})"]
        out += [f"move @{a}: v{old} -> v{self.version} (audited: alias.rollback)" for a, old in self.moves] or \
            [f"no alias of {self.name} holds a later version of {self.run_id}: none moves"]
        out.append(f"mark {ROLLBACK_TAG}{self.run_id}={self.iteration} on {self.name}: later registrations of "
                   f"{self.run_id} move no alias")
        out.append(f"start run {self.new_run_id}: task.policy_model={self.config.task.policy_model}, "
                   f"task.ref_model={self.config.task.ref_model}, the rest of {self.run_id}'s config")
        return out


def run_versions(tracker: Any, run_id: str) -> list[Any]:
    """RUN's registered policy versions (any model name), by iteration."""
    found = tracker.client.search_model_versions(f"tags.run_id = '{run_id}'")
    found = [m for m in found if m.tags.get("kind", "policy") == "policy" and "iteration" in m.tags]
    return sorted(found, key=lambda m: (int(m.tags["iteration"]), int(m.version)))


def _target(versions: list[Any], run_id: str, to: str) -> Any:
    m = _TO.match(to.strip())
    if not versions:
        raise RollbackError(f"run {run_id!r} has no registered model version in this registry: check the run id "
                            "(`rlpipe audit --action alias` lists recent ones) and RLPIPE_TRACKING_URI")
    have = ", ".join(f"iteration {v.tags['iteration']} = v{v.version}" for v in versions)
    if m is None:
        raise RollbackError(f"--to {to!r}: expected an iteration of {run_id} (e.g. 0) or a model version (e.g. "
                            f"v{versions[0].version}); its save points: {have}")
    hit = [v for v in versions if (v.tags["iteration"] == str(int(m.group(1))) if m.group(1) else
                                   str(v.version) == m.group(2))]
    if not hit:
        what = f"iteration {m.group(1)}" if m.group(1) else f"version v{m.group(2)}"
        raise RollbackError(f"--to {to}: {what} is not a registered save point of run {run_id}; its save points: "
                            f"{have} (train.save_interval decides which iterations are saved)")
    return hit[0]


def reference(old: RunConfig, name: str, started_from: str) -> str:
    """RUN's KL reference: its ``task.ref_model``, else the policy it started from. A start written as an alias
    (``models:/NAME@base``) is pinned to the version RUN started from (``started_from``: its first version's
    ``parent_version`` tag, ``V`` of ``name`` or ``OTHER/V``), since the alias may have moved since."""
    if old.task.ref_model is not None:
        return old.task.ref_model
    start = old.task.policy_model
    if not (start.startswith("models:/") and "@" in start and started_from):
        return start
    return f"models:/{started_from}" if "/" in started_from else f"models:/{name}/{started_from}"


def _new_config(old: RunConfig, name: str, version: str, started_from: str) -> RunConfig:
    """RUN's config, starting from the save point, with RUN's KL reference kept."""
    data = old.model_dump(mode="json")
    data["task"]["ref_model"] = reference(old, name, started_from)
    data["task"]["policy_model"] = f"models:/{name}/{version}"
    return RunConfig.model_validate(data)


def plan_rollback(tracker: Any, run_id: str, to: str, new_run_id: str | None = None) -> RollbackPlan:
    """What ``rlpipe rollback`` would do; raises :class:`RollbackError` naming the fix when it cannot."""
    versions = run_versions(tracker, run_id)
    mv = _target(versions, run_id, to)
    iteration, mlflow_run = int(mv.tags["iteration"]), mv.tags.get("mlflow_run_id") or mv.run_id
    if not mlflow_run:
        raise RollbackError(f"{mv.name} v{mv.version} names no MLflow run, so {run_id}'s config cannot be found: "
                            f"start the run by hand, `rlpipe run CONFIG --run-id {run_id}-rb{iteration} --set "
                            f"task.policy_model=models:/{mv.name}/{mv.version}`")
    try:
        old = tracker.run_config(mlflow_run)
    except LookupError as e:
        raise RollbackError(f"{e}: start the run by hand, `rlpipe run CONFIG --run-id {run_id}-rb{iteration} --set "
                            f"task.policy_model=models:/{mv.name}/{mv.version}` with {run_id}'s config") from None
    holders = tracker.client.get_registered_model(mv.name).aliases or {}
    later = {str(v.version) for v in versions if v.name == mv.name and int(v.tags["iteration"]) > iteration}
    started_from = next((v.tags.get("parent_version", "") for v in versions if v.name == mv.name), "")
    # MLflow's alias ``last`` is what users (and the registration's audit records) call ``latest``.
    moves = sorted(("latest" if a == "last" else a, str(v)) for a, v in holders.items() if str(v) in later)
    return RollbackPlan(run_id, mv.name, str(mv.version), iteration, mv.tags.get("weights_sha256", ""),
                        mv.tags.get("dataset_version", ""), mlflow_run, new_run_id or f"{run_id}-rb{iteration}",
                        _new_config(old, mv.name, str(mv.version), started_from), moves)


def rolled_back_to(tracker: Any, name: str, run_id: str) -> int | None:
    """The iteration ``run_id`` was last rolled back to on registered model ``name`` (None: never)."""
    from mlflow.exceptions import MlflowException

    try:
        tags = tracker.client.get_registered_model(name).tags or {}
    except MlflowException:
        return None
    value = tags.get(f"{ROLLBACK_TAG}{run_id}")
    return int(value) if value is not None else None


def move_back(audit: Any, tracker: Any, plan: RollbackPlan) -> list[Any]:
    """Mark the rollback, then move each alias of ``plan.moves`` back (each recorded first); the records."""
    from rlpipe.audit import move_alias

    # The mark first: a registration of RUN racing the moves must not carry an alias forward again.
    tracker.client.set_registered_model_tag(plan.name, f"{ROLLBACK_TAG}{plan.run_id}", str(plan.iteration))
    why = f"rollback of run {plan.run_id} to iteration {plan.iteration}; new run {plan.new_run_id}"
    recs = [move_alias(audit, tracker, plan.name, alias, plan.version, action="alias.rollback", why=why)
            for alias, _ in plan.moves]
    return [r for r in recs if r is not None]


def lineage_tags(plan: RollbackPlan, prefix: str) -> dict[str, str]:
    """The tags that name the new run's parent: ``rlpipe.parent_`` on its MLflow run, ``rollback_parent_`` on its
    versions."""
    return {f"{prefix}run_id": plan.run_id, f"{prefix}iteration": str(plan.iteration),
            f"{prefix}version": f"{plan.name}/{plan.version}", f"{prefix}mlflow_run_id": plan.mlflow_run_id}
