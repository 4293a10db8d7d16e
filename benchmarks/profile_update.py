"""Where the DeepSpeed update's time goes (issue 16: "a fast update"), and its FLOP rate against this machine's
measured peak (issue 43).

    .venv/bin/python benchmarks/profile_update.py --out /tmp/rlpipe-bench/update-profile.json
    .venv/bin/python benchmarks/profile_update.py --model-size 100M --repeats 2    # ~110M parameters

One process, the in-process trainer (`PolicyTrainer`, DeepSpeed on gloo) with the demo's training
settings (`RunConfig().train`: 64 completions per optimizer step, one micro-batch per step, AdamW),
an untrained tiny model built from the default model config (the time does not depend on the
weights), and the demo's batch shape: 32 arithmetic prompts × 8 completions of 1–8 tokens. After one
warm-up update, ``--repeats`` updates under cProfile: seconds per update, the share of each part
(the log-probs before the first step, forward, backward, optimizer step, the per-token inputs'
collation) and the share of padded positions the forward passes compute.

FLOP rate: a forward and backward pass cost about 6 × (parameters in matrix multiplies) FLOPs per position they
compute (2 forward, 4 backward), a forward without gradient 2 (attention's own products are left out: they are
under 2% at these lengths). The positions are counted by a hook on the input embeddings, as the forwards computed
them (padding, packing and shared prompts as they are); the peak is the best of a few float32 2048×2048 matrix
products on the same threads (``torch.mm``), measured here; under train.precision bf16 or bf16_weights also the
bfloat16 products' peak.
``--model-size`` takes ``scaling.py``'s MODELS (3M, 30M, 100M): an untrained model of that size.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The parts, by the function whose cumulative time they are (file name fragment, function name).
PARTS = {
    "precompute (log-probs before the first step)": ("trainer.py", "_precompute"),
    "prepare (advantages, per-token inputs)": ("update_math.py", "_prepare"),
    "collate micro-batches": ("packing.py", "collate"),
    "forward + loss": ("update_math.py", "_micro_loss"),
    "backward": ("engine.py", "backward"),
    "optimizer step": ("engine.py", "step"),
    "gradient norm": ("clip_grad.py", "_get_total_norm"),
    "gradient clip": ("clip_grad.py", "_clip_grads_with_norm_"),
}


def samples(tokenizer, n_prompts: int, per_prompt: int, max_new: int, seed: int) -> list:
    from rlpipe.config import RunConfig
    from rlpipe.data import build_arithmetic
    from rlpipe.storage.samples import Sample
    from rlpipe.tokens import render_prompt

    rng = random.Random(seed)
    rows = [r for r in build_arithmetic(RunConfig().data).to_pylist() if r["split"] == "train"][:n_prompts]
    out = []
    for g, row in enumerate(rows):
        prompt = tokenizer(render_prompt(tokenizer, row["prompt"], row["chat"]), add_special_tokens=False)["input_ids"]
        for _ in range(per_prompt):
            length = rng.randint(1, max_new)
            out.append(Sample(prompt, [rng.randrange(3, 100) for _ in range(length)],
                              [-rng.uniform(0.1, 3.0) for _ in range(length)], float(rng.random() < 0.4), g))
    return out


def untrained_policy(cfg) -> Path:
    """The default model config's tiny model, untrained (the update's time does not depend on the weights),
    saved once under /tmp/rlpipe-bench/profile-policy."""
    from rlpipe.training.checkpoint import save_checkpoint
    from rlpipe.training.tiny import build_char_tokenizer, build_tiny_model

    folder = Path("/tmp/rlpipe-bench/profile-policy")
    if not (folder / "config.json").exists():
        tok = build_char_tokenizer()
        save_checkpoint(folder, build_tiny_model(cfg.model, tok, seed=0), tok, trainer_state={"kind": "init"})
    return folder


def padding_share(batch: list, micro: int) -> float:
    """Padded positions / computed positions over the micro-batches of one update (in its order)."""
    real = padded = 0
    for start in range(0, len(batch), micro):
        chunk = batch[start : start + micro]
        width = max(len(s.prompt_ids) + len(s.response_ids) for s in chunk)
        real += sum(len(s.prompt_ids) + len(s.response_ids) for s in chunk)
        padded += width * len(chunk)
    return 1 - real / padded


def part_seconds(stats: pstats.Stats) -> dict[str, float]:
    out = {}
    for name, (file, func) in PARTS.items():
        out[name] = sum(v[3] for (f, _, fn), v in stats.stats.items() if fn == func and f.endswith(file))
    return out


def measured_peak_gflops(n: int = 2048, reps: int = 8, dtype: str = "float32") -> float:
    """The best matrix-product rate of this process's threads (GFLOP/s) in ``dtype`` (float32 or bfloat16)."""
    import torch

    a, b = torch.randn(n, n).to(getattr(torch, dtype)), torch.randn(n, n).to(getattr(torch, dtype))
    for _ in range(3):  # warm: the first products run below the clock the rest reach
        torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def count_positions(trainer) -> dict[str, int]:
    """A forward hook on the input embeddings that counts the positions each forward computes (padding and
    packing as they are), with and without gradient: {"grad": …, "no_grad": …}, updated in place."""
    import torch

    seen = {"grad": 0, "no_grad": 0}

    def hook(module, args, output) -> None:
        seen["grad" if torch.is_grad_enabled() else "no_grad"] += int(args[0].numel())

    trainer.module.get_input_embeddings().register_forward_hook(hook)
    return seen


def flop_rate(trainer, positions: dict[str, int], seconds: float, peak: float) -> dict[str, float]:
    """The update's GFLOP/s over the positions its forwards computed (6 per matmul parameter and position with a
    backward, 2 without), and its share of ``peak``."""
    matmul = sum(m.weight.numel() for m in trainer.module.modules() if type(m).__name__ == "Linear")
    flops = matmul * (6 * positions["grad"] + 2 * positions["no_grad"])
    return {"matmul_params": matmul, "positions": positions, "gflops": round(flops / seconds / 1e9, 2),
            "peak_gflops": round(peak, 1), "share_of_peak": round(flops / seconds / 1e9 / peak, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model-size", default=None, help="a key of scaling.py's MODELS (3M, 30M, 100M); default: the demo's")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="train.* overrides (e.g. train.precision=bf16)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/rlpipe-bench/update-profile.json"))
    ap.add_argument("--top", type=int, default=25, help="print the top functions by own time")
    a = ap.parse_args()
    sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # this checkout's code, a worktree's too (not the installed one)
    from rlpipe.config import RunConfig
    from rlpipe.training.trainer import PolicyTrainer

    from rlpipe.config import load_config

    cfg = load_config(None, a.set) if a.set else RunConfig()
    if a.model_size:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from scaling import policy

        folder, _ = policy(Path("/tmp/rlpipe-bench/sizes"), a.model_size)
    else:
        folder = untrained_policy(cfg)
    trainer = PolicyTrainer(model_dir=str(folder), cfg=cfg.train, seed=0, max_new_tokens=cfg.rollout.max_new_tokens)
    batch = samples(trainer.tokenizer, cfg.rollout.batch_size, cfg.rollout.samples_per_prompt, cfg.rollout.max_new_tokens, 0)
    trainer.update(batch, 0)  # warm-up (allocations, first-call paths)
    prof, wall = cProfile.Profile(), []
    for k in range(1, a.repeats + 1):
        t = time.perf_counter()
        prof.enable()
        trainer.update(batch, k)
        prof.disable()
        wall.append(time.perf_counter() - t)
    stats = pstats.Stats(prof)
    per_update = statistics.fmean(wall)
    parts = {k: round(v / a.repeats, 4) for k, v in part_seconds(stats).items()}
    result = {"seconds_per_update": round(per_update, 4), "updates": a.repeats, "optimizer_steps_per_update":
              len(batch) // cfg.train.batch_size, "samples": len(batch), "parts_s": parts,
              "padding_share": round(padding_share(batch, cfg.train.micro_batch_size), 3),
              "padding_share_length_sorted": round(padding_share(sorted(batch, key=lambda s: len(s.prompt_ids) + len(
                  s.response_ids)), cfg.train.micro_batch_size), 3),
              "torch_threads": __import__("torch").get_num_threads(), "cpus": os.cpu_count(),
              "model_size": a.model_size or "demo", "precision": cfg.train.precision}
    seen, plain = count_positions(trainer), []  # the FLOP rate without the profiler's per-call cost
    for k in range(2):
        seen.update(grad=0, no_grad=0)
        t = time.perf_counter()
        trainer.update(batch, a.repeats + 1 + k)
        plain.append(time.perf_counter() - t)
    result |= {"seconds_per_update_unprofiled": round(min(plain), 4)}  # the fastest: the least disturbed
    result |= flop_rate(trainer, dict(seen), min(plain), measured_peak_gflops())
    if cfg.train.precision != "fp32":  # the matrices run in bfloat16: its own peak on this machine too
        bf16_peak = measured_peak_gflops(dtype="bfloat16")
        result |= {"peak_gflops_bf16": round(bf16_peak, 1), "share_of_bf16_peak": round(result["gflops"] / bf16_peak, 3)}
    print(json.dumps(result, indent=2))
    stats.sort_stats("tottime").print_stats(a.top)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
