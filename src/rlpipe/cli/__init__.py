"""`rlpipe …`: the command line.

Every command that takes a config also takes ``--set dotted.key=value`` (repeatable), validated
like the file. Commands that run something print the path of the run's summary.json last.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
import yaml

from rlpipe.config import ConfigError, RunConfig, load_config, settings

app = typer.Typer(help="LLM reinforcement learning as Prefect flows.", no_args_is_help=True, add_completion=False)
config_app = typer.Typer(help="Check and inspect run configs.", no_args_is_help=True)
data_app = typer.Typer(help="Build and validate prompt datasets.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(data_app, name="data")
serve_app = typer.Typer(help="Run rlpipe's services.", no_args_is_help=True)
app.add_typer(serve_app, name="serve")
verifier_app = typer.Typer(help="Check verifiers against labelled cases.", no_args_is_help=True)
app.add_typer(verifier_app, name="verifier")
from rlpipe.sandbox.cli import sandbox_app  # noqa: E402 - typer app only; the sandbox does nothing on import

app.add_typer(sandbox_app, name="sandbox", help="Run untrusted Python in the sandbox.")
automations_app = typer.Typer(help="Prefect automations that act on rlpipe's alerts.", no_args_is_help=True)
app.add_typer(automations_app, name="automations")

SetOpt = Annotated[Optional[list[str]], typer.Option("--set", "-s", help="Override: dotted.key=value (repeatable).")]
ConfigArg = Annotated[Optional[Path], typer.Argument(help="Run config YAML (default: the embedded defaults).")]


def _load(path: Path | None, overrides: list[str] | None) -> RunConfig:
    try:
        return load_config(path, overrides)
    except ConfigError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(2) from None


def _prefect_env() -> None:
    # The ephemeral API's first start on a fresh PREFECT_HOME takes ~22 s, over Prefect's 20 s default.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@config_app.command("validate")
def config_validate(file: Path, set_: SetOpt = None) -> None:
    """Print every problem of a config with its YAML path (exit 2), or its fingerprint."""
    cfg = _load(file, set_)
    typer.echo(f"{file}: ok (fingerprint {cfg.fingerprint()})")


@config_app.command("show")
def config_show(file: ConfigArg = None, set_: SetOpt = None) -> None:
    """Print the validated config with every default filled in."""
    cfg = _load(file, set_)
    typer.echo(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), nl=False)
    typer.echo(f"# fingerprint: {cfg.fingerprint()}")


@config_app.command("schema")
def config_schema() -> None:
    """JSON schema of the run config (every field documented)."""
    typer.echo(json.dumps(RunConfig.model_json_schema(), indent=2))


@data_app.command("build")
def data_build(
    out: Annotated[Path, typer.Option(help="Where to write the prompt table (.parquet or .jsonl).")],
    config: Annotated[Optional[Path], typer.Option(help="Run config whose `data` section to use.")] = None,
    set_: SetOpt = None,
) -> None:
    """Build the synthetic arithmetic prompt set and print its version."""
    import pyarrow.parquet as pq

    from rlpipe.data import build_arithmetic, dataset_version

    cfg = _load(config, set_)
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

    try:
        result = import_dataset(format_, src, out, split=split, limit=limit)
    except DataImportError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(2) from None
    for f in result.findings:
        typer.echo(str(f))
    splits = ", ".join(f"{n} {s}" for s, n in sorted(result.splits.items()))
    what = "preference pairs" if result.kind == "preferences" else "rows"
    typer.echo(f"{out}: {result.rows} {what} written ({splits}), {len(result.findings)} finding(s)")
    typer.echo(f"version {result.version}")
    if result.findings:
        raise typer.Exit(1)


@app.command("plan")
def plan_cmd(
    config: ConfigArg = None,
    set_: SetOpt = None,
    gpu_mem: Annotated[Optional[float], typer.Option("--gpu-mem", help="GiB of one GPU: say whether it fits, and what to change if not.")] = None,
    nproc: Annotated[int, typer.Option(help="Trainer ranks (ZeRO splits by them).")] = 1,
    prompt_tokens: Annotated[int, typer.Option(help="The longest prompt, in tokens.")] = 64,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object instead of the table.")] = False,
) -> None:
    """Peak memory per component (policy, gradients, Adam moments, reference, critic, activations, the engine's
    weights and KV cache) for CONFIG's model, before anything is loaded; with --gpu-mem, whether it fits."""
    import tempfile

    from rlpipe.training.plan import format_plan, plan_memory

    cfg, s = _load(config, set_), settings()
    with tempfile.TemporaryDirectory() as tmp, _refused("plan"):
        plan = plan_memory(cfg, _plan_folder(cfg, s, Path(tmp)), gpu=gpu_mem is not None, world=nproc,
                           prompt_tokens=prompt_tokens, budget=int(gpu_mem * 2**30) if gpu_mem is not None else None)
    typer.echo(json.dumps(plan.to_dict(), indent=2) if as_json else format_plan(plan))
    if plan.fits is False:
        raise typer.Exit(1)


def _plan_folder(cfg: RunConfig, s: Any, tmp: Path) -> Path:
    """The policy's folder; for 'tiny', its config written to ``tmp`` (no weights are needed)."""
    from rlpipe.training.models import fetch_source, resolve_source

    if cfg.task.policy_model == "tiny":
        from rlpipe.training.tiny import build_char_tokenizer, build_tiny_model

        build_tiny_model(cfg.model, build_char_tokenizer()).config.save_pretrained(tmp)
        return tmp
    return fetch_source(resolve_source(cfg.task.policy_model, s, cfg), s)


@app.command("export")
def export_cmd(
    model: Annotated[str, typer.Argument(help="A registered version (models:/NAME@ALIAS, models:/NAME/VERSION) or a save point folder.")],
    out: Path,
    merge: Annotated[bool, typer.Option("--merge", help="A plain HF folder with the adapter merged into the base weights (LoRA runs); without it, the adapter alone.")] = False,
) -> None:
    """Write a model version as a Hugging Face folder: weights, config, tokenizer and generation config, without
    rlpipe's resumable state. A LoRA version: the adapter (peft's folder, naming its base) or, with --merge, the
    merged weights every LoRA save point holds for the engine."""
    from rlpipe.training.export import export_model
    from rlpipe.training.models import fetch_source, resolve_source

    s = settings()
    with _refused("export"):
        written = export_model(fetch_source(resolve_source(model, s), s), out, merge=merge)
    typer.echo(str(written))


@contextlib.contextmanager
def _refused(command: str):
    """A user's mistake (a model that is not there, a bad argument) as one line and exit 2, not a traceback."""
    try:
        yield
    except (LookupError, FileNotFoundError, ValueError) as e:
        typer.echo(f"{command}: {e}", err=True)
        raise typer.Exit(2) from None


@app.command("standin")
def standin_cmd(
    folder: Path,
    arch: Annotated[str, typer.Option(help="qwen2 | qwen3 (ChatML, EOS an int, tied, bf16) or llama | mistral "
                                           "(Llama-3 template, EOS a list, no pad token, untied, fp16).")] = "qwen2",
    hidden: Annotated[int, typer.Option(help="Hidden size (256: ~6M parameters; 768 with 12 layers: ~90M).")] = 256,
    layers: Annotated[int, typer.Option(help="Transformer blocks.")] = 6,
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """Write a small hub-style checkpoint (trained byte-level BPE tokenizer, chat template with a tool role,
    16-bit safetensors) to FOLDER: a stand-in for a hub model where none can be downloaded."""
    from rlpipe.training.standin import build_standin

    with _refused("standin"):
        out = build_standin(folder, arch, hidden=hidden, layers=layers, heads=max(hidden // 64, 1),
                            kv_heads=max(hidden // 128, 1), intermediate=hidden * 4, seed=seed)
    typer.echo(str(out))


@data_app.command("validate")
def data_validate(
    file: Path,
    as_json: Annotated[bool, typer.Option("--json", help="Print findings as JSON lines.")] = False,
    plugin: Annotated[Optional[list[str]], typer.Option(help="Module registering extra verifiers the rows name (repeatable).")] = None,
) -> None:
    """Check a prompt file (JSONL/Parquet): shape, splits, each reference by its verifier, answers given
    away in the prompt. Every finding names its row and the fix. Exit 1 if any."""
    import importlib

    from rlpipe.data import PromptFileError, dataset_version, load_prompts, validate_prompts

    for module in plugin or ():
        try:
            importlib.import_module(module)
        except ImportError as e:
            typer.echo(f"--plugin {module}: cannot import it ({e}); give an importable module name", err=True)
            raise typer.Exit(2) from None
    from rlpipe.data.preferences import is_preference_file

    if file.exists() and is_preference_file(file):
        _validate_preferences(file, as_json)
        return
    try:
        table = load_prompts(file)
    except PromptFileError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(2) from None
    findings = validate_prompts(table)
    for f in findings:
        typer.echo(json.dumps(f.to_dict()) if as_json else str(f))
    status = f"{len(findings)} finding(s)" if findings else "ok"
    typer.echo(f"{file}: {table.num_rows} rows, {status}; version {dataset_version(table)}", err=as_json)
    if findings:
        raise typer.Exit(1)


def _validate_preferences(file: Path, as_json: bool) -> None:
    """Preference pairs (rows with chosen/rejected): every finding names the row; exit 1 if any."""
    from rlpipe.data.preferences import PreferenceFileError, load_preferences, preference_version

    try:
        table, findings = load_preferences(file)
    except PreferenceFileError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(2) from None
    for f in findings:
        typer.echo(json.dumps(f.to_dict()) if as_json else str(f))
    status = f"{len(findings)} finding(s)" if findings else "ok"
    typer.echo(f"{file}: {table.num_rows} preference pairs, {status}; version {preference_version(table)}", err=as_json)
    if findings:
        raise typer.Exit(1)


def _run_sft(cfg: RunConfig, run_id: str | None) -> dict:
    _prefect_env()
    from flows.sft import sft

    path = sft(config=cfg, run_id=run_id)
    return json.loads(Path(path).read_text()) | {"_path": path}


def _run_rl(cfg: RunConfig, run_id: str | None, allow_config_change: bool = False) -> dict:
    _prefect_env()
    from flows.train import train

    path = train(config=cfg, run_id=run_id or "", allow_config_change=allow_config_change)
    return json.loads(Path(path).read_text()) | {"_path": path}


@app.command("run")
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
    from tasks.rl import NonFiniteUpdate

    cfg = _load(config, set_)
    try:
        with _ranks(cfg, nproc):
            summary = _run_rl(cfg, run_id, allow_config_change)
    except ResumeRefused as e:
        typer.echo(f"rlpipe run refused to resume {run_id}: {e}", err=True)
        raise typer.Exit(4) from None
    except (RewardCircuitOpen, SandboxFloorError, NonFiniteUpdate, PreflightError) as e:  # a guard tripped: say why
        typer.echo(f"rlpipe run stopped: {e}", err=True)
        raise typer.Exit(3) from None
    except CancelledRun as e:  # an automation acting on a critical alert, or a person in the UI
        typer.echo(f"rlpipe run: {e}", err=True)
        raise typer.Exit(5) from None
    _print_rl(summary)
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
        try:
            url, token = stack.enter_context(local_trainer(nproc, home, s.resolve_storage_uri(cfg)))
        except RuntimeError as e:
            typer.echo(f"rlpipe run: {e}", err=True)
            raise typer.Exit(2) from None
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


def _print_rl(summary: dict) -> None:
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


def _version_text(reg: dict | None) -> str:
    """``NAME vN (aliases)``, or why there is none."""
    if not reg:
        return "not registered (tracking.register_models is false)"
    return f"{reg['name']} v{reg['version']}" + (f" ({', '.join(reg['aliases'])})" if reg.get("aliases") else "")


def _run_rm(cfg: RunConfig, run_id: str | None) -> dict:
    _prefect_env()
    from flows.reward_model import rm_train

    path = rm_train(config=cfg, run_id=run_id or "")
    return json.loads(Path(path).read_text()) | {"_path": path}


@app.command("doctor")
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

    cfg = _load(config, set_)
    checks = run_checks(cfg, settings(), engine=engine, timeout_s=timeout_s,
                        progress=None if as_json else (lambda c: typer.echo(format_check(c))))
    failed = [c.component for c in checks if c.status == "fail"]
    if as_json:
        typer.echo(json.dumps([c.as_dict() for c in checks], indent=1))
    else:
        typer.echo(f"{len(failed)} of {len(checks)} failed: {', '.join(failed)}" if failed
                   else f"all {len(checks)} checks passed or skipped")
    raise typer.Exit(1 if failed else 0)


@app.command("gc")
def gc_cmd(
    config: ConfigArg = None, set_: SetOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would go; delete nothing.")] = False,
) -> None:
    """Apply CONFIG's retention (retention.keep_checkpoints, retention.trajectory_days) to the object store and
    the model registry. Never deletes a checkpoint a registry alias points to, a run's resume point, a model
    version a run's config names, or the trajectories of an unfinished iteration."""
    from rlpipe.retention import apply, plan
    from rlpipe.storage import open_store
    from rlpipe.tracking.mlflow_utils import Tracker

    cfg = _load(config, set_)
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
        apply(p, store, client)
    n = {k: sum(i.kind == k for i in p.delete) for k in ("checkpoint", "trajectories", "model-version")}
    typer.echo(f"{'would free' if dry_run else 'freed'} {p.freed_bytes() / 2**20:.1f} MiB in {store.url('')}: "
               f"{n['checkpoint']} checkpoint(s), {n['trajectories']} iteration(s) of trajectories, "
               f"{n['model-version']} registry version(s){' (dry run: nothing deleted)' if dry_run else ''}")


@app.command("up")
def up_cmd(
    config: ConfigArg = None, set_: SetOpt = None,
    rollout_replicas: Annotated[int, typer.Option(help="Rollout services to start for task.policy_model (RLPIPE_ROLLOUT_URL).")] = 0,
    trainer_ranks: Annotated[int, typer.Option(help="Start the trainer service with this many ranks (RLPIPE_TRAINER_URL); 0: none.")] = 0,
    timeout_s: Annotated[float, typer.Option(help="Seconds each group of components may take to become healthy.")] = 180.0,
) -> None:
    """Start the local stack in the background (S3, MLflow server, Prefect server and worker, the services
    CONFIG needs), each health-checked; logs, pids and env.sh in $RLPIPE_HOME/stack/."""
    from rlpipe.stack import StackError, up

    cfg = _load(config, set_)
    try:
        stack = up(cfg, settings(), rollout_replicas=rollout_replicas, trainer_ranks=trainer_ranks, timeout_s=timeout_s)
    except StackError as e:
        typer.echo(f"rlpipe up: {e}", err=True)
        raise typer.Exit(1) from None
    for c in stack["components"]:
        typer.echo(f"up    {c['name']:14s} pid {c['pid']:<7d} {c['url']}")
    typer.echo(f"point runs at it: source {stack['dir']}/env.sh")


@app.command("status")
def status_cmd(as_json: Annotated[bool, typer.Option("--json", help="One JSON list instead of lines.")] = False) -> None:
    """Every component `rlpipe up` started, with its URL and health; exit 1 when any is down."""
    from rlpipe.stack import StackError, status

    try:
        rows = status(settings())
    except StackError as e:
        typer.echo(f"rlpipe status: {e}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
    for r in [] if as_json else rows:
        state = "ok  " if r["healthy"] else ("DOWN" if not r["alive"] else "SICK")
        typer.echo(f"{state}  {r['name']:14s} pid {r['pid']:<7d} {r['url']}  (log {r['log']})")
    raise typer.Exit(0 if all(r["healthy"] for r in rows) else 1)


@app.command("down")
def down_cmd() -> None:
    """Stop exactly what `rlpipe up` started (by the PIDs it recorded)."""
    from rlpipe.stack import StackError, down

    try:
        stopped = down(settings())
    except StackError as e:
        typer.echo(f"rlpipe down: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"stopped {len(stopped)}: {', '.join(stopped) or 'nothing was running'}")


@app.command("rm-train")
def rm_train_cmd(config: ConfigArg = None, set_: SetOpt = None, run_id: Annotated[Optional[str], typer.Option()] = None) -> None:
    """Train a reward model on preference pairs (Bradley–Terry); registers it as `<task>-rm` (`best` follows
    validation pair accuracy). Prints summary.json's path last."""
    from tasks.reward_model import PreferencesInvalid

    cfg = _load(config, set_)
    try:
        summary = _run_rm(cfg, run_id)
    except PreferencesInvalid as e:
        typer.echo(f"rlpipe rm-train: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"reward model {_version_text(summary['registered_model'])}: "
               f"pair accuracy validation {summary['rm_validation_pair_accuracy']:.3f}, test {summary['rm_pair_accuracy']:.3f} "
               f"(n={summary['rm_test_pairs']}), {summary['rm_steps']} steps")
    typer.echo(summary["_path"])


@app.command("sft")
def sft_cmd(config: ConfigArg = None, set_: SetOpt = None, run_id: Annotated[Optional[str], typer.Option()] = None,
            nproc: Annotated[Optional[int], typer.Option(help="Data-parallel DeepSpeed ranks (sets sft.nproc).")] = None) -> None:
    """Supervised warm-up of the policy; registers it as `base`. Prints summary.json's path last."""
    cfg = _load(config, (set_ or []) + ([f"sft.nproc={nproc}"] if nproc is not None else []))
    summary = _run_sft(cfg, run_id)
    typer.echo(summary["_path"])


@app.command("evaluate")
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
    _prefect_env()
    from flows.evaluate import evaluate

    cfg = _load(config, set_) if config or set_ else None
    if suite is not None or suite_set:
        return _evaluate_suite(model, suite, suite_set, experiment, cfg, promote_to)
    if split not in ("validation", "test"):
        typer.echo(f"rlpipe evaluate: --split {split!r}: use validation or test", err=True)
        raise typer.Exit(2)
    try:
        out = evaluate(model=model, split=split, baseline=None if baseline == "none" else baseline, promote_to=promote_to, config=cfg)
    except (LookupError, ValueError) as e:
        typer.echo(f"rlpipe evaluate: {e}", err=True)
        raise typer.Exit(2) from None
    b = out["baseline"]
    typer.echo(f"{out['name'] or model} v{out['version']} on {split}: accuracy {out['accuracy']:.3f} (n={out['n']})"
               + (f"; @{b['alias']} (v{b['version']}): {b['accuracy']:.3f}" if b["accuracy"] is not None else "")
               + f"; {out['reason']}")
    typer.echo(settings().run_dir(out["run_id"]) / "summary.json")


def _evaluate_suite(model: str, suite: str | None, overrides: list[str] | None, experiment: str, cfg: RunConfig | None,
                    promote_to: str | None) -> None:
    from flows.evaluate import evaluate_suite

    if promote_to is not None or not suite:
        typer.echo("rlpipe evaluate: " + ("--suite reports only; --promote-to moves aliases after a split evaluation "
                   "(drop --suite)" if promote_to is not None else "--suite-set needs --suite NAMES"), err=True)
        raise typer.Exit(2)
    try:
        out = evaluate_suite(model=model, suite=suite.split(","), overrides=overrides or [], experiment=experiment, config=cfg)
    except (LookupError, ValueError) as e:  # ConfigError too: a benchmark file or override that cannot be used
        typer.echo(f"rlpipe evaluate: {e}", err=True)
        raise typer.Exit(2) from None
    for name, b in out["benchmarks"].items():
        m = b["metrics"]
        passes = ", ".join(f"pass@{k[8:]} {v:.3f}" for k, v in m.items() if k.startswith("pass_at_"))
        typer.echo(f"{name}: " + (f"greedy {m['greedy_acc']:.3f}, " if "greedy_acc" in m else "") + (f"{passes}, " if passes else "")
                   + f"mean_len {m['mean_len']:.1f}, truncated {m['truncated']:.2f}, errors {int(m['n_error'])} (n={int(m['n'])})")
    typer.echo(f"MLflow run {out['mlflow_run_id']} in experiment {out['experiment']}")
    typer.echo(settings().run_dir(out["run_id"]) / "summary.json")


@app.command("report")
def report_cmd(
    run_id: Annotated[str, typer.Argument(help="The rlpipe run id (its newest MLflow run) or an MLflow run id.")],
    out: Annotated[Optional[Path], typer.Option(help="Where to write the page (default: $RLPIPE_HOME/runs/RUN_ID/report.html).")] = None,
    log: Annotated[bool, typer.Option("--log/--no-log", help="Also log the page to the MLflow run as report.html.")] = True,
) -> None:
    """One self-contained HTML page of a run, from MLflow: curves (reward, held-out accuracy, KL, entropy,
    lengths), stage times, verdict statuses, alerts and sampled generations. Prints its path."""
    from rlpipe.tracking.report import RunNotFound, build_report

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # two bars for two small tables: noise
    try:
        path = build_report(run_id, settings(), out, log=log)
    except RunNotFound as e:
        typer.echo(f"rlpipe report: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(str(path))


# The RLHF demo's recipe (configs/sft-rm-grpo-rlhf.yaml spells out the same): arithmetic prompts whose
# hidden true quality is `closeness`; the reward model learns it from noisy preference pairs only.
RLHF_DEMO = [
    "task.name=arithmetic-rlhf", "task.dataset=builtin:arithmetic-rlhf", "reward.type=model",
    "sft.steps=500", "sft.stop_at_accuracy=null", "sft.eval_every=100",
    "rm.steps=600", "rm.lr=3e-4", "rm.eval_every=25", "rm.patience=6",
    "train.total_iterations=40", "train.eval_interval=10", "train.save_interval=20", "train.kl_coef=0.05",
]


# The agent demo's recipe (configs/sft-agent-calculator.yaml and configs/grpo-agent-calculator.yaml spell
# out the same): SFT on a small set of calculator traces, stopped early so the tool use is shaky, then
# GRPO on whole episodes in the calculator environment.
AGENT_DEMO = [
    "task.name=agent-calculator", "task.dataset=builtin:episodes",
    "agent.env={env: calculator, params: {digits: 4, ops: ['*']}, limits: {max_steps: 4, episode_timeout_s: 60}}",
    "agent.max_context=160", "agent.sft_traces=2000", "agent.sft_tool_share=0.3",
    "data.test_size=200", "data.validation_size=100", "data.train_size=4000",
    "sft.steps=250", "sft.eval_every=50", "sft.eval_size=100", "sft.stop_at_accuracy=null",
    "rollout.max_new_tokens=24", "rollout.batch_size=16", "rollout.samples_per_prompt=8",
    "train.total_iterations=40", "train.eval_interval=10", "train.save_interval=20", "train.lr=1e-4",
    "train.batch_size=64", "train.micro_batch_size=64", "train.warmup_steps=20",
]


@automations_app.command("install")
def automations_install(
    file: Annotated[Optional[Path], typer.Option(help="Automations YAML (default: infra/prefect/automations.yaml).")] = None,
) -> None:
    """Create or update, by name, the Prefect automations that act on rlpipe's alerts (cancel a run on a
    critical alert; pause its deployment) on the Prefect API in PREFECT_API_URL. Safe to repeat."""
    _prefect_env()
    from tasks.alerts import AUTOMATIONS_FILE, install_automations

    try:
        done = install_automations(file or AUTOMATIONS_FILE)
    except (OSError, ValueError) as e:
        typer.echo(f"rlpipe automations install: {e}", err=True)
        raise typer.Exit(2) from None
    for name, what in done:
        typer.echo(f"{what:8s} {name}")


@app.command("demo")
def demo(
    which: Annotated[str, typer.Argument(help="rlvr: SFT → GRPO with a verifier (default); rlhf: SFT → reward model → GRPO "
                                             "against it; agent: SFT on tool-use traces → GRPO on episodes in the calculator environment.")] = "rlvr",
    set_: SetOpt = None, sft_only: Annotated[bool, typer.Option(help="Stop after the base model.")] = False,
) -> None:
    """Data → SFT base model (once) → RL; prints accuracy before/after, a reward curve and where to look.
    `rlpipe demo rlhf` adds a reward model between SFT and RL and reports true vs reward-model score."""
    if which not in ("rlvr", "rlhf", "agent"):
        typer.echo(f"rlpipe demo: unknown demo {which!r}; use rlvr, rlhf or agent", err=True)
        raise typer.Exit(2)
    import time

    start = time.time()
    cfg = _load(None, {"rlhf": RLHF_DEMO, "agent": AGENT_DEMO}.get(which, []) + (set_ or []))
    s = settings()
    _demo_base(cfg, s)
    if sft_only:
        return
    if which == "rlhf":
        _demo_rlhf(cfg, s, start)
        return
    if which == "agent":
        _demo_agent(cfg, s, start)
        return
    rl_cfg = cfg.model_copy(deep=True)
    rl_cfg.task.policy_model = f"models:/{cfg.registered_model}@base"
    summary = _run_rl(rl_cfg, None)
    _print_rl(summary)
    _demo_links(s)
    typer.echo(summary["_path"])


def _demo_base(cfg: RunConfig, s) -> None:
    from rlpipe.tracking.mlflow_utils import Tracker

    base = Tracker(s, cfg).version_by_alias(cfg.registered_model, "base")
    if base is None or base.tags.get("config_fingerprint") != cfg.fingerprint():
        _demo_sft(cfg, s)
    else:
        typer.echo(f"base model: {cfg.registered_model} v{base.version} (registered earlier; `rm -r {s.home}` to retrain)")


def _demo_links(s) -> None:
    from rlpipe.tracking.mlflow_utils import mlflow_ui_command

    typer.echo(f"\nBrowse the runs:\n  MLflow:  {mlflow_ui_command(s)}   # then http://127.0.0.1:5000")
    typer.echo("  Prefect: prefect server start   # then http://127.0.0.1:4200 (flow runs rl-train and rl-iteration)")


def _demo_rlhf(cfg: RunConfig, s, start: float) -> None:
    """SFT base → reward model on the base's trunk → GRPO against the reward model (pinned to that version).
    ``wall_s`` counts from ``start``, the demo's own start, so it includes the SFT base when one was trained."""
    import time

    from rlpipe.runs import new_run_id, write_summary

    rm_cfg = cfg.model_copy(deep=True)
    rm_cfg.rm.base_model = f"models:/{cfg.registered_model}@base"
    rm = _run_rm(rm_cfg, None)
    typer.echo(f"\nreward model {rm['registered_model']['name']} v{rm['registered_model']['version']}: held-out pair "
               f"accuracy {rm['rm_pair_accuracy']:.3f} (n={rm['rm_test_pairs']}), {rm['rm_steps']} steps in {rm['rm_train_s']:.0f} s")
    rl_cfg = cfg.model_copy(deep=True)
    rl_cfg.task.policy_model = f"models:/{cfg.registered_model}@base"
    rl_cfg.reward.model = f"models:/{rm['registered_model']['name']}/{rm['registered_model']['version']}"
    rl = _run_rl(rl_cfg, None)
    _print_rl(rl)
    keys = ("heldout_true_score_base", "heldout_true_score_final", "heldout_rm_score_base", "heldout_rm_score_final")
    summary = {"kind": "rlhf-demo", "rm_pair_accuracy": rm["rm_pair_accuracy"], **{k: rl[k] for k in keys},
               "heldout_accuracy_base": rl["heldout_accuracy_base"], "heldout_accuracy_final": rl["heldout_accuracy_final"],
               "reward_hacking_alerts": rl["reward_hacking_alerts"], "reward_model": rl["reward_model_version"],
               "rm_summary": rm["_path"], "rl_summary": rl["_path"], "rm_vs_true_png": rl.get("rm_vs_true_png"),
               "wall_s": round(time.time() - start, 1)}
    path = write_summary(s, new_run_id("rlhf-demo"), summary)
    typer.echo(f"  true score (hidden)  base {summary['heldout_true_score_base']:.3f}  →  final "
               f"{summary['heldout_true_score_final']:.3f}   ({summary['heldout_true_score_final'] - summary['heldout_true_score_base']:+.3f})")
    typer.echo(f"  reward-model score   base {summary['heldout_rm_score_base']:.3f}  →  final {summary['heldout_rm_score_final']:.3f}")
    typer.echo(f"  reward hacking       {summary['reward_hacking_alerts']} alert(s); curve {summary['rm_vs_true_png']}")
    minutes, seconds = divmod(round(summary["wall_s"]), 60)
    typer.echo(f"  demo wall time       {minutes} min {seconds} s")
    _demo_links(s)
    typer.echo(str(path))


def _demo_agent(cfg: RunConfig, s, start: float) -> None:
    """GRPO on episodes from the SFT base; the summary's episode keys come from the RL run's, ``wall_s`` from
    the demo's own start (the SFT base included when one was trained)."""
    import time

    from rlpipe.runs import new_run_id, write_summary

    rl_cfg = cfg.model_copy(deep=True)
    rl_cfg.task.policy_model = f"models:/{cfg.registered_model}@base"
    rl = _run_rl(rl_cfg, None)
    _print_rl(rl)
    keys = ("episode_success_base", "episode_success_final", "mean_steps", "tool_calls_per_episode", "mean_steps_base",
            "tool_calls_per_episode_base", "episodes_error_total")
    summary = {"kind": "agent-demo", "env": rl["env"], **{k: rl[k] for k in keys}, "heldout_n": rl["heldout_n"],
               "rl_summary": rl["_path"], "reward_curve_png": rl["reward_curve_png"], "wall_s": round(time.time() - start, 1)}
    path = write_summary(s, new_run_id("agent-demo"), summary)
    b, f = summary["episode_success_base"], summary["episode_success_final"]
    typer.echo(f"  episode success      base {b:.1%}  →  final {f:.1%}   ({(f - b) * 100:+.1f} points, n={summary['heldout_n']}, greedy)")
    typer.echo(f"  steps per episode    base {summary['mean_steps_base']:.2f}  →  final {summary['mean_steps']:.2f}")
    typer.echo(f"  tool calls/episode   base {summary['tool_calls_per_episode_base']:.2f}  →  final {summary['tool_calls_per_episode']:.2f}")
    typer.echo(f"  environment errors   {summary['episodes_error_total']} episode(s), excluded from the updates")
    minutes, seconds = divmod(round(summary["wall_s"]), 60)
    typer.echo(f"  demo wall time       {minutes} min {seconds} s")
    _demo_links(s)
    typer.echo(str(path))


def _demo_sft(cfg: RunConfig, s) -> None:

    summary = _run_sft(cfg, None)
    rows = [
        ("model parameters", f"{summary['model_parameters']:,}"),
        ("SFT steps / time", f"{summary['sft_steps']} / {summary['sft_train_s']:.1f} s"),
        ("held-out accuracy before SFT", f"{summary['heldout_accuracy_before']:.1%}"),
        ("held-out accuracy after SFT", f"{summary['heldout_accuracy_after']:.1%}  (n={summary['heldout_n']})"),
        *([("tool calls/episode after SFT", f"{summary['tool_calls_per_episode_after']:.2f}")]
          if "tool_calls_per_episode_after" in summary else []),
        ("registered", _version_text(summary["registered_model"])),
        ("dataset version", summary["dataset_version"][:16]),
        ("wall time", f"{summary['wall_s']:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    typer.echo("\nrlpipe demo — base model")
    for k, v in rows:
        typer.echo(f"  {k:<{width}}  {v}")
    typer.echo(f"  summary: {summary['_path']}")


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

    try:
        cases = [c for f in labels for c in load_labels(f)]
    except (LabelsError, FileNotFoundError) as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(2) from None
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


@serve_app.command("reward-model")
def serve_reward_model(
    model_uri: Annotated[str, typer.Argument(help="The reward model: a folder or models:/NAME@ALIAS (e.g. models:/rlpipe-arithmetic-rlhf-rm@best).")],
    host: Annotated[str, typer.Option(help="Address to listen on (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8766,
    max_queue: Annotated[int, typer.Option(help="Requests that may wait; more are refused with 429.")] = 64,
    max_batch_items: Annotated[int, typer.Option(help="Most items scored in one forward batch (concurrent requests are micro-batched).")] = 512,
    request_timeout: Annotated[float, typer.Option(help="Seconds a request without timeout_s waits before its items get status timeout.")] = 30.0,
) -> None:
    """HTTP reward-model service: /health, batch /score, /metrics. Point runs at it with services.reward_model (or RLPIPE_REWARD_MODEL_URL)."""
    from rlpipe.services.reward_model import serve
    from rlpipe.training.models import load_reward_model

    _listen_ok("reward_model", host)
    try:
        scorer = load_reward_model(model_uri, settings())
    except (LookupError, FileNotFoundError) as e:
        typer.echo(f"serve reward-model: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"reward-model service {scorer.version} on http://{host}:{port} (queue {max_queue}, batch ≤ {max_batch_items})", err=True)
    serve(scorer, host=host, port=port, max_queue=max_queue, max_batch_items=max_batch_items, request_timeout_s=request_timeout)


@serve_app.command("verifier")
def serve_verifier(
    host: Annotated[str, typer.Option(help="Address to listen on (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8765,
    workers: Annotated[int, typer.Option(help="Verifier worker processes (bounded concurrency).")] = 2,
    grace: Annotated[float, typer.Option(help="Seconds past each verifier's declared budget before a sample is killed (status timeout).")] = 5.0,
    request_timeout: Annotated[float, typer.Option(help="Least time a request without timeout_s is given; more when its batch's declared budgets need it.")] = 60.0,
    max_queue: Annotated[int, typer.Option(help="Requests that may wait; more are refused with 429.")] = 32,
    plugin: Annotated[Optional[list[str]], typer.Option(help="Module registering extra verifiers (repeatable).")] = None,
    timeout: Annotated[Optional[float], typer.Option(hidden=True)] = None,
) -> None:
    """HTTP verifier service: /health, batch /verify, /metrics. Point runs at it with services.verifier (or RLPIPE_VERIFIER_URL)."""
    if timeout is not None:
        typer.echo("serve verifier: --timeout was removed: each sample's deadline is its verifier's declared "
                   "budget plus --grace; use --grace SECONDS", err=True)
        raise typer.Exit(2)
    from rlpipe.services.verifier import serve

    _listen_ok("verifier", host)
    typer.echo(f"verifier service on http://{host}:{port} ({workers} workers, grace {grace:g} s, queue {max_queue})", err=True)
    serve(host=host, port=port, workers=workers, grace_s=grace, max_queue=max_queue,
          request_timeout_s=request_timeout, plugins=tuple(plugin or ()))


@serve_app.command("rollout")
def serve_rollout(
    model_uri: Annotated[str, typer.Argument(help="The policy to start from: a folder or models:/NAME@ALIAS.")],
    engine: Annotated[str, typer.Option(help="Engine: vllm or hf.")] = "vllm",
    host: Annotated[str, typer.Option(help="Address to listen on (loopback by default; elsewhere needs RLPIPE_ROLLOUT_TOKEN).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8768,
    max_model_len: Annotated[int, typer.Option(help="Positions per sequence (prompt + completion).")] = 256,
    max_queue: Annotated[int, typer.Option(help="Requests that may wait for the engine; more are refused with 429.")] = 8,
    request_timeout: Annotated[float, typer.Option(help="Seconds a request without timeout_s waits for its turn (then 504).")] = 300.0,
    seed: Annotated[int, typer.Option(help="Engine seed (requests carry their own sampling seeds).")] = 0,
    gpu_memory_utilization: Annotated[float, typer.Option(help="vLLM: the GPU's share the engine may take (0.9 when the service has its GPU alone).")] = 0.3,
    max_num_seqs: Annotated[Optional[int], typer.Option(help="vLLM: most sequences in one step (default: vLLM's).")] = None,
    tensor_parallel_size: Annotated[int, typer.Option(help="vLLM: GPUs the engine spans.")] = 1,
    enable_prefix_caching: Annotated[bool, typer.Option(help="vLLM: reuse the KV cache of shared prefixes.")] = False,
) -> None:
    """HTTP rollout service: /generate, /logprobs, /weights (from the object store, hash-checked), /health,
    /metrics. Runs point at its replicas with services.rollout (or RLPIPE_ROLLOUT_URL, comma-separated)."""
    from rlpipe.rollout.engines import new_engine
    from rlpipe.services.rollout import serve
    from rlpipe.storage import open_store
    from rlpipe.training.models import fetch_source, resolve_source

    _listen_ok("rollout", host)
    s = settings()
    try:
        folder = fetch_source(resolve_source(model_uri, s), s)
    except (LookupError, FileNotFoundError) as e:
        typer.echo(f"serve rollout: {e}", err=True)
        raise typer.Exit(2) from None
    eng = new_engine(engine, folder, max_model_len=max_model_len, seed=seed, **(
        {"gpu_memory_utilization": gpu_memory_utilization, "max_num_seqs": max_num_seqs,
         "tensor_parallel_size": tensor_parallel_size, "enable_prefix_caching": enable_prefix_caching}
        if engine == "vllm" else {}))
    typer.echo(f"rollout service ({eng.name}, weights {eng.weights_sha256()[:12]}) on http://{host}:{port}", err=True)
    serve(eng, folder, open_store(s.resolve_storage_uri(), s), host=host, port=port, max_model_len=max_model_len,
          max_queue=max_queue, request_timeout_s=request_timeout)


@serve_app.command("trainer")
def serve_trainer(
    nproc: Annotated[int, typer.Option(help="Ranks (processes) of the DeepSpeed group on this machine.")] = 1,
    host: Annotated[str, typer.Option(help="Address to listen on (loopback by default; elsewhere needs RLPIPE_TRAINER_TOKEN).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8769,
    max_queue: Annotated[int, typer.Option(help="Requests that may wait for the ranks; more are refused with 429.")] = 4,
    request_timeout: Annotated[float, typer.Option(help="Seconds a request without timeout_s waits for its result (then 504).")] = 3600.0,
) -> None:
    """HTTP trainer service: the policy trainer as NPROC ranks under torchrun; rank 0 answers /init, /update
    (trajectories from the object store in; the new resumable state written there; sha256 and metrics out),
    /logprobs, /health, /metrics. Runs point at it with services.trainer (or RLPIPE_TRAINER_URL)."""
    import os
    import sys

    from rlpipe.services.trainer import launch_cmd

    _listen_ok("trainer", host)
    if nproc < 1:
        typer.echo("serve trainer: --nproc must be at least 1", err=True)
        raise typer.Exit(2)
    cmd = launch_cmd(nproc, host, port, max_queue, request_timeout)
    typer.echo(f"trainer service ({nproc} rank(s)) on http://{host}:{port}", err=True)
    sys.stdout.flush()
    os.execv(cmd[0], cmd)  # torchrun in this process: a signal to this PID reaches every rank


def _listen_ok(name: str, host: str) -> None:
    """Exit 2 before anything starts when a service would listen beyond loopback without a credential."""
    from rlpipe.services._common import check_listen
    from rlpipe.services.calls import service_token

    try:
        check_listen(name, host, service_token(name))
    except (ValueError, OSError) as e:
        typer.echo(f"serve {name.replace('_', '-')}: {e}", err=True)
        raise typer.Exit(2) from None


@serve_app.command("env")
def serve_env(
    host: Annotated[str, typer.Option(help="Address to listen on (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8767,
    workers: Annotated[int, typer.Option(help="Sandboxes running at once (bounded concurrency).")] = 2,
    max_queue: Annotated[int, typer.Option(help="Requests that may wait; more are refused with 429.")] = 64,
    step_timeout: Annotated[float, typer.Option(help="Seconds one environment step may take; past it the episode is an error.")] = 10.0,
    cpu: Annotated[float, typer.Option(help="CPU seconds per sandboxed call.")] = 10.0,
    memory_mb: Annotated[int, typer.Option(help="Memory per sandboxed call (MB).")] = 512,
    plugin: Annotated[Optional[list[str]], typer.Option(help="Module registering extra environments (repeatable).")] = None,
    allow_host: Annotated[Optional[list[str]], typer.Option(help="host:port environments may reach through rlpipe.envs.net.connect (repeatable); default: no network.")] = None,
) -> None:
    """HTTP environment service: /health, /reset, /step, /metrics; every call in its own sandbox.
    Point runs at it with services.env (or RLPIPE_ENV_URL)."""
    import importlib

    from rlpipe.envs.sandboxed import SandboxOptions
    from rlpipe.services.env import serve

    _listen_ok("env", host)
    for mod in plugin or ():
        importlib.import_module(mod)
    opts = SandboxOptions(step_timeout_s=step_timeout, cpu_s=cpu, memory_mb=memory_mb, plugins=tuple(plugin or ()),
                          allow_hosts=tuple(allow_host or ()))
    typer.echo(f"environment service on http://{host}:{port} ({workers} sandboxes, queue {max_queue}, "
               f"step timeout {step_timeout:g} s)", err=True)
    serve(opts, host=host, port=port, workers=workers, max_queue=max_queue)


def main() -> None:
    # Per-shard progress bars of save_pretrained are noise in flow logs.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
