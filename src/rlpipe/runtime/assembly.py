"""How a run's services are built from its config and checked before the first iteration.

The engine (in this process, or rollout replicas elsewhere), the trainer (in this process, or the trainer
service), the verifier pool (local workers, or the verifier service) and, for RLHF, the reward model. The
engine and the trainer must start from the same policy: the hash of the weights and the probe batch on the
engine both say so before anything trains.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlpipe.config import RunConfig, Settings
from rlpipe.rollout.base import WeightSyncError
from rlpipe.runtime.context import RunContext
from rlpipe.runtime.services import RunServices
from rlpipe.storage.schemas import PROMPT_SCHEMA

__all__ = [
    "ServicesStarted", "adapter_sync", "build_services", "check_sandbox", "context_length", "ground_truths", "prompt_rows",
    "reward_model_source", "split_rows", "start_probe", "verifier_pool",
]

_LOG = logging.getLogger("rlpipe")


@dataclass(frozen=True)
class ServicesStarted:
    """What starting the services found: the record of the run's first moments."""

    engine: str
    policy_version: str
    start_s: float
    sandbox_level: str | None
    probe_max_abs_diff: float
    reward_model_version: str | None
    reward_stats: dict[str, Any] | None


def build_services(ctx: RunContext, dataset: dict[str, Any], resume_dir: str | None, log: Any = _LOG
                   ) -> tuple[RunServices, ServicesStarted]:
    """Start the rollout engine, the trainer and the verifier pool of the run; prove they hold one policy."""
    from rlpipe.tokens import load_tokenizer, require_chat_template
    from rlpipe.storage.weights import file_weights_digest

    config, models = ctx.config, ctx.resolve_models()
    rows = prompt_rows(ctx.store, dataset)
    sandbox_level = check_sandbox(config, ctx.settings, rows, log)  # before anything slow starts
    start = time.perf_counter()
    policy_dir = resume_dir or models.policy
    if config.agent is None and any(r["chat"] for r in rows):  # before an engine starts, not at the first prompt
        require_chat_template(load_tokenizer(policy_dir), f"task.dataset {config.task.dataset} with task.policy_model "
                              f"{config.task.policy_model}")
    engine = _engine(ctx, rows, resume_dir, log)
    engine_s = time.perf_counter() - start
    trainer = _trainer(ctx, resume_dir)
    expected = file_weights_digest(policy_dir)
    if engine.weights_sha256() != expected:
        raise WeightSyncError(f"engine holds {engine.weights_sha256()[:12]}, trainer starts from {expected[:12]}")
    expected = _rounded_start(engine, trainer, expected, log)
    svc = RunServices(
        run_id=ctx.run_id, engine=engine, trainer=trainer, pool=None, tokenizer=trainer.tokenizer,
        train_rows=split_rows(config, rows, "train"), test_rows=split_rows(config, rows, "test"),
        ground_truth=ground_truths(rows), validation_rows=split_rows(config, rows, "validation"),
    )
    proof = start_probe(svc, config)  # the engine and the trainer hold the same policy, shown on the engine
    svc.policy_iteration = _state_iteration(resume_dir)
    svc.pool = verifier_pool(config, ctx.settings, log)
    svc.prompts = {r["id"]: r for r in rows}
    svc.reward_model = reward_model_source(config, ctx.settings, log) if config.reward.type == "model" else None
    log.info("services up in %.1f s (engine %s %.1f s, verifier %s%s); policy %s", time.perf_counter() - start,
             engine.name, engine_s, ctx.settings.verifier_url or f"{svc.pool.size} local workers",
             f", reward model {svc.reward_model.version}" if svc.reward_model else "", expected[:12])
    rm = svc.reward_model
    return svc, ServicesStarted(engine=engine.name, policy_version=expected, start_s=time.perf_counter() - start,
                                sandbox_level=sandbox_level, probe_max_abs_diff=proof,
                                reward_model_version=rm.version if rm else None, reward_stats=rm.stats if rm else None)


def _rounded_start(engine: Any, trainer: Any, expected: str, log: Any) -> str:
    """train.precision bf16_weights holds the start weights rounded to bfloat16: where the folder's are not
    bfloat16 already (a float32 or float16 checkpoint), the engine takes the trainer's weights before the start probe,
    so that iteration 0 samples from the policy it trains. Returns the policy version the engine now holds."""
    if trainer.cfg.precision != "bf16_weights":
        return expected
    from rlpipe.rollout.probe import load_policy

    # a trainer service reports the rounded weights' hash at its start (streamed only where they differ)
    rounded = trainer.version if getattr(trainer, "remote", False) else trainer.policy_tensors()[0]
    if rounded == expected:  # a bfloat16 checkpoint, or a bf16_weights save point
        return expected
    log.info("train.precision bf16_weights: the start weights (%s) rounded to bfloat16 (%s); the engine takes them",
             expected[:12], rounded[:12])
    return load_policy(engine, None, None, -1, trainer=trainer)


def _engine(ctx: RunContext, rows: list[dict[str, Any]], resume_dir: str | None, log: Any) -> Any:
    """Rollout replicas elsewhere (the start weights reach them streamed), the vLLM engine with the save point's
    LoRA adapter on the start model (adapter syncs; replicas that serve LoRA alike), or an engine loaded with the
    policy."""
    from rlpipe.rollout.engines import engine_options, get_engine

    config, start_model = ctx.config, ctx.resolve_models().policy
    policy_dir = resume_dir or start_model
    adapters = adapter_sync(ctx)
    if config.train.lora:
        log.info("LoRA weight sync: %s", "the adapter (vLLM LoRA)" if adapters else "the merged weights")
    if ctx.settings.rollout_urls:
        return _remote_engine(ctx, start_model if adapters else policy_dir, log, adapters, resume_dir)
    if adapters:
        engine = get_engine("vllm", start_model, max_model_len=context_length(config, rows, start_model), seed=config.seed,
                            lora_rank=config.train.lora.r, **engine_options(config.rollout))
        _resume_adapter(engine, resume_dir)
        return engine
    return get_engine(config.rollout.engine, policy_dir, max_model_len=context_length(config, rows, policy_dir),
                      seed=config.seed, **engine_options(config.rollout))


def _resume_adapter(engine: Any, resume_dir: str | None) -> None:
    """An engine for adapter syncs holds the start model: on a resume it takes the save point's adapter, and then
    reports the save point's policy (its merged weights' hash)."""
    from rlpipe.storage.weights import file_weights_digest
    from rlpipe.training.checkpoint import ADAPTER

    if resume_dir:
        engine.load_adapter(Path(resume_dir) / ADAPTER, file_weights_digest(resume_dir))


def prompt_rows(store: Any, dataset: dict[str, Any]) -> list[dict[str, Any]]:
    """Every row of the run's prompt set (all splits), as stored under its content version."""
    return store.read_stage(dataset["prefix"], schema=PROMPT_SCHEMA).to_pylist()


def split_rows(config: RunConfig, rows: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    """The rows of one split; the test split is cut to ``train.eval_size`` as the run's evaluation is."""
    out = [r for r in rows if r["split"] == split]
    return out[: config.train.eval_size] if split == "test" and config.train.eval_size else out


def ground_truths(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {r["id"]: r["ground_truth"] if r["ground_truth"] is not None else r["tests"] for r in rows}


def adapter_sync(ctx: RunContext) -> bool:
    """Whether this run's syncs move only the LoRA adapter (rollout.lora_sync: adapter, train.lora, an in-process
    trainer): to the in-process vLLM engine, or to rollout replicas that serve LoRA of rank ≥ train.lora.r (their
    /health says; a replica that does not is an error here, at the run's start, naming the fix). A trainer service
    and the HF engine take the merged weights."""
    c, s = ctx.config, ctx.settings
    if c.train.lora is None or c.rollout.lora_sync != "adapter" or s.trainer_url:
        return False
    if not s.rollout_urls:
        return c.rollout.engine == "vllm"
    from rlpipe.rollout.remote import served_lora_ranks

    short = {url: rank for url, rank in served_lora_ranks(s.rollout_urls).items() if rank < c.train.lora.r}
    if short:
        listed = ", ".join(f"{url} (LoRA rank {rank or 'none'})" for url, rank in short.items())
        raise ValueError(f"rollout.lora_sync: adapter sends the rollout replicas only the LoRA adapter of rank "
                         f"train.lora.r={c.train.lora.r}, and {listed} cannot serve it: restart them with `rlpipe serve "
                         f"rollout MODEL --lora-rank {c.train.lora.r}` (vLLM), or set rollout.lora_sync: merged to "
                         "stream the merged weights")
    return True  # a replica that does not answer is left out at the start (_remote_engine)


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


def _trainer(ctx: RunContext, resume_dir: str | None) -> Any:
    """The trainer service the config names (it gets the start weights through the store), else one in this process."""
    config, models = ctx.config, ctx.resolve_models()
    train = config.train.model_copy(update={"critic": config.train.critic.model_copy(update={"model": models.critic})})
    args = {"model_dir": models.policy, "cfg": train, "temperature": config.rollout.temperature or 1.0,
            "seed": config.seed, "ref_model_dir": models.ref, "resume_dir": resume_dir,
            "max_new_tokens": config.rollout.max_new_tokens}
    if url := ctx.settings.trainer_url:
        from rlpipe.training.remote import RemoteTrainer

        return RemoteTrainer(url, ctx.store, ctx.run_id, **args)
    from rlpipe.training.trainer import PolicyTrainer

    return PolicyTrainer(**args)


def _remote_engine(ctx: RunContext, policy_dir: str, log: Any, adapters: bool = False,
                   resume_dir: str | None = None) -> Any:
    """The rollout service replicas of RLPIPE_ROLLOUT_URL as one engine, loaded with ``policy_dir``'s weights
    (streamed). ``adapters``: syncs move only the LoRA adapter; ``policy_dir`` is then the start model, and a resume
    gives the replicas the save point's adapter on it."""
    from rlpipe.rollout.remote import RemoteEngine, ReplicaDown, ReplicatedEngine

    replicas, urls = [], ctx.settings.rollout_urls
    for url in urls:  # a replica that is down at the start is left out, as one that dies later is
        try:
            replicas.append(RemoteEngine(url, ctx.store, ctx.run_id))
        except ReplicaDown as e:
            log.warning("ALERT rollout replica %s is down at the start (%s); its share goes to the others", url, e)
    if not replicas:
        raise ReplicaDown(f"no rollout replica answers: {', '.join(urls)}; start them (rlpipe serve rollout) or drop "
                          "services.rollout / RLPIPE_ROLLOUT_URL to roll out in this process")
    engine = ReplicatedEngine(replicas, adapters=adapters)
    engine.load_weights(policy_dir)  # in adapter mode also the adapter a replica held before goes
    if adapters:
        _resume_adapter(engine, resume_dir)
    return engine


def reward_model_source(config: RunConfig, s: Settings, log: Any = _LOG) -> Any:
    """The reward-model service when RLPIPE_REWARD_MODEL_URL is set, else the model in this process
    (``s``: settings for the run, :meth:`Settings.for_run`)."""
    from rlpipe.rewards.model import LocalRewardModel, RemoteRewardModel

    if url := s.reward_model_url:
        rm = RemoteRewardModel(url)
        if not rm.healthy():
            log.warning("ALERT reward-model service %s is not healthy; samples it cannot score get status skipped", url)
        return rm
    from rlpipe.training.models import load_reward_model

    return LocalRewardModel(load_reward_model(config.reward_model_spec, s, config))


def verifier_pool(config: RunConfig, s: Settings, log: Any = _LOG) -> Any:
    """The verifier service when RLPIPE_VERIFIER_URL is set, else a local pool of worker processes."""
    reward = config.reward
    if not (url := s.verifier_url):
        from rlpipe.rewards.pool import VerifierPool

        return VerifierPool(workers=reward.workers, grace_s=reward.grace_s, plugins=tuple(reward.plugins),
                            options=reward.verifier_options())
    from rlpipe.rewards.remote import RemoteVerifier

    pool = RemoteVerifier(url, timeout_s=600.0, options=reward.verifier_options())
    if not pool.healthy():
        log.warning("ALERT verifier service %s is not healthy; samples it cannot score get status skipped", url)
    return pool


def check_sandbox(config: RunConfig, s: Settings, rows: list[dict[str, Any]], log: Any = _LOG) -> str | None:
    """Refuse to start a run that would score model code below reward.sandbox_min_level.

    With a verifier service the sandbox is the service's: each verdict's level is checked instead."""
    from rlpipe.rewards.guards import check_sandbox_floor, sandboxed_verifiers

    used = sandboxed_verifiers(r["task"] for r in rows)
    if not used:
        return None
    if s.verifier_url:
        return "remote"
    from rlpipe.sandbox import isolation_report

    level = isolation_report()["level"]
    check_sandbox_floor(level, config.reward.required_sandbox_components(),
                        f"verifier(s) {', '.join(used)} on this machine")
    log.info("sandbox for %s: %s", ", ".join(used), level)
    return level


def start_probe(svc: RunServices, config: RunConfig) -> float:
    """Build the run's probe batch and check, on the engine, that it holds the trainer's policy."""
    from rlpipe.rollout.probe import SyncProof, build_probe, default_tolerance
    from rlpipe.tokens import render_prompt

    render = (lambda r: r["prompt"]) if config.agent is not None else (lambda r: render_prompt(svc.tokenizer, r["prompt"], r["chat"]))
    svc.proof = SyncProof(build_probe(svc.tokenizer, svc.train_rows, render, seed=config.seed),
                          config.rollout.sync_tolerance or default_tolerance(svc.engine.dtype))
    return svc.proof.prove(svc.engine, svc.trainer, "at start")["probe_max_abs_diff"]


def _state_iteration(resume_dir: str | None) -> int:
    """The last update in a resume state's weights (-1: the run's start policy)."""
    if not resume_dir:
        return -1
    from rlpipe.training.checkpoint import read_trainer_state

    return int(read_trainer_state(resume_dir)["iteration"])
