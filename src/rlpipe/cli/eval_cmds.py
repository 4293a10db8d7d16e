"""Measuring: ``rlpipe evaluate`` (a model on a split or a benchmark suite), ``report`` (a run's HTML page) and
``verifier audit`` (verifiers against labelled cases)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from rlpipe.cli.common import ConfigArg, SetOpt, load, prefect_env, refused
from rlpipe.config import RunConfig, settings

verifier_app = typer.Typer(help="Check verifiers against labelled cases.", no_args_is_help=True)


def evaluate_cmd(
    model: Annotated[str, typer.Argument(help="models:/NAME@ALIAS, models:/NAME/VERSION or a checkpoint folder.")],
    config: ConfigArg = None, set_: SetOpt = None,
    split: Annotated[str, typer.Option(help="validation (promotion allowed) or test (report only).")] = "validation",
    baseline: Annotated[Optional[str], typer.Option(help="Alias of the same model to compare with; 'none' for no baseline.")] = "best",
    promote_to: Annotated[Optional[str], typer.Option(help="Move this alias (best, champion) to MODEL when it beats the baseline.")] = None,
    suite: Annotated[Optional[str], typer.Option(help="Benchmarks instead of a split: names in configs/evals/ or YAML paths, comma-separated (gsm8k,math500,humaneval,mbpp).")] = None,
    suite_set: Annotated[Optional[list[str]], typer.Option("--suite-set", help="Benchmark override BENCH.key=value (repeatable), e.g. gsm8k.prompts=FILE.")] = None,
    experiment: Annotated[str, typer.Option(help="MLflow experiment of a --suite run.")] = "rlpipe-evals",
) -> None:
    """Greedy evaluation of a model on a split, beside a baseline alias, logged to MLflow (the `evaluate`
    deployment); with --suite, the benchmarks of configs/evals/ instead (the `evaluate-nightly` deployment).
    CONFIG defaults to the config MODEL was trained with. Prints summary.json's path last."""
    prefect_env()
    from flows.evaluate import evaluate

    cfg = load(config, set_) if config or set_ else None
    if suite is not None or suite_set:
        return _evaluate_suite(model, suite, suite_set, experiment, cfg, promote_to)
    if split not in ("validation", "test"):
        typer.echo(f"rlpipe evaluate: --split {split!r}: use validation or test", err=True)
        raise typer.Exit(2)
    with refused("rlpipe evaluate", (LookupError, ValueError)):
        out = evaluate(model=model, split=split, baseline=None if baseline == "none" else baseline, promote_to=promote_to, config=cfg)
    b = out["baseline"]
    typer.echo(f"{out['name'] or model} v{out['version']} on {split}: accuracy {out['accuracy']:.3f} (n={out['n']})"
               + (f"; @{b['alias']} (v{b['version']}): {b['accuracy']:.3f}" if b["accuracy"] is not None else "")
               + f"; {out['reason']}")
    typer.echo(settings().run_dir(out["run_id"]) / "summary.json")


def _evaluate_suite(model: str, suite: str | None, overrides: list[str] | None, experiment: str, cfg: RunConfig | None,
                    promote_to: str | None) -> None:
    """``rlpipe evaluate --suite``: the benchmarks' metrics, the MLflow run, then summary.json's path."""
    from flows.evaluate import evaluate_suite

    if promote_to is not None or not suite:
        typer.echo("rlpipe evaluate: " + ("--suite reports only; --promote-to moves aliases after a split evaluation "
                   "(drop --suite)" if promote_to is not None else "--suite-set needs --suite NAMES"), err=True)
        raise typer.Exit(2)
    # (LookupError, ValueError) takes in ConfigError too: a benchmark file or override that cannot be used.
    with refused("rlpipe evaluate", (LookupError, ValueError)):
        out = evaluate_suite(model=model, suite=suite.split(","), overrides=overrides or [], experiment=experiment, config=cfg)
    for name, b in out["benchmarks"].items():
        m = b["metrics"]
        passes = ", ".join(f"pass@{k[8:]} {v:.3f}" for k, v in m.items() if k.startswith("pass_at_"))
        typer.echo(f"{name}: " + (f"greedy {m['greedy_acc']:.3f}, " if "greedy_acc" in m else "") + (f"{passes}, " if passes else "")
                   + f"mean_len {m['mean_len']:.1f}, truncated {m['truncated']:.2f}, errors {int(m['n_error'])} (n={int(m['n'])})")
    typer.echo(f"MLflow run {out['mlflow_run_id']} in experiment {out['experiment']}")
    typer.echo(settings().run_dir(out["run_id"]) / "summary.json")


def report_cmd(
    run_id: Annotated[str, typer.Argument(help="The rlpipe run id (its newest MLflow run) or an MLflow run id.")],
    out: Annotated[Optional[Path], typer.Option(help="Where to write the page (default: $RLPIPE_HOME/runs/RUN_ID/report.html).")] = None,
    log: Annotated[bool, typer.Option("--log/--no-log", help="Also log the page to the MLflow run as report.html.")] = True,
) -> None:
    """One self-contained HTML page of a run, from MLflow: curves (reward, held-out accuracy, KL, entropy,
    lengths), stage times, verdict statuses, alerts and sampled generations. Prints its path."""
    from rlpipe.tracking.report import RunNotFound, build_report

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # two bars for two small tables: noise
    with refused("rlpipe report", (RunNotFound,)):
        path = build_report(run_id, settings(), out, log=log)
    typer.echo(str(path))


@verifier_app.command("audit")
def verifier_audit(
    labels: list[Path],
    out: Annotated[Optional[Path], typer.Option(help="Write the full report (with every disagreement) as JSON.")] = None,
    workers: Annotated[int, typer.Option(help="Verifier worker processes.")] = 2,
    grace: Annotated[float, typer.Option(help="Seconds allowed past each verifier's declared budget before a case is killed.")] = 5.0,
) -> None:
    """Agreement, false positives and false negatives per verifier and per category on labelled JSONL files."""
    from rlpipe.rewards.audit import LabelsError, audit, load_labels, totals
    from rlpipe.rewards.pool import VerifierPool

    with refused(None, (LabelsError, FileNotFoundError)):
        cases = [c for f in labels for c in load_labels(f)]
    with VerifierPool(workers=workers, grace_s=grace) as pool:
        report = audit(cases, pool)

    def row(name: str, r: dict) -> str:
        return (f"{name:<28} {r['n']:>4} {r['agreement']:>7.1%} {r['false_positive']:>4} "
                f"{r['false_negative']:>4} {r['not_ok']:>7}")

    typer.echo(f"{'verifier / category':<28} {'n':>4} {'agree':>7} {'FP':>4} {'FN':>4} {'not ok':>7}")
    for task, r in report.items():
        typer.echo(row(task, r))
        cats = r.get("categories", {})
        if len(cats) > 1 or "-" not in cats:
            for cat, c in cats.items():
                typer.echo(row(f"  {cat}", c))
        for d in r["disagreements"]:
            typer.echo(f"    line {d['line']}: {d['kind']}: {d.get('note') or ''} — {d['reason'][:90]}")
    typer.echo(row("total", totals(report)))
    if out:
        out.write_text(json.dumps(report, indent=2))
        typer.echo(f"report: {out}")
