"""Trainer updates on a fixed batch, run alone or under torchrun; each case writes its updated weights."""

import argparse
import gc
import json
import random
import sys
from pathlib import Path

import torch

from rlpipe.config import TrainConfig
from rlpipe.storage.samples import Sample
from rlpipe.training.trainer import PolicyTrainer


def fixed_batch(n: int = 48) -> list[Sample]:
    rng = random.Random(123)
    out = []
    for i in range(n):
        prompt = [rng.randrange(5, 90) for _ in range(rng.randint(3, 7))]
        resp = [rng.randrange(5, 90) for _ in range(rng.randint(1, 5))]
        reward = None if i % 11 == 5 else float(rng.random() < 0.5)
        out.append(Sample(prompt, resp, [rng.uniform(-3, -0.1) for _ in resp], reward, i // 6, truncated=len(resp) == 5))
    return out


def run_case(model: str, out: Path, zero: int, kl: float, sets: list[str]) -> None:
    """One update from ``model`` on the fixed batch; weights and (rank 0) metrics.json into ``out``."""
    import yaml

    extra = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in sets)}
    if "critic_lr" in extra:
        extra["critic"] = {"lr": extra.pop("critic_lr")}
    cfg = TrainConfig(**({"batch_size": 16, "micro_batch_size": 4, "zero_stage": zero, "lr": 1e-3, "kl_coef": kl} | extra))
    trainer = PolicyTrainer(model_dir=model, cfg=cfg, seed=0, max_new_tokens=5)
    metrics = trainer.update(fixed_batch(), iteration=0)
    digest = trainer.export_weights(str(out))
    if trainer.rank == 0:
        json.dump({"metrics": metrics, "sha": digest, "world": trainer.world}, open(out / "metrics.json", "w"))
    del trainer
    gc.collect()


def main() -> None:
    """``--cases FILE``: a JSON object ``{name: {"zero": Z, "kl": K, "sets": [...]}}``, run one after another
    in this process (one launch, one process group, for all of them); each writes ``OUT/<name>/``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    for name, case in json.loads(Path(a.cases).read_text()).items():
        out = Path(a.out) / name
        out.mkdir(parents=True, exist_ok=True)
        run_case(a.model, out, case.get("zero", 0), case.get("kl", 0.0), case.get("sets", []))
    # Leave the gloo group cleanly: exiting with it alive can abort a rank during interpreter teardown
    # ("terminate called without an active exception").
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
