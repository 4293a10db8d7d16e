"""The SFT task: dataset URI in, checkpoint URI + accuracies out."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from rlpipe.config import RunConfig, settings
from rlpipe.eta import Eta
from rlpipe.storage.layout import checkpoint_prefix
from rlpipe.storage.schemas import PROMPT_SCHEMA
from rlpipe.storage.store import open_store
from rlpipe.training.checkpoint import save_checkpoint
from rlpipe.training.models import load_model
from rlpipe.training.sft import evaluate_accuracy, train_sft
from rlpipe.training.tiny import count_parameters
from tasks._log import run_logger


# No retries: a rerun retrains from scratch; resuming mid-SFT is not worth the state here.
@task(name="train-sft", cache_policy=NO_CACHE, timeout_seconds=6 * 3600)
def train_sft_task(config: RunConfig, dataset: dict[str, Any], run_id: str, mlflow_run_id: str | None) -> dict[str, Any]:
    """Read the dataset stage, train, evaluate on test, upload the checkpoint; returns its URI and accuracies."""
    s = settings()
    store = open_store(s.resolve_storage_uri(config), s)
    rows = store.read_stage(dataset["prefix"], schema=PROMPT_SCHEMA).to_pylist()
    train = [r for r in rows if r["split"] == "train"]
    test = [r for r in rows if r["split"] == "test"]
    # Early stopping and `best` look at validation, never at test (test is reported, not selected on).
    validation = [r for r in rows if r["split"] == "validation"]
    if not validation and config.sft.stop_at_accuracy is not None:
        raise ValueError(f"dataset {dataset['version'][:16]} has no 'validation' split, which sft.stop_at_accuracy "
                         "stops on (the test split is only reported); add validation rows (data.validation_size for "
                         "builtin tasks) or set sft.stop_at_accuracy: null")
    torch.manual_seed(config.seed)
    model, tok, source = load_model(config.task.policy_model, config, s)
    params = count_parameters(model)
    tracker = None
    if mlflow_run_id:
        from rlpipe.tracking.mlflow_utils import Tracker

        tracker = Tracker(s, config)
        tracker.log_params(mlflow_run_id, {"model.parameters": params, "model.source": source})
    logger = run_logger()
    max_new = config.rollout.max_new_tokens
    probe = validation[: config.sft.eval_size] if config.sft.eval_size else validation

    eta = Eta(config.sft.steps)  # an upper bound when sft.stop_at_accuracy stops it early

    def log(step: int, metrics: dict[str, float]) -> None:
        if "loss_ema" in metrics:
            eta.tick(step)
        if tracker:
            tracker.log_metrics(mlflow_run_id, {f"sft/{k}": v for k, v in metrics.items()}, step)
        if "validation_tool_calls_per_episode" in metrics:
            logger.info("sft step %d/%d: validation episode success %.3f, tool calls/episode %.2f", step, config.sft.steps,
                        metrics["validation_accuracy"], metrics["validation_tool_calls_per_episode"])
        elif "validation_accuracy" in metrics:
            logger.info("sft step %d/%d: validation accuracy %.3f", step, config.sft.steps, metrics["validation_accuracy"])
        elif step % 50 == 0:
            logger.info("sft step %s: loss %.3f", eta.line(), metrics["loss_ema"])

    if config.agent is not None:
        result, before, after, val_after = _agent_sft(config, model, tok, train, test, validation, probe, log)
        logger.info("model %s (%d parameters): episode success before SFT %.3f", source, params, before["accuracy"])
        return _finish(config, store, run_id, dataset, model, tok, result, before, after, val_after, params, tracker, mlflow_run_id)
    ver = config.sft.eval_verifier
    before = evaluate_accuracy(model, tok, test, max_new, verifier=ver)
    logger.info("model %s (%d parameters): held-out accuracy before SFT %.3f", source, params, before["accuracy"])
    if config.sft.nproc > 1:
        from rlpipe.training.sft import encode_row
        from rlpipe.training.sft_ranks import train_sft_ranks

        result = train_sft_ranks(model, tok, [encode_row(tok, r) for r in train], config.sft, config.seed, log, probe,
                                 max_new, ver)
    else:
        result = train_sft(model, tok, train, config.sft, seed=config.seed, log=log,
                           eval_fn=(lambda m: evaluate_accuracy(m, tok, probe, max_new, verifier=ver)) if probe else None)
    after = evaluate_accuracy(model, tok, test, max_new, verifier=ver)
    val_after = evaluate_accuracy(model, tok, validation, max_new, verifier=ver)["accuracy"] if validation else None
    return _finish(config, store, run_id, dataset, model, tok, result, before, after, val_after, params, tracker, mlflow_run_id)


def _agent_sft(config: RunConfig, model: Any, tok: Any, train: list, test: list, validation: list, probe: list, log: Any):
    """SFT on expert demonstrations of ``agent.sft_traces`` training tasks (loss on the policy's tokens only),
    evaluated by greedy episodes: ``accuracy`` is the episode success share."""
    from rlpipe.data.episodes import episode_task
    from rlpipe.envs.experts import demonstrations
    from rlpipe.rollout.agent import agent_evaluate
    from rlpipe.rollout.hf_engine import HFEngine
    from rlpipe.rollout.multiturn import encode_episode
    from rlpipe.training.sft import episode_example, train_sft_examples

    agent, spec, max_new = config.agent, config.agent.spec(), config.rollout.max_new_tokens
    examples = []
    for ep in demonstrations(spec, [episode_task(r) for r in train], agent.sft_traces, agent.sft_tool_share):
        r = encode_episode(tok, ep, chat=agent.chat, system=agent.system)
        examples.append(episode_example(r.prompt_ids, r.response_ids, r.loss_mask))

    def episodes(m: Any, rows: list) -> dict[str, Any]:
        return agent_evaluate(HFEngine.from_model(m, tok), tok, agent, rows, max_new)

    before = episodes(model, test)
    result = train_sft_examples(model, tok, examples, config.sft, config.seed, log=log,
                                eval_fn=(lambda m: episodes(m, probe)) if probe else None)
    model.eval()
    after = episodes(model, test)
    val_after = episodes(model, validation)["accuracy"] if validation else None
    return result, before, after, val_after


def _finish(config: RunConfig, store: Any, run_id: str, dataset: dict[str, Any], model: Any, tok: Any, result: Any,
            before: dict[str, Any], after: dict[str, Any], val_after: float | None, params: int, tracker: Any,
            mlflow_run_id: str | None) -> dict[str, Any]:
    """Upload the checkpoint, log, and the task's result."""
    logger = run_logger()
    with tempfile.TemporaryDirectory() as tmp:
        digest = save_checkpoint(
            tmp, model, tok,
            trainer_state={"kind": "sft", "run_id": run_id, "steps": result.steps, "iteration": 0,
                           "dataset_version": dataset["version"], "config_fingerprint": config.fingerprint()},
        )
        uri = store.upload_dir(tmp, checkpoint_prefix(run_id, "sft"))
    if tracker:
        tracker.log_metrics(mlflow_run_id, {"heldout_accuracy": after["accuracy"], "sft/wall_s": result.wall_s}, result.steps)
    logger.info("SFT done: %d steps in %.1f s, held-out accuracy %.3f → %.3f", result.steps, result.wall_s, before["accuracy"], after["accuracy"])
    return {
        "checkpoint_uri": uri,
        "weights_sha256": digest,
        "parameters": params,
        "steps": result.steps,
        "final_loss": result.final_loss,
        "train_wall_s": result.wall_s,
        "heldout_accuracy_before": before["accuracy"],
        "heldout_accuracy_after": after["accuracy"],
        "validation_accuracy_after": val_after,
        "heldout_n": after["n"],
        "stopped_early": result.stopped_early,
        "mean_steps_after": after.get("mean_steps"),
        "tool_calls_per_episode_after": after.get("tool_calls_per_episode"),
    }

