"""Operating rlpipe: ``rlpipe doctor`` (check every component a config uses), ``gc`` (apply retention), ``audit``
(who changed shared state, and when), ``up | status | down`` (the local stack) and ``automations install``
(Prefect automations on rlpipe's alerts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from rlpipe.cli.common import ConfigArg, SetOpt, load, prefect_env, refused
from rlpipe.config import settings

automations_app = typer.Typer(help="Prefect automations that act on rlpipe's alerts and heal failed runs.",
                              no_args_is_help=True)


def doctor_cmd(
    config: ConfigArg = None, set_: SetOpt = None,
    engine: Annotated[bool, typer.Option(help="Start the rollout engine and generate a few tokens (the slow check).")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON list of the checks instead of lines.")] = False,
    timeout_s: Annotated[float, typer.Option(help="Seconds each check may take before it counts as failed.")] = 120.0,
) -> None:
    """Check every component CONFIG uses (object store, MLflow tracking and registry, Prefect API, rollout
    engine, verifier/reward-model/environment services, sandbox, DeepSpeed, GPU): one line each, with the
    fix on failure. Exits 1 when any check fails."""
    from rlpipe.doctor import format_check, run_checks

    cfg = load(config, set_)
    checks = run_checks(cfg, settings(), engine=engine, timeout_s=timeout_s,
                        progress=None if as_json else (lambda c: typer.echo(format_check(c))))
    failed = [c.component for c in checks if c.status == "fail"]
    if as_json:
        typer.echo(json.dumps([c.as_dict() for c in checks], indent=1))
    else:
        typer.echo(f"{len(failed)} of {len(checks)} failed: {', '.join(failed)}" if failed
                   else f"all {len(checks)} checks passed or skipped")
    raise typer.Exit(1 if failed else 0)


def gc_cmd(
    config: ConfigArg = None, set_: SetOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would go; delete nothing.")] = False,
) -> None:
    """Apply CONFIG's retention (retention.keep_checkpoints, retention.trajectory_days) to the object store and
    the model registry. Never deletes a checkpoint a registry alias points to, a run's resume point, a model
    version a run's config names, or the trajectories of an unfinished iteration."""
    from rlpipe.audit import AuditError
    from rlpipe.retention import apply, plan
    from rlpipe.storage import open_store
    from rlpipe.tracking.mlflow_utils import Tracker

    cfg = load(config, set_)
    if cfg.retention.keep_checkpoints is None and cfg.retention.trajectory_days is None:
        typer.echo("rlpipe gc: nothing to do: retention.keep_checkpoints and retention.trajectory_days are both "
                   "null (keep everything); set them in the config or with --set", err=True)
        raise typer.Exit(2)
    s = settings()
    store, client = open_store(s.resolve_storage_uri(cfg), s), Tracker(s, cfg).client
    p = plan(cfg.retention, store, client)
    for line in p.lines("would" if dry_run else "delete"):
        typer.echo(line)
    if not dry_run:
        prefect_env()
        from tasks.audit import audit_log

        with refused("rlpipe gc", (AuditError,), code=1):
            apply(p, store, client, audit_log(store, s))
    n = {k: sum(i.kind == k for i in p.delete) for k in ("checkpoint", "trajectories", "model-version")}
    typer.echo(f"{'would free' if dry_run else 'freed'} {p.freed_bytes() / 2**20:.1f} MiB in {store.url('')}: "
               f"{n['checkpoint']} checkpoint(s), {n['trajectories']} iteration(s) of trajectories, "
               f"{n['model-version']} registry version(s){' (dry run: nothing deleted)' if dry_run else ''}")


def audit_cmd(
    config: ConfigArg = None, set_: SetOpt = None,
    since: Annotated[Optional[str], typer.Option(help="Only records from then on: a duration back (90m, 12h, 7d, 2w) "
                                                      "or a UTC date/time (2026-12-01, 2026-12-01T09:30).")] = None,
    action: Annotated[Optional[str], typer.Option(help="Only this action, or actions under it (alias: alias.move "
                                                       "and alias.promote).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON record a line instead of the table.")] = False,
) -> None:
    """The audit trail in CONFIG's object store: who (identity, user@host) changed what shared state (alias
    moves and promotions, gc deletions, resumes with a config change, cancels, automations) and when, oldest first."""
    from rlpipe.audit import AuditLog, parse_since
    from rlpipe.storage import open_store

    cfg = load(config, set_)
    with refused("rlpipe audit", (ValueError,)):
        when = parse_since(since) if since else None
        s = settings()
        records = AuditLog(open_store(s.resolve_storage_uri(cfg), s), actor={}).read(when, action)
    for rec in records:
        typer.echo(rec.line() if as_json else audit_row(rec))
    if not as_json:
        typer.echo(f"{len(records)} record(s)" + (f" since {when:%Y-%m-%d %H:%M:%S} UTC" if when else ""), err=True)


def audit_row(rec) -> str:
    """One record as a line: time, action, status, who, what, how."""
    who = f"{rec.who.get('identity', '?')} ({rec.who.get('user', '?')}@{rec.who.get('host', '?')})"
    what = " ".join(f"{k}={_brief(v)}" for k, v in rec.target.items() if v not in ("", None, []))
    how = " ".join(f"{k}={_brief(v)}" for k, v in rec.details.items() if k != "reasons")
    status = rec.status if rec.ref is None else f"{rec.status} (of {rec.ref[:8]})"
    return f"{rec.time[:19]}Z  {rec.action:20s} {status:8s} {who}  {what}  {how}"


def _brief(v) -> str:
    if isinstance(v, list):
        return f"[{len(v)}: {', '.join(map(str, v[:3]))}{', …' if len(v) > 3 else ''}]"
    return str(v)


def up_cmd(
    config: ConfigArg = None, set_: SetOpt = None,
    rollout_replicas: Annotated[int, typer.Option(help="Rollout services to start for task.policy_model (RLPIPE_ROLLOUT_URL).")] = 0,
    trainer_ranks: Annotated[int, typer.Option(help="Start the trainer service with this many ranks (RLPIPE_TRAINER_URL); 0: none.")] = 0,
    timeout_s: Annotated[float, typer.Option(help="Seconds each group of components may take to become healthy.")] = 180.0,
) -> None:
    """Start the local stack in the background (S3, MLflow server, Prefect server and worker, the services
    CONFIG needs), each health-checked; logs, pids and env.sh in $RLPIPE_HOME/stack/."""
    from rlpipe.stack import StackError, up

    cfg = load(config, set_)
    with refused("rlpipe up", (StackError,), code=1):
        stack = up(cfg, settings(), rollout_replicas=rollout_replicas, trainer_ranks=trainer_ranks, timeout_s=timeout_s)
    for c in stack["components"]:
        typer.echo(f"up    {c['name']:14s} pid {c['pid']:<7d} {c['url']}")
    typer.echo(f"point runs at it: source {stack['dir']}/env.sh")


def status_cmd(as_json: Annotated[bool, typer.Option("--json", help="One JSON list instead of lines.")] = False) -> None:
    """Every component `rlpipe up` started, with its URL and health; exit 1 when any is down."""
    from rlpipe.stack import StackError, status

    with refused("rlpipe status", (StackError,)):
        rows = status(settings())
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
    for r in [] if as_json else rows:
        state = "ok  " if r["healthy"] else ("DOWN" if not r["alive"] else "SICK")
        typer.echo(f"{state}  {r['name']:14s} pid {r['pid']:<7d} {r['url']}  (log {r['log']})")
    raise typer.Exit(0 if all(r["healthy"] for r in rows) else 1)


def down_cmd() -> None:
    """Stop exactly what `rlpipe up` started (by the PIDs it recorded)."""
    from rlpipe.stack import StackError, down

    with refused("rlpipe down", (StackError,)):
        stopped = down(settings())
    typer.echo(f"stopped {len(stopped)}: {', '.join(stopped) or 'nothing was running'}")


@automations_app.command("install")
def automations_install(
    file: Annotated[Optional[Path], typer.Option(help="Automations YAML (default: infra/prefect/automations.yaml).")] = None,
) -> None:
    """Create or update, by name, the Prefect automations that act on rlpipe's alerts (cancel a run on a
    critical alert; pause its deployment) and heal failed runs (relaunch; needs the heal deployment) on the Prefect
    API in PREFECT_API_URL. Safe to repeat."""
    prefect_env()
    from rlpipe.audit import AuditError
    from tasks.alerts import AUTOMATIONS_FILE, install_automations
    from tasks.audit import audit_log

    with refused("rlpipe automations install", (OSError, ValueError, AuditError)):
        done = install_automations(file or AUTOMATIONS_FILE, audit_log())
    for name, what in done:
        if what.startswith("skipped: "):  # a deployment it names is not there yet: on stderr, with the fix
            typer.echo(f"skipped  {name}: {what.removeprefix('skipped: ')}", err=True)
        else:
            typer.echo(f"{what:8s} {name}")
