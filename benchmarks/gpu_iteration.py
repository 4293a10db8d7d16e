"""A GRPO iteration's stages on one device, in one process (issue 16, item 6: tokens/s per GPU and the breakdown).

    python benchmarks/gpu_iteration.py --out /tmp/rlpipe-bench/gpu.json                    # every model, bf16
    python benchmarks/gpu_iteration.py --models 3M --completions 64 --max-new-tokens 8     # a CPU smoke test

rlpipe's own parts, without the orchestrator (no Prefect flow run, Parquet, MLflow or S3: what those cost is CPU
work measured by benchmarks/grpo_loop.py and scaling.py, the same on any accelerator): the HF engine
(``HFEngine``: on CUDA in bfloat16, as vLLM's dtype "auto") samples ``--completions`` completions of at most
``--max-new-tokens`` tokens for arithmetic prompts (8 per prompt); the ``math`` verifier scores them in this
process; the DeepSpeed trainer (``PolicyTrainer``, ``train.precision``) takes 4 optimizer steps on them (GRPO,
KL 0.01 against a reference, micro-batches of at most 64, packed sequences); the resumable state (weights + Adam
moments) is saved over the previous one; the engine reloads the weights from it (read back) and the probe proves
them (the engine's log-probs against the trainer's, within ``rollout/probe.py``'s tolerance), as the flow's
update and sync-weights tasks do. (The H200 figures in benchmarks/README.md were taken before this order: the
sync then exported the weights a second time.)

Models are untrained Qwen2s built from config (their skill does not change the cost per token; responses end
at EOS at random, so the mean response length is reported). Per model: the mean over iterations 2..N (the
first carries one-off warm-ups) of each stage's seconds, generated tokens/s (generated tokens / generate
seconds), trained tokens/s (prompt + response tokens of the batch / update seconds: each optimizer step
sees a quarter of them once, the reference and the log-probs before the first step see them all), and the peak
device memory. Prints a markdown table and writes one JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
MODELS: dict[str, dict[str, int]] = {
    "3M": {},  # the default ModelConfig
    "30M": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "intermediate_size": 2048},
    "100M": {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "intermediate_size": 3072},
    "400M": {"hidden_size": 1024, "num_layers": 24, "num_heads": 16, "intermediate_size": 4096},  # 402.9M built
}
PER_PROMPT, STEPS = 8, 4
STAGES = ("generate", "verify", "update", "sync", "save")


def build(name: str, root: Path) -> tuple[Path, int]:
    """The untrained model ``name`` saved under ``root``, and its parameter count."""
    from rlpipe.config import ModelConfig
    from rlpipe.training.checkpoint import save_checkpoint
    from rlpipe.training.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    model = build_tiny_model(ModelConfig(**MODELS[name], max_position_embeddings=512), tok, seed=0)
    save_checkpoint(root / name, model, tok, trainer_state={"kind": "init"})
    return root / name, sum(p.numel() for p in model.parameters())


def prompts(tokenizer: Any, n: int) -> list[dict[str, Any]]:
    from rlpipe.config import RunConfig
    from rlpipe.data import build_arithmetic
    from rlpipe.tokens import render_prompt

    rows = [r for r in build_arithmetic(RunConfig().data).to_pylist() if r["split"] == "train"][:n]
    return [r | {"ids": tokenizer(render_prompt(tokenizer, r["prompt"], r["chat"]), add_special_tokens=False)["input_ids"]}
            for r in rows]


def synced() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def iteration(k: int, rows: list[dict[str, Any]], engine: Any, trainer: Any, probe: Any, work: Path,
              max_new: int) -> dict[str, float]:
    """One iteration's stages, each timed to its end on the device."""
    from rlpipe.rewards import get_verifier
    from rlpipe.rollout.base import SamplingConfig
    from rlpipe.rollout.probe import default_tolerance, max_gap
    from rlpipe.storage.samples import Sample

    t: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        synced()
        t[stage], clock = time.perf_counter() - clock, time.perf_counter()

    outs = engine.generate([r["ids"] for r in rows], SamplingConfig(n=PER_PROMPT, temperature=1.0, max_new_tokens=max_new, seed=k))
    lap("generate")
    verify = get_verifier("math")
    samples = [Sample(r["ids"], c.token_ids, c.logprobs, verify(c.text, r["ground_truth"]).reward, g)
               for g, (r, o) in enumerate(zip(rows, outs)) for c in o]
    lap("verify")
    metrics = trainer.update(samples, k)
    lap("update")
    # As the flow does: the save point (weights + AdamW moments) is written once, and the engine reloads from it.
    state = work / f"state{k % 2}"
    trainer.save(state, spare=work / f"state{(k + 1) % 2}" if k > 1 else None)
    lap("save")
    engine.load_weights(state)
    gap = max_gap(engine.sequence_logprobs(probe[0], probe[1]), trainer.sequence_logprobs(probe[0], probe[1]))
    if not gap <= default_tolerance(engine.dtype):
        raise RuntimeError(f"iteration {k}: the engine's log-probs are {gap:.3g} from the trainer's after the sync")
    lap("sync")
    return t | {"generated_tokens": sum(len(s.response_ids) for s in samples), "probe_gap": gap,
                "trained_tokens": sum(len(s.prompt_ids) + len(s.response_ids) for s in samples),
                "optimizer_steps": metrics["optimizer_steps"], "completions": len(samples)}


def measure(name: str, a: argparse.Namespace, root: Path) -> dict[str, Any]:
    import torch

    from rlpipe.config import TrainConfig
    from rlpipe.rollout.hf_engine import HFEngine
    from rlpipe.training.trainer import PolicyTrainer

    folder, params = build(name, root)
    batch = a.completions // STEPS
    cfg = TrainConfig(batch_size=batch, micro_batch_size=min(64, batch), lr=1e-5, kl_coef=0.01, precision=a.precision,
                      zero_stage=1 if a.precision == "bf16_weights" else 0)  # its float32 masters are ZeRO's
    trainer = PolicyTrainer(model_dir=str(folder), cfg=cfg, seed=0, max_new_tokens=a.max_new_tokens)
    engine = HFEngine(folder)
    rows = prompts(trainer.tokenizer, a.completions // PER_PROMPT)
    probe = ([r["ids"] for r in rows[:8]], [trainer.tokenizer(r["ground_truth"], add_special_tokens=False)["input_ids"] for r in rows[:8]])
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    runs = []
    for k in range(1, a.iterations + 1):
        runs.append(iteration(k, rows, engine, trainer, probe, root / f"{name}-work", a.max_new_tokens))
        print(f"  {name} iteration {k}/{a.iterations}: " + ", ".join(f"{s} {runs[-1][s]:.3f}s" for s in STAGES)
              + f"; {runs[-1]['generated_tokens']} generated, {runs[-1]['trained_tokens']} trained tokens", flush=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    del trainer, engine
    return summarise(name, params, runs[1:] or runs, peak)


def summarise(name: str, params: int, runs: list[dict[str, float]], peak_gib: float | None) -> dict[str, Any]:
    mean = {k: statistics.fmean(r[k] for r in runs) for k in runs[0]}
    total = sum(mean[s] for s in STAGES)
    return {"model": name, "parameters": params, "iterations_measured": len(runs),
            "stages_s": {s: round(mean[s], 4) for s in STAGES}, "iteration_s": round(total, 4),
            "share": {s: round(mean[s] / total, 3) for s in STAGES},
            "mean_response_tokens": round(mean["generated_tokens"] / mean["completions"], 1),
            "generate_tokens_per_s": round(mean["generated_tokens"] / mean["generate"]),
            "train_tokens_per_s": round(mean["trained_tokens"] / mean["update"]),
            "completions_per_s": round(mean["completions"] / total, 1), "probe_gap_max": max(r["probe_gap"] for r in runs),
            "peak_device_memory_gib": round(peak_gib, 2) if peak_gib is not None else None}


def device_line() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return f"CPU ({os.cpu_count()} cores), torch {torch.__version__}"


def table(results: list[dict[str, Any]], a: argparse.Namespace) -> str:
    head = (f"{device_line()}; train.precision {a.precision}; {a.completions} completions per iteration, "
            f"≤{a.max_new_tokens} new tokens; mean of iterations 2..{a.iterations}\n\n"
            "| model | params | resp. tokens | iteration s | generate | verify | update | sync | save | gen tok/s | "
            "train tok/s | peak GiB |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    rows = [f"| {r['model']} | {r['parameters'] / 1e6:.1f}M | {r['mean_response_tokens']} | {r['iteration_s']:.3f} | "
            + " | ".join(f"{r['stages_s'][s]:.3f} ({r['share'][s]:.0%})" for s in STAGES)
            + f" | {r['generate_tokens_per_s']:,} | {r['train_tokens_per_s']:,} | {r['peak_device_memory_gib']} |"
            for r in results]
    return head + "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--completions", type=int, default=256, help="per iteration (a multiple of 32)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--iterations", type=int, default=4, help="per model; the first is not counted")
    ap.add_argument("--precision", choices=["bf16", "bf16_weights", "fp32"], default="bf16",
                    help="train.precision (bf16_weights with zero_stage 1)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/rlpipe-bench/gpu.json"))
    a = ap.parse_args()
    if a.completions % (PER_PROMPT * STEPS):
        ap.error("--completions must be a multiple of 32 (8 per prompt, 4 optimizer steps)")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" at every save
    root = Path(tempfile.mkdtemp(prefix="rlpipe-gpu-"))
    results = []
    try:
        for n, name in enumerate(a.models, 1):
            print(f"[{n}/{len(a.models)}] {name}", flush=True)
            results.append(measure(name, a, root))
            write(a, results)  # after each model: a run stopped later keeps what it measured
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(table(results, a))


def write(a: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"device": device_line(), "settings": vars(a) | {"out": str(a.out)}, "results": results}, indent=2))


if __name__ == "__main__":
    main()
