"""The optimizer steps of one RL update: ``ppo_epochs`` passes split the samples into mini-batches of
``train.batch_size`` completions (one optimizer step each, in a seeded order), and every mini-batch into
``gradient_accumulation_steps × world_size`` micro-batch slots (slot s runs on rank s mod world), or by a token
budget. A step whose loss or gradient is not finite on any rank is skipped without changing the weights or the
optimizer state; the learning rate warms up by DeepSpeed's step count.

:class:`OptimizerSteps` is a part of :class:`rlpipe.training.trainer.PolicyTrainer`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rlpipe.algorithms import LossAgg
from rlpipe.storage.samples import Sample
from rlpipe.training.packing import collate, token_bins
from rlpipe.training.update_math import Prepared, merge_stats

__all__ = ["OptimizerSteps"]


def _skipped_step(engine: Any) -> None:
    """Close the accumulation window without an optimizer step (ZeRO 0): the gradients are dropped and
    the optimizer's ``step`` is bypassed for this call, so weights and Adam moments stay as they were."""
    for p in engine.module.parameters():
        if p.grad is not None:
            p.grad.zero_()  # finite, so any clipping on the way still runs
    opt = engine.optimizer
    opt.step = lambda *args, **kwargs: None  # an instance attribute shadows the class's step
    try:
        engine.step()
    finally:
        del opt.step


class OptimizerSteps:
    """The mini-batches and optimizer steps of an update (part of ``PolicyTrainer``)."""

    def _slots(self, valid: Sequence[Sample], idx: list[int]) -> list[list[list[int]]]:
        """A mini-batch's micro-batches, per rank: ``[rank][k] -> sample indices`` (every rank the same count K,
        an empty micro-batch where a rank has fewer). By count: GAS slots of micro_batch_size. By token budget:
        the samples dealt to the ranks longest first (each to the rank with the fewest tokens), then each
        rank's cut into bins of at most max_tokens_per_micro_batch tokens."""
        if not self.cfg.max_tokens_per_micro_batch:
            split = np.array_split(np.array(idx), self.gas * self.world)
            return [[[int(i) for i in split[k * self.world + r]] for k in range(self.gas)] for r in range(self.world)]
        length = {i: len(valid[i].prompt_ids) + len(valid[i].response_ids) for i in idx}
        dealt: list[list[int]] = [[] for _ in range(self.world)]
        load = [0] * self.world
        for i in sorted(idx, key=lambda i: -length[i]):
            r = load.index(min(load))
            dealt[r].append(i)
            load[r] += length[i]
        bins = [token_bins([length[i] for i in d], d, self.cfg.max_tokens_per_micro_batch, self.cfg.pack_sequences)
                for d in dealt]
        k = max(len(b) for b in bins)
        return [b + [[] for _ in range(k - len(b))] for b in bins]

    def _optimize(self, valid: Sequence[Sample], prep: "Prepared", iteration: int) -> tuple[dict[str, float], dict[str, list[float]], int, int]:
        sums: dict[str, float] = {}
        norms: dict[str, list[float]] = {"policy": [], "critic": []}
        steps = skipped = 0
        self.engine.train()
        if self.critic is not None:
            self.critic.train()
        for epoch in range(self.cfg.ppo_epochs):
            order = self._order(valid, iteration, epoch)
            for start in range(0, len(order), self.cfg.batch_size):
                first = epoch == 0 and start == 0  # the policy has not moved yet: it is the sampling policy
                ok = self._minibatch(valid, prep, order[start : start + self.cfg.batch_size], sums, norms,
                                     measure=first and prep.measure_mismatch)
                steps += 1
                skipped += 0 if ok else 1
        return sums, norms, steps, skipped

    def _order(self, valid: Sequence[Sample], iteration: int, epoch: int) -> list[int]:
        """The samples' order for one epoch's mini-batches (train.shuffle): a shuffle of the samples, or of whole
        groups, seeded by the run's seed, the iteration and the epoch: identical on every rank and after a resume."""
        rng = random.Random(self.seed * 1_000_003 + iteration + 7_919 * epoch)
        if self.cfg.shuffle == "samples":
            order = list(range(len(valid)))
            rng.shuffle(order)
            return order
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(valid):
            groups.setdefault(s.group, []).append(i)
        keys = list(groups)
        rng.shuffle(keys)
        return [i for g in keys for i in groups[g]]

    def _minibatch(self, valid: Sequence[Sample], prep: "Prepared", idx: list[int], sums: dict[str, float],
                   norms: dict[str, list[float]], measure: bool = False) -> bool:
        """One optimizer step over ``idx`` (GAS micro-batches × ranks); False when it was skipped."""
        self._warm_up(self.engine, self.cfg.lr)
        if self.critic is not None:
            self._warm_up(self.critic, self.cfg.critic.lr)
        masks = prep.train_masks
        n_tok = float(sum(sum(masks[i]) for i in idx))
        # Dr.GRPO's constant normaliser counts every sequence; the other modes the ones with tokens.
        n_seq = float(len(idx)) if self.parts["loss_agg_mode"] == "constant" else float(sum(1 for i in idx if sum(masks[i]) > 0))
        agg = LossAgg(self.parts["loss_agg_mode"], n_tok, n_seq, self.agg_constant)
        critic_agg = LossAgg("token_mean", float(sum(sum(valid[i].action_mask) for i in idx)))
        mine = self._slots(valid, idx)[self.rank]
        finite = {"policy": True, "critic": True}
        collected: dict[str, float] = {"micro_batches": float(len(mine))} if self.rank == 0 else {}
        budget = self.cfg.max_tokens_per_micro_batch
        for k, slot in enumerate(mine):
            boundary = k == len(mine) - 1
            self._set_boundary(boundary)
            if budget and len(slot) == 1 and len(valid[slot[0]].prompt_ids) + len(valid[slot[0]].response_ids) > budget:
                collected["over_budget"] = collected.get("over_budget", 0.0) + 1.0
            micro = None
            if slot:
                micro = collate([valid[i] for i in slot], {key: [rows[i] for i in slot] for key, rows in prep.per_token.items()},
                                 self.tokenizer.pad_token_id, [masks[i] for i in slot], self.cfg.pack_sequences,
                                 self.cfg.share_prompts).to(self.device)
                loss, stats = self._micro_loss(micro, agg, prep.beta, measure)
            else:  # an empty slot still takes part in the collective step
                loss, stats = self._idle_loss(self.engine), {}
            finite["policy"] &= bool(torch.isfinite(loss.detach()))
            self.engine.backward(loss)
            finite["policy"] = self._step(self.engine, self.cfg.grad_clip, boundary, finite["policy"], norms["policy"])
            if self.critic is not None:
                if micro is not None:
                    vloss, vstats = self._critic_loss(micro, critic_agg)
                    stats |= vstats
                else:
                    vloss = self._idle_loss(self.critic)
                finite["critic"] &= bool(torch.isfinite(vloss.detach()))
                self.critic.backward(vloss)
                finite["critic"] = self._step(self.critic, self.cfg.critic.grad_clip, boundary, finite["critic"], norms["critic"])
            merge_stats(collected, stats)
        ok = finite["policy"] and finite["critic"]
        if not ok:  # a skipped step's statistics are not averaged into the iteration's, but its mismatch is what
            collected = {k: v for k, v in collected.items() if k.startswith("mm_")}  # tells why it was skipped
        merge_stats(sums, collected)
        return ok

    def _set_boundary(self, boundary: bool) -> None:
        """Token-budget micro-batches vary in number: tell DeepSpeed which backward ends the accumulation (its
        own count assumes GAS of them). By count, DeepSpeed's count is right and is left alone."""
        if self.cfg.max_tokens_per_micro_batch:
            for engine in (self.engine, self.critic):
                if engine is not None:
                    engine.set_gradient_accumulation_boundary(boundary)

    def _idle_loss(self, engine: Any) -> torch.Tensor:
        """A zero loss for a rank with nothing in this micro-batch slot, so that it still joins the step's
        collectives. Under ZeRO-3 it runs a one-token forward: the other ranks' forward gathers each layer's
        weights from every rank. Under bf16_weights too: DeepSpeed's bf16 optimizer clears the last micro-batch's
        gradients in a hook on the engine's output, and a backward that bypasses it would count them twice."""
        if self.cfg.zero_stage < 3 and self.cfg.precision != "bf16_weights":
            return sum(p.sum() for p in engine.module.parameters()) * 0.0
        ids = torch.full((1, 1), self.tokenizer.pad_token_id, dtype=torch.long, device=self.device)
        with self._autocast():
            return engine(input_ids=ids).logits.float().sum() * 0.0

    def _warm_up(self, engine: Any, base_lr: float) -> None:
        """Set the learning rate of the engine's next optimizer step: ``base_lr × min(1, k/N)`` for the k-th
        step (1-based) of the run, N = ``train.warmup_steps``. The count is DeepSpeed's ``global_steps``, which
        its checkpoint restores, so a resumed run continues the same schedule (a skipped step counts)."""
        n = self.cfg.warmup_steps
        lr = base_lr * (min(1.0, (engine.global_steps + 1) / n) if n else 1.0)
        for group in engine.optimizer.param_groups:
            group["lr"] = lr

    def _step(self, engine: Any, clip: float, boundary: bool, finite: bool, norms: list[float]) -> bool:
        """``engine.step()`` (ZeRO 0: after clipping the gradient norm to ``clip``); at the accumulation boundary
        the step is skipped unless loss and gradient are finite on every rank. Returns whether this mini-batch is
        (still) finite."""
        if not boundary:
            engine.step()
            return finite
        if self.cfg.zero_stage == 0:
            params = [p for p in engine.module.parameters() if p.grad is not None]
            total = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
            norm = float(total)
            ok = self._all_ranks(finite and math.isfinite(norm))
            if ok:
                _clip_and_step(engine, params, clip, total, norm)
            else:
                _skipped_step(engine)
        else:
            engine.step()  # ZeRO 1/2: DeepSpeed skips a step whose gradient norm is not finite itself
            norm = self._ds_grad_norm(engine)
            ok = self._all_ranks(finite and math.isfinite(norm))
        if ok:
            norms.append(norm)
        return ok

    def _all_ranks(self, flag: bool) -> bool:
        if self.world == 1:
            return flag
        import torch.distributed as dist

        t = torch.tensor([0.0 if flag else 1.0], device=self.device)  # NCCL reduces device tensors only
        dist.all_reduce(t)
        return float(t) == 0.0

    @staticmethod
    def _ds_grad_norm(engine: Any) -> float:
        gn = engine.get_global_grad_norm()
        return float(gn) if gn is not None else float("nan")


def _clip_and_step(engine: Any, params: list[Any], clip: float, total: Any, norm: float) -> None:
    """Clip the gradients ×min(1, clip / (norm + 1e-6)), as DeepSpeed and torch do, and take the optimizer step.
    Under the clip nothing is multiplied (×1 changes no bit). Above it, where the optimizer is torch's fused Adam or
    AdamW, the factor goes into its kernel (``grad_scale``, which divides each gradient as the kernel reads it: how
    torch's GradScaler unscales) instead of a pass of its own over every gradient (benchmarks/README.md: ~2% of the
    update at 30M and 113M on this CPU). Elsewhere torch's ``clip_grads_with_norm_``."""
    if clip / (norm + 1e-6) >= 1.0:
        engine.step()
        return
    opt = engine.optimizer
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)) and all(g.get("fused") for g in opt.param_groups):
        opt.grad_scale = (total + 1e-6) / clip  # a tensor on the gradients' device: no host round trip
        try:
            engine.step()
        finally:
            opt.grad_scale = None
        return
    torch.nn.utils.clip_grads_with_norm_(params, clip, total, foreach=True)
    engine.step()
