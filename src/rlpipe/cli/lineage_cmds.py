"""Looking back at a run: ``rlpipe rescore`` (its stored trajectories re-scored by another verifier version, into
a stage of their own) and ``rlpipe lineage`` (where a model version came from)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from rlpipe.cli.common import refused
from rlpipe.config import settings

StoreOpt = Annotated[Optional[str], typer.Option("--store", help="Object store URI (default: RLPIPE_STORAGE_URI).")]


def rescore_cmd(
    run: Annotated[str, typer.Argument(help="The run id whose trajectories to re-score.")],
    verifier: Annotated[str, typer.Option("--verifier", help="NAME or NAME@VERSION (the registered version must match).")],
    iterations: Annotated[Optional[str], typer.Option("--iterations", help="A:B (inclusive), A:, :B or K; default all.")] = None,
    plugin: Annotated[Optional[list[str]], typer.Option("--plugin", help="Module registering the verifier (repeatable); "
                                                        "replaces the run's reward.plugins.")] = None,
    force_new: Annotated[bool, typer.Option("--force-new", help="When the stage exists, write a numbered new one.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    store_uri: StoreOpt = None,
) -> None:
    """Re-score RUN's stored trajectories with VERIFIER into a new stage ``rescore-<name>-<version>`` beside each
    iteration's ``verify`` (never overwriting it), through the run's verifier pool and sandbox; report the changed
    verdicts and how the mean reward and the advantages would move (also written as JSON to the store)."""
    import contextlib
    import importlib

    from rlpipe.lineage import dataset_prefix_of
    from rlpipe.rescore import (RescoreError, check_verifier, format_report, parse_verifier, report_json, rescore_run,
                                run_config)
    from rlpipe.runs import RunFolder
    from rlpipe.runtime.assembly import ground_truths, prompt_rows, verifier_pool
    from rlpipe.storage import open_store

    s = settings()
    with refused("rlpipe rescore", (RescoreError, LookupError, FileNotFoundError, ValueError, ImportError)):
        store = open_store(store_uri, s)
        config, progress = run_config(store, RunFolder.of(s, run), run)
        if plugin:
            config = config.model_copy(update={"reward": config.reward.model_copy(update={"plugins": list(plugin)})})
        for mod in config.reward.plugins:
            importlib.import_module(mod)
        name, version = parse_verifier(verifier)
        check_verifier(name, version)
        prefix = progress.dataset_version and dataset_prefix_of(store, progress.dataset_version)
        if not prefix:
            raise RescoreError(f"run {run!r}: its dataset (version {progress.dataset_version}) is not in {store.uri}")
        truth = ground_truths(prompt_rows(store, {"prefix": prefix}))
        with contextlib.closing(verifier_pool(config, s)) as pool:
            report = rescore_run(store, config, run, pool, truth, name, version, iterations, force_new)
    typer.echo(report_json(report) if as_json else format_report(report))


def lineage_cmd(
    model_version: Annotated[str, typer.Argument(help="NAME/VERSION, models:/NAME/VERSION or models:/NAME@ALIAS.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the chain as JSON.")] = False,
    store_uri: StoreOpt = None,
) -> None:
    """Print where MODEL_VERSION came from: version → run → iterations → trajectory objects → verifier and
    reward-model versions → dataset version → base model, following parent_version back."""
    from rlpipe.lineage import format_lineage, lineage, lineage_json
    from rlpipe.storage import open_store
    from rlpipe.tracking.mlflow_utils import Tracker

    s = settings()
    with refused("rlpipe lineage"):
        info = lineage(Tracker(s, None), open_store(store_uri, s), model_version)
    typer.echo(lineage_json(info) if as_json else format_lineage(info))
