"""The tasks of one RL iteration: rollout → verify → update → sync (+ evaluate, upload the save point).

Each task adapts core work to the orchestrator: it reads and writes through the store, gives the stage its
retries and timeout, logs, and returns a typed result (:mod:`rlpipe.stages`). A stage whose manifest exists
and was made for this config and these inputs is not redone, so a resumed iteration skips what it
finished and redoes what it did not. The work itself lives in the core: service assembly in
:mod:`rlpipe.runtime.assembly`, reward mixing in :mod:`rlpipe.rewards.mix`, the sync proof in
:mod:`rlpipe.rollout.probe`, prompt slots and staleness in :mod:`rlpipe.rollout.batch`, the guards that stop
a run in :mod:`rlpipe.guards`.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE

from rlpipe.config import RunConfig
from rlpipe.guards import RewardCircuitOpen, SandboxFloorError, check_dynamic, check_nonfinite, check_staleness
from rlpipe.rollout.batch import (
    draw_sampling, filter_groups, generate_table, prompt_slot, reuse_expectation, select_prompts, table_to_samples,
    with_column,
)
from rlpipe.rollout.probe import load_policy
from rlpipe.rollout.redact import redact_samples, write_trajectories
from rlpipe.rollout.scoring import score_batch
from rlpipe.runtime import RunContext, RunServices, register_services, run_context, services
from rlpipe.runtime.assembly import ServicesStarted, build_services
from rlpipe.stages import RolloutDone, SavedCheckpoint, SavePointBehind, SyncDone, UpdateDone, VerifyDone
from rlpipe.storage.layout import stage_prefix
from rlpipe.storage.schemas import TRAJECTORY_SCHEMA
from tasks._log import run_logger
from tasks.stage import stage


def fault_point(iteration: int, stage: str) -> None:
    """Test hook: ``RLPIPE_FAULT=<iteration>:<stage>`` SIGKILLs this process right after that stage."""
    if os.environ.get("RLPIPE_FAULT") == f"{iteration}:{stage}":
        os.kill(os.getpid(), signal.SIGKILL)


def _reusable(ctx: RunContext, meta: dict[str, Any], expect: dict[str, Any], what: str) -> bool:
    """A stored stage is reused only if it was made for this config and these inputs; else it is redone."""
    want = {"fingerprint": ctx.resume_fingerprint} | expect
    differ = {k: (meta.get(k), v) for k, v in want.items() if meta.get(k) != v}
    if differ:
        run_logger().warning("redoing %s: the stored stage was made with %s", what,
                             ", ".join(f"{k} {str(got)[:12]} (now {str(now)[:12]})" for k, (got, now) in differ.items()))
    return not differ


@task(name="start-services", cache_policy=NO_CACHE, timeout_seconds=900)
def start_services(config: RunConfig, run_id: str, dataset: dict[str, Any], resume_dir: str | None) -> ServicesStarted:
    """Start the rollout engine, the trainer and the verifier pool for this run (:func:`build_services`)."""
    svc, started = build_services(run_context(run_id, config), dataset, resume_dir, run_logger())
    register_services(svc)
    return started


def prefetch_rollout(config: RunConfig, run_id: str, iteration: int) -> None:
    """rollout.prefetch: generate ``iteration``'s first batch in the background now, by the policy the engine
    holds (just synced, so on-policy); that iteration's rollout task joins it and takes the stored batch."""
    services(run_id).generate_ahead(iteration, lambda: generate_rollout(config, run_id, iteration, 0))


@stage("rollout", retries=1, retry_delay_s=1, timeout_s=3600)
def rollout(config: RunConfig, run_id: str, iteration: int, draw: int = 0) -> RolloutDone:
    """The draw's batch: generated here, or taken from the store (generated ahead, or before a resume)."""
    waited = services(run_id).join_ahead(iteration, draw)
    out = generate_rollout(config, run_id, iteration, draw)
    if waited is not None and out.reused:
        return RolloutDone(**{**out.__dict__, "prefetched": True, "prefetch_wait_s": waited})
    return out


def generate_rollout(config: RunConfig, run_id: str, iteration: int, draw: int) -> RolloutDone:
    ctx, svc = run_context(run_id, config), services(run_id)
    prefix = stage_prefix(run_id, iteration, "rollout", draw)
    if ctx.store.stage_done(prefix):
        manifest = ctx.store.read_manifest(prefix)
        meta = manifest["meta"]
        expect = reuse_expectation(config.rollout.async_steps, svc.engine.weights_sha256(), meta, iteration)
        if _reusable(ctx, meta, expect, f"rollout {prefix}"):
            return RolloutDone.from_meta(meta, prefix, manifest["written_at"], reused=True)
    policy_iteration = svc.policy_iteration
    staleness = iteration - 1 - policy_iteration
    check_staleness(config.rollout.async_steps, iteration, staleness, f"rollout {prefix}")
    prompts, cursor = select_prompts(svc.train_rows, prompt_slot(config.rollout, iteration, draw),
                                     config.rollout.batch_size, config.seed)
    sampling = draw_sampling(config.rollout, config.seed, iteration, draw)
    if config.agent is not None:
        from rlpipe.rollout.agent import agent_rollout

        table, stats = agent_rollout(svc.engine, svc.tokenizer, config.agent, prompts, sampling, run_id, iteration,
                                     ctx.settings.env_url)
    else:
        table, stats = generate_table(svc.engine, svc.tokenizer, prompts, sampling, run_id, iteration)
    table = with_column(with_column(table, "policy_iteration", policy_iteration), "staleness", staleness)
    if hasattr(svc.engine, "rerouted"):  # rollout replicas: how many answer, how many prompts moved off dead ones
        stats |= {"rollout/replicas_live": float(len(svc.engine.live())), "rollout/rerouted_prompts": float(svc.engine.rerouted)}
    meta = stats | {"rows": table.num_rows, "cursor": cursor, "draw": draw, "policy_version": svc.engine.weights_sha256(),
                    "policy_iteration": policy_iteration, "staleness": staleness, "fingerprint": ctx.resume_fingerprint}
    start = time.perf_counter()
    manifest = write_trajectories(ctx.store, prefix, table, meta, redact=config.data.redact, tokenizer=svc.tokenizer)
    fault_point(iteration, "rollout")
    return RolloutDone.from_meta(meta | {"write_s": time.perf_counter() - start}, prefix, manifest["written_at"], reused=False)


def _retry_unless_guard(exc: BaseException) -> bool:
    """Retry a failed verify, except when a reward guard tripped: rescoring would only repeat it."""
    return not isinstance(exc, (RewardCircuitOpen, SandboxFloorError))


@stage("verify", retries=1, retry_delay_s=1, timeout_s=3600, retry_if=_retry_unless_guard)
def verify(config: RunConfig, run_id: str, iteration: int, rollout_ref: RolloutDone, draw: int = 0,
           reward_norm: dict[str, float] | None = None) -> VerifyDone:
    """Score the rollout. ``reward_norm``: the reward normaliser's state before this draw (RLHF)."""
    ctx = run_context(run_id, config)
    prefix = stage_prefix(run_id, iteration, "verify", draw)
    inputs: dict[str, Any] = {"rollout_written_at": rollout_ref.written_at}  # scores of exactly the rollout in use
    if config.reward.normalize:
        inputs["reward_norm_in"] = reward_norm  # ... normalised from exactly this state
    if ctx.store.stage_done(prefix):
        meta = ctx.store.read_manifest(prefix)["meta"]
        if _reusable(ctx, meta, inputs, f"verify {prefix}"):
            return VerifyDone.from_meta(meta, prefix, reused=True)
    start = time.perf_counter()
    table = ctx.store.read_stage(rollout_ref.prefix, schema=TRAJECTORY_SCHEMA)
    read_s = time.perf_counter() - start
    scored, stats, alerts = score_batch(config, services(run_id), ctx.folder.history, table, iteration, reward_norm,
                                        run_logger())
    meta = stats | inputs | {"alerts": alerts, "rows": scored.num_rows, "read_s": read_s, "draw": draw,
                             "fingerprint": ctx.resume_fingerprint}
    start = time.perf_counter()
    write_trajectories(ctx.store, prefix, scored, meta, redact=config.data.redact)  # tokens were masked at rollout
    fault_point(iteration, "verify")
    return VerifyDone.from_meta(meta | {"write_s": time.perf_counter() - start}, prefix, reused=False)


# No retries: an update that failed half-way has touched the optimizer; the run resumes from the
# last saved state instead.
@stage("update", timeout_s=3600)
def update(config: RunConfig, run_id: str, iteration: int, verify_refs: list[VerifyDone]) -> UpdateDone:
    """One trainer update on the iteration's scored draws (with dynamic sampling: the groups with signal)."""
    ctx, svc = run_context(run_id, config), services(run_id)
    extra_state = {"iteration": iteration, "run_id": run_id, "config_fingerprint": ctx.fingerprint}
    if getattr(svc.trainer, "remote", False):
        return _remote_update(ctx, svc, iteration, verify_refs, extra_state)
    save_wait_s = svc.join_save()  # the last save point's state must be whole before the weights change
    start = time.perf_counter()
    tables = [ctx.store.read_stage(ref.prefix, schema=TRAJECTORY_SCHEMA) for ref in verify_refs]
    read_s = time.perf_counter() - start
    dyn: dict[str, float] = {}
    if config.rollout.dynamic_sampling:
        table, dyn = filter_groups(tables, config.rollout.batch_size)
    else:
        table = pa.concat_tables(tables)
    start = time.perf_counter()
    step_rewards = config.agent is not None and config.agent.step_rewards
    metrics = svc.trainer.update(table_to_samples(table, step_rewards), iteration) | dyn
    metrics["samples_generated"] = float(sum(t.num_rows for t in tables))
    update_s = time.perf_counter() - start
    _check_update(config, iteration, metrics, len(tables))
    start = time.perf_counter()
    svc.trainer.handoff()  # the new weights, hashed once on a thread: the sync waits for it once the engine has them
    metrics |= {"trainer/hash_s": time.perf_counter() - start, "trainer/save_wait_s": save_wait_s}
    start = time.perf_counter()
    folder, digest = _save_point(ctx, svc, iteration, extra_state) if config.train.save_point(iteration) else (None, None)
    adapter = _adapter_handoff(ctx, svc)
    save_s = time.perf_counter() - start
    fault_point(iteration, "update")
    return UpdateDone(metrics=metrics, update_s=update_s, save_s=save_s, read_s=read_s, weights_sha256=digest,
                      state_dir=folder and str(folder), adapter_dir=adapter and adapter[0],
                      adapter_sha256=adapter and adapter[1])


def _save_point(ctx: RunContext, svc: RunServices, iteration: int, extra_state: dict[str, Any]) -> tuple[Path, str | None]:
    """Save point ``iteration``'s resumable state: (its folder, the weights' hash, or None while the hash is
    still being taken). The trainer state and the RNG are taken now; the files are written here, or (train.async_save,
    one rank) on a thread started once the sync has proven the engine's weights (:meth:`RunServices.defer_save`),
    while the evaluation and the next batch's generation go on. A folder is a save point only once the progress
    records it."""
    folder = ctx.folder.state_dir(iteration)
    if folder.exists():
        shutil.rmtree(folder)
    digest, write = svc.trainer.plan_save(folder, extra_state=extra_state, spare=ctx.folder.spare_state_dir,
                                          midway=lambda: fault_point(iteration, "save"))
    if ctx.config.train.async_save and svc.trainer.world == 1:
        svc.defer_save(iteration, str(folder), write)
        return folder, None
    write()
    return folder, digest.result()


def _adapter_handoff(ctx: RunContext, svc: RunServices) -> tuple[str, str] | None:
    """An engine started for adapter syncs takes only the adapter, from a folder (vLLM reads LoRA adapters from
    disk): written each update to one scratch folder of the run, megabytes; (folder, its hash), else None."""
    if not getattr(svc.engine, "lora_rank", None):
        return None
    folder = ctx.folder.path / "adapter-handoff"
    return str(folder), svc.trainer.export_adapter(folder)


def _remote_update(ctx: RunContext, svc: RunServices, iteration: int, verify_refs: list[VerifyDone],
                   extra_state: dict[str, Any]) -> UpdateDone:
    """The trainer service reads the stages from the store and keeps the new weights for the sync to stream; at a
    save point it writes the whole state to the store, and this side keeps a checked copy of its weights (the
    local resume point)."""
    config = ctx.config
    save = config.train.save_point(iteration)
    out = svc.trainer.update_stages([ref.prefix for ref in verify_refs], iteration,
                                    config.rollout.batch_size if config.rollout.dynamic_sampling else None,
                                    config.agent is not None and config.agent.step_rewards, extra_state, save=save)
    metrics = out["metrics"]
    _check_update(config, iteration, metrics, len(verify_refs))
    start = time.perf_counter()
    folder = (svc.trainer.fetch_weights(out["state_prefix"], out["weights_sha256"], ctx.folder.state_dir(iteration))
              if save else None)
    fetch_s = time.perf_counter() - start
    fault_point(iteration, "update")
    metrics = metrics | {"trainer/upload_s": out.get("upload_s", 0.0), "trainer/fetch_s": fetch_s,
                         "trainer/hash_s": out["handoff_s"], "trainer/world": float(svc.trainer.world)}
    return UpdateDone(metrics=metrics, update_s=out["update_s"], save_s=out.get("save_s", 0.0) + out.get("upload_s", 0.0),
                      read_s=out["read_s"], state_dir=folder and str(folder), weights_sha256=out["weights_sha256"],
                      state_uri=out.get("state_uri"))


def _check_update(config: RunConfig, iteration: int, metrics: dict[str, float], draws: int) -> None:
    if config.rollout.dynamic_sampling:
        check_dynamic(config.rollout.batch_size, iteration, metrics, draws, run_logger())
    check_nonfinite(config.train.max_nonfinite_steps, iteration, metrics, run_logger())


@stage("sync-weights", retries=2, retry_delay_s=1, timeout_s=600)
def sync_weights(config: RunConfig, run_id: str, iteration: int, update_ref: UpdateDone) -> SyncDone:
    """Reload the trained weights into the engine in place, then prove it: the engine's hash must equal
    the trainer's export, and the engine's log-probs on the probe batch the trainer's."""
    svc = services(run_id)
    start = time.perf_counter()
    adapter = update_ref.adapter_sha256 is not None
    trainer_side = svc.proof.trainer_ahead(svc.trainer)  # the trainer's probe forward while the engine reloads
    proof: dict[str, float] = {}

    def prove() -> None:
        proof.update(svc.proof.prove(svc.engine, svc.trainer, f"iteration {iteration}", trainer_side))

    # In memory, the engine is proven on the probe batch while the trainer's hash is still being taken; the sync
    # ends once both hold (the hash equal to the one the engine reports).
    held = load_policy(svc.engine, update_ref.adapter_dir if adapter else update_ref.state_dir, update_ref.weights_sha256,
                       iteration, adapter_sha256=update_ref.adapter_sha256, trainer=svc.trainer, meanwhile=prove)
    if not proof:  # a folder or an adapter: proven once loaded
        prove()
    svc.policy_iteration = iteration
    svc.start_deferred_save()  # a save point's state (train.async_save): written from now, beside what follows
    fault_point(iteration, "sync")
    return SyncDone(sync_s=time.perf_counter() - start, policy_version=held, adapter_only=adapter,
                    readback_tensors=0.0 if adapter else float(getattr(svc.engine, "last_readback", 0)), **proof)


def evaluate(config: RunConfig, run_id: str, split: str = "test") -> dict[str, Any]:
    """Greedy answers of the policy the engine holds now on ``split`` (see :func:`rlpipe.evaluation.greedy_eval`).
    'validation' is what the ``evaluate`` flow promotes on; 'test' is reported."""
    from rlpipe.evaluation import greedy_eval

    svc = services(run_id)
    rows = svc.test_rows if split == "test" else svc.validation_rows
    env_url = run_context(run_id, config).settings.env_url if config.agent is not None else None
    return redact_samples(greedy_eval(svc.engine, svc.tokenizer, svc.pool, rows, svc.ground_truth,
                                      max_new_tokens=config.rollout.max_new_tokens, reward_model=svc.reward_model,
                                      agent=config.agent, env_url=env_url), config.data.redact)


def upload_behind(config: RunConfig, run_id: str, point: SavePointBehind) -> None:
    """train.async_save: save point ``point.iteration``'s state uploaded to the store on a thread once it is written,
    while the next iteration runs; that iteration records it (``flows.iteration._record_behind``). An upload that
    fails is tried twice more, as the upload stage is; a save point whose upload failed is never recorded."""
    svc, ctx = services(run_id), run_context(run_id, config)
    written = svc.saving[2] if svc.saving is not None else None  # the local write (the next update joins it too)

    def work() -> SavedCheckpoint:
        if written is not None:
            written.result()
        for attempt in range(3):
            try:
                uri = ctx.state.upload_state(Path(point.state_dir), point.iteration, point.weights_sha256)
                break
            except Exception as e:  # noqa: BLE001 - tried again, then raised to whoever records the save point
                if attempt == 2:
                    raise
                logging.getLogger("rlpipe").warning("uploading save point %d failed (%s); trying again", point.iteration, e)
                time.sleep(2)
        fault_point(point.iteration, "upload")
        return SavedCheckpoint(checkpoint_uri=uri, weights_sha256=point.weights_sha256)

    svc.upload_in_background(point, work)


@stage("upload-checkpoint", retries=2, retry_delay_s=2, timeout_s=600)
def upload_checkpoint(config: RunConfig, run_id: str, iteration: int, update_ref: UpdateDone) -> SavedCheckpoint:
    """Copy the iteration's full resumable state (weights, tokenizer, optimizer and critic states, KL
    controller, RNG, iteration) to the store, once it is written (train.async_save); a redo finds a whole copy and
    keeps it."""
    svc = services(run_id)
    svc.join_save()
    digest = update_ref.weights_sha256 or svc.trainer.policy_tensors()[0]  # a deferred save's: taken by now
    uri = run_context(run_id, config).state.upload_state(Path(update_ref.state_dir), iteration, digest)
    fault_point(iteration, "upload")
    return SavedCheckpoint(checkpoint_uri=uri, weights_sha256=digest)
