"""The policy trainer: a DeepSpeed engine that keeps model and optimizer in memory across iterations.

One :meth:`PolicyTrainer.update` call per RL iteration: the iteration's scored samples are split
into mini-batches of ``train.batch_size`` completions (one optimizer step each), every mini-batch
into ``gradient_accumulation_steps × world_size`` micro-batch slots (slot s runs on rank
s mod world). Log-probs are recomputed under the current policy; the loss is normalised by the
token count of the whole mini-batch and pre-multiplied by (GAS × world) to undo DeepSpeed's
averaging, so any split into micro-batches or ranks yields the same gradient (tested: 2 ranks
== 1 rank).

deepspeed is imported inside the trainer, never at module import.
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlpipe.algorithms import algorithm, compute_advantages, kl_penalty, policy_loss
from rlpipe.algorithms.advantages import AdvantageInput
from rlpipe.algorithms.functional import entropy_from_logits, token_logprobs
from rlpipe.config import TrainConfig
from rlpipe.training.checkpoint import TRAINER_STATE, file_weights_sha256, rng_state, set_rng_state

__all__ = ["PolicyTrainer", "Sample", "init_distributed"]


@dataclass
class Sample:
    """One scored completion, as the trainer needs it."""

    prompt_ids: list[int]
    response_ids: list[int]
    old_logprobs: list[float]  # sampling log-probs, one per response token
    reward: float | None  # None unless the reward status is ok
    group: int  # samples of the same prompt share a group
    loss_mask: list[int] | None = None  # per response token; None = all 1

    @property
    def valid(self) -> bool:
        return self.reward is not None and math.isfinite(self.reward)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> tuple[int, int]:
    """Initialise torch.distributed (gloo on CPU, nccl on CUDA) once; (rank, world_size).

    A single process needs the launcher's variables or DeepSpeed looks for MPI: set them.
    """
    import deepspeed
    import torch.distributed as dist

    # Also when torch.distributed is already up (an in-process vLLM engine starts a 1-process
    # group): DeepSpeed still insists on LOCAL_RANK.
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


@dataclass
class _Micro:
    input_ids: torch.Tensor  # (b, L)
    attention_mask: torch.Tensor  # (b, L)
    targets: torch.Tensor  # (b, L-1) next-token ids
    mask: torch.Tensor  # (b, L-1) 1 where the target is a trained response token
    old_logprobs: torch.Tensor  # (b, L-1)
    advantages: torch.Tensor  # (b, L-1)


def _collate(samples: Sequence[Sample], adv: Sequence[float], pad_id: int) -> _Micro:
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    b = len(samples)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    att = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width - 1))
    old = torch.zeros((b, width - 1))
    advs = torch.zeros((b, width - 1))
    for i, (s, a) in enumerate(zip(samples, adv)):
        seq = s.prompt_ids + s.response_ids
        ids[i, : len(seq)] = torch.tensor(seq)
        att[i, : len(seq)] = 1
        p, r = len(s.prompt_ids), len(s.response_ids)
        # Position t predicts token t+1: response token j sits at p+j and is predicted at p+j-1.
        lm = torch.tensor(s.loss_mask if s.loss_mask is not None else [1] * r, dtype=torch.float32)
        mask[i, p - 1 : p - 1 + r] = lm
        old[i, p - 1 : p - 1 + r] = torch.tensor(s.old_logprobs, dtype=torch.float32)
        advs[i, p - 1 : p - 1 + r] = a
    return _Micro(ids, att, ids[:, 1:], mask, old, advs)


@dataclass
class PolicyTrainer:
    """Holds the DeepSpeed engine (policy + optimizer) and the frozen reference model."""

    model_dir: str
    cfg: TrainConfig
    temperature: float = 1.0
    seed: int = 0
    ref_model_dir: str | None = None
    resume_dir: str | None = None
    state: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        import deepspeed
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.rank, self.world = init_distributed()
        slots = self.cfg.batch_size // self.cfg.micro_batch_size
        if self.cfg.batch_size % (self.cfg.micro_batch_size * self.world) or slots % self.world:
            raise ValueError(
                f"train.batch_size ({self.cfg.batch_size}) must be a multiple of micro_batch_size "
                f"({self.cfg.micro_batch_size}) × ranks ({self.world})"
            )
        self.gas = slots // self.world
        torch.manual_seed(self.seed)
        src = self.resume_dir or self.model_dir
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(src)
        self.algo = algorithm(self.cfg.algorithm)
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
        ds_config = {
            "train_batch_size": self.cfg.batch_size,
            "train_micro_batch_size_per_gpu": self.cfg.micro_batch_size,
            "gradient_accumulation_steps": self.gas,
            "gradient_clipping": self.cfg.grad_clip,
            "zero_optimization": {"stage": self.cfg.zero_stage},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        self.ref = None
        if self.cfg.kl_coef > 0:
            self.ref = AutoModelForCausalLM.from_pretrained(self.ref_model_dir or self.model_dir, dtype=torch.float32)
            self.ref.eval().requires_grad_(False)
        if self.resume_dir:
            self._load_state(Path(self.resume_dir))

    # -- the update -------------------------------------------------------------------------
    def _forward(self, micro: _Micro, model: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(input_ids=micro.input_ids, attention_mask=micro.attention_mask).logits[:, :-1]
        return token_logprobs(logits, micro.targets, self.temperature), logits

    def _micro_loss(self, micro: _Micro, normalizer: float) -> tuple[torch.Tensor, dict[str, float]]:
        logprobs, logits = self._forward(micro, self.engine)
        scale = self.gas * self.world  # undo DeepSpeed's mean over accumulation steps and ranks
        pg, pm = policy_loss(
            self.algo["policy_loss"], logprobs, micro.old_logprobs, micro.advantages, micro.mask,
            clip_ratio=self.cfg.clip_ratio, normalizer=normalizer,
        )
        loss = pg
        tokens = float(micro.mask.sum())
        stats = {"pg_loss": float(pg.detach()) * normalizer, "tokens": tokens,
                 "clip_frac": float(pm["clip_frac"]) * tokens, "approx_kl_old": float(pm["approx_kl_old"]) * tokens}
        with torch.no_grad():
            stats["entropy"] = float((entropy_from_logits(logits, self.temperature) * micro.mask).sum())
        if self.ref is not None:
            with torch.no_grad():
                ref_lp, _ = self._forward(micro, self.ref)
            kl = kl_penalty(logprobs, ref_lp, self.cfg.kl_estimator)
            kl_term = (kl * micro.mask).sum() / normalizer
            loss = loss + self.cfg.kl_coef * kl_term
            stats["kl"] = float(kl_term.detach()) * normalizer
        return loss * scale, stats

    def update(self, samples: Sequence[Sample], iteration: int) -> dict[str, float]:
        """One iteration's optimizer steps on scored samples; invalid ones are left out and counted."""
        valid = [s for s in samples if s.valid]
        metrics: dict[str, float] = {"samples": len(samples), "samples_excluded": len(samples) - len(valid)}
        if not valid:
            return metrics | {"optimizer_steps": 0}
        adv_in = AdvantageInput(
            rewards=torch.tensor([s.reward for s in valid], dtype=torch.float32),
            group_ids=torch.tensor([s.group for s in valid]),
            valid=torch.ones(len(valid), dtype=torch.bool),
            response_mask=torch.ones(len(valid), 1),
        )
        adv, adv_metrics = compute_advantages(self.algo["advantage"], adv_in, **self.cfg.advantage_kwargs())
        seq_adv = adv[:, 0].tolist()
        # A seeded shuffle per iteration: identical on every rank and after a resume.
        order = list(range(len(valid)))
        random.Random(self.seed * 1_000_003 + iteration).shuffle(order)
        sums: dict[str, float] = {}
        grad_norms = []
        steps = 0
        self.engine.train()
        for start in range(0, len(order), self.cfg.batch_size):
            idx = order[start : start + self.cfg.batch_size]
            normalizer = float(sum(sum(valid[i].loss_mask or [1] * len(valid[i].response_ids)) for i in idx)) or 1.0
            slots = np.array_split(np.array(idx), self.gas * self.world)
            for k in range(self.gas):
                slot = slots[k * self.world + self.rank]
                if len(slot):
                    micro = _collate([valid[i] for i in slot], [seq_adv[i] for i in slot], self.tokenizer.pad_token_id)
                    loss, stats = self._micro_loss(micro, normalizer)
                else:  # an empty slot still takes part in the collective step
                    loss = sum(p.sum() for p in self.engine.module.parameters()) * 0.0
                    stats = {}
                self.engine.backward(loss)
                if k == self.gas - 1 and self.cfg.zero_stage == 0:
                    grad_norms.append(self._grad_norm())
                self.engine.step()
                for key, v in stats.items():
                    sums[key] = sums.get(key, 0.0) + v
            if self.cfg.zero_stage > 0:
                gn = self.engine.get_global_grad_norm()
                grad_norms.append(float(gn) if gn is not None else float("nan"))
            steps += 1
        sums = self._all_reduce(sums)
        tokens = max(sums.get("tokens", 0.0), 1.0)
        metrics |= {
            "optimizer_steps": steps,
            "loss": (sums.get("pg_loss", 0.0) + self.cfg.kl_coef * sums.get("kl", 0.0)) / tokens,
            "pg_loss": sums.get("pg_loss", 0.0) / tokens,
            "kl": sums.get("kl", 0.0) / tokens,
            "entropy": sums.get("entropy", 0.0) / tokens,
            "clip_frac": sums.get("clip_frac", 0.0) / tokens,
            "approx_kl_old": sums.get("approx_kl_old", 0.0) / tokens,
            "grad_norm": float(np.nanmean(grad_norms)) if grad_norms else float("nan"),
            "tokens": sums.get("tokens", 0.0),
        } | {f"adv_{k}": v for k, v in adv_metrics.items()}
        self.state["iteration"] = iteration
        return metrics

    def _grad_norm(self) -> float:
        sq = sum(float(p.grad.detach().float().pow(2).sum()) for p in self.engine.module.parameters() if p.grad is not None)
        return math.sqrt(sq)

    def _all_reduce(self, sums: dict[str, float]) -> dict[str, float]:
        if self.world == 1:
            return sums
        import torch.distributed as dist

        keys = ["pg_loss", "tokens", "clip_frac", "approx_kl_old", "entropy", "kl"]
        t = torch.tensor([sums.get(k, 0.0) for k in keys], dtype=torch.float64)
        dist.all_reduce(t)
        return dict(zip(keys, t.tolist()))

    # -- weights and state ------------------------------------------------------------------
    @property
    def module(self) -> Any:
        return self.engine.module

    def export_weights(self, folder: str | Path) -> str:
        """HF weights + tokenizer (rank 0); returns the sha256 of the saved safetensors."""
        folder = Path(folder)
        if self.rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            self.engine.module.save_pretrained(folder, safe_serialization=True)
            self.tokenizer.save_pretrained(folder)
            digest = file_weights_sha256(folder)
        else:
            digest = ""
        if self.world > 1:
            import torch.distributed as dist

            box = [digest]
            dist.broadcast_object_list(box, src=0)
            digest = box[0]
        return digest

    def save(self, folder: str | Path, extra_state: dict[str, Any] | None = None) -> str:
        """A resumable checkpoint: HF weights + tokenizer + DeepSpeed optimizer state + trainer state."""
        folder = Path(folder)
        digest = self.export_weights(folder)
        self.engine.save_checkpoint(str(folder / "deepspeed"), tag="state", save_latest=False)
        if self.rank == 0:
            state = dict(self.state) | (extra_state or {}) | {"weights_sha256": digest, "world_size": self.world}
            (folder / TRAINER_STATE).write_text(json.dumps(state, indent=2, sort_keys=True, default=str))
            torch.save(rng_state(), folder / "rng.pt")
        return digest

    def _load_state(self, folder: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(folder / "deepspeed"), tag="state", load_optimizer_states=True)
        if path is None:
            raise FileNotFoundError(f"{folder}/deepspeed holds no DeepSpeed checkpoint 'state'")
        self.state = json.loads((folder / TRAINER_STATE).read_text())
        rng = folder / "rng.pt"
        if rng.exists():
            set_rng_state(torch.load(rng, weights_only=False))
