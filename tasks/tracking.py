"""Tracking tasks: the MLflow run of an rlpipe run, and checkpoint registration."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from rlpipe.audit import move_alias
from rlpipe.config import RunConfig, settings
from rlpipe.runtime import find_context
from rlpipe.tracking.mlflow_utils import PROMOTION_ALIASES, Tracker, mlflow_alias
from tasks._log import run_logger


@task(name="start-tracking", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE, timeout_seconds=120)
def start_tracking(config: RunConfig, run_id: str, kind: str, dataset_version: str) -> str:
    return Tracker(settings(), config).start_run(config, run_id, kind, dataset_version)


def lora_tags(config: RunConfig, checkpoint: dict[str, Any]) -> dict[str, str] | None:
    """Lineage of a LoRA run's version: the adapter (beside the merged weights the version's folder holds) and the
    base model it belongs to."""
    lora = config.train.lora
    if lora is None:
        return None
    return {"lora_base": config.task.policy_model, "lora_adapter": f"{checkpoint['checkpoint_uri'].rstrip('/')}/adapter",
            "lora_r": str(lora.r), "lora_alpha": f"{lora.alpha:g}",
            "lora_target_modules": lora.target_modules if isinstance(lora.target_modules, str) else ",".join(lora.target_modules)}


@task(name="register-checkpoint", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE, timeout_seconds=120)
def register_checkpoint(
    config: RunConfig,
    run_id: str,
    mlflow_run_id: str,
    checkpoint: dict[str, Any],
    dataset_version: str,
    iteration: int,
    aliases: tuple[str, ...],
    accuracy: float | None = None,
    test_accuracy: float | None = None,
    model_name: str | None = None,
    extra_tags: dict[str, str] | None = None,
    promote_best: bool = False,
) -> dict[str, Any] | None:
    """Register a checkpoint once, with its lineage, and announce it (event ``rlpipe.checkpoint.registered``).
    None when the config opts out (``tracking.register_models: false``): the checkpoint stays in the store.

    ``best`` and ``champion`` never move here: the ``evaluate`` flow moves them, on the validation split.
    The one exception is ``promote_best`` (the reward-model fit, whose ``best`` follows validation pair
    accuracy). Validation and test accuracy are tags; the test split is never a selection criterion.

    An iteration redone after a kill finds its version (same run, iteration and weights) and returns it
    without registering again (:func:`_redone`). Each alias move is in the audit log (:mod:`rlpipe.audit`). ``model_name`` defaults to the policy's registry name."""
    if protected := PROMOTION_ALIASES & set(aliases):
        raise ValueError(f"alias {sorted(protected)} moves only through the evaluate flow (validation split), not on registration")
    if not config.tracking.register_models:
        run_logger().info("run %s iteration %d: not registered (tracking.register_models is false); checkpoint %s",
                          run_id, iteration, checkpoint["checkpoint_uri"])
        return None
    ctx = find_context(run_id)  # an RL run's tracker, made once; SFT and reward-model fits make their own
    tracker = ctx.tracker if ctx is not None else Tracker(settings(), config)
    name = model_name or config.registered_model
    aliases = _held_back(tracker, name, run_id, iteration, aliases)
    existing = _registered(tracker, name, run_id, iteration)
    if existing is not None:
        return asdict(_redone(config, ctx, tracker, existing, checkpoint, aliases, run_id, iteration))
    parent = _parent_version(tracker, name, run_id, iteration, config.task.policy_model)
    extra = {k: f"{v:.6f}" for k, v in (("validation_accuracy", accuracy), ("test_accuracy", test_accuracy)) if v is not None}
    extra |= {"kind": "policy", "prefect_flow_run_id": str(flow_run.get_id() or ""), "mlflow_run_id": mlflow_run_id or ""} | (extra_tags or {})
    mv = tracker.register_checkpoint(
        name, checkpoint["checkpoint_uri"], mlflow_run_id, rlpipe_run_id=run_id, iteration=iteration,
        config_fingerprint=config.fingerprint(), dataset_version=dataset_version,
        weights_sha256=checkpoint["weights_sha256"], parent_version=parent,
        aliases=(), extra_tags=extra,
    )
    mv = replace(mv, aliases=_move_aliases(config, ctx, tracker, mv, aliases, f"run {run_id} iteration {iteration}"))
    if promote_best and accuracy is not None:
        best = tracker.version_by_alias(name, "best")
        if accuracy > (float(best.tags.get("validation_accuracy", "-1")) if best else -1.0):
            move_alias(_audit(config, ctx), tracker, name, "best", mv.version, action="alias.promote",
                       why=f"validation pair accuracy {accuracy:.4f} beats @best's")
    announce_registration(mv, kind=extra.get("kind", "policy"))
    return asdict(mv)


def _redone(config: RunConfig, ctx: Any, tracker: Tracker, existing: Any, checkpoint: dict[str, Any],
            aliases: tuple[str, ...], run_id: str, iteration: int) -> Any:
    """A redone iteration's version, registered before: the same weights or an error; an alias the first try
    did not move (it failed between the version and the move) moves now, forward only."""
    name = existing.name
    if existing.tags.get("weights_sha256") != checkpoint["weights_sha256"]:
        raise RuntimeError(
            f"{existing.name} v{existing.version} is run {run_id}'s iteration {iteration} with weights "
            f"{existing.tags.get('weights_sha256', '')[:12]}, the redone iteration made {checkpoint['weights_sha256'][:12]}: "
            "the redo was not deterministic; the registered version is kept")
    pending = tuple(a for a in aliases if mlflow_alias(a) not in existing.aliases
                    and _behind(tracker, name, a, run_id, iteration))
    if pending:  # the first try registered, then failed before its aliases moved (its audit record, say)
        moved = _move_aliases(config, ctx, tracker, existing, pending, f"run {run_id} iteration {iteration}")
        existing = replace(existing, aliases=tuple(existing.aliases) + moved)
    return existing


def _audit(config: RunConfig, ctx: Any) -> Any:
    """The audit log in the run's store (the run context's where one is registered)."""
    from rlpipe.storage import open_store
    from tasks.audit import audit_log

    s = settings()
    return audit_log(ctx.store if ctx is not None else open_store(s.resolve_storage_uri(config), s), s)


def _move_aliases(config: RunConfig, ctx: Any, tracker: Tracker, mv: Any, aliases: tuple[str, ...], why: str
                  ) -> tuple[str, ...]:
    """Point each alias at the new version, each move in the audit log first (an alias that cannot be audited
    does not move: :class:`rlpipe.audit.AuditError`)."""
    audit = _audit(config, ctx) if aliases else None
    for alias in aliases:
        move_alias(audit, tracker, mv.name, alias, mv.version, why=f"registered {why}")
    return tuple(mlflow_alias(a) for a in aliases)


def _held_back(tracker: Tracker, name: str, run_id: str, iteration: int, aliases: tuple[str, ...]) -> tuple[str, ...]:
    """No alias for an iteration past the one ``rlpipe rollback`` put this run back to (:mod:`rlpipe.rollback`): a
    redone iteration or a resume of the rolled-back run registers its version without undoing the rollback."""
    from rlpipe.rollback import rolled_back_to

    if not aliases or (to := rolled_back_to(tracker, name, run_id)) is None or iteration <= to:
        return aliases
    run_logger().warning("run %s iteration %d: registered without alias %s: the run was rolled back to iteration %d "
                         "(`rlpipe audit --action alias.rollback`)", run_id, iteration, ", ".join(aliases), to)
    return ()


def _behind(tracker: Tracker, name: str, alias: str, run_id: str, iteration: int) -> bool:
    """Whether ``alias`` is missing or holds an earlier iteration of this run: a redone registration moves it on,
    never back, nor away from another run's version."""
    holder = tracker.version_by_alias(name, alias)
    return holder is None or (holder.tags.get("run_id") == run_id and int(holder.tags.get("iteration", "-1")) < iteration)


def announce_registration(mv: Any, kind: str) -> None:
    """Emit ``rlpipe.checkpoint.registered`` (resource ``rlpipe.model.<name>.<version>``, label
    ``rlpipe.model.kind``; payload ``model_uri`` = ``models:/<name>/<version>``): deployment triggers start
    on it (prefect.yaml's evaluate-on-registration). An event that cannot be sent is logged, never fatal:
    the version is registered either way."""
    from prefect.events import emit_event

    try:
        emit_event(
            event="rlpipe.checkpoint.registered",
            resource={"prefect.resource.id": f"rlpipe.model.{mv.name}.{mv.version}", "prefect.resource.name": mv.name,
                      "rlpipe.model.kind": kind, "rlpipe.run_id": mv.tags.get("run_id", "")},
            payload={"model_uri": f"models:/{mv.name}/{mv.version}", "name": mv.name, "version": mv.version,
                     "run_id": mv.tags.get("run_id"), "iteration": mv.tags.get("iteration"), "aliases": list(mv.aliases),
                     "weights_sha256": mv.tags.get("weights_sha256")},
        )
    except Exception as e:  # noqa: BLE001
        run_logger().warning("%s v%s: the registration event could not be sent (%s: %s)", mv.name, mv.version,
                             type(e).__name__, e)


def version_summary(version: dict[str, Any] | None) -> dict[str, Any] | None:
    """A registered version as a summary shows it; None when the config opted out of registration."""
    return {"name": version["name"], "version": version["version"], "aliases": list(version["aliases"])} if version else None


def _parent_version(tracker: Tracker, name: str, run_id: str, iteration: int, start: str) -> str | None:
    """What a new version came from: this run's previous version, else the registered version the run
    started from (``task.policy_model`` when it is ``models:/``; written ``NAME/VERSION`` when that is
    another model). Never another run's version that happens to hold ``@last``."""
    found = tracker.client.search_model_versions(f"name='{name}' and tags.run_id='{run_id}'")
    earlier = [m for m in found if int(m.tags.get("iteration", "-1")) < iteration]
    if earlier:
        return str(max(earlier, key=lambda m: (int(m.tags["iteration"]), int(m.version))).version)
    if not start.startswith("models:/"):
        return None
    ref = start[len("models:/"):]
    if "@" in ref:
        start_name, alias = ref.split("@", 1)
        mv = tracker.version_by_alias(start_name, alias)
        version = mv.version if mv else None
    else:
        start_name, version = ref.rsplit("/", 1)
    if version is None:
        return None
    return str(version) if start_name == name else f"{start_name}/{version}"


def _registered(tracker: Tracker, name: str, run_id: str, iteration: int):
    from rlpipe.tracking.mlflow_utils import ModelVersionInfo

    found = tracker.client.search_model_versions(
        f"name='{name}' and tags.run_id='{run_id}' and tags.iteration='{iteration}'")
    if not found:
        return None
    mv = min(found, key=lambda m: int(m.version))
    return ModelVersionInfo(name, str(mv.version), mv.source, dict(mv.tags), tuple(getattr(mv, "aliases", ()) or ()))


@task(name="end-tracking", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE, timeout_seconds=60)
def end_tracking(config: RunConfig, mlflow_run_id: str, status: str = "FINISHED") -> None:
    Tracker(settings(), config).end_run(mlflow_run_id, status)


@task(name="log-metrics", retries=2, retry_delay_seconds=1, cache_policy=NO_CACHE, timeout_seconds=60)
def log_metrics(config: RunConfig, mlflow_run_id: str, metrics: dict[str, float], step: int) -> None:
    Tracker(settings(), config).log_metrics(mlflow_run_id, metrics, step)


@task(name="log-artifact", retries=2, retry_delay_seconds=1, cache_policy=NO_CACHE, timeout_seconds=120)
def log_artifact(config: RunConfig, mlflow_run_id: str, path: str) -> None:
    Tracker(settings(), config).log_artifact(mlflow_run_id, path)
