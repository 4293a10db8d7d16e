"""``rlpipe sandbox …``: run a Python file in the sandbox from the command line.

Mount with ``app.add_typer(sandbox_app, name="sandbox")``. ``run`` prints exactly one JSON object
(status, exit_code, stdout, stderr, wall_s, cpu_s, isolation, truncated) and exits 0 whenever the
sandbox ran, whatever the program did; 2 when the sandbox could not be set up in strict mode
(``RLPIPE_SANDBOX_STRICT=1``). ``report`` prints what isolation this machine offers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

sandbox_app = typer.Typer(help="Run untrusted Python in the sandbox.", no_args_is_help=True, add_completion=False)


@sandbox_app.command("run")
def run(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, readable=True, help="The program (runs as main.py).")],
    stdin: Annotated[Optional[Path], typer.Option("--stdin", exists=True, dir_okay=False, readable=True,
                                                  help="File fed to the program's standard input.")] = None,
    timeout: Annotated[float, typer.Option("--timeout", min=0.01, help="Wall-clock limit in seconds (the CPU limit too).")] = 10.0,
    memory_mb: Annotated[int, typer.Option("--memory-mb", min=32, help="Address-space and cgroup memory limit.")] = 256,
) -> None:
    """Run FILE in the sandbox and print the result as one JSON object."""
    from rlpipe.sandbox import SandboxLimits, SandboxUnavailableError, run_python

    limits = SandboxLimits(wall_s=timeout, cpu_s=timeout, memory_mb=memory_mb)
    code = file.read_text(encoding="utf-8", errors="surrogateescape")
    data = stdin.read_text(encoding="utf-8", errors="surrogateescape") if stdin else ""
    try:
        result = run_python(code, stdin=data, limits=limits)
    except SandboxUnavailableError as e:
        typer.echo(json.dumps({"status": "unavailable", "error": str(e)}), err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(result.to_dict()))


@sandbox_app.command("report")
def report() -> None:
    """Print which isolation components this machine offers and the level runs will use."""
    from rlpipe.sandbox import isolation_report

    typer.echo(json.dumps(isolation_report(), indent=2))
