"""The ``evaluate`` flow: a registered model on a split of a prompt set → MLflow, beside a baseline alias's
score → (validation split only) the promotion alias moves when the candidate is better.

This is the one place ``best`` and ``champion`` move for a policy: registration never moves them, so a
smoke run cannot change what people compare (see :data:`rlpipe.tracking.mlflow_utils.PROMOTION_ALIASES`).

The ``evaluate-suite`` flow measures a model on benchmarks (``configs/evals/*.yaml``: GSM8K, MATH-500,
HumanEval, MBPP) and logs them as one MLflow run; it only reports, it moves no alias.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional

from prefect import flow

from rlpipe.audit import move_alias
from rlpipe.config import RunConfig, settings
from rlpipe.evaluation import compare
from rlpipe.runs import new_run_id, write_summary
from rlpipe.storage import open_store
from rlpipe.storage.layout import check_run_id
from rlpipe.tracking.mlflow_utils import Tracker
from tasks._log import run_logger
from tasks.audit import audit_log
from tasks.data import prepare_dataset
from rlpipe.eval_suite import load_suite
from tasks.evaluate import Candidate, config_for, evaluate_models, log_evaluation, log_suite, resolve_candidate, run_suite
from tasks.preflight import preflight_task

DEFAULT_SUITE = ("gsm8k", "math500", "humaneval", "mbpp")
SUITE_EXPERIMENT = "rlpipe-evals"


@flow(name="evaluate", flow_run_name="eval-{split}")
def evaluate(
    model: str = "models:/rlpipe-arithmetic@last",
    split: Literal["validation", "test"] = "validation",
    baseline: Optional[str] = "best",
    promote_to: Optional[str] = None,
    config: Optional[RunConfig] = None,
    run_id: str = "",
) -> dict[str, Any]:
    """Evaluate a model greedily on a split, beside a baseline alias; returns (and writes as summary.json)
    the scores and whether ``promote_to`` moved.

    Args:
        model: The model: models:/NAME@ALIAS, models:/NAME/VERSION or a checkpoint folder.
        split: The prompt set's split. Promotion needs 'validation'; the test split only reports.
        baseline: Alias of the same model name to compare with, evaluated now on the same rows; empty: none.
        promote_to: Alias to move to the model when it beats the baseline (best, champion); empty: report only.
        config: The prompt set, verifiers and engine; empty: the config the model was trained with.
        run_id: Id of this evaluation (its summary.json and MLflow run); empty: a new one.
    """
    start = time.perf_counter()
    run_id = check_run_id(run_id or new_run_id("eval"))
    candidate = resolve_candidate(model, config)
    _check_promotion(promote_to, split, candidate)
    config = config_for(candidate, config)
    preflight_task(_without_policy(config))  # fail fast, naming the component that is down
    dataset = prepare_dataset(config)
    base = _baseline(candidate, baseline, config)
    models = [candidate] + ([base] if base and base.version != candidate.version else [])
    results = evaluate_models(config, dataset, split, models)
    base_result = (results[1] if len(results) > 1 else results[0]) if base else None
    mlflow_run = log_evaluation(config, run_id, dataset["version"], split, candidate, results[0], base, base_result, baseline)
    promoted, why = _promote(config, candidate, promote_to, results[0], base_result)
    summary = {
        "kind": "evaluate", "run_id": run_id, "model": model, "name": candidate.name, "version": candidate.version, "split": split,
        "accuracy": results[0]["accuracy"], "true_score": results[0]["true_score"], "n": results[0]["n"],
        "baseline": {"alias": baseline, "version": base.version if base else None,
                     "accuracy": base_result["accuracy"] if base_result else None},
        "promote_to": promote_to, "promoted": promoted, "reason": why, "dataset_version": dataset["version"],
        "mlflow_run_id": mlflow_run, "wall_s": round(time.perf_counter() - start, 2),
    }
    write_summary(settings(), run_id, summary)
    Tracker(settings(), config).end_run(mlflow_run)
    run_logger().info("%s on %s: %.3f; baseline @%s: %s; %s", candidate.label, split, summary["accuracy"], baseline,
                      summary["baseline"]["accuracy"], why)
    return summary


@flow(name="evaluate-suite", flow_run_name="eval-suite")
def evaluate_suite(
    model: str = "models:/rlpipe-arithmetic@best",
    # List defaults, so the UI's form shows them (the flow never changes them in place).
    suite: list[str] = list(DEFAULT_SUITE),  # noqa: B006
    overrides: list[str] = [],  # noqa: B006
    experiment: str = SUITE_EXPERIMENT,
    config: Optional[RunConfig] = None,
    run_id: str = "",
) -> dict[str, Any]:
    """Evaluate a model on a suite of benchmarks; one MLflow run with ``<bench>/greedy_acc``,
    ``<bench>/pass_at_<k>``, ``<bench>/mean_len``, ``<bench>/truncated`` and verdict counts; returns (and
    writes as summary.json) the metrics and each problem's verdicts.

    Args:
        model: The model: models:/NAME@ALIAS, models:/NAME/VERSION or a checkpoint folder.
        suite: Benchmarks: names in configs/evals/ (gsm8k, math500, humaneval, mbpp) or paths to benchmark YAML files.
        overrides: BENCH.key=value changes, e.g. gsm8k.prompts=datasets/evals/gsm8k.jsonl (the full imported file).
        experiment: MLflow experiment of the run; keep one per comparison, so versions line up in the compare view.
        config: The engine and verifier settings; empty: the config the model was trained with.
        run_id: Id of this evaluation (its summary.json and MLflow run); empty: a new one.
    """
    start = time.perf_counter()
    run_id = check_run_id(run_id or new_run_id("suite"))
    benchmarks = load_suite(suite, overrides)  # a typo or a missing key fails before anything slow
    candidate = resolve_candidate(model, config)
    config = config_for(candidate, config)
    preflight_task(_without_policy(config))
    result = run_suite(config, candidate, benchmarks)
    mlflow_run = log_suite(config, run_id, experiment, candidate, result)
    summary = {
        "kind": "evaluate-suite", "run_id": run_id, "model": model, "name": candidate.name, "version": candidate.version,
        "weights_sha256": result["weights_sha256"], "suite": [b.name for b in benchmarks], "experiment": experiment,
        "benchmarks": {b["name"]: {k: b[k] for k in ("metrics", "prompts", "dataset_version", "problems")}
                       for b in result["benchmarks"]},
        "mlflow_run_id": mlflow_run, "wall_s": round(time.perf_counter() - start, 2),
    }
    write_summary(settings(), run_id, summary)
    Tracker(settings(), config).end_run(mlflow_run)
    return summary


def _check_promotion(promote_to: str | None, split: str, candidate: Candidate) -> None:
    if promote_to is None:
        return
    if split != "validation":
        raise ValueError(f"promote_to={promote_to!r} on the {split!r} split: aliases move on the validation split only "
                         "(the test split is reported, never selected on); use split=validation")
    if candidate.name is None:
        raise ValueError(f"promote_to={promote_to!r}: {candidate.spec} is not a registered version; register it first")


def _without_policy(config: RunConfig) -> RunConfig:
    """The preflight's config: the model under test is resolved here, not through task.policy_model."""
    out = config.model_copy(deep=True)
    out.task.policy_model = "tiny"
    return out


def _baseline(candidate: Candidate, alias: str | None, config: RunConfig) -> Candidate | None:
    if alias is None or candidate.name is None:
        return None
    try:
        return resolve_candidate(f"models:/{candidate.name}@{alias}", config)
    except LookupError:
        run_logger().info("%s has no @%s yet: no baseline", candidate.name, alias)
        return None


def _promote(config: RunConfig, candidate: Candidate, alias: str | None, result: dict[str, Any],
             base_result: dict[str, Any] | None) -> tuple[bool, str]:
    """Move ``alias`` to the candidate when it beats the baseline (validation split, checked before)."""
    if alias is None:
        return False, "report only (no promote_to)"
    better, why = compare(result["accuracy"], base_result["accuracy"] if base_result else None)
    if better:
        s = settings()
        tracker = Tracker(s, config)
        move_alias(audit_log(open_store(s.resolve_storage_uri(config), s), s), tracker, candidate.name, alias,
                   candidate.version, action="alias.promote", why=f"validation accuracy {result['accuracy']:.4f}: {why}")
        tracker.client.set_model_version_tag(candidate.name, candidate.version, f"promoted_to_{alias}", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        return True, f"@{alias} → {candidate.label}: {why}"
    return False, f"@{alias} stays: {why}"
