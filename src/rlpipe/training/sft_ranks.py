"""SFT on N data-parallel DeepSpeed ranks (``sft.nproc``, ``rlpipe sft --nproc N``).

The caller's process hands the start model, the encoded examples and the validation rows to N processes started by
``torch.distributed.run``; each runs :func:`rlpipe.training.sft.train_sft_examples` (every rank takes every N-th
example of a step's batch; the gradients are reduced before the step). Rank 0 runs the validation checks, prints
each logged point as a ``SFTLOG {json}`` line that the caller forwards to its own ``log`` as it comes, and writes the
trained weights and the result; the caller loads them back into its model.

    python -m rlpipe.training.sft_ranks --work DIR   # under torch.distributed.run; DIR written by train_sft_ranks
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlpipe.config import SFTConfig

__all__ = ["train_sft_ranks"]

TAG = "SFTLOG "


def train_sft_ranks(model: Any, tokenizer: Any, examples: Sequence[tuple[list[int], list[int]]], cfg: SFTConfig,
                    seed: int = 0, log: Callable[[int, dict[str, float]], None] | None = None,
                    probe: Sequence[dict[str, Any]] = (), max_new_tokens: int = 8, verifier: str | None = "exact") -> Any:
    """:func:`train_sft_examples` on ``cfg.nproc`` ranks; ``model`` holds the trained weights afterwards. The
    validation checks (``probe`` rows, greedy, ``verifier``) run on rank 0 as in one process."""
    from safetensors.torch import load_file

    from rlpipe.net import free_port
    from rlpipe.training.sft import SFTResult

    with tempfile.TemporaryDirectory(prefix="rlpipe-sft-") as tmp:
        work = Path(tmp)
        model.save_pretrained(work / "start", safe_serialization=True)
        tokenizer.save_pretrained(work / "start")
        (work / "job.json").write_text(json.dumps({
            "cfg": cfg.model_dump(), "seed": seed, "examples": [list(map(list, e)) for e in examples],
            "probe": list(probe), "max_new_tokens": max_new_tokens, "verifier": verifier}))
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={cfg.nproc}", f"--master_port={free_port()}",
               "-m", "rlpipe.training.sft_ranks", "--work", str(work)]
        tail: list[str] = []
        with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            for line in proc.stdout:
                if line.startswith(TAG):
                    point = json.loads(line[len(TAG):])
                    if log:
                        log(point.pop("step"), point)
                else:
                    tail = (tail + [line])[-40:]
        if proc.returncode != 0:
            raise RuntimeError(f"SFT on {cfg.nproc} ranks failed (exit {proc.returncode}):\n{''.join(tail)}")
        done = json.loads((work / "out" / "result.json").read_text())
        trained = load_file(work / "out" / "model.safetensors")
        missing, unexpected = model.load_state_dict(trained, strict=False)
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        if unexpected or [m for m in missing if not (tied and m.endswith("lm_head.weight"))]:
            raise RuntimeError(f"the ranks' weights do not fit the model: missing {missing}, unexpected {unexpected}")
        return SFTResult(**done)


def main() -> None:
    """One rank: train on the job in ``--work``; rank 0 writes ``out/``."""
    import dataclasses

    import torch

    from rlpipe.tokens import load_tokenizer
    from rlpipe.training.sft import evaluate_accuracy, train_sft_examples

    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    work = Path(ap.parse_args().work)
    job = json.loads((work / "job.json").read_text())
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(work / "start", dtype=torch.float32)
    tok = load_tokenizer(work / "start")
    cfg = SFTConfig.model_validate(job["cfg"])
    probe = job["probe"]

    def log(step: int, point: dict[str, float]) -> None:
        print(TAG + json.dumps({"step": step} | point), flush=True)

    def eval_fn(m: Any) -> dict[str, float]:
        return evaluate_accuracy(m, tok, probe, job["max_new_tokens"], verifier=job["verifier"])

    examples = [tuple(e) for e in job["examples"]]
    result = train_sft_examples(model, tok, examples, cfg, job["seed"], eval_fn=eval_fn if probe else None, log=log)
    import torch.distributed as dist

    if dist.get_rank() == 0:
        (work / "out").mkdir()
        model.save_pretrained(work / "out", safe_serialization=True)
        (work / "out" / "result.json").write_text(json.dumps(dataclasses.asdict(result)))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
