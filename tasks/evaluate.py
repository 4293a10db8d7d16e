"""Tasks of the ``evaluate`` flow: resolve a model version, measure it greedily on a split, log the result
beside the baseline's in MLflow, and move a promotion alias when the candidate is better; and of the
``evaluate-suite`` flow: run the benchmarks of ``configs/evals/`` on a model and log them as one MLflow run."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlpipe.config import RunConfig, settings
from rlpipe.eval_suite import Benchmark
from rlpipe.evaluation import greedy_eval
from rlpipe.rollout.redact import redact_samples
from rlpipe.storage.store import open_store
from rlpipe.tracking.mlflow_utils import Tracker
from tasks._log import run_logger

SPLITS = ("validation", "test")


@dataclass(frozen=True)
class Candidate:
    """A model to evaluate: a registry version (name, version) or a plain folder (name None)."""

    spec: str
    source: str
    name: str | None = None
    version: str | None = None
    mlflow_run_id: str | None = None
    aliases: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return f"{self.name} v{self.version}" if self.name else self.spec


def resolve_candidate(spec: str, config: RunConfig | None) -> Candidate:
    """``models:/NAME@ALIAS``, ``models:/NAME/VERSION`` or a checkpoint folder/URI."""
    if not spec.startswith("models:/"):
        return Candidate(spec, spec)
    tracker = Tracker(settings(), config)
    ref = spec[len("models:/"):]
    if "@" in ref:
        name, alias = ref.split("@", 1)
        mv = tracker.version_by_alias(name, alias)
        if mv is None:
            raise LookupError(f"{spec}: model {name!r} has no version with alias {alias!r} in {tracker.uri}; register one "
                              "first (the sft deployment registers @base, train registers @last)")
        version = mv.version
    else:
        name, _, version = ref.rpartition("/")
    mv = tracker.client.get_model_version(name, version)
    return Candidate(spec, mv.source, name, str(mv.version), mv.run_id, tuple(getattr(mv, "aliases", ()) or ()))


def config_for(candidate: Candidate, config: RunConfig | None) -> RunConfig:
    """The given config, else the one the candidate was trained with (its MLflow run's config.json)."""
    if config is not None:
        return config
    if candidate.mlflow_run_id is None:
        return RunConfig()
    return Tracker(settings(), None).run_config(candidate.mlflow_run_id)


@task(name="evaluate-models", cache_policy=NO_CACHE, timeout_seconds=3600)
def evaluate_models(config: RunConfig, dataset: dict[str, Any], split: str, models: list[Candidate]) -> list[dict[str, Any]]:
    """Greedy evaluation of each model on ``split``, one engine reloaded between them (the numbers are the
    ones an RL run logs for the same weights: :func:`rlpipe.evaluation.greedy_eval`)."""
    from rlpipe.rollout.engines import engine_options, new_engine
    from rlpipe.training.models import fetch_source
    from rlpipe.runtime.assembly import context_length, ground_truths, prompt_rows, reward_model_source, split_rows, verifier_pool
    from rlpipe.tokens import load_tokenizer

    s = settings().for_run(config)
    rows = prompt_rows(open_store(s.resolve_storage_uri(config), s), dataset)
    chosen = split_rows(config, rows, split)
    if not chosen:
        raise ValueError(f"the prompt set {dataset['uri']} has no {split!r} rows; set data.{split}_size or use another split")
    folders = [str(fetch_source(m.source, settings())) for m in models]
    engine = new_engine(config.rollout.engine, folders[0], max_model_len=context_length(config, rows, folders[0]),
                        seed=config.seed, **engine_options(config.rollout))
    pool = verifier_pool(config, s, run_logger())
    rm = reward_model_source(config, s, run_logger()) if config.reward.type == "model" else None
    out = []
    try:
        for k, (m, folder) in enumerate(zip(models, folders)):
            if k:
                engine.load_weights(folder)
            res = redact_samples(greedy_eval(engine, load_tokenizer(folder), pool, chosen, ground_truths(rows),
                                             max_new_tokens=config.rollout.max_new_tokens, reward_model=rm,
                                             agent=config.agent), config.data.redact)
            run_logger().info("%s on %s: accuracy %.3f (n=%d) in %.1f s [%d/%d]", m.label, split, res["accuracy"], res["n"],
                              res["eval_s"], k + 1, len(models))
            out.append(res)
    finally:
        pool.close()
        engine.close()
    return out


@task(name="log-evaluation", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE, timeout_seconds=120)
def log_evaluation(config: RunConfig, run_id: str, dataset_version: str, split: str, candidate: Candidate,
                   result: dict[str, Any], baseline: Candidate | None, baseline_result: dict[str, Any] | None,
                   baseline_alias: str | None) -> str:
    """An MLflow run (kind ``evaluate``) with the candidate's and the baseline's scores side by side, the
    generations table, and tags on the candidate's model version (``eval_<split>_accuracy``)."""
    tracker = Tracker(settings(), config)
    rid = tracker.start_run(config, run_id, "evaluate", dataset_version)
    metrics = {f"{split}_accuracy": result["accuracy"], f"{split}_true_score": result["true_score"], "n": result["n"]}
    if baseline_result is not None:
        metrics |= {f"baseline_{split}_accuracy": baseline_result["accuracy"],
                    f"delta_{split}_accuracy": result["accuracy"] - baseline_result["accuracy"]}
    tracker.log_metrics(rid, metrics, 0)
    tags = {"rlpipe.eval.model": candidate.spec, "rlpipe.eval.split": split,
            "rlpipe.eval.model_version": candidate.label, "rlpipe.eval.baseline": (
                f"@{baseline_alias} = {baseline.label}" if baseline else f"@{baseline_alias} (none)" if baseline_alias else "")}
    for k, v in tags.items():
        tracker.client.set_tag(rid, k, v)
    tracker.log_table(rid, result.get("samples") or [], "generations.json")
    if candidate.name:
        tracker.client.set_model_version_tag(candidate.name, candidate.version, f"eval_{split}_accuracy", f"{result['accuracy']:.6f}")
        tracker.client.set_model_version_tag(candidate.name, candidate.version, f"eval_{split}_run", rid)
    return rid


# -- the evaluation suite --------------------------------------------------------------------------------


@task(name="run-suite", cache_policy=NO_CACHE, timeout_seconds=6 * 3600)
def run_suite(config: RunConfig, candidate: Candidate, benchmarks: list[Benchmark]) -> dict[str, Any]:
    """Every benchmark of the suite on one engine holding the candidate (:func:`rlpipe.eval_suite.run_benchmark`).

    Rows and prompts are checked before the engine starts, so a missing file or a prompt longer than the
    model's context fails in seconds. Returns the weights' sha256 and, per benchmark, its results with the
    prompt file and its content version."""
    from rlpipe.eval_suite import prepare_benchmark, run_benchmark, suite_context
    from rlpipe.rollout.engines import engine_options, new_engine
    from rlpipe.tokens import load_tokenizer
    from rlpipe.training.models import fetch_source, model_context
    from rlpipe.runtime.assembly import check_sandbox, verifier_pool

    folder = str(fetch_source(candidate.source, settings()))
    tokenizer, options = load_tokenizer(folder), config.reward.verifier_options()
    prepared = [prepare_benchmark(b, tokenizer, options) for b in benchmarks]
    s = settings().for_run(config)
    check_sandbox(config, s, [r for p in prepared for r in p.rows], run_logger())
    context = config.rollout.max_model_len or suite_context(prepared, model_context(folder))
    engine = new_engine(config.rollout.engine, folder, max_model_len=context, seed=config.seed, **engine_options(config.rollout))
    pool = verifier_pool(config, s, run_logger())
    out: dict[str, Any] = {"weights_sha256": engine.weights_sha256(), "benchmarks": []}
    try:
        for k, p in enumerate(prepared):
            start = time.perf_counter()
            res = run_benchmark(engine, pool, p) | {"prompts": p.bench.prompts, "dataset_version": p.dataset_version}
            m = res["metrics"]
            run_logger().info("%s on %s: greedy %s, %s, mean_len %.1f, truncated %.2f (n=%d) in %.1f s [%d/%d]", candidate.label,
                              p.bench.name, _fmt(m.get("greedy_acc")), ", ".join(f"pass@{key[8:]} {v:.3f}" for key, v in m.items()
                              if key.startswith("pass_at_")) or "no samples", m["mean_len"], m["truncated"], m["n"],
                              time.perf_counter() - start, k + 1, len(prepared))
            out["benchmarks"].append(res)
    finally:
        pool.close()
        engine.close()
    return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


@task(name="log-suite", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE, timeout_seconds=300)
def log_suite(config: RunConfig, run_id: str, experiment: str, candidate: Candidate, result: dict[str, Any]) -> str:
    """One MLflow run (kind ``evaluate-suite``) in ``experiment``: ``<bench>/<metric>`` for every benchmark, the
    responses as tables (``evals/<bench>.json``), and tags naming the model and its version. Every version is
    evaluated into the same experiment under the same metric names, so MLflow's compare view lines them up."""
    cfg = config.model_copy(update={"tracking": config.tracking.model_copy(update={"experiment": experiment})})
    tracker = Tracker(settings(), cfg)
    rid = tracker.start_run(cfg, run_id, "evaluate-suite")
    metrics = {f"{b['name']}/{k}": v for b in result["benchmarks"] for k, v in b["metrics"].items()}
    tracker.log_metrics(rid, metrics, 0)
    tags = {"mlflow.runName": f"{candidate.label} suite", "rlpipe.eval.model": candidate.spec,
            "rlpipe.eval.model_name": candidate.name or candidate.spec, "rlpipe.eval.model_version": candidate.version or "",
            "rlpipe.eval.weights_sha256": result["weights_sha256"],
            "rlpipe.eval.suite": ",".join(b["name"] for b in result["benchmarks"])}
    for b in result["benchmarks"]:
        tags |= {f"rlpipe.eval.{b['name']}.prompts": b["prompts"], f"rlpipe.eval.{b['name']}.dataset_version": b["dataset_version"]}
        tracker.log_table(rid, b["table"], f"evals/{b['name']}.json")
    for k, v in tags.items():
        tracker.client.set_tag(rid, k, v)
    if candidate.name:
        tracker.client.set_model_version_tag(candidate.name, candidate.version, "eval_suite_run", rid)
    return rid
