"""Reward-model tasks: preference pairs → stored under their content version → a trained reward model."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from rlpipe.config import RunConfig, settings
from rlpipe.data import BUILTIN
from rlpipe.data.preferences import PREFERENCE_SCHEMA, build_synthetic_preferences, load_preferences, preference_version
from rlpipe.storage.layout import checkpoint_prefix, dataset_prefix
from rlpipe.storage.store import open_store
from tasks._log import run_logger

SYNTHETIC = "builtin:synthetic-preferences"


class PreferencesInvalid(ValueError):
    pass


def _store(config: RunConfig):
    s = settings()
    return open_store(s.resolve_storage_uri(config), s)


def _preference_table(config: RunConfig):
    if config.rm.dataset == SYNTHETIC:
        prompts = BUILTIN["builtin:arithmetic"](config.data)
        table = build_synthetic_preferences(prompts, config.rm.pairs_per_prompt, config.rm.label_noise, seed=config.data.seed)
        return table, "synthetic-preferences"
    table, findings = load_preferences(config.rm.dataset)
    if findings:
        shown = "\n".join(f"  {f}" for f in findings[:20])
        more = f"\n  … and {len(findings) - 20} more" if len(findings) > 20 else ""
        raise PreferencesInvalid(f"{config.rm.dataset}: {len(findings)} finding(s); nothing was dropped "
                                 f"(see `rlpipe data validate {config.rm.dataset}`):\n{shown}{more}")
    return table, config.rm.dataset.rsplit("/", 1)[-1].split(".")[0]


@task(name="prepare-preferences", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE, timeout_seconds=600)
def prepare_preferences(config: RunConfig) -> dict[str, Any]:
    """Build or load the pairs, refuse any finding, and store them once per content version."""
    table, name = _preference_table(config)
    version = preference_version(table)
    store = _store(config)
    prefix = dataset_prefix(name, version)
    if not store.stage_done(prefix):
        store.write_stage(prefix, [table], meta={"version": version, "source": config.rm.dataset}, schema=PREFERENCE_SCHEMA)
    splits = table.column("split").to_pylist()
    counts = {k: splits.count(k) for k in ("train", "validation", "test")}
    run_logger().info("preferences %s version %s: %s pairs at %s", name, version[:12], counts, store.url(prefix))
    return {"name": name, "version": version, "prefix": prefix, "uri": store.url(prefix)} | {f"{k}_pairs": v for k, v in counts.items()}


def _base_model(config: RunConfig) -> tuple[str, str]:
    from rlpipe.training.models import fetch_source, resolve_source

    spec = config.rm.base_model or config.task.policy_model
    if spec == "tiny":
        raise ValueError("rm.base_model 'tiny' is an untrained trunk: run `rlpipe sft` first and use "
                         "models:/NAME@base (or set rm.base_model to a trained folder)")
    return spec, str(fetch_source(resolve_source(spec, settings(), config), settings()))


# No retries: a rerun retrains from the start (the fit is minutes; its state is not worth resuming).
@task(name="train-reward-model", cache_policy=NO_CACHE, timeout_seconds=6 * 3600)
def train_reward_model(config: RunConfig, data: dict[str, Any], run_id: str, mlflow_run_id: str | None) -> dict[str, Any]:
    """Fit on train pairs (early stopping on validation pairs), report test pairs, upload the model."""
    from rlpipe.training.reward_model import RewardModelTrainer, encode_pairs

    log = run_logger()
    rows = _store(config).read_stage(data["prefix"], schema=PREFERENCE_SCHEMA).to_pylist()
    spec, folder = _base_model(config)
    torch.manual_seed(config.seed)
    trainer = RewardModelTrainer(folder, config.rm, seed=config.seed)
    pairs = {split: encode_pairs(trainer.tokenizer, [r for r in rows if r["split"] == split])
             for split in ("train", "validation", "test")}
    if not pairs["validation"]:
        raise PreferencesInvalid(f"preferences {data['version'][:16]} have no 'validation' pairs, which early stopping "
                                 "and the `best` alias are chosen on (never test); give some rows split: validation")
    tracker = _tracker(config) if mlflow_run_id else None

    def progress(step: int, metrics: dict[str, float]) -> None:
        if tracker:
            tracker.log_metrics(mlflow_run_id, {f"rm/{k}": v for k, v in metrics.items()}, step)
        if "validation_pair_accuracy" in metrics:
            log.info("rm step %d/%d: validation pair accuracy %.3f", step, config.rm.steps, metrics["validation_pair_accuracy"])

    result = trainer.train(pairs["train"], pairs["validation"], log=progress)
    test = trainer.evaluate(pairs["test"]) if pairs["test"] else {"pair_accuracy": None, "n": 0}
    stats = trainer.reward_stats(pairs["train"])
    with tempfile.TemporaryDirectory() as tmp:
        digest = trainer.save(tmp, stats | {"base_model": spec, "preference_version": data["version"]})
        uri = _store(config).upload_dir(tmp, checkpoint_prefix(run_id, "rm"))
    if tracker:
        tracker.log_metrics(mlflow_run_id, {"rm/test_pair_accuracy": test["pair_accuracy"] or 0.0,
                                            "rm/wall_s": result.wall_s}, result.steps)
    log.info("reward model: %d steps in %.1f s; pair accuracy validation %.3f (step %d), test %s", result.steps,
             result.wall_s, result.best_validation_accuracy or float("nan"), result.best_step,
             "n/a" if test["pair_accuracy"] is None else f"{test['pair_accuracy']:.3f}")
    return {"checkpoint_uri": uri, "weights_sha256": digest, "base_model": spec, "steps": result.steps,
            "best_step": result.best_step, "stopped_early": result.stopped_early, "train_wall_s": result.wall_s,
            "validation_pair_accuracy": result.best_validation_accuracy, "test_pair_accuracy": test["pair_accuracy"],
            "test_pairs": test["n"], "reward_stats": stats}


def _tracker(config: RunConfig):
    from rlpipe.tracking.mlflow_utils import Tracker

    return Tracker(settings(), config)
