"""Reward models: a scalar head on a causal-LM trunk, trained on preference pairs with DeepSpeed.

The model is the trunk with a one-output token-classification head (the critic's shape); a
sequence's score is the head's output at its last token (the end token after the response).
:class:`RewardModelTrainer` trains it with a registered preference loss (Bradley–Terry by default)
under DeepSpeed like the policy trainer, checks validation pair accuracy every ``eval_every``
steps, keeps the best weights and stops after ``patience`` checks without a gain.
:class:`RewardScorer` loads a saved reward model for scoring (in-process or behind the service).
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlpipe.algorithms.preference import preference_loss
from rlpipe.config import RewardModelConfig
from rlpipe.tokens import encode_chat_turn, encode_prompt, load_tokenizer
from rlpipe.storage.weights import file_weights_digest
from rlpipe.training.checkpoint import ADAPTER

__all__ = ["REWARD_STATS", "RewardModelTrainer", "RewardScorer", "RMTrainResult", "encode_response", "pair_accuracy"]

REWARD_STATS = "reward_stats.json"


def encode_response(tokenizer: Any, prompt: str, chat: bool, response: str) -> list[int]:
    """What the reward model reads: the rendered prompt, the response and the end token (for chat, the
    assistant's turn as the template writes it, as the policy was trained to write it)."""
    if chat:
        p, r = encode_chat_turn(tokenizer, json.loads(prompt), response)
        return p + r
    p = encode_prompt(tokenizer, prompt, chat)
    return p + tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def _batch(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask, torch.tensor([len(s) - 1 for s in seqs])


def scores(model: Any, seqs: Sequence[Sequence[int]], pad_id: int) -> torch.Tensor:
    """(B,) the head's output at each sequence's last token (right padding, so padding is never read)."""
    ids, mask, last = _batch(seqs, pad_id)
    dev = next(model.parameters()).device
    out = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits[..., 0]
    return out[torch.arange(len(seqs), device=dev), last.to(dev)].float()


@torch.no_grad()
def score_all(model: Any, seqs: Sequence[Sequence[int]], pad_id: int, batch_size: int = 256) -> list[float]:
    was = model.training
    model.eval()
    try:
        return [x for i in range(0, len(seqs), batch_size) for x in scores(model, seqs[i : i + batch_size], pad_id).tolist()]
    finally:
        model.train(was)


def pair_accuracy(chosen: Sequence[float], rejected: Sequence[float]) -> float:
    """Share of pairs whose chosen response scores strictly higher (a tie counts as wrong)."""
    return sum(c > r for c, r in zip(chosen, rejected)) / max(len(chosen), 1)


@dataclass
class Pair:
    chosen: list[int]
    rejected: list[int]
    margin: float | None = None


def encode_pairs(tokenizer: Any, rows: Sequence[dict[str, Any]]) -> list[Pair]:
    return [Pair(encode_response(tokenizer, r["prompt"], r["chat"], r["chosen"]),
                 encode_response(tokenizer, r["prompt"], r["chat"], r["rejected"]), r.get("margin")) for r in rows]


@dataclass
class RMTrainResult:
    steps: int = 0
    wall_s: float = 0.0
    best_step: int = 0
    best_validation_accuracy: float | None = None
    stopped_early: bool = False
    history: list[dict[str, float]] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)


def with_head_lora(model: Any, cfg: Any) -> Any:
    """A scalar-head model (``*ForTokenClassification``) with LoRA adapters on its trunk per ``cfg`` (a target that
    matches nothing is refused, as for the policy) and its new head trained in full (peft's modules_to_save)."""
    from peft import LoraConfig, get_peft_model

    from rlpipe.training.lora import lora_targets

    head = [n for n, m in model.named_children() if isinstance(m, torch.nn.Linear) and m.out_features == 1]
    if len(head) != 1:
        raise ValueError(f"rm.lora: no single scalar head among the model's top modules {[n for n, _ in model.named_children()]}")
    peft_cfg = LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, bias="none", modules_to_save=head,
                          target_modules=lora_targets(model, cfg.target_modules, exclude=head[0], key="rm.lora"))
    return get_peft_model(model, peft_cfg)


class RewardModelTrainer:
    """A DeepSpeed engine around the reward model; :meth:`train` runs the whole fit with early stopping."""

    def __init__(self, model_dir: str | Path, cfg: RewardModelConfig, seed: int = 0):
        from transformers import AutoConfig, AutoModelForTokenClassification

        from rlpipe.training.engines import init_distributed

        self.cfg, self.seed = cfg, seed
        self.rank, self.world = init_distributed()
        slots = cfg.batch_size // cfg.micro_batch_size
        if cfg.batch_size % (cfg.micro_batch_size * self.world):
            raise ValueError(f"rm.batch_size ({cfg.batch_size}) must be a multiple of rm.micro_batch_size "
                             f"({cfg.micro_batch_size}) × ranks ({self.world})")
        self.gas = slots // self.world
        config = AutoConfig.from_pretrained(model_dir, num_labels=1)
        config.classifier_dropout = 0.0
        torch.manual_seed(seed + 29)  # the new head: the same start on every rank and rerun
        model = AutoModelForTokenClassification.from_pretrained(model_dir, config=config, dtype=torch.float32)
        torch.manual_seed(seed)
        if cfg.lora:
            model = with_head_lora(model, cfg.lora)
        self.tokenizer = load_tokenizer(model_dir)
        self.engine = self._engine(model)
        self.loss_fn = preference_loss(cfg.loss)

    def _engine(self, model: Any) -> Any:
        import deepspeed

        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=self.cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
        # Linear warm-up, then cosine decay to min_lr_ratio × lr at the last step (as OpenRLHF's RM recipe):
        # a constant rate leaves validation pair accuracy swinging by several points between checks.
        warm, total, floor = self.cfg.warmup_steps, self.cfg.steps, self.cfg.min_lr_ratio

        def factor(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            progress = min(1.0, (step - warm) / max(total - warm, 1))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        ds_config = {
            "train_batch_size": self.cfg.batch_size, "train_micro_batch_size_per_gpu": self.cfg.micro_batch_size,
            "gradient_accumulation_steps": self.gas, "gradient_clipping": self.cfg.grad_clip,
            "zero_optimization": {"stage": self.cfg.zero_stage}, "steps_per_print": 10**9,
        }
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule, config=ds_config)
        return engine

    @property
    def module(self) -> Any:
        return self.engine.module

    def _micro(self, pairs: Sequence[Pair]) -> dict[str, float]:
        pad = self.tokenizer.pad_token_id
        s = scores(self.engine, [p.chosen for p in pairs] + [p.rejected for p in pairs], pad)
        margin = None
        if self.cfg.use_margin and any(p.margin is not None for p in pairs):
            margin = torch.tensor([float("nan") if p.margin is None else p.margin for p in pairs])
        loss, metrics = self.loss_fn(s[: len(pairs)], s[len(pairs):], margin)
        self.engine.backward(loss)
        self.engine.step()  # DeepSpeed applies the optimizer only at the accumulation boundary
        return metrics

    def _step(self, pairs: Sequence[Pair]) -> dict[str, float]:
        """One optimizer step over ``batch_size`` pairs (this rank's micro-batch slots)."""
        m = self.cfg.micro_batch_size
        mine = [pairs[i : i + m] for i in range(0, len(pairs), m)][self.rank :: self.world]
        out = [self._micro(chunk) for chunk in mine]
        return {k: sum(o[k] for o in out) / len(out) for k in out[0]}

    def evaluate(self, pairs: Sequence[Pair]) -> dict[str, float]:
        pad = self.tokenizer.pad_token_id
        c = score_all(self.module, [p.chosen for p in pairs], pad)
        r = score_all(self.module, [p.rejected for p in pairs], pad)
        return {"pair_accuracy": pair_accuracy(c, r), "n": len(pairs),
                "score_gap": sum(a - b for a, b in zip(c, r)) / max(len(pairs), 1)}

    def train(self, train: Sequence[Pair], validation: Sequence[Pair],
              log: Callable[[int, dict[str, float]], None] | None = None) -> RMTrainResult:
        """Shuffled passes over ``train`` until ``steps``; the weights of the best validation check are kept."""
        if len(train) < self.cfg.batch_size:
            raise ValueError(f"{len(train)} training pairs, fewer than one batch (rm.batch_size {self.cfg.batch_size})")
        rng, order, res = random.Random(self.seed), [], RMTrainResult()
        best_state, waited, start = None, 0, time.perf_counter()
        self.engine.train()
        for step in range(1, self.cfg.steps + 1):
            if len(order) < self.cfg.batch_size:
                epoch = list(range(len(train)))
                rng.shuffle(epoch)
                order += epoch
            idx, order = order[: self.cfg.batch_size], order[self.cfg.batch_size :]
            point = self._step([train[i] for i in idx]) | {"step": step}
            res.history.append(point)
            res.steps = step
            if log and step % 10 == 0:
                log(step, {f"train_{k}": v for k, v in point.items() if k != "step"})
            if not validation or (step % self.cfg.eval_every and step != self.cfg.steps):
                continue
            ev = self.evaluate(validation) | {"step": step}
            res.evals.append(ev)
            if log:
                log(step, {"validation_pair_accuracy": ev["pair_accuracy"], "validation_score_gap": ev["score_gap"]})
            if res.best_validation_accuracy is None or ev["pair_accuracy"] > res.best_validation_accuracy:
                res.best_validation_accuracy, res.best_step, waited = ev["pair_accuracy"], step, 0
                best_state = copy.deepcopy(self.module.state_dict())
            else:
                waited += 1
                if waited >= self.cfg.patience:
                    res.stopped_early = True
                    break
        if best_state is not None:
            self.module.load_state_dict(best_state)
        res.wall_s = time.perf_counter() - start
        self.module.eval()
        return res

    def reward_stats(self, train: Sequence[Pair], limit: int = 2048) -> dict[str, float]:
        """Mean and std of the scores of training responses: the starting point of reward normalisation."""
        seqs = [s for p in train[:limit] for s in (p.chosen, p.rejected)]
        xs = score_all(self.module, seqs, self.tokenizer.pad_token_id)
        mean = sum(xs) / len(xs)
        std = (sum((x - mean) ** 2 for x in xs) / len(xs)) ** 0.5
        return {"mean": mean, "std": std, "count": float(len(xs))}

    def save(self, folder: str | Path, stats: dict[str, Any]) -> str:
        """HF weights + tokenizer + reward statistics (rank 0); the digest of the weights (:func:`rlpipe.storage.weights.weights_digest`)."""
        folder = Path(folder)
        if self.rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            if self.cfg.lora:  # the adapter (and head) beside a plain HF folder of the merged weights
                self.module.save_pretrained(folder / ADAPTER, safe_serialization=True)
                merged = copy.deepcopy(self.module).merge_and_unload()
                merged.save_pretrained(folder, safe_serialization=True)
            else:
                self.module.save_pretrained(folder, safe_serialization=True)
            self.tokenizer.save_pretrained(folder)
            (folder / REWARD_STATS).write_text(json.dumps(stats, indent=2, sort_keys=True))
        return file_weights_digest(folder) if self.rank == 0 else ""


class RewardScorer:
    """A saved reward model in memory, scoring (prompt, response) texts or token ids in batches."""

    def __init__(self, folder: str | Path, version: str, batch_size: int = 256, device: str | None = None):
        from transformers import AutoModelForTokenClassification

        folder = Path(folder)
        self.version, self.batch_size = version, batch_size
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForTokenClassification.from_pretrained(folder, dtype=torch.float32).to(self.device).eval()
        self.tokenizer = load_tokenizer(folder)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        stats = folder / REWARD_STATS
        self.stats = json.loads(stats.read_text()) if stats.exists() else {}
        self.weights_sha256 = file_weights_digest(folder)

    def score_ids(self, seqs: Sequence[Sequence[int]]) -> list[float]:
        return score_all(self.model, seqs, self.tokenizer.pad_token_id, self.batch_size)

    def encode(self, prompt: str, response: str, chat: bool = False) -> list[int]:
        return encode_response(self.tokenizer, prompt, chat, response)

    def score_texts(self, items: Sequence[tuple[str, str, bool]]) -> list[float]:
        """Scores of ``(prompt, response, chat)`` triples."""
        return self.score_ids([self.encode(p, r, c) for p, r, c in items])
