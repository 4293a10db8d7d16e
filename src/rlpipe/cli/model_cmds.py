"""``rlpipe plan | export | standin``: a model's memory before it is loaded, a model version as a Hugging Face
folder, and a small stand-in checkpoint where no hub model can be downloaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from rlpipe.cli.common import ConfigArg, SetOpt, load, refused
from rlpipe.config import RunConfig, settings


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

    cfg, s = load(config, set_), settings()
    with tempfile.TemporaryDirectory() as tmp, refused("plan"):
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
    with refused("export"):
        written = export_model(fetch_source(resolve_source(model, s), s), out, merge=merge)
    typer.echo(str(written))


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

    with refused("standin"):
        out = build_standin(folder, arch, hidden=hidden, layers=layers, heads=max(hidden // 64, 1),
                            kv_heads=max(hidden // 128, 1), intermediate=hidden * 4, seed=seed)
    typer.echo(str(out))
