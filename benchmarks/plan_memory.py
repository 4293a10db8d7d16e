"""`rlpipe plan` against measured peaks: the trainer's peak memory for one update, by model size and mode.

For each size (hub-style stand-ins built from config, rlpipe.training.standin) and each mode (full fine-tuning,
LoRA, gradient checkpointing), a fresh process builds the trainer and runs two GRPO updates of one micro-batch
(the second is the steady state: Adam's moments exist from the first step on);
its peak RSS above the RSS after imports (CPU) or ``torch.cuda.max_memory_allocated`` (CUDA) is compared with the
plan's trainer figure (policy, gradients, moments, reference, activations).

    python benchmarks/plan_memory.py --sizes 30M,110M,400M --out benchmarks/plan_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

SIZES = {  # hidden, layers (stand-in qwen2 family: vocabulary 716, 4× MLP)
    "30M": (512, 9), "110M": (768, 15), "400M": (1280, 20),
}
MODES = {"full": {}, "lora": {"lora": {"r": 16, "alpha": 32, "target_modules": "all-linear"}},
         "checkpointing": {"gradient_checkpointing": True},
         "lora+checkpointing": {"lora": {"r": 16, "alpha": 32, "target_modules": "all-linear"}, "gradient_checkpointing": True}}
# The same under train.precision bf16 (bfloat16 autocast; LoRA then keeps the frozen base in 16 bits).
MODES |= {f"{name}-bf16": dict(train, precision="bf16") for name, train in list(MODES.items())}
# And under bf16_weights (bfloat16 weights, float32 masters in DeepSpeed's bf16 optimizer: ZeRO 1; no LoRA).
MODES |= {f"{name}-bf16w": dict(train, precision="bf16_weights", zero_stage=1)
          for name, train in list(MODES.items()) if "lora" not in train and "precision" not in train}
MICRO, PROMPT, RESPONSE = 8, 64, 64


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(folder: str, mode: str, out: str) -> None:
    """One trainer, one update; writes the measured peak beside the plan's figure."""
    import random

    import peft  # noqa: F401 - imported before the baseline in every mode: its import is not the model's memory
    import torch

    from rlpipe.config import RunConfig
    from rlpipe.storage.samples import Sample
    from rlpipe.training.plan import plan_memory
    from rlpipe.training.trainer import PolicyTrainer

    cuda = torch.cuda.is_available()
    train = {"algorithm": "grpo", "batch_size": MICRO, "micro_batch_size": MICRO, "lr": 1e-5, "pack_sequences": False,
             **({"precision": "bf16"} if cuda else {}), **MODES[mode]}
    cfg = RunConfig.model_validate({"train": train, "rollout": {"max_new_tokens": RESPONSE, "batch_size": 1,
                                                                "samples_per_prompt": MICRO}})
    plan = plan_memory(cfg, folder, gpu=cuda, prompt_tokens=PROMPT)
    rng = random.Random(0)
    samples = [Sample([rng.randrange(5, 700) for _ in range(PROMPT)], [rng.randrange(5, 700) for _ in range(RESPONSE)],
                      [-1.0] * RESPONSE, float(i % 2), 0) for i in range(MICRO)]
    base = torch.cuda.memory_allocated() if cuda else _rss()
    trainer = PolicyTrainer(model_dir=folder, cfg=cfg.train, seed=0, max_new_tokens=RESPONSE)
    trainer.update(samples, 0)  # the Adam moments exist from the first step on:
    start = time.perf_counter()
    trainer.update(samples, 1)  # the second update is the steady state's peak (and its time)
    update_s = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) - base
    Path(out).write_text(json.dumps({"mode": mode, "measured": peak, "planned": plan.trainer_bytes,
                                     "parameters": plan.parameters, "trainable": plan.trainable,
                                     "device": "cuda" if cuda else "cpu", "seconds": update_s,
                                     "components": plan.components}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="30M,110M,400M")
    ap.add_argument("--modes", default="full,lora,checkpointing")
    ap.add_argument("--out", default="benchmarks/plan_memory.json")
    ap.add_argument("--child", nargs=3, metavar=("FOLDER", "MODE", "OUT"))
    args = ap.parse_args()
    if args.child:
        return child(*args.child)
    from rlpipe.training.standin import build_standin

    # glibc raises its mmap threshold after each large free (up to 32 MiB), after which freed activations stay in
    # the heap and RSS keeps their high-water mark: measured at 110M, a LoRA update's peak read 2.5 GiB with the
    # default and 1.7 GiB with the threshold fixed. A fixed threshold makes RSS follow the tensors alive.
    results = []
    env = os.environ | {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MALLOC_MMAP_THRESHOLD_": "131072"}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            hidden, layers = SIZES[size]
            folder = build_standin(Path(tmp) / size, "qwen2", hidden=hidden, layers=layers, heads=hidden // 64,
                                   kv_heads=hidden // 128, intermediate=hidden * 4)
            for mode in args.modes.split(","):
                out = Path(tmp) / f"{size}-{mode}.json"
                env["MASTER_PORT"] = str(29600 + len(results))
                subprocess.run([sys.executable, __file__, "--child", str(folder), mode, str(out)], env=env, check=True,
                               stdout=subprocess.DEVNULL)
                r = json.loads(out.read_text()) | {"size": size}
                results.append(r)
                print(f"{size:>5} {mode:<14} params {r['parameters'] / 1e6:6.1f}M  measured {r['measured'] / 2**30:6.2f} GiB"
                      f"  planned {r['planned'] / 2**30:6.2f} GiB  ({r['planned'] / r['measured'] - 1:+.0%})"
                      f"  update {r['seconds']:.1f} s", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
