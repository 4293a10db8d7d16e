"""``rlpipe data build | import | validate``: build, convert and check prompt and preference tables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from rlpipe.cli.common import SetOpt, load, refused

data_app = typer.Typer(help="Build and validate prompt datasets.", no_args_is_help=True)


@data_app.command("build")
def data_build(
    out: Annotated[Path, typer.Option(help="Where to write the prompt table (.parquet or .jsonl).")],
    config: Annotated[Optional[Path], typer.Option(help="Run config whose `data` section to use.")] = None,
    set_: SetOpt = None,
) -> None:
    """Build the synthetic arithmetic prompt set and print its version."""
    import pyarrow.parquet as pq

    from rlpipe.data import build_arithmetic, dataset_version

    cfg = load(config, set_)
    table = build_arithmetic(cfg.data)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".parquet":
        pq.write_table(table, out)
    elif out.suffix == ".jsonl":
        with out.open("w") as f:
            for row in table.to_pylist():
                f.write(json.dumps(row) + "\n")
    else:
        typer.echo(f"{out}: use a .parquet or .jsonl file name", err=True)
        raise typer.Exit(2)
    splits = table.column("split").to_pylist()
    typer.echo(f"{out}: {table.num_rows} rows ({splits.count('train')} train, {splits.count('test')} test)")
    typer.echo(f"version {dataset_version(table)}")


@data_app.command("import")
def data_import(
    format_: Annotated[str, typer.Argument(metavar="FORMAT", help="gsm8k, math, humaneval, mbpp, apps, codecontests, ultrafeedback or hh-rlhf.")],
    src: Annotated[str, typer.Argument(metavar="SRC", help="A .jsonl, .jsonl.gz, .json or .parquet file, a folder, or a hub dataset name (needs `datasets`).")],
    out: Annotated[Path, typer.Option(help="Where to write the table (.jsonl or .parquet).")],
    split: Annotated[Optional[str], typer.Option(help="The rows' split (train/test/validation; a hub split name such as test_prefs is read too). Default: from the file name.")] = None,
    limit: Annotated[Optional[int], typer.Option(help="Import the first N rows only.")] = None,
) -> None:
    """Convert a published dataset, rows as distributed, into a prompt or preference table; validate it and
    print its version. Exit 1 if validation finds problems (the file is written), 2 if a row cannot be converted."""
    from rlpipe.data.importers import DataImportError, import_dataset

    with refused(None, (DataImportError,)):
        result = import_dataset(format_, src, out, split=split, limit=limit)
    for f in result.findings:
        typer.echo(str(f))
    splits = ", ".join(f"{n} {s}" for s, n in sorted(result.splits.items()))
    what = "preference pairs" if result.kind == "preferences" else "rows"
    typer.echo(f"{out}: {result.rows} {what} written ({splits}), {len(result.findings)} finding(s)")
    typer.echo(f"version {result.version}")
    if result.findings:
        raise typer.Exit(1)


@data_app.command("validate")
def data_validate(
    file: Path,
    as_json: Annotated[bool, typer.Option("--json", help="Print findings as JSON lines.")] = False,
    plugin: Annotated[Optional[list[str]], typer.Option(help="Module registering extra verifiers the rows name (repeatable).")] = None,
    redact: Annotated[Optional[Path], typer.Option("--redact", metavar="OUT", help="Also write a de-identified copy of FILE (same format) with each personal datum or secret replaced by a typed placeholder such as [EMAIL].")] = None,
) -> None:
    """Check a prompt file (JSONL/Parquet): shape, splits, each reference by its verifier, answers given
    away in the prompt, personal data and secrets (looked for in preference files and trajectory Parquet files
    too). Every finding names its row and the fix. Exit 1 if any."""
    import importlib

    from rlpipe.data import PromptFileError, dataset_version, load_prompts, validate_prompts

    for module in plugin or ():
        try:
            importlib.import_module(module)
        except ImportError as e:
            typer.echo(f"--plugin {module}: cannot import it ({e}); give an importable module name", err=True)
            raise typer.Exit(2) from None
    from rlpipe.data.pii_files import is_trajectory_file, pii_findings
    from rlpipe.data.preferences import is_preference_file

    _check_redact_target(file, redact)
    if file.exists() and file.suffix == ".parquet" and is_trajectory_file(file):
        _validate_trajectories(file, as_json, redact)
        return
    if file.exists() and is_preference_file(file):
        _validate_preferences(file, as_json, redact)
        return
    with refused(None, (PromptFileError,)):
        table = load_prompts(file)
    findings = validate_prompts(table) + pii_findings(table)
    _write_redacted(file, redact, as_json)
    _print_findings(file, findings, f"{table.num_rows} rows", dataset_version(table), as_json)


def _validate_preferences(file: Path, as_json: bool, redact: Path | None) -> None:
    """Preference pairs (rows with chosen/rejected): every finding names the row; exit 1 if any."""
    from rlpipe.data.pii_files import pii_findings
    from rlpipe.data.preferences import PreferenceFileError, load_preferences, preference_version

    with refused(None, (PreferenceFileError,)):
        table, findings = load_preferences(file)
    _write_redacted(file, redact, as_json)
    _print_findings(file, findings + pii_findings(table), f"{table.num_rows} preference pairs", preference_version(table), as_json)


def _validate_trajectories(file: Path, as_json: bool, redact: Path | None) -> None:
    """A trajectory Parquet file (a rollout or verify stage's part): personal data and secrets in its text
    (response, reward reason, agent steps), each finding naming the row as ``prompt_id#sample_index``."""
    import hashlib

    import pyarrow.parquet as pq

    from rlpipe.data.pii_files import pii_findings

    table = pq.read_table(file)
    _write_redacted(file, redact, as_json)
    version = hashlib.sha256(file.read_bytes()).hexdigest()
    _print_findings(file, pii_findings(table), f"{table.num_rows} trajectory rows", version, as_json)


def _check_redact_target(file: Path, out: Path | None) -> None:
    """--redact OUT: a new file of the same format, never FILE itself."""
    if out is None:
        return
    if out.resolve() == file.resolve():
        typer.echo(f"--redact {out}: that is the file being validated; give another path", err=True)
        raise typer.Exit(2)
    if out.suffix != file.suffix:
        typer.echo(f"--redact {out}: the copy keeps the format of {file.name}; name it *{file.suffix}", err=True)
        raise typer.Exit(2)


def _write_redacted(file: Path, out: Path | None, as_json: bool) -> None:
    from rlpipe.data.pii_files import redact_file

    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    replaced = redact_file(file, out)
    typer.echo(f"{out}: de-identified copy written, {replaced} value(s) replaced", err=as_json)


def _print_findings(file: Path, findings: list, rows: str, version: str, as_json: bool) -> None:
    """Each finding (a JSON line with --json), then the file's line (on stderr with --json, so stdout stays
    JSON lines); exit 1 if there is any finding."""
    for f in findings:
        typer.echo(json.dumps(f.to_dict()) if as_json else str(f))
    status = f"{len(findings)} finding(s)" if findings else "ok"
    typer.echo(f"{file}: {rows}, {status}; version {version}", err=as_json)
    if findings:
        raise typer.Exit(1)
