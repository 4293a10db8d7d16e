"""The tasks of one RL iteration: rollout → verify → update → register → sync (+ evaluate).

Each task reads and writes through the store and returns a small dict. A stage whose manifest
exists is not redone, so a resumed iteration skips what it finished and redoes what it did not.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE

from rlpipe.config import RunConfig, settings
from rlpipe.rewards.guards import (
    RewardCircuitOpen, SandboxFloorError, check_circuit, check_rows_isolation, check_sandbox_floor, invalid_share, sandboxed_verifiers,
)
from rlpipe.rewards.pool import VerifierPool, VerifyItem
from rlpipe.rollout.base import SamplingConfig, WeightSyncError
from rlpipe.rollout.batch import (
    apply_overlong_penalty, apply_verdicts, batch_metrics, filter_groups, generate_table, score_table, select_prompts, table_to_samples,
)
from rlpipe.rollout.engines import engine_options, get_engine
from rlpipe.history import RunHistory
from rlpipe.resume import RunState, resume_fingerprint
from rlpipe.runtime import RunServices, register_services, services
from rlpipe.storage.layout import stage_prefix
from rlpipe.storage.schemas import PROMPT_SCHEMA, TRAJECTORY_SCHEMA
from rlpipe.storage.store import open_store
from rlpipe.tokens import load_tokenizer, render_prompt, require_chat_template
from rlpipe.training.checkpoint import ADAPTER, file_weights_sha256, read_trainer_state
from tasks._log import run_logger
from tasks.stage import stage


def _store(config: RunConfig):
    s = settings()
    return open_store(s.resolve_storage_uri(config), s)


def _urls(config: RunConfig):
    """Settings with the services the config names (an RLPIPE_*_URL variable overrides its key)."""
    return settings().for_run(config)


def fault_point(iteration: int, stage: str) -> None:
    """Test hook: ``RLPIPE_FAULT=<iteration>:<stage>`` SIGKILLs this process right after that stage."""
    if os.environ.get("RLPIPE_FAULT") == f"{iteration}:{stage}":
        os.kill(os.getpid(), signal.SIGKILL)


# -- run state on local disk -------------------------------------------------------------------
def run_dir(run_id: str) -> Path:
    return settings().run_dir(run_id)


def read_progress(run_id: str) -> dict[str, Any] | None:
    p = run_dir(run_id) / "progress.json"
    return json.loads(p.read_text()) if p.exists() else None


def write_progress(run_id: str, progress: dict[str, Any]) -> None:
    p = run_dir(run_id) / "progress.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(progress, indent=2, sort_keys=True))
    os.replace(tmp, p)


def run_history(run_id: str) -> RunHistory:
    """The run's per-iteration metrics on this machine (``runs/<id>/history.jsonl``, append-only)."""
    return RunHistory(run_dir(run_id) / "history.jsonl")


def state_dir(run_id: str, iteration: int) -> Path:
    return run_dir(run_id) / "state" / f"iter={iteration}"


def spare_state_dir(run_id: str) -> Path:
    """The last save point no longer needed: the next save writes its files over this one's (RecyclingWrites)."""
    return run_dir(run_id) / "state" / "spare"


def run_state(config: RunConfig, run_id: str) -> RunState:
    return RunState(_store(config), run_dir(run_id), run_id)


def _reusable(config: RunConfig, meta: dict[str, Any], expect: dict[str, Any], what: str) -> bool:
    """A stored stage is reused only if it was made for this config and these inputs; else it is redone."""
    want = {"fingerprint": resume_fingerprint(config)} | expect
    differ = {k: (meta.get(k), v) for k, v in want.items() if meta.get(k) != v}
    if differ:
        run_logger().warning("redoing %s: the stored stage was made with %s", what,
                             ", ".join(f"{k} {str(got)[:12]} (now {str(now)[:12]})" for k, (got, now) in differ.items()))
    return not differ


# -- services ---------------------------------------------------------------------------------
@task(name="start-services", cache_policy=NO_CACHE, timeout_seconds=900)
def start_services(config: RunConfig, run_id: str, dataset: dict[str, Any], model_dir: str, resume_dir: str | None) -> dict[str, Any]:
    """Start (or reuse) the rollout engine, the trainer and the verifier pool for this run."""
    log = run_logger()
    rows = prompt_rows(config, dataset)
    sandbox_level = _check_sandbox_floor(config, rows)  # before anything slow starts
    train, test = split_rows(config, rows, "train"), split_rows(config, rows, "test")
    start = time.perf_counter()
    policy_dir = resume_dir or model_dir
    adapters = adapter_sync(config)
    if config.agent is None and any(r["chat"] for r in rows):  # before an engine starts, not at the first prompt
        require_chat_template(load_tokenizer(policy_dir), f"task.dataset {config.task.dataset} with task.policy_model "
                              f"{config.task.policy_model}")
    if _urls(config).rollout_urls:  # rollout replicas elsewhere: the start weights reach them through the store
        engine = _remote_engine(config, run_id, policy_dir)
    elif adapters:  # the start model, with the save point's adapter on it when resuming
        engine = get_engine("vllm", model_dir, max_model_len=context_length(config, rows, model_dir), seed=config.seed,
                            lora_rank=config.train.lora.r, **engine_options(config.rollout))
        if resume_dir:
            engine.load_adapter(Path(resume_dir) / ADAPTER, file_weights_sha256(resume_dir))
    else:
        engine = get_engine(config.rollout.engine, policy_dir, max_model_len=context_length(config, rows, policy_dir),
                            seed=config.seed, **engine_options(config.rollout))
    if config.train.lora:
        log.info("LoRA weight sync: %s", "the adapter (vLLM LoRA)" if adapters else "the merged weights")
    engine_s = time.perf_counter() - start
    trainer = _trainer(config, run_id, model_dir, resume_dir)
    expected = file_weights_sha256(policy_dir)
    if engine.weights_sha256() != expected:
        raise WeightSyncError(f"engine holds {engine.weights_sha256()[:12]}, trainer starts from {expected[:12]}")
    svc = RunServices(
        run_id=run_id, engine=engine, trainer=trainer, pool=None, tokenizer=trainer.tokenizer,
        train_rows=train, test_rows=test, ground_truth=ground_truths(rows), validation_rows=split_rows(config, rows, "validation"),
    )
    proof = start_probe(svc, config)  # the engine and the trainer hold the same policy, shown on the engine
    svc.info["policy_iteration"] = _state_iteration(resume_dir)
    svc.pool = verifier_pool(config)
    svc.prompts = {r["id"]: r for r in rows}
    svc.reward_model = reward_model_source(config) if config.reward.type == "model" else None
    pool = svc.pool
    register_services(svc)
    log.info("services up in %.1f s (engine %s %.1f s, verifier %s%s); policy %s", time.perf_counter() - start,
             engine.name, engine_s, _urls(config).verifier_url or f"{pool.size} local workers",
             f", reward model {svc.reward_model.version}" if svc.reward_model else "", expected[:12])
    return {"engine": engine.name, "policy_version": expected, "start_s": time.perf_counter() - start,
            "sandbox_level": sandbox_level, "probe_max_abs_diff": proof,
            "reward_model_version": svc.reward_model.version if svc.reward_model else None,
            "reward_stats": svc.reward_model.stats if svc.reward_model else None}


def prompt_rows(config: RunConfig, dataset: dict[str, Any]) -> list[dict[str, Any]]:
    """Every row of the run's prompt set (all splits), as stored under its content version."""
    return _store(config).read_stage(dataset["prefix"], schema=PROMPT_SCHEMA).to_pylist()


def split_rows(config: RunConfig, rows: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    """The rows of one split; the test split is cut to ``train.eval_size`` as the run's evaluation is."""
    out = [r for r in rows if r["split"] == split]
    return out[: config.train.eval_size] if split == "test" and config.train.eval_size else out


def ground_truths(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {r["id"]: r["ground_truth"] if r["ground_truth"] is not None else r["tests"] for r in rows}


def adapter_sync(config: RunConfig) -> bool:
    """Whether this run's syncs move only the LoRA adapter (rollout.lora_sync): train.lora on the in-process vLLM
    engine with an in-process trainer; elsewhere the merged weights."""
    urls = _urls(config)
    return (config.train.lora is not None and config.rollout.lora_sync == "adapter" and config.rollout.engine == "vllm"
            and not urls.rollout_urls and not urls.trainer_url)


def context_length(config: RunConfig, rows: list[dict[str, Any]], model_dir: str | None = None) -> int:
    """The engine's max_model_len: ``rollout.max_model_len`` if set; else the longest prompt (4 tokens a character
    at most) and the response, or an agent's whole episode context; never above the model's own context."""
    from rlpipe.training.models import model_context

    own = model_context(model_dir) if model_dir else None
    if config.rollout.max_model_len is not None:
        if own is not None and config.rollout.max_model_len > own:
            raise ValueError(f"rollout.max_model_len {config.rollout.max_model_len} exceeds the model's own context "
                             f"({own}, max_position_embeddings in {model_dir}/config.json); set it to {own} or less")
        return config.rollout.max_model_len
    n = config.agent.max_context if config.agent is not None else max(len(r["prompt"]) for r in rows) * 4 + config.rollout.max_new_tokens + 16
    n = max(n, 64)
    return min(n, own) if own is not None else n


def _trainer(config: RunConfig, run_id: str, model_dir: str, resume_dir: str | None):
    """The trainer service the config names (it gets the start weights through the store), else one in this process."""
    args = {"model_dir": model_dir, "cfg": config.train, "temperature": config.rollout.temperature or 1.0,
            "seed": config.seed, "ref_model_dir": config.task.ref_model, "resume_dir": resume_dir,
            "max_new_tokens": config.rollout.max_new_tokens}
    if url := _urls(config).trainer_url:
        from rlpipe.training.remote import RemoteTrainer

        return RemoteTrainer(url, _store(config), run_id, **args)
    from rlpipe.training.trainer import PolicyTrainer

    return PolicyTrainer(**args)


def _remote_engine(config: RunConfig, run_id: str, policy_dir: str):
    """The rollout service replicas of RLPIPE_ROLLOUT_URL as one engine, loaded with the run's start policy."""
    from rlpipe.rollout.remote import RemoteEngine, ReplicaDown, ReplicatedEngine

    store, replicas, urls = _store(config), [], _urls(config).rollout_urls
    for url in urls:  # a replica that is down at the start is left out, as one that dies later is
        try:
            replicas.append(RemoteEngine(url, store, run_id))
        except ReplicaDown as e:
            run_logger().warning("ALERT rollout replica %s is down at the start (%s); its share goes to the others", url, e)
    if not replicas:
        raise ReplicaDown(f"no rollout replica answers: {', '.join(urls)}; start them (rlpipe serve rollout) or drop "
                          "services.rollout / RLPIPE_ROLLOUT_URL to roll out in this process")
    engine = ReplicatedEngine(replicas)
    engine.load_weights(policy_dir)
    return engine


def reward_model_source(config: RunConfig):
    """The reward-model service when RLPIPE_REWARD_MODEL_URL is set, else the model in this process."""
    from rlpipe.rewards.model import LocalRewardModel, RemoteRewardModel

    url = _urls(config).reward_model_url
    if url:
        rm = RemoteRewardModel(url)
        if not rm.healthy():
            run_logger().warning("ALERT reward-model service %s is not healthy; samples it cannot score get status "
                                 "skipped", url)
        return rm
    from rlpipe.training.models import load_reward_model

    return LocalRewardModel(load_reward_model(config.reward_model_spec, settings(), config))


def _score(config: RunConfig, svc: RunServices, table: pa.Table, norm_state: dict[str, float] | None
           ) -> tuple[pa.Table, dict[str, Any]]:
    """Verdicts of every reward source the config names, mixed by weight (RLHF: the reward model, its score
    normalised when asked, and any verifiers); the hidden true score of each row is measured beside it."""
    weights = config.reward.source_weights()
    if weights == {"": 1.0}:
        return score_table(svc.pool, table, svc.ground_truth)
    from rlpipe.algorithms.preference import RunningNorm
    from rlpipe.rewards.model import RMItem, mix_rewards, normalise_results

    rows, start, stats, results = table.to_pylist(), time.perf_counter(), {}, {}
    own = svc.pool.score([VerifyItem(r["verifier"], r["response_text"] or "", svc.ground_truth.get(r["prompt_id"])) for r in rows])
    true_ok = [v.reward for v in own if v.status == "ok"]
    stats |= {"true_reward_mean": sum(true_ok) / len(true_ok) if true_ok else float("nan"),
              "true_accuracy": sum(x == 1.0 for x in true_ok) / max(len(rows), 1)}
    for name in weights:
        if name == "model":
            items = [RMItem(svc.prompts[r["prompt_id"]]["prompt"], r["response_text"] or "", svc.prompts[r["prompt_id"]]["chat"])
                     for r in rows]
            res = svc.reward_model.score(items)
            raw = [v.reward for v in res if v.status == "ok"]
            stats["rm_score_mean"] = sum(raw) / len(raw) if raw else float("nan")
            if config.reward.normalize:
                norm = RunningNorm(**norm_state) if norm_state else _seed_norm(config, svc)
                res = normalise_results(res, norm, config.reward.clip)
                stats["reward_norm"] = norm.state_dict()
            results[name] = res
        else:
            results[name] = own if name == "" else svc.pool.score(
                [VerifyItem(name, r["response_text"] or "", svc.ground_truth.get(r["prompt_id"])) for r in rows])
    label = "+".join("rm" if n == "model" else (n or "verifier") for n in weights)
    version = svc.reward_model.version if "model" in weights else None
    verify_s = time.perf_counter() - start
    scored = apply_verdicts(rows, mix_rewards(results, weights), [(label, version)] * len(rows), verify_s)
    return scored, stats | {"verify_s": verify_s, "verify_per_s": len(rows) / max(verify_s, 1e-9)}


def _seed_norm(config: RunConfig, svc: RunServices):
    """The normaliser's start: the reward model's registered statistics, weighted as one iteration's batch."""
    from rlpipe.algorithms.preference import RunningNorm

    st = svc.reward_model.stats or {}
    if "mean" not in st:
        return RunningNorm()
    weight = min(float(st.get("count", 1.0)), float(config.rollout.batch_size * config.rollout.samples_per_prompt))
    return RunningNorm.seeded(float(st["mean"]), float(st["std"]), weight)


def verifier_pool(config: RunConfig):
    """The verifier service when RLPIPE_VERIFIER_URL is set, else a local pool of worker processes."""
    url = _urls(config).verifier_url
    if not url:
        return VerifierPool(workers=config.reward.workers, grace_s=config.reward.grace_s,
                            plugins=tuple(config.reward.plugins), options=config.reward.verifier_options())
    from rlpipe.rewards.remote import RemoteVerifier

    pool = RemoteVerifier(url, timeout_s=600.0, options=config.reward.verifier_options())
    if not pool.healthy():
        run_logger().warning("ALERT verifier service %s is not healthy; samples it cannot score get status skipped", url)
    return pool


def _check_sandbox_floor(config: RunConfig, rows: list[dict[str, Any]]) -> str | None:
    """Refuse to start a run that would score model code below reward.sandbox_min_level.

    With a verifier service the sandbox is the service's: each verdict's level is checked instead."""
    used = sandboxed_verifiers(r["task"] for r in rows)
    if not used:
        return None
    if _urls(config).verifier_url:
        return "remote"
    from rlpipe.sandbox import isolation_report

    level = isolation_report()["level"]
    check_sandbox_floor(level, config.reward.required_sandbox_components(), f"verifier(s) {', '.join(used)} on this machine")
    run_logger().info("sandbox for %s: %s", ", ".join(used), level)
    return level


# -- the iteration's stages -------------------------------------------------------------------
def _state_iteration(resume_dir: str | None) -> int:
    """The last update in a resume state's weights (-1: the run's start policy)."""
    if not resume_dir:
        return -1
    return int(read_trainer_state(resume_dir)["iteration"])


def _stage(name: str, draw: int) -> str:
    return name if draw == 0 else f"{name}-draw{draw}"


def prompt_slot(config: RunConfig, iteration: int, draw: int) -> int:
    """Which slice of the data order a draw takes. With dynamic sampling every iteration reserves
    1 + max_extra_draws slices, so a resumed run draws exactly what the uninterrupted one would."""
    if not config.rollout.dynamic_sampling:
        return iteration
    return iteration * (1 + config.rollout.max_extra_draws) + draw


def prefetch_rollout(config: RunConfig, run_id: str, iteration: int) -> None:
    """rollout.prefetch: generate ``iteration``'s first batch in the background now, by the policy the engine
    holds (just synced, so on-policy); that iteration's rollout task joins it and takes the stored batch."""
    from concurrent.futures import Future

    svc = services(run_id)
    if svc.background is not None:
        raise RuntimeError(f"iteration {svc.background[0]}'s batch is still being generated ahead; join it first")
    future: Future = Future()

    def work() -> None:
        try:
            future.set_result(generate_rollout(config, run_id, iteration, 0))
        except BaseException as e:  # noqa: BLE001 - handed to the rollout task that joins it
            future.set_exception(e)

    svc.background = (iteration, future)
    threading.Thread(target=work, name=f"rlpipe-prefetch-{iteration}", daemon=True).start()


def _join_prefetch(svc: RunServices, iteration: int, draw: int) -> float | None:
    """Wait for the batch generated ahead for this rollout (seconds waited), None when there is none. Its
    error is this task's (a retry generates the batch here)."""
    if svc.background is None or (svc.background[0], draw) != (iteration, 0):
        return None
    _, future = svc.background
    start = time.perf_counter()
    try:
        future.result()
    except Exception as e:
        raise RuntimeError(f"iteration {iteration}: generating its batch ahead (rollout.prefetch) failed: {e}") from e
    finally:
        svc.background = None
    return time.perf_counter() - start


@stage("rollout", retries=1, retry_delay_s=1, timeout_s=3600)
def rollout(config: RunConfig, run_id: str, iteration: int, draw: int = 0) -> dict[str, Any]:
    """The draw's batch: generated here, or taken from the store (generated ahead, or before a resume)."""
    waited = _join_prefetch(services(run_id), iteration, draw)
    out = generate_rollout(config, run_id, iteration, draw)
    return out | {"prefetched": True, "prefetch_wait_s": waited} if waited is not None and out["reused"] else out


def generate_rollout(config: RunConfig, run_id: str, iteration: int, draw: int) -> dict[str, Any]:
    store = _store(config)
    prefix = stage_prefix(run_id, iteration, _stage("rollout", draw))
    svc = services(run_id)
    if store.stage_done(prefix):
        manifest = store.read_manifest(prefix)
        if _reusable(config, manifest["meta"], _rollout_expect(config, svc, manifest["meta"], iteration), f"rollout {prefix}"):
            return manifest["meta"] | {"prefix": prefix, "reused": True, "written_at": manifest["written_at"]}
    policy_iteration = svc.info.get("policy_iteration", iteration - 1)
    staleness = iteration - 1 - policy_iteration
    check_staleness(config, iteration, staleness, f"rollout {prefix}")
    prompts, cursor = select_prompts(svc.train_rows, prompt_slot(config, iteration, draw), config.rollout.batch_size, config.seed)
    sampling = SamplingConfig(
        n=config.rollout.samples_per_prompt, temperature=config.rollout.temperature, top_p=config.rollout.top_p,
        max_new_tokens=config.rollout.max_new_tokens, seed=config.seed * 1_000_003 + iteration * 10_007 + draw * 101,
    )
    if config.agent is not None:
        from rlpipe.rollout.agent import agent_rollout

        table, stats = agent_rollout(svc.engine, svc.tokenizer, config.agent, prompts, sampling, run_id, iteration,
                                     _urls(config).env_url)
    else:
        table, stats = generate_table(svc.engine, svc.tokenizer, prompts, sampling, run_id, iteration)
    table = _with_column(table, "policy_iteration", policy_iteration)
    table = _with_column(table, "staleness", staleness)
    if hasattr(svc.engine, "rerouted"):  # rollout replicas: how many answer, how many prompts moved off dead ones
        stats |= {"rollout/replicas_live": float(len(svc.engine.live())), "rollout/rerouted_prompts": float(svc.engine.rerouted)}
    meta = stats | {"rows": table.num_rows, "cursor": cursor, "draw": draw, "policy_version": svc.engine.weights_sha256(),
                    "policy_iteration": policy_iteration, "staleness": staleness, "fingerprint": resume_fingerprint(config)}
    start = time.perf_counter()
    manifest = store.write_stage(prefix, [table], meta=meta, schema=TRAJECTORY_SCHEMA)
    meta["write_s"] = time.perf_counter() - start
    fault_point(iteration, "rollout")
    return meta | {"prefix": prefix, "reused": False, "written_at": manifest["written_at"]}


def _with_column(table: pa.Table, name: str, value: int) -> pa.Table:
    column = pa.array([value] * table.num_rows, pa.int32())
    i = table.schema.get_field_index(name)
    return table.set_column(i, name, column) if i >= 0 else table.append_column(name, column)


def _rollout_expect(config: RunConfig, svc: RunServices, meta: dict[str, Any], iteration: int) -> dict[str, Any]:
    """What a stored batch must match to be reused. An on-policy batch: the policy the engine holds now. A
    batch generated ahead (rollout.async_steps) by an earlier policy: its staleness within the bound."""
    staleness = iteration - 1 - meta.get("policy_iteration", iteration - 1)
    if staleness == 0 or config.rollout.async_steps == 0:
        return {"policy_version": svc.engine.weights_sha256()}
    return {"staleness": staleness if staleness <= config.rollout.async_steps else f"at most {config.rollout.async_steps}"}


class StaleBatchError(RuntimeError):
    """A batch sampled by a policy more updates behind the one it would train than rollout.async_steps allows."""


def check_staleness(config: RunConfig, iteration: int, staleness: int, what: str) -> None:
    if not 0 <= staleness <= config.rollout.async_steps:
        raise StaleBatchError(
            f"iteration {iteration}: {what} would be sampled by a policy {staleness} update(s) behind the one it "
            f"trains; rollout.async_steps={config.rollout.async_steps} allows at most {config.rollout.async_steps}. "
            "Generate it after the weight sync (rollout.async_steps: 0), or raise the bound")


def _retry_unless_guard(exc: BaseException) -> bool:
    """Retry a failed verify, except when a reward guard tripped: rescoring would only repeat it."""
    return not isinstance(exc, (RewardCircuitOpen, SandboxFloorError))


@stage("verify", retries=1, retry_delay_s=1, timeout_s=3600, retry_if=_retry_unless_guard)
def verify(config: RunConfig, run_id: str, iteration: int, rollout_ref: dict[str, Any], draw: int = 0,
           reward_norm: dict[str, float] | None = None) -> dict[str, Any]:
    """Score the rollout. ``reward_norm``: the reward normaliser's state before this draw (RLHF)."""
    store = _store(config)
    prefix = stage_prefix(run_id, iteration, _stage("verify", draw))
    inputs = {"rollout_written_at": rollout_ref["written_at"]}  # scores of exactly the rollout in use
    if config.reward.normalize:
        inputs["reward_norm_in"] = reward_norm  # ... normalised from exactly this state
    if store.stage_done(prefix):
        meta = store.read_manifest(prefix)["meta"]
        if _reusable(config, meta, inputs, f"verify {prefix}"):
            return meta | {"prefix": prefix, "reused": True}
    svc = services(run_id)
    start = time.perf_counter()
    table = store.read_stage(rollout_ref["prefix"], schema=TRAJECTORY_SCHEMA)
    read_s = time.perf_counter() - start
    healthy = svc.pool.healthy()  # every iteration, not only at start
    if not healthy:
        run_logger().warning("ALERT iteration %d: verifier pool/service not healthy; unscorable samples are counted", iteration)
    if config.agent is not None:  # the environment gave the rewards; check every episode before training
        from rlpipe.rollout.agent import check_episodes

        scored, stats = check_episodes(table, config.agent.spec().limits.max_steps)
        check_s = time.perf_counter() - start - read_s
        stats |= {"verify_s": check_s, "verify_per_s": table.num_rows / max(check_s, 1e-9)}
    else:
        scored, stats = _score(config, svc, table, reward_norm)
    rows = scored.to_pylist()
    stats |= check_rows_isolation(rows, config.reward.required_sandbox_components())
    stats |= {"verifier/healthy": float(healthy), "verifier/restarts": float(getattr(svc.pool, "restarts", 0))}
    recent = run_history(run_id).tail(config.reward.max_invalid_iterations + 1)
    previous = [h.get("invalid_share", 0.0) for h in recent if h["iteration"] < iteration]
    check_circuit(previous, invalid_share(rows), rows, config.reward.max_invalid_share,
                  config.reward.max_invalid_iterations, iteration)
    if config.reward.overlong_buffer:
        scored, pen = apply_overlong_penalty(scored, config.rollout.max_new_tokens, config.reward.overlong_buffer,
                                             config.reward.overlong_penalty)
        stats |= pen
    # With dynamic sampling an all-equal batch is expected: its groups are dropped, not an alert.
    metrics, alerts = batch_metrics(scored, flat_batch_alert=not config.rollout.dynamic_sampling)
    if "true_accuracy" in stats:  # RLHF: accuracy is the hidden verifier's, not "reward == 1"
        metrics["accuracy"] = stats.pop("true_accuracy")
    for source in (svc.pool, svc.reward_model):  # a verifier or reward-model service was down, refused or slow
        if getattr(source, "last_problem", None):
            alerts.append(source.last_problem)
    for a in alerts:
        run_logger().warning("ALERT iteration %d: %s", iteration, a)
    meta = stats | metrics | inputs | {"alerts": alerts, "rows": scored.num_rows, "read_s": read_s, "draw": draw,
                                      "fingerprint": resume_fingerprint(config)}
    start = time.perf_counter()
    store.write_stage(prefix, [scored], meta=meta, schema=TRAJECTORY_SCHEMA)
    meta["write_s"] = time.perf_counter() - start
    fault_point(iteration, "verify")
    return meta | {"prefix": prefix, "reused": False}


# No retries: an update that failed half-way has touched the optimizer; the run resumes from the
# last saved state instead.
@stage("update", timeout_s=3600)
def update(config: RunConfig, run_id: str, iteration: int, verify_refs: list[dict[str, Any]]) -> dict[str, Any]:
    """One trainer update on the iteration's scored draws (with dynamic sampling: the groups with signal)."""
    svc = services(run_id)
    extra_state = {"iteration": iteration, "run_id": run_id, "config_fingerprint": config.fingerprint()}
    if getattr(svc.trainer, "remote", False):
        return _remote_update(config, svc, run_id, iteration, verify_refs, extra_state)
    store = _store(config)
    start = time.perf_counter()
    tables = [store.read_stage(ref["prefix"], schema=TRAJECTORY_SCHEMA) for ref in verify_refs]
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
    _check_dynamic(config, iteration, metrics, len(tables))
    _check_nonfinite(config, iteration, metrics)
    start = time.perf_counter()
    folder = state_dir(run_id, iteration)
    if folder.exists():
        shutil.rmtree(folder)
    digest = svc.trainer.save(folder, extra_state=extra_state, spare=spare_state_dir(run_id))
    save_s = time.perf_counter() - start
    fault_point(iteration, "update")
    return {"metrics": metrics, "update_s": update_s, "save_s": save_s, "read_s": read_s,
            "state_dir": str(folder), "weights_sha256": digest,
            "train_tokens_per_s": metrics.get("tokens", 0.0) / max(update_s, 1e-9)}


def _remote_update(config: RunConfig, svc: RunServices, run_id: str, iteration: int, verify_refs: list[dict[str, Any]],
                   extra_state: dict[str, Any]) -> dict[str, Any]:
    """The trainer service reads the stages from the store and writes the whole new state there; this side
    keeps a checked copy of the new weights (for an in-process engine, and as the local resume point)."""
    out = svc.trainer.update_stages([ref["prefix"] for ref in verify_refs], iteration,
                                    config.rollout.batch_size if config.rollout.dynamic_sampling else None,
                                    config.agent is not None and config.agent.step_rewards, extra_state)
    metrics = out["metrics"]
    _check_dynamic(config, iteration, metrics, len(verify_refs))
    _check_nonfinite(config, iteration, metrics)
    start = time.perf_counter()
    folder = svc.trainer.fetch_weights(out["state_prefix"], out["weights_sha256"], state_dir(run_id, iteration))
    fetch_s = time.perf_counter() - start
    fault_point(iteration, "update")
    return {"metrics": metrics | {"trainer/upload_s": out["upload_s"], "trainer/fetch_s": fetch_s,
                                  "trainer/world": float(svc.trainer.world)},
            "update_s": out["update_s"], "save_s": out["save_s"] + out["upload_s"], "read_s": out["read_s"],
            "state_dir": str(folder), "state_uri": out["state_uri"], "weights_sha256": out["weights_sha256"],
            "train_tokens_per_s": metrics.get("tokens", 0.0) / max(out["update_s"], 1e-9)}


def _check_dynamic(config: RunConfig, iteration: int, metrics: dict[str, float], draws: int) -> None:
    if config.rollout.dynamic_sampling and metrics["dynamic/groups_kept"] < config.rollout.batch_size:
        run_logger().warning(
            "ALERT iteration %d: dynamic sampling kept %d/%d groups after %d draws (rollout.max_extra_draws caps it)",
            iteration, metrics["dynamic/groups_kept"], config.rollout.batch_size, draws)


class NonFiniteUpdate(RuntimeError):
    """Too many optimizer steps of one iteration had a non-finite loss or gradient."""


def _check_nonfinite(config: RunConfig, iteration: int, metrics: dict[str, float]) -> None:
    skipped = int(metrics.get("nonfinite_steps", 0))
    if not skipped:
        return
    total = skipped + int(metrics.get("optimizer_steps", 0))
    run_logger().warning("ALERT iteration %d: %d/%d optimizer step(s) skipped: non-finite loss or gradient "
                         "(mismatch/abs_max %.3g)", iteration, skipped, total, metrics.get("mismatch/abs_max", float("nan")))
    if skipped >= config.train.max_nonfinite_steps:
        raise NonFiniteUpdate(
            f"iteration {iteration}: {skipped}/{total} optimizer steps had a non-finite loss or gradient "
            f"(train.max_nonfinite_steps={config.train.max_nonfinite_steps}); the run stops before saving this "
            "update. Look at the iteration's trajectories (log-probs, rewards) and lower train.lr; the same --run-id "
            "resumes from the last saved state")


def start_probe(svc: RunServices, config: RunConfig) -> float:
    """Build the run's probe batch and check, on the engine, that it holds the trainer's policy."""
    from rlpipe.rollout.probe import build_probe, default_tolerance

    render = (lambda r: r["prompt"]) if config.agent is not None else (lambda r: render_prompt(svc.tokenizer, r["prompt"], r["chat"]))
    svc.info["probe"] = build_probe(svc.tokenizer, svc.train_rows, render, seed=config.seed)
    svc.info["probe_tol"] = config.rollout.sync_tolerance or default_tolerance(svc.engine.dtype)
    return prove_sync(svc, "at start")["probe_max_abs_diff"]


def prove_sync(svc: RunServices, when: str) -> dict[str, float]:
    """max |Δ log-prob| between engine and trainer on the probe batch; a WeightSyncError above tolerance."""
    from rlpipe.rollout.probe import max_gap

    probe, tol = svc.info["probe"], svc.info["probe_tol"]
    # Every replica of a replicated engine is proven, not only the one that answers first.
    each = (svc.engine.probe_each(probe.prompts, probe.continuations) if hasattr(svc.engine, "probe_each")
            else {svc.engine.name: svc.engine.sequence_logprobs(probe.prompts, probe.continuations)})
    trainer_lp = svc.trainer.sequence_logprobs(probe.prompts, probe.continuations)
    gaps = {name: max_gap(lp, trainer_lp) for name, lp in each.items()}
    worst = max(gaps, key=lambda k: gaps[k])
    gap, engine_lp = gaps[worst], next(iter(each.values()))
    change = max_gap(engine_lp, svc.info["probe_last"]) if "probe_last" in svc.info else 0.0
    if not gap <= tol:
        raise WeightSyncError(
            f"{when}: engine {worst} and trainer disagree on the probe batch ({probe.tokens} tokens): "
            f"max |Δ log-prob| {gap:.3g} > tolerance {tol:g}. The engine does not run the trainer's policy "
            "(a stale, partial or wrongly repacked reload); set rollout.sync_tolerance only if the engine's dtype "
            "explains the gap")
    svc.info["probe_last"] = engine_lp
    return {"probe_max_abs_diff": gap, "probe_policy_change": change, "probe_tokens": float(probe.tokens)}


@stage("sync-weights", retries=2, retry_delay_s=1, timeout_s=600)
def sync_weights(config: RunConfig, run_id: str, iteration: int, update_ref: dict[str, Any]) -> dict[str, Any]:
    """Reload the trained weights into the engine in place, then prove it: the engine's hash must equal
    the trainer's export, and the engine's log-probs on the probe batch the trainer's."""
    svc = services(run_id)
    start = time.perf_counter()
    adapter = bool(getattr(svc.engine, "lora_rank", None))  # started for adapter syncs (adapter_sync at start)
    if adapter:  # only the adapter moves; its tensors must be the trainer's (hashed from memory)
        folder = Path(update_ref["state_dir"])
        want = read_trainer_state(folder)["adapter_sha256"]
        got = svc.engine.load_adapter(folder / ADAPTER, update_ref["weights_sha256"])
        if got != want:
            raise WeightSyncError(f"iteration {iteration}: engine {svc.engine.name} read adapter {got[:12]}, the "
                                  f"trainer saved {want[:12]}")
        held = svc.engine.weights_sha256()
    elif update_ref.get("state_uri") and hasattr(svc.engine, "load_uri"):  # replicas read the trainer's own upload
        held = svc.engine.load_uri(update_ref["state_uri"], update_ref["weights_sha256"])
    else:
        held = svc.engine.load_weights(update_ref["state_dir"])
    if held != update_ref["weights_sha256"]:
        raise WeightSyncError(
            f"iteration {iteration}: engine {svc.engine.name} holds {held[:12]} after reload, trainer exported "
            f"{update_ref['weights_sha256'][:12]}"
        )
    proof = prove_sync(svc, f"iteration {iteration}")
    svc.info["policy_iteration"] = iteration
    fault_point(iteration, "sync")
    return {"sync_s": time.perf_counter() - start, "policy_version": held, "adapter_only": float(adapter),
            "readback_tensors": 0.0 if adapter else float(getattr(svc.engine, "last_readback", 0))} | proof


def evaluate(config: RunConfig, run_id: str, split: str = "test") -> dict[str, Any]:
    """Greedy answers of the policy the engine holds now on ``split`` (see :func:`rlpipe.evaluation.greedy_eval`).
    'validation' is what the ``evaluate`` flow promotes on; 'test' is reported."""
    from rlpipe.evaluation import greedy_eval

    svc = services(run_id)
    rows = svc.test_rows if split == "test" else svc.validation_rows
    return greedy_eval(svc.engine, svc.tokenizer, svc.pool, rows, svc.ground_truth,
                       max_new_tokens=config.rollout.max_new_tokens, reward_model=svc.reward_model,
                       agent=config.agent, env_url=_urls(config).env_url if config.agent is not None else None)


@stage("upload-checkpoint", retries=2, retry_delay_s=2, timeout_s=600)
def upload_checkpoint(config: RunConfig, run_id: str, iteration: int, update_ref: dict[str, Any]) -> dict[str, Any]:
    """Copy the iteration's full resumable state (weights, tokenizer, optimizer and critic states, KL
    controller, RNG, iteration) to the store; a redo finds a whole copy and keeps it."""
    uri = run_state(config, run_id).upload_state(Path(update_ref["state_dir"]), iteration, update_ref["weights_sha256"])
    fault_point(iteration, "upload")
    return {"checkpoint_uri": uri, "weights_sha256": update_ref["weights_sha256"]}
