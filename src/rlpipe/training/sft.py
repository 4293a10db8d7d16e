"""Supervised fine-tuning on prompt → solution pairs, with the loss on response tokens only.

Used as the warm-up before RL: it takes a model from chance to a middling accuracy so that
sampled rewards are not all zero (a start below ~5% sampled accuracy does not recover under
GRPO; see shared/FACTS-rl-on-cpu.md).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from rlpipe.config import SFTConfig
from rlpipe.tokens import encode_chat_turn, encode_prompt, render_prompt

IGNORE = -100

__all__ = ["IGNORE", "SFTResult", "collate", "encode_chat_example", "encode_example", "encode_row", "episode_example",
           "evaluate_accuracy", "sft_loss", "train_sft", "train_sft_examples"]


def encode_example(tokenizer: Any, prompt_text: str, response: str) -> tuple[list[int], list[int]]:
    """Token ids of prompt+response+eos and labels with every prompt position set to IGNORE."""
    p = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return p + r, [IGNORE] * len(p) + r


def encode_chat_example(tokenizer: Any, messages: list[dict[str, Any]], response: str) -> tuple[list[int], list[int]]:
    """A chat row with loss on the assistant's turn only (:func:`rlpipe.tokens.encode_chat_turn`)."""
    p, r = encode_chat_turn(tokenizer, messages, response)
    return p + r, [IGNORE] * len(p) + r


def encode_row(tokenizer: Any, row: dict[str, Any]) -> tuple[list[int], list[int]]:
    """A prompt row as an SFT example: its solution (else its reference answer) after its prompt."""
    response = row.get("solution") or row["ground_truth"]
    if row["chat"]:
        return encode_chat_example(tokenizer, json.loads(row["prompt"]), response)
    p = encode_prompt(tokenizer, row["prompt"], chat=False)
    r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return p + r, [IGNORE] * len(p) + r


def collate(examples: Sequence[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example; padding carries no loss and no attention."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        attention[i, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention}


def sft_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean next-token cross-entropy over labelled (response) positions.

    logits: (B, T, V) scores for the token after each position; labels: (B, T) target ids at each
    position, IGNORE where no loss applies (prompt, padding). Position t predicts labels[:, t+1].
    """
    shift_logits = logits[:, :-1].reshape(-1, logits.size(-1)).float()
    shift_labels = labels[:, 1:].reshape(-1)
    n = int((shift_labels != IGNORE).sum())
    if n == 0:
        return logits.sum() * 0.0, {"loss": 0.0, "tokens": 0}
    loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE, reduction="sum") / n
    return loss, {"loss": float(loss.detach()), "tokens": n}


@torch.no_grad()
def greedy_answers(model: Any, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int, batch_size: int = 256) -> list[str]:
    """Greedy completions (text up to the end token) for rendered prompts."""
    was_training = model.training
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    out: list[str] = []
    try:
        for i in range(0, len(prompts), batch_size):
            enc = tokenizer(list(prompts[i : i + batch_size]), return_tensors="pt", padding=True, add_special_tokens=False)
            enc = {k: v.to(model.device) for k, v in enc.items()}
            gen = model.generate(
                **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
            new = gen[:, enc["input_ids"].shape[1] :]
            out += tokenizer.batch_decode(new, skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return out


def evaluate_accuracy(
    model: Any, tokenizer: Any, rows: Sequence[dict[str, Any]], max_new_tokens: int = 8, verifier: str | None = "exact"
) -> dict[str, float]:
    """Share of rows whose greedy answer the verifier accepts (non-ok verdicts count as wrong).

    ``verifier=None`` uses each row's own verifier (its ``task``)."""
    from rlpipe.rewards import get_verifier

    prompts = [render_prompt(tokenizer, r["prompt"], r["chat"]) for r in rows]
    answers = greedy_answers(model, tokenizer, prompts, max_new_tokens)
    results = [get_verifier(verifier or r["task"])(a, r["ground_truth"] if r["ground_truth"] is not None else r["tests"])
               for a, r in zip(answers, rows)]
    correct = sum(1 for v in results if v.status == "ok" and v.reward == 1.0)
    return {"accuracy": correct / max(len(rows), 1), "n": len(rows), "not_ok": sum(v.status != "ok" for v in results)}


def _micro_loss(model: Any, micro: Sequence[tuple[list[int], list[int]]], pad_id: int, pack: bool,
                device: torch.device, bf16: bool) -> tuple[torch.Tensor, int]:
    """Mean next-token cross-entropy of a micro-batch's labelled positions and their count; ``pack``: the
    examples end to end in rows (position ids restart at each; the trainer's packed layout), no padding."""
    batch = {k: v.to(device) for k, v in collate(micro, pad_id).items()}
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        if not pack:  # sft_loss: the one-process loop's arithmetic (the demo's figures reproduce to the bit)
            loss, m = sft_loss(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                               batch["labels"])
            return loss, m["tokens"]
        from rlpipe.training.packing import pack_rows

        p = pack_rows([ids for ids, _ in micro], batch["input_ids"].shape[1], pad_id).to(device)
        logits = model(input_ids=p.input_ids, position_ids=p.position_ids, use_cache=False).logits[:, :-1]
    targets = batch["labels"][:, 1:].reshape(-1)[p.dst]
    n = int((targets != IGNORE).sum())
    if n == 0:
        return logits.sum() * 0.0, 0
    picked = logits.reshape(-1, logits.size(-1))[p.src].float()
    return F.cross_entropy(picked, targets, ignore_index=IGNORE, reduction="sum") / n, n


def accumulate(engine: Any, batch: Sequence[tuple[list[int], list[int]]], pad_id: int, cfg: SFTConfig,
               device: torch.device, rank: int = 0, world: int = 1) -> dict[str, float]:
    """Backward of this rank's share of one step's batch (every world-th example) in micro-batches of
    ``cfg.micro_batch_size``: each micro-batch's summed token loss over the whole batch's response tokens, so the
    accumulated gradient, summed over ranks, is the one-pass gradient of the batch's mean loss (not the mean of
    micro-batch means, which weights short micro-batches up). DeepSpeed averages over ranks: the loss is scaled
    by ``world`` to undo it. The last micro-batch is the accumulation boundary (the reduction)."""
    total = sum(sum(1 for lab in labels[1:] if lab != IGNORE) for _, labels in batch)
    mine = list(batch[rank::world])
    size = cfg.micro_batch_size or len(batch)
    micros = [mine[i : i + size] for i in range(0, len(mine), size)] or [[]]
    loss_sum = 0.0
    for k, micro in enumerate(micros):
        engine.set_gradient_accumulation_boundary(k == len(micros) - 1)
        if micro:
            loss, n = _micro_loss(engine, micro, pad_id, cfg.pack_sequences, device, cfg.precision == "bf16")
        else:  # a rank with no example this step still joins the reduction
            loss, n = sum(p.sum() for p in engine.module.parameters()) * 0.0, 0
        engine.backward(loss * n / max(total, 1) * world)
        if k < len(micros) - 1:
            engine.step()  # not a boundary: DeepSpeed counts the micro-step, the optimizer does not move
        loss_sum += float(loss.detach()) * n
    return {"loss": loss_sum / max(total, 1), "tokens": total}


def _sft_engine(model: torch.nn.Module, cfg: SFTConfig, world: int) -> Any:
    """The RL trainer's machinery: a DeepSpeed engine over torch's AdamW, ZeRO ``cfg.zero_stage``, bf16 autocast
    under ``precision: bf16``; gradients clipped at 1.0 (ZeRO 0: by :func:`_clip`, as the one-process loop did;
    ZeRO 1/2: by DeepSpeed, which holds the partitions)."""
    import deepspeed

    if cfg.batch_size % world:
        raise ValueError(f"sft.batch_size ({cfg.batch_size}) must be a multiple of the ranks ({world})")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    ds = {"train_batch_size": cfg.batch_size, "train_micro_batch_size_per_gpu": cfg.batch_size // world,
          "gradient_accumulation_steps": 1, "gradient_clipping": 1.0 if cfg.zero_stage else 0.0,
          "zero_optimization": {"stage": cfg.zero_stage}, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if cfg.precision == "bf16":
        ds["torch_autocast"] = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    if world == 1 and cfg.zero_stage == 0:
        engine.enable_backward_allreduce = False  # nothing to reduce
    return engine


@dataclass
class SFTResult:
    steps: int
    final_loss: float
    wall_s: float
    history: list[dict[str, float]] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)
    stopped_early: bool = False


def train_sft(model: torch.nn.Module, tokenizer: Any, train_rows: Sequence[dict[str, Any]], cfg: SFTConfig,
              **options: Any) -> SFTResult:
    """:func:`train_sft_examples` on prompt rows (each encoded by :func:`encode_row`); ``options``: its ``seed``,
    ``eval_fn`` and ``log``, by name."""
    if not train_rows:
        raise ValueError("SFT needs at least one training row (split 'train')")
    examples = [encode_row(tokenizer, r) for r in train_rows]
    return train_sft_examples(model, tokenizer, examples, cfg, **options)


def episode_example(prompt_ids: Sequence[int], response_ids: Sequence[int], loss_mask: Sequence[int]) -> tuple[list[int], list[int]]:
    """A multi-turn demonstration as an SFT example: loss on the policy's tokens (mask 1) only — never on
    the prompt or on observation tokens, exactly as the RL update masks them."""
    labels = [IGNORE] * len(prompt_ids) + [t if m else IGNORE for t, m in zip(response_ids, loss_mask)]
    return list(prompt_ids) + list(response_ids), labels


def train_sft_examples(
    model: torch.nn.Module,
    tokenizer: Any,
    examples: Sequence[tuple[list[int], list[int]]],
    cfg: SFTConfig,
    seed: int = 0,
    eval_fn: Callable[[torch.nn.Module], dict[str, float]] | None = None,
    log: Callable[[int, dict[str, float]], None] | None = None,
) -> SFTResult:
    """AdamW on encoded ``(input_ids, labels)`` examples (labels ``IGNORE`` where no loss); shuffles with ``seed``;
    periodic validation checks via ``eval_fn``."""
    if not examples:
        raise ValueError("SFT needs at least one example")
    from rlpipe.training.engines import init_distributed
    from rlpipe.training.packing import check_packing

    rank, world = init_distributed()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model.train()
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if cfg.pack_sequences:
        check_packing(model, "sft.pack_sequences")
    engine = _sft_engine(model, cfg, world)
    device = torch.device(engine.device)  # the trainer's rule: the rank's GPU when present
    order: list[int] = []
    result = SFTResult(steps=0, final_loss=math.nan, wall_s=0.0)
    start = time.perf_counter()
    ema = None
    for step in range(1, cfg.steps + 1):
        if len(order) < cfg.batch_size:
            epoch = list(range(len(examples)))
            rng.shuffle(epoch)
            order += epoch
        idx, order = order[: cfg.batch_size], order[cfg.batch_size :]
        for group in engine.optimizer.param_groups:  # linear warm-up, then constant
            group["lr"] = cfg.lr * min(1.0, step / max(cfg.warmup_steps, 1))
        metrics = accumulate(engine, [examples[i] for i in idx], tokenizer.pad_token_id, cfg, device, rank, world)
        grad_norm = _clip(engine, cfg)
        engine.step()
        metrics["loss"] = _all_sum(metrics["loss"], world, device)
        ema = metrics["loss"] if ema is None else 0.9 * ema + 0.1 * metrics["loss"]
        point = {"step": step, "loss": metrics["loss"], "loss_ema": ema,
                 "grad_norm": grad_norm if grad_norm is not None else float(engine.get_global_grad_norm() or 0.0),
                 "lr": engine.optimizer.param_groups[0]["lr"]}
        result.history.append(point)
        result.steps, result.final_loss = step, ema
        if log and rank == 0 and (step % 10 == 0 or step == cfg.steps):
            log(step, {k: v for k, v in point.items() if k != "step"})
        if eval_fn and (step % cfg.eval_every == 0 or step == cfg.steps) and _evaluate(eval_fn, model, cfg, result, step, log, rank, world, device):
            break
    result.wall_s = time.perf_counter() - start
    model.eval()
    return result


def _clip(engine: Any, cfg: SFTConfig) -> float | None:
    """ZeRO 0: clip the (reduced) gradient to norm 1.0 before the step; its norm. ZeRO 1/2: None (DeepSpeed
    clips the partitions in its step)."""
    if cfg.zero_stage:
        return None
    return float(torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 1.0))


def _all_sum(x: float, world: int, device: torch.device) -> float:
    if world == 1:
        return x
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t)


def _evaluate(eval_fn: Callable[[torch.nn.Module], dict[str, float]], model: Any, cfg: SFTConfig, result: SFTResult,
              step: int, log: Callable[[int, dict[str, float]], None] | None, rank: int, world: int, device: torch.device) -> bool:
    """A periodic validation check on rank 0 (every rank holds the whole model below ZeRO-3); whether to stop,
    the same answer on every rank."""
    stop = 0.0
    if rank == 0:
        ev = eval_fn(model) | {"step": step}
        result.evals.append(ev)
        if log:
            extra = {f"validation_{k}": ev[k] for k in ("mean_steps", "tool_calls_per_episode") if k in ev}  # episodes
            log(step, {"validation_accuracy": ev["accuracy"], **extra})
        stop = float(cfg.stop_at_accuracy is not None and ev["accuracy"] >= cfg.stop_at_accuracy)
        model.train()
    stop = _all_sum(stop, world, device)
    result.stopped_early = stop > 0
    return result.stopped_early
