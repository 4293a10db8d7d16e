"""What every command module shares: the root Typer app, the CONFIG argument and ``--set`` option, loading a
config with its problems as exit 2, and a user's mistake as one line and an exit code instead of a traceback."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from rlpipe.config import ConfigError, RunConfig, load_config

app = typer.Typer(help="LLM reinforcement learning as Prefect flows.", no_args_is_help=True, add_completion=False)

SetOpt = Annotated[Optional[list[str]], typer.Option("--set", "-s", help="Override: dotted.key=value (repeatable).")]
ConfigArg = Annotated[Optional[Path], typer.Argument(help="Run config YAML (default: the embedded defaults).")]

# What a mistyped model name, a missing folder or a bad argument raises inside the library.
USER_ERRORS: tuple[type[Exception], ...] = (LookupError, FileNotFoundError, ValueError)


@contextlib.contextmanager
def refused(prefix: str | None, errors: tuple[type[Exception], ...] = USER_ERRORS, code: int = 2):
    """One of ``errors`` raised inside: printed as one line (``prefix: message``, or the message alone when
    ``prefix`` is None) with exit ``code``, not a traceback."""
    try:
        yield
    except errors as e:
        typer.echo(f"{prefix}: {e}" if prefix else str(e), err=True)
        raise typer.Exit(code) from None


def load(path: Path | None, overrides: list[str] | None) -> RunConfig:
    """The validated config; every problem with its YAML path and exit 2 otherwise."""
    with refused(None, (ConfigError,)):
        return load_config(path, overrides)


def prefect_env() -> None:
    """Settings for the ephemeral Prefect API a flow started from the command line uses."""
    # The ephemeral API's first start on a fresh PREFECT_HOME can outlast Prefect's 20 s default.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def read_summary(path: str | Path) -> dict:
    """A flow's summary.json, with its own path under ``_path``."""
    return json.loads(Path(path).read_text()) | {"_path": path}


def version_text(reg: dict | None) -> str:
    """``NAME vN (aliases)``, or why there is none."""
    if not reg:
        return "not registered (tracking.register_models is false)"
    return f"{reg['name']} v{reg['version']}" + (f" ({', '.join(reg['aliases'])})" if reg.get("aliases") else "")
