"""Sequence packing in the update (`train.pack_sequences`, `train.share_prompts`): seconds per update, padded vs
packed vs packed with shared prompts.

    .venv/bin/python benchmarks/packing.py --out /tmp/rlpipe-bench/packing.json

One process, two in-process trainers (`PolicyTrainer`, DeepSpeed on gloo) on the same untrained tiny model
built from the default model config, the demo's training settings (256 completions per update, 4 optimizer
steps of 64, one micro-batch each, the samples shuffled across groups): three trainers, padded, packed, and packed
with each micro-batch's shared prompts computed once. For each response-length bound (`--max-new`), a batch
shaped like the demo's (32 arithmetic prompts × 8 completions, response lengths uniform in 1..bound): a warm-up
update each, then ``--repeats`` updates alternating between the trainers (so a slow moment of the machine hits
all); median seconds per update, the positions each forward computes, and the largest weight difference to the
padded trainer after the same updates (float rounding only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def positions(trainer, batch: list, micro: int) -> dict[str, int]:
    """Positions the forward computes over one update's micro-batches (in the update's shuffled order): padded,
    and as the trainer lays them."""
    from rlpipe.training.packing import collate

    order = trainer._order(batch, 1, 0)  # the first timed update's order
    padded = laid = 0
    for start in range(0, len(batch), micro):
        m = collate([batch[i] for i in order[start : start + micro]], {}, trainer.tokenizer.pad_token_id,
                     pack=trainer.cfg.pack_sequences, share=trainer.cfg.share_prompts)
        padded += m.input_ids.numel()
        laid += m.packed.input_ids.numel() if m.packed is not None else m.input_ids.numel()
    return {"padded": padded, "computed": laid, "tokens": sum(len(s.prompt_ids) + len(s.response_ids) for s in batch)}


def measure(trainers: dict[str, object], batch: list, repeats: int, micro: int) -> dict[str, object]:
    for t in trainers.values():
        t.update(batch, 0)  # warm-up
    wall: dict[str, list[float]] = {k: [] for k in trainers}
    for k in range(1, repeats + 1):
        for name, t in trainers.items():
            start = time.perf_counter()
            t.update(batch, k)
            wall[name].append(time.perf_counter() - start)
    base = trainers["padded"].engine.module.state_dict()
    out: dict[str, object] = {f"{name}_s": round(statistics.median(ts), 4) for name, ts in wall.items()}
    out |= {"positions_" + name: positions(t, batch, micro) for name, t in trainers.items()}
    for name, t in trainers.items():
        if name != "padded":
            w = t.engine.module.state_dict()
            out[f"max_weight_diff_{name}"] = max(float((w[key] - base[key]).abs().max()) for key in base)
            out[f"speedup_{name}"] = round(out["padded_s"] / out[f"{name}_s"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-new", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("/tmp/rlpipe-bench/packing.json"))
    a = ap.parse_args()
    sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # this checkout's code, a worktree's too (not the installed one)
    from profile_update import samples, untrained_policy
    from rlpipe.config import RunConfig
    from rlpipe.training.trainer import PolicyTrainer

    cfg = RunConfig()
    folder = untrained_policy(cfg)
    results = {}
    for max_new in a.max_new:
        layouts = (("padded", False, False), ("packed", True, False), ("shared", True, True))
        trainers = {name: PolicyTrainer(model_dir=str(folder), cfg=cfg.train.model_copy(
                        update={"pack_sequences": pack, "share_prompts": share}), seed=0, max_new_tokens=max_new)
                    for name, pack, share in layouts}
        batch = samples(trainers["padded"].tokenizer, cfg.rollout.batch_size, cfg.rollout.samples_per_prompt, max_new, 0)
        results[max_new] = measure(trainers, batch, a.repeats, cfg.train.micro_batch_size)
        print(f"[packing] responses 1..{max_new}: {json.dumps(results[max_new])}", flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
