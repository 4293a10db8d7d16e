"""``rlpipe config validate | show | schema``: check and inspect run configs."""

from __future__ import annotations

import json
from pathlib import Path

import typer
import yaml

from rlpipe.cli.common import ConfigArg, SetOpt, load
from rlpipe.config import RunConfig

config_app = typer.Typer(help="Check and inspect run configs.", no_args_is_help=True)


@config_app.command("validate")
def config_validate(file: Path, set_: SetOpt = None) -> None:
    """Print every problem of a config with its YAML path (exit 2), or its fingerprint."""
    cfg = load(file, set_)
    typer.echo(f"{file}: ok (fingerprint {cfg.fingerprint()})")


@config_app.command("show")
def config_show(file: ConfigArg = None, set_: SetOpt = None) -> None:
    """Print the validated config with every default filled in."""
    cfg = load(file, set_)
    typer.echo(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), nl=False)
    typer.echo(f"# fingerprint: {cfg.fingerprint()}")


@config_app.command("schema")
def config_schema() -> None:
    """JSON schema of the run config (every field documented)."""
    typer.echo(json.dumps(RunConfig.model_json_schema(), indent=2))
