"""``rlpipe run | sft | rm-train``: start or resume a training flow and print where its summary is; the flow
runners the demo reuses."""

from __future__ import annotations

import contextlib
import os
from typing import Annotated, Optional

import typer

from rlpipe.cli.common import ConfigArg, SetOpt, load, prefect_env, read_summary, refused, version_text
from rlpipe.config import RunConfig, settings


def run_sft(cfg: RunConfig, run_id: str | None) -> dict:
    """The SFT flow; its summary (``_path``: where it is)."""
    prefect_env()
    from flows.sft import sft

    return read_summary(sft(config=cfg, run_id=run_id))


def run_rl(cfg: RunConfig, run_id: str | None, allow_config_change: bool = False) -> dict:
    """The RL training flow; its summary (``_path``: where it is)."""
    prefect_env()
    from flows.train import train

    return read_summary(train(config=cfg, run_id=run_id or "", allow_config_change=allow_config_change))


def run_rm(cfg: RunConfig, run_id: str | None) -> dict:
    """The reward-model training flow; its summary (``_path``: where it is)."""
    prefect_env()
    from flows.reward_model import rm_train

    return read_summary(rm_train(config=cfg, run_id=run_id or ""))


def run_cmd(
    config: ConfigArg = None, set_: SetOpt = None,
    run_id: Annotated[Optional[str], typer.Option(help="Start or resume this run.")] = None,
    allow_config_change: Annotated[bool, typer.Option(help="Resume even though the config or dataset changed (recorded in MLflow).")] = False,
    nproc: Annotated[int, typer.Option(help="Train with this many DeepSpeed ranks: the trainer service on this machine for the run's length (0: in this process).")] = 0,
) -> None:
    """RL training (one Prefect flow run per iteration); the same --run-id resumes (from the object store when
    this machine has no state). Prints summary.json's path last."""
    from prefect.exceptions import CancelledRun

    from rlpipe.doctor import PreflightError
    from rlpipe.resume import ResumeRefused
    from rlpipe.rewards.guards import RewardCircuitOpen, SandboxFloorError
    from rlpipe.guards import NonFiniteUpdate

    cfg = load(config, set_)
    try:
        with _ranks(cfg, nproc):
            summary = run_rl(cfg, run_id, allow_config_change)
    except ResumeRefused as e:
        typer.echo(f"rlpipe run refused to resume {run_id}: {e}", err=True)
        raise typer.Exit(4) from None
    except (RewardCircuitOpen, SandboxFloorError, NonFiniteUpdate, PreflightError) as e:  # a guard tripped: say why
        typer.echo(f"rlpipe run stopped: {e}", err=True)
        raise typer.Exit(3) from None
    except CancelledRun as e:  # an automation acting on a critical alert, or a person in the UI
        typer.echo(f"rlpipe run: {e}", err=True)
        raise typer.Exit(5) from None
    print_rl(summary)
    typer.echo(summary["_path"])


@contextlib.contextmanager
def _ranks(cfg: RunConfig, nproc: int):
    """``--nproc N``: a trainer service of N ranks on loopback for this run (RLPIPE_TRAINER_URL while it lasts)."""
    if nproc <= 0:
        yield
        return
    from rlpipe.services.trainer import local_trainer

    s = settings().for_run(cfg)
    if s.trainer_url:
        typer.echo(f"rlpipe run: --nproc and a trainer service ({s.trainer_url}) exclude each other", err=True)
        raise typer.Exit(2)
    home = (s.home / "trainer-service").resolve()
    typer.echo(f"starting the trainer service with {nproc} rank(s) (log {home / 'trainer.log'})", err=True)
    with contextlib.ExitStack() as stack:
        with refused("rlpipe run", (RuntimeError,)):
            url, token = stack.enter_context(local_trainer(nproc, home, s.resolve_storage_uri(cfg)))
        saved = {k: os.environ.get(k) for k in ("RLPIPE_TRAINER_URL", "RLPIPE_TRAINER_TOKEN")}
        os.environ.update({"RLPIPE_TRAINER_URL": url, "RLPIPE_TRAINER_TOKEN": token})
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def print_rl(summary: dict) -> None:
    """An RL run's summary as the lines `rlpipe run` and the demos print."""
    base, final = summary.get("heldout_accuracy_base"), summary.get("heldout_accuracy_final")
    typer.echo(f"\nrlpipe run {summary['run_id']} — {summary['algorithm']}, {summary['iterations_done']} iterations, {summary['wall_s']:.0f} s")
    typer.echo(f"  held-out accuracy   base {base:.1%}  →  final {final:.1%}   ({(final - base) * 100:+.1f} points, n={summary['heldout_n']})")
    st = summary["stage_seconds"]
    typer.echo("  seconds by stage    " + ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in st.items()))
    typer.echo(f"  per iteration       {summary['iteration_seconds_mean']:.2f} s; outside generate/verify/update: {summary['overhead_share']:.0%}")
    typer.echo(f"  reward curve        {summary['reward_curve_png']}")
    fired = summary.get("alerts_fired") or {}
    typer.echo("  alerts              " + (", ".join(f"{k} ×{n}" for k, n in fired.items()) if fired else "none"))
    typer.echo(f"  report              {summary.get('report_html') or 'not built (see the log)'}")


def rm_train_cmd(config: ConfigArg = None, set_: SetOpt = None, run_id: Annotated[Optional[str], typer.Option()] = None) -> None:
    """Train a reward model on preference pairs (Bradley–Terry); registers it as `<task>-rm` (`best` follows
    validation pair accuracy). Prints summary.json's path last."""
    from tasks.reward_model import PreferencesInvalid

    cfg = load(config, set_)
    with refused("rlpipe rm-train", (PreferencesInvalid,)):
        summary = run_rm(cfg, run_id)
    typer.echo(f"reward model {version_text(summary['registered_model'])}: "
               f"pair accuracy validation {summary['rm_validation_pair_accuracy']:.3f}, test {summary['rm_pair_accuracy']:.3f} "
               f"(n={summary['rm_test_pairs']}), {summary['rm_steps']} steps")
    typer.echo(summary["_path"])


def sft_cmd(config: ConfigArg = None, set_: SetOpt = None, run_id: Annotated[Optional[str], typer.Option()] = None,
            nproc: Annotated[Optional[int], typer.Option(help="Data-parallel DeepSpeed ranks (sets sft.nproc).")] = None) -> None:
    """Supervised warm-up of the policy; registers it as `base`. Prints summary.json's path last."""
    cfg = load(config, (set_ or []) + ([f"sft.nproc={nproc}"] if nproc is not None else []))
    summary = run_sft(cfg, run_id)
    typer.echo(summary["_path"])
