"""``rlpipe demo [rlvr | rlhf | agent]``: the whole pipeline on a small task, from data to an RL-trained model,
with what changed printed at the end. ``RLHF_DEMO`` and ``AGENT_DEMO`` are the demos' ``--set`` recipes."""

from __future__ import annotations

from typing import Annotated

import typer

from rlpipe.cli.common import SetOpt, load, version_text
from rlpipe.cli.run_cmds import print_rl, run_rl, run_rm, run_sft
from rlpipe.config import RunConfig, settings


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
    cfg = load(None, {"rlhf": RLHF_DEMO, "agent": AGENT_DEMO}.get(which, []) + (set_ or []))
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
    rl_cfg = _on_base(cfg)
    summary = run_rl(rl_cfg, None)
    print_rl(summary)
    _demo_links(s)
    typer.echo(summary["_path"])


def _on_base(cfg: RunConfig) -> RunConfig:
    """A copy of ``cfg`` whose RL starts from the SFT base registered as ``NAME@base``."""
    rl_cfg = cfg.model_copy(deep=True)
    rl_cfg.task.policy_model = f"models:/{cfg.registered_model}@base"
    return rl_cfg


def _demo_base(cfg: RunConfig, s) -> None:
    """The SFT base: trained unless one registered from this very config is there already."""
    from rlpipe.tracking.mlflow_utils import Tracker

    base = Tracker(s, cfg).version_by_alias(cfg.registered_model, "base")
    if base is None or base.tags.get("config_fingerprint") != cfg.fingerprint():
        _demo_sft(cfg, s)
    else:
        typer.echo(f"base model: {cfg.registered_model} v{base.version} (registered earlier; `rm -r {s.home}` to retrain)")


def _demo_end(s, wall_s: float, path) -> None:
    """The last lines of a demo with its own summary: wall time, where to browse, the summary's path."""
    minutes, seconds = divmod(round(wall_s), 60)
    typer.echo(f"  demo wall time       {minutes} min {seconds} s")
    _demo_links(s)
    typer.echo(str(path))


def _demo_links(s) -> None:
    """How to open the MLflow and Prefect UIs on what the demo wrote."""
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
    rm = run_rm(rm_cfg, None)
    typer.echo(f"\nreward model {rm['registered_model']['name']} v{rm['registered_model']['version']}: held-out pair "
               f"accuracy {rm['rm_pair_accuracy']:.3f} (n={rm['rm_test_pairs']}), {rm['rm_steps']} steps in {rm['rm_train_s']:.0f} s")
    rl_cfg = _on_base(cfg)
    rl_cfg.reward.model = f"models:/{rm['registered_model']['name']}/{rm['registered_model']['version']}"
    rl = run_rl(rl_cfg, None)
    print_rl(rl)
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
    _demo_end(s, summary["wall_s"], path)


def _demo_agent(cfg: RunConfig, s, start: float) -> None:
    """GRPO on episodes from the SFT base; the summary's episode keys come from the RL run's, ``wall_s`` from
    the demo's own start (the SFT base included when one was trained)."""
    import time

    from rlpipe.runs import new_run_id, write_summary

    rl_cfg = _on_base(cfg)
    rl = run_rl(rl_cfg, None)
    print_rl(rl)
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
    _demo_end(s, summary["wall_s"], path)


def _demo_sft(cfg: RunConfig, s) -> None:
    """Train the SFT base and print what it reached."""
    summary = run_sft(cfg, None)
    rows = [
        ("model parameters", f"{summary['model_parameters']:,}"),
        ("SFT steps / time", f"{summary['sft_steps']} / {summary['sft_train_s']:.1f} s"),
        ("held-out accuracy before SFT", f"{summary['heldout_accuracy_before']:.1%}"),
        ("held-out accuracy after SFT", f"{summary['heldout_accuracy_after']:.1%}  (n={summary['heldout_n']})"),
        *([("tool calls/episode after SFT", f"{summary['tool_calls_per_episode_after']:.2f}")]
          if "tool_calls_per_episode_after" in summary else []),
        ("registered", version_text(summary["registered_model"])),
        ("dataset version", summary["dataset_version"][:16]),
        ("wall time", f"{summary['wall_s']:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    typer.echo("\nrlpipe demo — base model")
    for k, v in rows:
        typer.echo(f"  {k:<{width}}  {v}")
    typer.echo(f"  summary: {summary['_path']}")
