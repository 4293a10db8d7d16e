"""The RL run: data → services (started once) → one `rl-iteration` flow run per iteration → summary.

Running it again with the same run id resumes after the last completed iteration, with the
optimizer state, RNG and data cursor saved then; stages of the interrupted iteration that were
finished (manifest written) are reused, half-written ones are redone.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow
from prefect.runtime import flow_run
from prefect.states import Cancelled, State

from flows.iteration import iteration, record_behind
from rlpipe.audit import AuditError, set_tag
from rlpipe.config import RunConfig
from rlpipe.eta import Eta
from rlpipe.guards import NonFiniteUpdate, RewardCircuitOpen
from rlpipe.progress import Progress
from rlpipe.runs import new_run_id
from rlpipe.runtime import RunContext, forget_context, register_context, stop_services
from rlpipe.runtime.assembly import ServicesStarted
from rlpipe.storage.layout import check_run_id
from tasks._log import run_logger
from tasks.alerts import cancel_requested, raise_alerts
from tasks.audit import audit_log
from tasks.data import prepare_dataset
from tasks.preflight import preflight_task
from tasks.rl import evaluate, start_services
from tasks.tracking import end_tracking, log_artifact, log_metrics, start_tracking


def _resume_point(ctx: RunContext, dataset_version: str, allow_change: bool) -> tuple[Progress, list[str]]:
    """The progress to continue from: this machine's last save point when its state is intact (``resume.json``;
    a run from before it kept a state per iteration, named in ``progress.json``), else the object store's last
    save point (its state downloaded), whichever is further along; an empty one for a new run. The iterations
    done after that save point are redone (their stored batches reused where the policy matches), and said so."""
    from rlpipe.resume import ResumeRefused, check_resume

    state, log, run_id = ctx.state, run_logger(), ctx.run_id
    latest, saved = state.read_local(), state.read_saved()
    local = ctx.folder.read_resume() or latest
    options = []
    if local and local.started and state.local_state_ok(local):
        options.append((local.completed_iteration, 1, local))
    elif local and local.completed_iteration >= 0:
        log.warning("run %s: the local state of iteration %d is missing or differs from its record; using the "
                    "object store", run_id, local.completed_iteration)
    if saved:
        options.append((saved.completed_iteration, 0, saved))
    if not options:
        if latest and latest.completed_iteration >= 0:  # never a silent restart from 0
            raise ResumeRefused(
                f"run {run_id} completed iteration {latest.completed_iteration}, but its state is gone from this "
                f"machine and {state.store.url('')} holds no save point; start a new --run-id")
        progress = latest or Progress()
        return progress, check_resume(progress, ctx.config, dataset_version, allow_change) if latest else []
    k, where, progress = max(options, key=lambda o: (o[0], o[1]))
    changes = check_resume(progress, ctx.config, dataset_version, allow_change)
    if where == 0:  # from the store: this machine has no (or older) state
        folder = state.fetch_state(progress, ctx.folder.state_dir(k))
        progress = state.fetch_history(progress).but(resume_dir=str(folder))
    elif progress is not latest:  # this machine's last save point: its history as it was then
        ctx.folder.history.replace(ctx.folder.history.bytes_from(0)[:progress.history_bytes])
    state.write_local(progress)
    ctx.folder.write_resume(progress)
    progress = state.history_out_of_progress(progress)
    done = latest.completed_iteration if latest else k
    ctx.logged_through = done
    (log.warning if done > k else log.info)(  # redoing iterations is worth a person's notice
        "resuming run %s after iteration %d from %s (%s)%s", run_id, k, progress.resume_dir or "the start policy",
        "this machine" if where else state.store.url(progress.resume_state),
        f"; iterations {k + 1}..{done} (done after that save point) are redone" if done > k else "")
    return progress, changes


@flow(name="rl-train", flow_run_name="{run_id}")
def train(config: RunConfig = RunConfig(), run_id: str = "", allow_config_change: bool = False) -> str | State:
    """Train with RL; returns the path of the run's summary.json.

    The same run id resumes (see :mod:`rlpipe.resume`); a changed config or dataset is refused unless
    ``allow_config_change``, and then recorded in MLflow.

    Args:
        config: The run config: task and prompt set, policy model (a registered models:/NAME@ALIAS), rollout,
            rewards, algorithm and optimizer, tracking. Each field is documented.
        run_id: Start this run, or resume it after its last completed iteration; empty: a new run id.
        allow_config_change: Resume even though the config or the dataset changed (recorded in MLflow).
    """
    ctx = register_context(RunContext.resolve(config, check_run_id(run_id or new_run_id("rl"))))
    try:
        _name_flow_run(ctx.run_id)
        return _train(ctx, allow_config_change)
    finally:
        forget_context(ctx.run_id)  # a run that stopped early leaves no context behind for a later run of its id


def _name_flow_run(run_id: str) -> None:
    """A run started without a run id (the deployment's default) names its flow run after the id it made up: the flow
    run's name was rendered from the empty parameter, and the heal flow (flows/heal.py) and a person in the UI find
    the run to resume by it."""
    me = flow_run.get_id()
    if me and flow_run.get_name() != run_id:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            client.set_flow_run_name(me, run_id)


def _train(ctx: RunContext, allow_config_change: bool) -> str | State:
    """Data, the resume point, services, the base evaluation, the iterations, the summary."""
    start, config = time.perf_counter(), ctx.config
    preflight_task(config)  # fail fast, naming the component that is down
    dataset = prepare_dataset(config)
    progress, changes = _resume_point(ctx, dataset["version"], allow_config_change)
    mlflow_run = start_tracking(config, ctx.run_id, "rl", dataset["version"])
    _logged_already(ctx, mlflow_run)
    if changes:
        _record_change(ctx, mlflow_run, progress, changes)
    ctx.resolve_models()
    sysmon = (ctx.tracker.system_metrics(mlflow_run, config.tracking.system_metrics_s)
              if mlflow_run and config.tracking.system_metrics_s else None)
    try:
        started = start_services(config, ctx.run_id, dataset, progress.resume_dir)
        _check_reward_model(ctx.run_id, progress, started, allow_config_change)
        if progress.base_accuracy is None:
            _evaluate_base(ctx, mlflow_run, progress, started, dataset["version"])
        if (stopped := _loop(ctx, mlflow_run, dataset["version"], progress.completed_iteration + 1)) is not None:
            return stopped
    except BaseException:
        end_tracking(config, mlflow_run, "FAILED")
        raise
    finally:
        stop_services(ctx.run_id)
        if sysmon:
            sysmon.finish()
    return _finish(ctx, dataset, mlflow_run, started, time.perf_counter() - start)


def _evaluate_base(ctx: RunContext, mlflow_run: str, progress: Progress, started: ServicesStarted, dataset_version: str
                   ) -> None:
    """The start policy on the held-out and validation splits: the run's baseline, recorded before any update."""
    config, run_id = ctx.config, ctx.run_id
    base, val = evaluate(config, run_id, "test"), evaluate(config, run_id, "validation")
    progress = progress.but(
        base_accuracy=base["accuracy"], base_validation_accuracy=val["accuracy"], base_policy=base["policy_version"],
        heldout_n=base["n"], dataset_version=dataset_version, config_fingerprint=ctx.fingerprint,
        resume_fingerprint=ctx.resume_fingerprint, config=config.flat(), reward_model_version=started.reward_model_version,
        base_true_score=base["true_score"], base_rm_score=base["rm_score"], base_mean_steps=base.get("mean_steps"),
        base_tool_calls_per_episode=base.get("tool_calls_per_episode"))
    ctx.folder.write_progress(progress)
    ctx.folder.write_resume(progress)  # a resume before the first save point starts here (the start policy)
    log_metrics(config, mlflow_run, {"heldout_accuracy": base["accuracy"], "validation_accuracy": val["accuracy"]}, -1)
    if mlflow_run and base.get("samples"):  # the base policy's generations: iteration -1 of the table
        ctx.tracker.log_table(mlflow_run, [{"iteration": -1} | x for x in base["samples"]], "generations.json")
    run_logger().info("base policy: held-out accuracy %.3f (n=%d), validation %s (n=%d)", base["accuracy"], base["n"],
                      "none" if val["accuracy"] is None else f"{val['accuracy']:.3f}", val["n"])


def _loop(ctx: RunContext, mlflow_run: str, dataset_version: str, first: int) -> State | None:
    """Iterations ``first`` .. the last, one flow run each; a Cancelled state when the run stops between them."""
    config, run_id = ctx.config, ctx.run_id
    eta = Eta(config.train.total_iterations, done=first)
    mark = time.perf_counter()  # an iteration's total runs from the last one's mark to its own: nothing is left out
    for k in range(first, config.train.total_iterations):
        if reason := cancel_requested(flow_run.id):  # the UI, the CLI or an automation, between iterations
            record_behind(ctx, mlflow_run, dataset_version)
            return _cancelled(ctx, mlflow_run, k - 1, reason)
        out = _iteration(config, run_id, k, mlflow_run, dataset_version)
        now = time.perf_counter()
        _account_outer_time(ctx, k, mlflow_run, out["metrics"], now - mark)
        mark = now
        run_logger().info("run %s: iteration %s", run_id, eta.tick(k + 1))
        if reason := raise_alerts(config, run_id, k, out["alerts"]):
            record_behind(ctx, mlflow_run, dataset_version)
            return _cancelled(ctx, mlflow_run, k, reason)
    return None


def _finish(ctx: RunContext, dataset: dict[str, Any], mlflow_run: str, started: ServicesStarted, wall_s: float) -> str:
    """The run's summary (MLflow cost metrics, the HTML report, ``summary.json``); returns its path."""
    config = ctx.config
    progress = ctx.folder.read_progress() or Progress()
    summary = _summary(ctx, dataset, mlflow_run, progress, started, wall_s)
    cost = ("cpu_s_total", "cpu_s_per_iteration", "cpu_s_per_heldout_point", "gpu_s_total", "gpu_s_per_heldout_point")
    log_metrics(config, mlflow_run, {f"cost/{k}": float(summary[k]) for k in cost if summary.get(k) is not None},
                max(summary["iterations_done"] - 1, 0))
    summary["report_html"] = _report(ctx, mlflow_run)
    end_tracking(config, mlflow_run)
    path = ctx.folder.write_summary(ctx.run_id, summary)
    run_logger().info("summary: %s", path)
    return str(path)


_QUIET: list[Any] = []  # [the settings it was derived from, those settings without a heartbeat]


def _no_heartbeat():
    """Settings under which a flow run sends no heartbeat. Each heartbeat thread is joined when its flow run
    ends, and it sleeps in 1-second steps: most of a second of every iteration for nothing, since the parent
    run's heartbeat already says the process lives (benchmarks/history.md has the figure). The settings are
    derived once and reused: Prefect's ``temporary_settings`` revalidates every setting on each call."""
    from prefect.context import SettingsContext, get_settings_context
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY

    context = get_settings_context()
    if not _QUIET or _QUIET[0] is not context.settings:
        _QUIET[:] = [context.settings, context.settings.copy_with_update(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})]
    return SettingsContext(profile=context.profile, settings=_QUIET[1])


def _iteration(config: RunConfig, run_id: str, k: int, mlflow_run: str, dataset_version: str) -> dict[str, Any]:
    """One iteration flow run; a guard that stops the run (non-finite updates, the reward circuit breaker)
    is raised as an alert first, so that it reaches people and automations, not only the log."""
    from rlpipe.alerts import guard_alert

    try:
        with _no_heartbeat():
            return iteration(config, run_id, k, mlflow_run, dataset_version)
    except (NonFiniteUpdate, RewardCircuitOpen) as e:
        rule = "nonfinite_loss" if isinstance(e, NonFiniteUpdate) else "verifier_errors"
        if alert := guard_alert(config, rule, f"the run stopped: {e}"):
            try:
                raise_alerts(config, run_id, k, [alert.as_dict()])
            except Exception as err:  # noqa: BLE001 - the guard's own error is the one to raise
                run_logger().warning("could not emit the %s alert: %s", rule, err)
        raise


def _cancelled(ctx: RunContext, mlflow_run: str, last: int, reason: str) -> State:
    """The run stops resumably: its MLflow run is marked KILLED, its flow run ends Cancelled. The cancel (an
    automation's, the UI's, the CLI's) is in the audit log as ``run.cancel``; it was made before this run saw
    it, so a record that cannot be written is an error in the log, and the run still stops."""
    config, run_id = ctx.config, ctx.run_id
    msg = (f"run {run_id} cancelled after iteration {last} ({reason}); its progress is saved: "
           f"resume with `rlpipe run --run-id {run_id}`")
    run_logger().warning(msg)
    audit = audit_log(ctx.store, ctx.settings)
    try:
        rec = audit.write("run.cancel", {"run_id": run_id, "mlflow_run_id": mlflow_run or ""},
                          {"after_iteration": last, "reason": reason})
    except AuditError as e:
        run_logger().error("%s", e)
    else:
        audit.announce(rec)
        if mlflow_run:
            set_tag(lambda k, v: ctx.tracker.client.set_tag(mlflow_run, k, v), rec, f"MLflow run {mlflow_run}")
    end_tracking(config, mlflow_run, "KILLED")
    return Cancelled(message=msg)


def _report(ctx: RunContext, mlflow_run: str) -> str | None:
    """The run's HTML report (``rlpipe report``), logged to its MLflow run. A report that cannot be built
    does not fail a finished run: the log says why, and ``rlpipe report RUN_ID`` can try again."""
    from rlpipe.tracking.report import build_report

    if not mlflow_run:
        return None
    run_id = ctx.run_id
    try:
        return str(build_report(mlflow_run, ctx.settings, ctx.folder.report_path, config=ctx.config))
    except Exception as e:  # noqa: BLE001
        run_logger().warning("run %s: the HTML report could not be built (%s: %s); try `rlpipe report %s`",
                             run_id, type(e).__name__, e, run_id)
        return None


def _check_reward_model(run_id: str, progress: Progress, started: ServicesStarted, allow_change: bool) -> None:
    """A resumed RLHF run scores with the reward model it started with: an alias that moved meanwhile
    (``@best`` of a newer fit) would change the reward in the middle of the run."""
    from rlpipe.resume import ResumeRefused

    before, now = progress.reward_model_version, started.reward_model_version
    if before and now and before != now and "unknown" not in (before, now):  # "unknown": the service was down
        if not allow_change:
            raise ResumeRefused(f"run {run_id} was trained against reward model {before}, which now resolves to {now}; "
                                "pin reward.model to the first (models:/NAME/VERSION) or pass --allow-config-change")
        run_logger().warning("run %s: reward model %s → %s (--allow-config-change)", run_id, before, now)


def _record_change(ctx: RunContext, mlflow_run: str, progress: Progress, changes: list[str]) -> None:
    """An allowed config change: a record in the audit log first (a change that cannot be audited is refused:
    :class:`rlpipe.audit.AuditError`), a tag on the MLflow run, a line in the log, the new config in the progress."""
    run_id, at = ctx.run_id, progress.completed_iteration + 1
    with audit_log(ctx.store, ctx.settings).change(
            "resume.config_change", {"run_id": run_id, "mlflow_run_id": mlflow_run or ""},
            {"iteration": at, "changes": changes}) as rec:
        ctx.tracker.client.set_tag(mlflow_run, f"rlpipe.config_change.iter{at}", "; ".join(changes)[:4900])
        if progress.started:
            ctx.folder.write_progress(progress.but(
                config=ctx.config.flat(), resume_fingerprint=ctx.resume_fingerprint, config_fingerprint=ctx.fingerprint,
                config_changes=progress.config_changes + [{"iteration": at, "changes": changes}]))
    set_tag(lambda k, v: ctx.tracker.client.set_tag(mlflow_run, k, v), rec, f"MLflow run {mlflow_run}")
    run_logger().warning("run %s resumes at iteration %d with %d config change(s) (--allow-config-change): %s",
                         run_id, at, len(changes), "; ".join(changes))


def _logged_already(ctx: RunContext, mlflow_run: str) -> None:
    """The last iteration whose metrics, and whose outer timings, the MLflow run holds already: a kill can fall
    between an iteration's logging and its record, or between the two, and an iteration redone after a resume is
    logged once, not twice."""
    if not mlflow_run or ctx.folder.read_progress() is None:  # a new run: nothing logged yet
        return
    client = ctx.tracker.client

    def last(key: str) -> int:
        return max((m.step for m in client.get_metric_history(mlflow_run, key)), default=-1)

    ctx.logged_through = max(ctx.logged_through, last("time/iteration_s"))
    ctx.outer_logged_through = last("time/iteration_total_s")


def _account_outer_time(ctx: RunContext, k: int, mlflow_run: str, m: dict[str, float], total: float) -> None:
    """Overhead as the parent sees it: ``total`` is the parent's wall since the previous iteration's mark, so it
    holds the iteration flow run's own start/finish and the parent's work between iterations (the previous
    iteration's outer logging and alert check, this one's cancel check): the totals add up to the loop's wall up
    to the last mark."""
    compute = m["time/generate_s"] + m["time/verify_s"] + m["time/update_s"]
    extra = {"time/iteration_total_s": total, "time/overhead_total_s": total - compute - m["time/eval_s"],
             "time/overhead_total_share": (total - compute - m["time/eval_s"]) / max(total - m["time/eval_s"], 1e-9)}
    if k > ctx.outer_logged_through:  # else logged before a resume redid iteration k
        ctx.tracker.log_metrics(mlflow_run, extra, k)
    ctx.folder.history.extend(k, extra)


def _summary(ctx: RunContext, dataset: dict[str, Any], mlflow_run: str, progress: Progress, started: ServicesStarted,
             wall_s: float) -> dict[str, Any]:
    """The run's summary (:func:`rlpipe.summary.rl_summary`) with its reward curves, logged to the MLflow run."""
    from rlpipe.summary import rl_summary
    from rlpipe.tracking.plots import reward_curve, rm_vs_true_curve

    config, run_id = ctx.config, ctx.run_id
    history = ctx.folder.history.read()  # the one reader of the whole history: once, at the run's end
    plot = reward_curve(history, ctx.folder.path / "reward_curve.png",
                        f"{config.train.algorithm} on {config.task.name} ({run_id})", progress.base_accuracy)
    log_artifact(config, mlflow_run, str(plot))
    hacking = rm_vs_true_curve(history, ctx.folder.path / "rm_vs_true.png", f"reward model vs true score ({run_id})",
                               (progress.base_rm_score, progress.base_true_score))
    if hacking:
        log_artifact(config, mlflow_run, str(hacking))
    return rl_summary(config, progress, history, fingerprint=ctx.fingerprint, dataset_version=dataset["version"]) | {
        "engine": started.engine, "sandbox_level": started.sandbox_level, "reward_curve_png": str(plot),
        "rm_vs_true_png": str(hacking) if hacking else None, "mlflow_run_id": mlflow_run, "wall_s": round(wall_s, 2)}
