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

from flows.iteration import iteration
from rlpipe.config import RunConfig, settings
from rlpipe.progress import Eta
from rlpipe.runs import new_run_id, write_summary
from rlpipe.runtime import stop_services
from rlpipe.resume import resume_fingerprint
from rlpipe.storage.layout import check_run_id
from rlpipe.tracking.mlflow_utils import Tracker
from tasks._log import run_logger
from tasks.alerts import cancel_requested, raise_alerts
from tasks.data import prepare_dataset
from tasks.preflight import preflight_task
from tasks.rl import evaluate, read_progress, run_dir, run_history, run_state, start_services, state_dir, write_progress
from tasks.tracking import end_tracking, log_metrics, start_tracking


def _with_local_models(config: RunConfig) -> RunConfig:
    """A copy whose reference and critic models are local folders (``models:/`` and s3:// fetched), for the
    services. The config as given stays the run's record: a resume compares that one, so a ``models:/`` URI
    recorded as a cache path would never match again."""
    ref_spec, critic_spec = config.task.ref_model, config.train.critic.model
    if not (ref_spec or critic_spec):
        return config
    config = config.model_copy(deep=True)
    if ref_spec:
        config.task.ref_model = _local_model(ref_spec, config)
    if critic_spec:
        config.train.critic.model = _local_model(critic_spec, config)
    return config


def _local_model(spec: str | None, config: RunConfig) -> str | None:
    if spec is None:
        return None
    from rlpipe.training.models import fetch_source, resolve_source

    if spec == "tiny":
        raise ValueError("task.policy_model 'tiny' is an untrained model: run `rlpipe sft` first and use models:/NAME@base")
    return str(fetch_source(resolve_source(spec, settings(), config), settings()))


def _resume_point(config: RunConfig, run_id: str, dataset_version: str, allow_change: bool) -> tuple[dict[str, Any], list[str]]:
    """The progress to continue from: this machine's when its state is intact, else the object store's
    last save point (its state downloaded), whichever is further along; {} for a new run."""
    from rlpipe.resume import ResumeRefused, check_resume

    state, log = run_state(config, run_id), run_logger()
    local, saved = state.read_local(), state.read_saved()
    options = []
    if local and local.get("completed_iteration", -1) >= 0 and state.local_state_ok(local):
        options.append((local["completed_iteration"], 1, local))
    elif local and local.get("completed_iteration", -1) >= 0:
        log.warning("run %s: the local state of iteration %d is missing or differs from its record; using the "
                    "object store", run_id, local["completed_iteration"])
    if saved:
        options.append((saved["completed_iteration"], 0, saved))
    if not options:
        if local and local.get("completed_iteration", -1) >= 0:  # never a silent restart from 0
            raise ResumeRefused(
                f"run {run_id} completed iteration {local['completed_iteration']}, but its state is gone from this "
                f"machine and {state.store.url('')} holds no save point; start a new --run-id")
        progress = local or {}
        return progress, check_resume(progress, config, dataset_version, allow_change) if progress else []
    k, where, progress = max(options, key=lambda o: (o[0], o[1]))
    changes = check_resume(progress, config, dataset_version, allow_change)
    if where == 0:  # from the store: this machine has no (or older) state
        folder = state.fetch_state(progress, state_dir(run_id, k))
        progress = state.fetch_history(progress) | {"resume_dir": str(folder)}
        state.write_local(progress)
    progress = state.history_out_of_progress(progress)
    log.info("resuming run %s after iteration %d from %s (%s)", run_id, k, progress["resume_dir"],
             "this machine" if where else state.store.url(progress["resume_state"]))
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
    start = time.perf_counter()
    run_id = check_run_id(run_id or new_run_id("rl"))
    log = run_logger()
    preflight_task(config)  # fail fast, naming the component that is down
    dataset = prepare_dataset(config)
    progress, changes = _resume_point(config, run_id, dataset["version"], allow_config_change)
    mlflow_run = start_tracking(config, run_id, "rl", dataset["version"])
    if changes:
        _record_change(config, run_id, mlflow_run, progress, changes)
    first = progress.get("completed_iteration", -1) + 1
    resume_dir = progress.get("resume_dir")
    model_dir = _local_model(config.task.policy_model, config)
    recorded = config  # as given: what a resume compares and the records name (models:/ URIs, not cache paths)
    config = _with_local_models(config)
    sysmon = (Tracker(settings(), config).system_metrics(mlflow_run, config.tracking.system_metrics_s)
              if mlflow_run and config.tracking.system_metrics_s else None)
    try:
        services = start_services(config, run_id, dataset, model_dir, resume_dir)
        _check_reward_model(run_id, progress, services, allow_config_change)
        if "base_accuracy" not in progress:
            base = evaluate(config, run_id, "test")
            val = evaluate(config, run_id, "validation")
            progress = progress | {"base_accuracy": base["accuracy"], "base_validation_accuracy": val["accuracy"],
                                   "base_policy": base["policy_version"], "heldout_n": base["n"],
                                   "dataset_version": dataset["version"], "config_fingerprint": recorded.fingerprint(),
                                   "resume_fingerprint": resume_fingerprint(recorded), "config": recorded.flat(),
                                   "reward_model_version": services.get("reward_model_version"),
                                   "base_true_score": base["true_score"], "base_rm_score": base["rm_score"],
                                   "base_mean_steps": base.get("mean_steps"),
                                   "base_tool_calls_per_episode": base.get("tool_calls_per_episode")}
            write_progress(run_id, progress)
            log_metrics(config, mlflow_run, {"heldout_accuracy": base["accuracy"], "validation_accuracy": val["accuracy"]}, -1)
            if mlflow_run and base.get("samples"):  # the base policy's generations: iteration -1 of the table
                Tracker(settings(), config).log_table(mlflow_run, [{"iteration": -1} | x for x in base["samples"]], "generations.json")
            log.info("base policy: held-out accuracy %.3f (n=%d), validation %s (n=%d)", base["accuracy"], base["n"],
                     "none" if val["accuracy"] is None else f"{val['accuracy']:.3f}", val["n"])
        eta = Eta(config.train.total_iterations, done=first)
        mark = time.perf_counter()  # an iteration's total runs from the last one's mark to its own: nothing is left out
        for k in range(first, config.train.total_iterations):
            if reason := cancel_requested(flow_run.id):  # the UI, the CLI or an automation, between iterations
                return _cancelled(config, run_id, mlflow_run, k - 1, reason)
            out = _iteration(config, run_id, k, mlflow_run, dataset["version"])
            now = time.perf_counter()
            _account_outer_time(config, run_id, k, mlflow_run, out["metrics"], now - mark)
            mark = now
            log.info("run %s: iteration %s", run_id, eta.tick(k + 1))
            if reason := raise_alerts(config, run_id, k, out["alerts"]):
                return _cancelled(config, run_id, mlflow_run, k, reason)
    except BaseException:
        end_tracking(config, mlflow_run, "FAILED")
        raise
    finally:
        stop_services(run_id)
        if sysmon:
            sysmon.finish()
    progress = read_progress(run_id) or {}
    summary = _summary(config, run_id, dataset, mlflow_run, progress, services, time.perf_counter() - start)
    summary["config_fingerprint"] = recorded.fingerprint()  # the one MLflow and progress.json record
    cost = ("cpu_s_total", "cpu_s_per_iteration", "cpu_s_per_heldout_point", "gpu_s_total", "gpu_s_per_heldout_point")
    log_metrics(config, mlflow_run, {f"cost/{k}": float(summary[k]) for k in cost if summary.get(k) is not None},
                max(summary["iterations_done"] - 1, 0))
    summary["report_html"] = _report(config, run_id, mlflow_run)
    end_tracking(config, mlflow_run)
    path = write_summary(settings(), run_id, summary)
    log.info("summary: %s", path)
    return str(path)


_QUIET: list[Any] = []  # [the settings it was derived from, those settings without a heartbeat]


def _no_heartbeat():
    """Settings under which a flow run sends no heartbeat. Each heartbeat thread is joined when its flow run
    ends, and it sleeps in 1-second steps: ~0.9 s of every iteration (measured in benchmarks/) for nothing,
    since the parent run's heartbeat already says the process lives. The settings are derived once and
    reused: Prefect's ``temporary_settings`` revalidates every setting on each call (~0.2 s here)."""
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
    from rlpipe.rewards.guards import RewardCircuitOpen
    from tasks.rl import NonFiniteUpdate

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


def _cancelled(config: RunConfig, run_id: str, mlflow_run: str, last: int, reason: str) -> State:
    """The run stops resumably: its MLflow run is marked KILLED, its flow run ends Cancelled."""
    msg = (f"run {run_id} cancelled after iteration {last} ({reason}); its progress is saved: "
           f"resume with `rlpipe run --run-id {run_id}`")
    run_logger().warning(msg)
    end_tracking(config, mlflow_run, "KILLED")
    return Cancelled(message=msg)


def _report(config: RunConfig, run_id: str, mlflow_run: str) -> str | None:
    """The run's HTML report (``rlpipe report``), logged to its MLflow run. A report that cannot be built
    does not fail a finished run: the log says why, and ``rlpipe report RUN_ID`` can try again."""
    from rlpipe.tracking.report import build_report

    if not mlflow_run:
        return None
    try:
        return str(build_report(mlflow_run, settings(), settings().run_dir(run_id) / "report.html", config=config))
    except Exception as e:  # noqa: BLE001
        run_logger().warning("run %s: the HTML report could not be built (%s: %s); try `rlpipe report %s`",
                             run_id, type(e).__name__, e, run_id)
        return None


def _check_reward_model(run_id: str, progress: dict[str, Any], services: dict[str, Any], allow_change: bool) -> None:
    """A resumed RLHF run scores with the reward model it started with: an alias that moved meanwhile
    (``@best`` of a newer fit) would change the reward in the middle of the run."""
    from rlpipe.resume import ResumeRefused

    before, now = progress.get("reward_model_version"), services.get("reward_model_version")
    if before and now and before != now and "unknown" not in (before, now):  # "unknown": the service was down
        if not allow_change:
            raise ResumeRefused(f"run {run_id} was trained against reward model {before}, which now resolves to {now}; "
                                "pin reward.model to the first (models:/NAME/VERSION) or pass --allow-config-change")
        run_logger().warning("run %s: reward model %s → %s (--allow-config-change)", run_id, before, now)


def _record_change(config: RunConfig, run_id: str, mlflow_run: str, progress: dict[str, Any], changes: list[str]) -> None:
    """An allowed config change: a tag on the MLflow run, a line in the log, the new config in the progress."""
    from rlpipe.tracking.mlflow_utils import Tracker

    at = progress.get("completed_iteration", -1) + 1
    Tracker(settings(), config).client.set_tag(mlflow_run, f"rlpipe.config_change.iter{at}", "; ".join(changes)[:4900])
    run_logger().warning("run %s resumes at iteration %d with %d config change(s) (--allow-config-change): %s",
                         run_id, at, len(changes), "; ".join(changes))
    if progress:
        write_progress(run_id, progress | {"config": config.flat(), "resume_fingerprint": resume_fingerprint(config),
                                           "config_fingerprint": config.fingerprint(),
                                           "config_changes": progress.get("config_changes", []) + [{"iteration": at, "changes": changes}]})


def _account_outer_time(config: RunConfig, run_id: str, k: int, mlflow_run: str, m: dict[str, float], total: float) -> None:
    """Overhead as the parent sees it: ``total`` is the parent's wall since the previous iteration's mark, so it
    holds the iteration flow run's own start/finish and the parent's work between iterations (the previous
    iteration's outer logging and alert check, this one's cancel check): the totals add up to the loop's wall up
    to the last mark."""
    from rlpipe.tracking.mlflow_utils import Tracker

    compute = m["time/generate_s"] + m["time/verify_s"] + m["time/update_s"]
    extra = {"time/iteration_total_s": total, "time/overhead_total_s": total - compute - m["time/eval_s"],
             "time/overhead_total_share": (total - compute - m["time/eval_s"]) / max(total - m["time/eval_s"], 1e-9)}
    Tracker(settings(), config).log_metrics(mlflow_run, extra, k)
    run_history(run_id).extend(k, extra)


def _summary(config: RunConfig, run_id: str, dataset: dict[str, Any], mlflow_run: str, progress: dict[str, Any],
             services: dict[str, Any], wall_s: float) -> dict[str, Any]:
    from rlpipe.tracking.plots import reward_curve, rm_vs_true_curve

    history = run_history(run_id).read()  # the one reader of the whole history: once, at the run's end
    stage_keys = ["generate_s", "verify_s", "update_s", "sync_s", "eval_s", "save_s"]
    breakdown = {k: round(sum(h.get(f"time/{k}", 0.0) for h in history), 3) for k in stage_keys}
    # Totals as the parent flow saw them: the iteration flow runs' own start/finish and the parent's work between
    # iterations included (they add up to the loop's wall up to the last mark).
    iter_total = sum(h.get("time/iteration_total_s", h.get("time/iteration_s", 0.0)) for h in history)
    breakdown["overhead_s"] = round(iter_total - sum(breakdown[k] for k in ("generate_s", "verify_s", "update_s", "eval_s")), 3)
    plot = reward_curve(history, run_dir(run_id) / "reward_curve.png",
                        f"{config.train.algorithm} on {config.task.name} ({run_id})", progress.get("base_accuracy"))
    from tasks.tracking import log_artifact

    log_artifact(config, mlflow_run, str(plot))
    hacking = rm_vs_true_curve(history, run_dir(run_id) / "rm_vs_true.png", f"reward model vs true score ({run_id})",
                               (progress.get("base_rm_score"), progress.get("base_true_score")))
    if hacking:
        log_artifact(config, mlflow_run, str(hacking))
    return {
        "kind": "rl",
        "algorithm": config.train.algorithm,
        "config_fingerprint": config.fingerprint(),
        "dataset_version": dataset["version"],
        "iterations_done": progress.get("completed_iteration", -1) + 1,
        "heldout_accuracy_base": progress.get("base_accuracy"),
        "heldout_accuracy_final": progress.get("final_accuracy"),
        "heldout_n": progress.get("heldout_n"),
        "reward_type": config.reward.type,
        "reward_model_version": progress.get("reward_model_version"),
        "heldout_true_score_base": progress.get("base_true_score"),
        "heldout_true_score_final": progress.get("final_true_score"),
        "heldout_rm_score_base": progress.get("base_rm_score"),
        "heldout_rm_score_final": progress.get("final_rm_score"),
        "reward_hacking_alerts": int(sum(h.get("alerts/reward_hacking", 0.0) for h in history)),
        "alerts_fired": {k.split("/", 1)[1]: n for k in sorted({k for h in history for k in h if k.startswith("alerts/")})
                         if (n := int(sum(h.get(k, 0.0) for h in history)))},
        "registered_model": {"name": config.registered_model, "version": progress.get("last_registered")},
        "final_policy_version": progress.get("weights_sha256"),
        **(_agent_summary(config, progress, history) if config.agent is not None else {}),
        **_cost(history, progress),
        "engine": services.get("engine"),
        "sandbox_level": services.get("sandbox_level"),
        "stage_seconds": breakdown,
        "iteration_seconds_mean": round(iter_total / max(len(history), 1), 3),
        "overhead_share": round(breakdown["overhead_s"] / max(iter_total - breakdown["eval_s"], 1e-9), 4),
        "reward_curve_png": str(plot),
        "rm_vs_true_png": str(hacking) if hacking else None,
        "mlflow_run_id": mlflow_run,
        "wall_s": round(wall_s, 2),
    }



def _cost(history: list[dict[str, Any]], progress: dict[str, Any]) -> dict[str, Any]:
    """What the iterations cost: CPU-seconds (GPU-seconds where present) in all, per iteration and per held-out
    point gained (None when nothing was gained), and bytes written to the object store."""
    cpu = sum(h.get("resource/cpu_s", 0.0) for h in history)
    gpu = sum(h.get("resource/gpu_s", 0.0) for h in history)
    base, final = progress.get("base_accuracy"), progress.get("final_accuracy")
    points = (final - base) * 100 if base is not None and final is not None else None
    out = {"cpu_s_total": round(cpu, 1), "cpu_s_per_iteration": round(cpu / max(len(history), 1), 2),
           "cpu_s_per_heldout_point": round(cpu / points, 1) if points and points > 0 else None,
           "store_bytes_written": int(sum(h.get("store/bytes_written", 0.0) for h in history)),
           "peak_rss_bytes": int(max((h.get("resource/rss_bytes", 0.0) for h in history), default=0.0))}
    if gpu:
        out |= {"gpu_s_total": round(gpu, 1), "gpu_s_per_heldout_point": round(gpu / points, 1) if points and points > 0 else None}
    return out


def _agent_summary(config: RunConfig, progress: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    """Agent runs: greedy episode success on the held-out tasks before and after, with steps and tool calls."""
    last = history[-1] if history else {}
    return {
        "env": config.agent.spec().env,
        "episode_success_base": progress.get("base_accuracy"),
        "episode_success_final": progress.get("final_accuracy"),
        "mean_steps": progress.get("final_mean_steps"),
        "mean_steps_base": progress.get("base_mean_steps"),
        "tool_calls_per_episode": progress.get("final_tool_calls_per_episode"),
        "tool_calls_per_episode_base": progress.get("base_tool_calls_per_episode"),
        "episodes_error_total": int(sum(h.get("episode/error_share", 0.0) * h.get("episode/count", 0.0) for h in history)),
        "episodes_truncated_share_last": last.get("episode/truncated_share"),
    }
