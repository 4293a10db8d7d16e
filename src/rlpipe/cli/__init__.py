"""`rlpipe …`: the command line.

Every command that takes a config also takes ``--set dotted.key=value`` (repeatable), validated
like the file. Commands that run something print the path of the run's summary.json last.

One module per command group: ``common`` (the root app, shared options, errors as exit codes),
``config_cmds``, ``data_cmds``, ``model_cmds`` (plan, export, standin), ``run_cmds`` (run, sft,
rm-train), ``rollback_cmd``, ``ops_cmds`` (doctor, gc, audit, up/status/down, automations), ``eval_cmds`` (evaluate, report,
verifier audit), ``lineage_cmds`` (rescore, lineage), ``serve_cmds`` and ``demo``. The top-level commands are registered below, in the
order ``rlpipe --help`` lists them.
"""

from __future__ import annotations

import os
import sys

from rlpipe.cli import demo as _demo
from rlpipe.cli import eval_cmds, lineage_cmds, model_cmds, ops_cmds, rollback_cmd, run_cmds
from rlpipe.cli.common import app
from rlpipe.cli.config_cmds import config_app
from rlpipe.cli.data_cmds import data_app
from rlpipe.cli.demo import AGENT_DEMO, RLHF_DEMO
from rlpipe.cli.eval_cmds import verifier_app
from rlpipe.cli.ops_cmds import automations_app
from rlpipe.cli.serve_cmds import serve_app
from rlpipe.sandbox.cli import sandbox_app  # typer app only; the sandbox does nothing on import

__all__ = ["AGENT_DEMO", "RLHF_DEMO", "app", "main"]

for _name, _command in (
    ("plan", model_cmds.plan_cmd), ("export", model_cmds.export_cmd), ("standin", model_cmds.standin_cmd),
    ("run", run_cmds.run_cmd), ("rollback", rollback_cmd.rollback_cmd),
    ("doctor", ops_cmds.doctor_cmd), ("gc", ops_cmds.gc_cmd), ("audit", ops_cmds.audit_cmd),
    ("up", ops_cmds.up_cmd), ("status", ops_cmds.status_cmd), ("down", ops_cmds.down_cmd),
    ("rm-train", run_cmds.rm_train_cmd), ("sft", run_cmds.sft_cmd),
    ("evaluate", eval_cmds.evaluate_cmd), ("report", eval_cmds.report_cmd),
    ("rescore", lineage_cmds.rescore_cmd), ("lineage", lineage_cmds.lineage_cmd),
    ("demo", _demo.demo),
):
    app.command(_name)(_command)

app.add_typer(config_app, name="config")
app.add_typer(data_app, name="data")
app.add_typer(serve_app, name="serve")
app.add_typer(verifier_app, name="verifier")
app.add_typer(sandbox_app, name="sandbox", help="Run untrusted Python in the sandbox.")
app.add_typer(automations_app, name="automations")


def main() -> None:
    """The ``rlpipe`` console script."""
    # Per-shard progress bars of save_pretrained are noise in flow logs.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
