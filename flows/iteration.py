"""One RL iteration as its own Prefect flow run: rollout → verify → update → register → sync."""

from __future__ import annotations

import time
from concurrent.futures import wait
from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from rlpipe import http_client
from rlpipe.config import RunConfig
from rlpipe.progress import Progress
from rlpipe.runtime import RunContext, run_context, services
from rlpipe.stages import RolloutDone, SavePointBehind, SyncDone, UpdateDone, VerifyDone, iteration_metrics
from rlpipe.tracking.resources import monitor
from tasks._log import run_logger
from tasks.rl import (
    evaluate, fault_point, prefetch_rollout, rollout, sync_weights, update, upload_behind, upload_checkpoint, verify,
)
from tasks.tracking import lora_tags, register_checkpoint

# Earlier iterations the alert rules see: enough for every rule's window (throughput's median, memory
# growth, reward hacking), and a constant, so an alert check late in a run costs what an early one costs.
ALERT_HISTORY = 200


# Its parameters come from the rl-train flow, already typed and validated (RunConfig is validated once, at the
# run's start): Prefect's validation of them would redo that work at every call.
@flow(name="rl-iteration", flow_run_name="{run_id}-iter-{iteration}", validate_parameters=False)
def iteration(config: RunConfig, run_id: str, iteration: int, mlflow_run_id: str, dataset_version: str) -> dict[str, Any]:
    start, mon = time.perf_counter(), monitor()
    ctx = run_context(run_id, config)
    mark = mon.begin()
    if not _prefetched(run_id, iteration):  # a batch generated ahead made this iteration's first calls
        http_client.drain()  # the services' calls of this iteration only
    last = config.train.total_iterations - 1
    progress = ctx.folder.read_progress() or Progress()  # read once; this iteration's line is added at its end
    draws = _draws(ctx, iteration, progress.reward_norm)
    ahead = _generate_ahead(config, run_id, iteration, last)
    try:
        with mon.stage("update"):
            u = update(config, run_id, iteration, [dv for _, dv in draws])
    except BaseException:
        if ahead:
            wait([ahead])  # never leave the engine generating behind a failed iteration
        raise
    waited = time.perf_counter()
    nxt = ahead.result() if ahead else None  # the engine is reloaded only once the batch ahead is written
    waited = time.perf_counter() - waited
    progress = _record_behind(ctx, mlflow_run_id, dataset_version, progress)  # the last save point, uploaded behind
    with mon.stage("sync"):
        s = sync_weights(config, run_id, iteration, u)
    ev, val = None, None
    if (iteration + 1) % config.train.eval_interval == 0 or iteration == last:
        with mon.stage("eval"):
            ev, val = evaluate(config, run_id, "test"), evaluate(config, run_id, "validation")
    if config.rollout.prefetch and iteration < last:  # the next batch, on-policy, while this flow run ends
        prefetch_rollout(config, run_id, iteration + 1)
    registered, behind = None, None
    save_point = config.train.save_point(iteration)
    if save_point and _upload_behind(ctx, iteration, last):
        behind = SavePointBehind(iteration, u.state_dir, u.weights_sha256 or s.policy_version, val["accuracy"] if val else None,
                                 ev["accuracy"] if ev else None, str(flow_run.get_id() or ""))
        upload_behind(config, run_id, behind)
    elif save_point:
        with mon.stage("save"):
            ck = upload_checkpoint(config, run_id, iteration, u).as_dict()
            registered = _register(ctx, mlflow_run_id, dataset_version, iteration, ck, val["accuracy"] if val else None,
                                   ev["accuracy"] if ev else None)
        fault_point(iteration, "register")
    metrics = iteration_metrics(draws, u, s, ev, val, time.perf_counter() - start, nxt, waited)
    metrics |= mon.metrics(mark) | http_client.drain()
    fired = _alerts(ctx, iteration, metrics)
    _log_tracking(ctx, mlflow_run_id, iteration, metrics, fired, ev)
    _record(ctx, progress, iteration, draws, metrics, u, s, ev, val, registered, save_point and not behind,
            behind.state_dir if behind else None)
    run_logger().info(
        "iteration %d: reward %.3f, accuracy %.3f%s, loss %.4f, %.2f s (generate %.2f, verify %.2f, update %.2f, "
        "sync %.2f; overhead %.0f%%)",
        iteration, metrics["reward_mean"], metrics["accuracy"],
        f", held-out {ev['accuracy']:.3f}" if ev else "", metrics.get("loss", float("nan")), metrics["time/iteration_s"],
        metrics["time/generate_s"], metrics["time/verify_s"], metrics["time/update_s"], metrics["time/sync_s"],
        100 * metrics["time/overhead_share"],
    )
    return {"iteration": iteration, "metrics": metrics, "registered": registered, "alerts": [a.as_dict() for a in fired]}


def _upload_behind(ctx: RunContext, iteration: int, last: int) -> bool:
    """Whether save point ``iteration`` is uploaded behind the run (train.async_save): its state is being written on
    a thread (the in-process trainer) and a next iteration is there to record it; the last is recorded at once."""
    writing = services(ctx.run_id).saving
    return iteration < last and writing is not None and writing[0] == iteration


def record_behind(ctx: RunContext, mlflow_run_id: str, dataset_version: str) -> None:
    """A run that stops between iterations (cancelled, an alert) first records the save point still uploading
    behind it: the stop loses nothing a resume could have continued from."""
    if services(ctx.run_id).uploading is not None:
        ctx.folder.write_progress(_record_behind(ctx, mlflow_run_id, dataset_version, ctx.folder.read_progress() or Progress()))


def _record_behind(ctx: RunContext, mlflow_run_id: str, dataset_version: str, progress: Progress) -> Progress:
    """The save point of the iteration before, uploaded behind the run, recorded once its upload is whole (waited
    for here): its model version registered (tagged with its own flow run), then the store's record and this
    machine's resume record, as an iteration that records its own save point does. The progress, updated."""
    done = services(ctx.run_id).join_upload()
    if done is None:
        return progress
    point, ck = done
    if progress.completed_iteration != point.iteration:
        raise RuntimeError(f"save point {point.iteration} was uploaded behind the run, but the progress is at "
                           f"iteration {progress.completed_iteration}: not recorded (a resume starts before it)")
    with monitor().stage("save"):
        registered = _register(ctx, mlflow_run_id, dataset_version, point.iteration, ck.as_dict(), point.accuracy,
                               point.test_accuracy, {"prefect_flow_run_id": point.flow_run_id})
    fault_point(point.iteration, "register")
    if registered:
        progress = progress.but(last_registered=registered["version"])
    progress = ctx.state.save_point(progress.but(resume_dir=point.state_dir))
    ctx.folder.write_resume(progress)
    run_logger().info("save point %d, uploaded behind the run, recorded%s", point.iteration,
                      f": model version {registered['version']}" if registered else "")
    return progress


def _register(ctx: RunContext, mlflow_run_id: str, dataset_version: str, iteration: int, ck: dict[str, Any],
              accuracy: float | None, test_accuracy: float | None, tags: dict[str, str] | None = None) -> dict[str, Any] | None:
    """Save point ``iteration``'s model version (alias ``latest``), with its LoRA lineage and ``tags``."""
    return register_checkpoint(ctx.config, ctx.run_id, mlflow_run_id, ck, dataset_version, iteration, aliases=("latest",),
                               accuracy=accuracy, test_accuracy=test_accuracy,
                               extra_tags=(lora_tags(ctx.config, ck) or {}) | (tags or {}) or None)


def _log_tracking(ctx: RunContext, mlflow_run_id: str, iteration: int, metrics: dict[str, float], fired: list,
                  ev: dict[str, Any] | None) -> None:
    """A direct call, not a task: per-iteration logging should not pay for a task run of its own. An iteration
    redone after a resume (from the save point before it) was logged before the stop: not logged twice. The same
    metrics go to the Pushgateway when one is set (:mod:`rlpipe.tracking.prom_push`; a failed push is a warning)."""
    if iteration <= ctx.logged_through:
        run_logger().info("iteration %d redone: its metrics were logged to MLflow before the resume", iteration)
        return
    tracker = ctx.tracker
    tracker.log_metrics(mlflow_run_id, metrics, iteration)
    if ctx.pusher is not None:
        ctx.pusher.push(iteration, metrics, run_logger())
    if fired:
        tracker.log_table(mlflow_run_id, [{"iteration": iteration} | a.as_dict() for a in fired], "alerts.json")
    if ev and ev.get("samples"):  # what the policy wrote, next to the numbers: MLflow's Evaluation view
        tracker.log_table(mlflow_run_id, [{"iteration": iteration} | x for x in ev["samples"]], "generations.json")


def _draws(ctx: RunContext, iteration: int, norm: dict[str, float] | None) -> list[tuple[RolloutDone, VerifyDone]]:
    """Rollout + verify; with DAPO dynamic sampling, more draws until enough groups carry a signal. ``norm``: the
    reward normaliser after the last iteration (RLHF)."""
    config, run_id, draws = ctx.config, ctx.run_id, []
    with_signal = 0.0
    for draw in range(1 + (config.rollout.max_extra_draws if config.rollout.dynamic_sampling else 0)):
        with monitor().stage("generate"):
            r = rollout(config, run_id, iteration, draw)
        with monitor().stage("verify"):
            v = verify(config, run_id, iteration, r, draw, reward_norm=norm)
        norm = v.reward_norm or norm
        draws.append((r, v))
        with_signal += v.groups_with_signal
        if with_signal >= config.rollout.batch_size:
            break
    return draws


def _prefetched(run_id: str, iteration: int) -> bool:
    background = services(run_id).background
    return background is not None and background[0] == iteration


def _generate_ahead(config: RunConfig, run_id: str, iteration: int, last: int) -> Any:
    """rollout.async_steps: 1 — iteration k+1's batch, generated by the policy the engine holds now (before
    update k) while update k runs; a future, joined before the weight sync. None when off or at the last."""
    if config.rollout.async_steps == 0 or iteration >= last:
        return None
    return rollout.submit(config, run_id, iteration + 1, 0)


def _alerts(ctx: RunContext, iteration: int, metrics: dict[str, float]) -> list:
    """The config's alert rules on this iteration (``alerts/<rule>`` metrics, an ALERT line each); the
    batch's own alerts (a flat batch, unscorable samples) are already counted in ``alerts``."""
    from rlpipe.alerts import evaluate

    history = [h for h in ctx.folder.history.tail(ALERT_HISTORY + 1) if h["iteration"] < iteration][-ALERT_HISTORY:]
    fired, flags = evaluate(ctx.config, metrics, history)
    metrics |= flags
    metrics["alerts"] = metrics.get("alerts", 0.0) + len(fired)
    for a in fired:
        run_logger().warning("ALERT iteration %d [%s %s]: %s", iteration, a.severity, a.rule, a.message)
    return fired


def _record(ctx: RunContext, progress: Progress, iteration: int, draws: list[tuple[RolloutDone, VerifyDone]],
            metrics: dict[str, float], u: UpdateDone, s: SyncDone, ev: dict[str, Any] | None, val: dict[str, Any] | None,
            registered: dict[str, Any] | None, save_point: bool, behind: str | None = None) -> None:
    """The iteration's line in ``progress`` (as the iteration began). At a save point the store's record first,
    then this machine's resume record (``resume.json``: what a resume continues from), then its progress.
    ``behind``: the state of this iteration's save point, uploaded behind the run and recorded by the next
    iteration: kept, not a save point yet."""
    ctx.folder.history.add(iteration, metrics)  # appended: the cost does not grow with the run
    norm = next((dv.reward_norm for _, dv in reversed(draws) if dv.reward_norm is not None), progress.reward_norm)
    progress = progress.but(reward_norm=norm, completed_iteration=iteration, weights_sha256=s.policy_version,
                            last_registered=registered["version"] if registered else progress.last_registered)
    if ev:
        progress = progress.but(final_accuracy=ev["accuracy"], final_true_score=ev["true_score"],
                                final_rm_score=ev["rm_score"], final_mean_steps=ev.get("mean_steps"),
                                final_tool_calls_per_episode=ev.get("tool_calls_per_episode"))
    if val:
        progress = progress.but(final_validation_accuracy=val["accuracy"])
    if save_point:
        progress = ctx.state.save_point(progress.but(resume_dir=u.state_dir))
        ctx.folder.write_resume(progress)
    ctx.folder.write_progress(progress)
    keep = [d for d in (progress.resume_dir, behind) if d]
    if keep:  # a trainer service's state of every iteration, or the save point before this one (and one uploading)
        ctx.folder.prune_states(keep=keep)
