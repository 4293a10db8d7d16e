"""The update at a hub vocabulary: the output layer's logits everywhere (before 0e1039d) against only where a
response token is predicted (``rlpipe.training.packing.logits_at``), side by side.

    .venv/bin/python benchmarks/logits_at.py --before <a checkout of beab23b> --repeats 3

A stand-in of Qwen2-0.5B's shape (``--layers`` of hidden 896, intermediate 4864, 14 heads, 2 KV heads, a tied
vocabulary of 151,936; untrained, float32 in the trainer) with a byte-level BPE tokenizer, built once under
``--home``. Each side runs in a process of its own, alternating (before, now, now, before, …): the in-process
trainer (`PolicyTrainer`, DeepSpeed, the default GRPO settings: packed sequences, shared prompts) updates on
``--groups`` prompts of ``--prompt`` tokens × 8 completions of ``--response`` tokens, one optimizer step of one
micro-batch; after a warm-up update, ``--repeats`` updates are timed. ``--chunk N`` adds a side with
``train.logits_chunk: N`` (the output layer in chunks the backward recomputes). Reports per side: seconds per update
(median), the process's peak RSS (``ru_maxrss``), and the positions the forward computed (a hook on the input
embeddings) against those that predict a response token.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 151_936


def build(home: Path, layers: int) -> Path:
    """The stand-in checkpoint (built once): build_standin's tokenizer and config, the vocabulary widened to
    Qwen2's 151,936 (the tokenizer's 716 ids are its first rows, as a hub model pads past its tokenizer)."""
    folder = home / f"qwen2-0.5b-shape-{layers}l"
    if (folder / "model.safetensors").exists():
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlpipe.training.standin import build_standin

    build_standin(folder, "qwen2", hidden=896, layers=layers, heads=14, kv_heads=2, intermediate=4864, max_positions=4096)
    config = AutoConfig.from_pretrained(folder)
    config.vocab_size = VOCAB
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


def one_side(a: argparse.Namespace) -> dict:
    """One process: the trainer of the ``src`` on sys.path, timed."""
    import random

    import torch

    from rlpipe.config import TrainConfig
    from rlpipe.storage.samples import Sample
    from rlpipe.training.trainer import PolicyTrainer

    torch.set_num_threads(a.threads)
    n = a.groups * 8
    chunk = {"logits_chunk": a.chunk} if a.side == "chunked" else {}
    cfg = TrainConfig(algorithm="grpo", batch_size=n, micro_batch_size=n, lr=1e-6, **chunk)
    t = PolicyTrainer(model_dir=str(a.model), cfg=cfg, seed=0, max_new_tokens=a.response)
    rng = random.Random(0)
    samples = []
    for g in range(a.groups):
        prompt = [rng.randrange(3, 700) for _ in range(a.prompt)]
        for k in range(8):
            resp = [rng.randrange(3, 700) for _ in range(a.response)]
            samples.append(Sample(prompt, resp, [-2.0] * a.response, float(k % 2), g))
    positions = []
    t.engine.module.get_input_embeddings().register_forward_hook(lambda m, i, o: positions.append(int(i[0].numel())))
    t.update(samples, 0)
    times = []
    for k in range(a.repeats):
        positions.clear()
        start = time.perf_counter()
        t.update(samples, k + 1)
        times.append(time.perf_counter() - start)
    return {"side": a.side, "s_per_update": round(statistics.median(times), 3), "times": [round(x, 3) for x in times],
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
            "positions_computed": sum(positions), "response_positions": n * a.response}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, help="a checkout of the code before (its src/ is used)")
    ap.add_argument("--layers", type=int, default=24, help="Qwen2-0.5B has 24")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=96)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=None, help="also a side with train.logits_chunk at this value")
    ap.add_argument("--sides", default=None, help="comma-separated subset of before,now,chunked (default: all given)")
    ap.add_argument("--home", type=Path, default=Path("/tmp/rlpipe-bench/logits-at"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/rlpipe-bench/logits-at/result.json"))
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.side:  # a child: one side, its src first on the path
        print(json.dumps(one_side(a)), flush=True)
        return
    sys.path.insert(0, str(ROOT / "src"))
    model = build(a.home, a.layers)
    sides = {"before": a.before / "src", "now": ROOT / "src"} | ({"chunked": ROOT / "src"} if a.chunk else {})
    order = [k for k in sides if a.sides is None or k in a.sides.split(",")]
    results: list[dict] = []
    for pair in range(a.pairs):
        for side in (order if pair % 2 == 0 else order[::-1]):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--side", side, "--model", str(model)]
            env = os.environ | {"PYTHONPATH": str(sides[side])}  # that side's rlpipe before the installed one
            run = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if run.returncode == 0:
                results.append(json.loads(run.stdout.strip().splitlines()[-1]))
            else:  # e.g. killed by the kernel for memory (-9): a result too, not a crash of the comparison
                results.append({"side": side, "failed": f"exit {run.returncode}"
                                + (" (SIGKILL: out of memory?)" if run.returncode == -9 else ""),
                                "stderr_tail": run.stderr[-400:]})
            print(f"[{len(results)}/{len(order) * a.pairs}] {json.dumps(results[-1])}", flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(a).items()}, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
