"""What one RL update computes: the inputs fixed before the first optimizer step (KL, advantages, importance
weights), each micro-batch's loss, and the statistics summed over micro-batches and ranks.

The loss is aggregated with the counts of the whole mini-batch and pre-multiplied by (GAS × world) to undo
DeepSpeed's averaging, so any split into micro-batches or ranks yields the same gradient (tested: 2 ranks == 1
rank). :class:`UpdateMath` is a part of :class:`rlpipe.training.trainer.PolicyTrainer`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rlpipe.algorithms import (
    AdvantageInput, LossAgg, aggregate, compute_advantages, explained_variance, kl_penalty, policy_loss, value_loss,
)
from rlpipe.algorithms.functional import logprob_gap, masked_mean, masked_stats
from rlpipe.storage.samples import Sample
from rlpipe.training.packing import MicroBatch

__all__ = ["Prepared", "UpdateMath", "merge_stats"]


@dataclass
class Prepared:
    """An iteration's inputs to the optimizer steps, fixed before the first one."""

    per_token: dict[str, list[list[float]]]  # response-aligned: old_logprobs, advantages, (is_weights, ref_logprobs, …)
    train_masks: list[list[int]]
    beta: float
    rollout_kl: float | None
    values: torch.Tensor | None
    returns: torch.Tensor | None
    action: torch.Tensor
    metrics: dict[str, float]
    measure_mismatch: bool = False  # no full pass before the first step: the first step's forward measures it


def merge_stats(into: dict[str, float], stats: dict[str, float]) -> None:
    """Add one micro-batch's (or mini-batch's) statistics into ``into``: summed, but max / min for the keys so
    reduced (``_MAX_KEYS``, ``_MIN_KEYS``)."""
    for key, v in stats.items():
        if key in _MAX_KEYS:  # NaN stays NaN (max(-inf, nan) would drop it)
            into[key] = v if math.isnan(v) else max(into.get(key, -math.inf), v)
        elif key in _MIN_KEYS:
            into[key] = v if math.isnan(v) else min(into.get(key, math.inf), v)
        else:
            into[key] = into.get(key, 0.0) + v


def _mismatch_sums(trainer: torch.Tensor, sampler: torch.Tensor, action: torch.Tensor, threshold: float) -> dict[str, float]:
    """The sums behind ``logprob_gap`` over one micro-batch's sampled tokens, to be added over micro-batches and
    ranks: token count, Σ|Δ|, count of |Δ| > threshold, Σ(sampler − trainer), and max |Δ|."""
    d = (trainer - sampler).double()[action > 0]
    if d.numel() == 0:
        return {}
    return {"mm_tokens": float(d.numel()), "mm_abs_tok": float(d.abs().sum()), "mm_above_tok": float((d.abs() > threshold).sum()),
            "mm_kl_tok": float((-d).sum()), "mm_abs_max": float(d.abs().max())}


def _aligned(rows: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    """Response-aligned (N, width) tensor from ragged per-sample lists (zero padded)."""
    return torch.tensor([list(r) + [0.0] * (width - len(r)) for r in rows], dtype=torch.float32).view(len(rows), width)


# Summed over micro-batches and ranks: *_sum are per-mini-batch loss values (divided by the step
# count), *_tok are token-weighted (divided by the token count).
_STAT_KEYS = ("pg_loss_sum", "kl_loss_sum", "entropy_loss_sum", "vf_loss_sum", "tokens", "critic_tokens",
              "clip_frac_tok", "approx_kl_old_tok", "entropy_tok", "vf_clip_frac_tok", "value_mse_tok", "ratio_tok",
              "mm_tokens", "mm_abs_tok", "mm_above_tok", "mm_kl_tok", "micro_batches", "over_budget")
# Reduced with max / min over micro-batches and ranks instead of summed.
_MAX_KEYS = ("ratio_max", "mm_abs_max")
_MIN_KEYS = ("ratio_min",)


class UpdateMath:
    """The loss and statistics of an update (part of ``PolicyTrainer``)."""

    def _micro_loss(self, micro: MicroBatch, agg: LossAgg, beta: float, measure: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
        """The micro-batch's loss (scaled for DeepSpeed) and its statistics; ``measure``: also the train/inference
        mismatch of its tokens (only while the weights are still the sampling policy's)."""
        logprobs, ent = self._forward(micro, self.engine, entropy="train" if self.cfg.entropy_coef > 0 else "stats")
        scale = self.gas * self.world  # undo DeepSpeed's mean over accumulation steps and ranks
        pg, pm = policy_loss(
            self.parts["policy_loss"], logprobs, micro.tok["old_logprobs"], micro.tok["advantages"], micro.mask,
            agg=agg, is_weights=micro.tok.get("is_weights"), **self.cfg.loss_kwargs(),
        )
        loss = pg
        tokens = float(micro.mask.sum())
        stats = {"pg_loss_sum": float(pg.detach()), "tokens": tokens,
                 "clip_frac_tok": float(pm["clip_frac"]) * tokens, "approx_kl_old_tok": float(pm["approx_kl_old"]) * tokens,
                 "ratio_tok": float(pm["ratio_mean"]) * tokens, "ratio_max": float(pm["ratio_max"]),
                 "ratio_min": float(pm["ratio_min"])}
        if measure:
            stats |= _mismatch_sums(logprobs.detach(), micro.tok["old_logprobs"], micro.action, self.cfg.mismatch_threshold)
        if self.cfg.entropy_coef > 0:
            ent_term = aggregate(ent, micro.mask, agg)
            loss = loss - self.cfg.entropy_coef * ent_term
            stats["entropy_loss_sum"] = float(ent_term.detach())
        stats["entropy_tok"] = float((ent.detach() * micro.mask).sum())
        if self.has_reference and self.cfg.kl_in == "loss":
            kl = kl_penalty(logprobs, micro.tok["ref_logprobs"], self.cfg.kl_estimator)
            kl_term = aggregate(kl, micro.mask, agg)
            loss = loss + beta * kl_term
            stats["kl_loss_sum"] = float(kl_term.detach())
        return loss * scale, stats

    def _critic_loss(self, micro: MicroBatch, agg: LossAgg) -> tuple[torch.Tensor, dict[str, float]]:
        values = self._values(micro, self.critic)
        vl, vm = value_loss(values, micro.tok["old_values"], micro.tok["returns"], micro.action,
                            clip=self.cfg.critic.value_clip, agg=agg)
        tokens = float(micro.action.sum())
        stats = {"vf_loss_sum": float(vl.detach()), "critic_tokens": tokens,
                 "vf_clip_frac_tok": float(vm["vf_clip_frac"]) * tokens, "value_mse_tok": float(vm["value_mse"]) * tokens}
        return vl * self.gas * self.world, stats

    def _train_mask(self, s: Sample) -> list[int]:
        if self.cfg.mask_truncated and s.truncated:
            return [0] * len(s.response_ids)
        return s.action_mask

    def _prepare(self, valid: Sequence[Sample]) -> "Prepared":
        """Everything fixed before the first optimizer step: mismatch, KL, advantages, per-token inputs."""
        pre = self._precompute(valid)
        width = max(1, max(len(s.response_ids) for s in valid))
        action = _aligned([s.action_mask for s in valid], width)
        old_lp = _aligned([s.old_logprobs for s in valid], width)
        metrics: dict[str, float] = {}
        if "policy_logprobs" in pre:
            trainer_lp = _aligned(pre["policy_logprobs"], width)
            metrics = {f"mismatch/{k}": v for k, v in logprob_gap(trainer_lp, old_lp, action, self.cfg.mismatch_threshold).items()}
        beta = self.kl_ctl.value
        rollout_kl, penalty = None, None
        if "ref_logprobs" in pre:
            token_kl = kl_penalty(old_lp, _aligned(pre["ref_logprobs"], width), self.cfg.kl_estimator) * action
            rollout_kl = float(token_kl.sum() / action.sum().clamp_min(1.0))
            metrics["kl"] = rollout_kl
            if self.cfg.kl_in == "reward":
                penalty = beta * token_kl
        values = _aligned(pre["values"], width) if "values" in pre else None
        adv_in = AdvantageInput(
            rewards=torch.tensor([s.reward for s in valid], dtype=torch.float32),
            group_ids=torch.tensor([s.group for s in valid]),
            valid=torch.ones(len(valid), dtype=torch.bool),
            response_mask=action, token_penalty=penalty, values=values,
            step_rewards=_aligned([s.step_rewards or [0.0] * len(s.response_ids) for s in valid], width)
            if any(s.step_rewards is not None for s in valid) else None,
        )
        adv_out = compute_advantages(self.parts["advantage"], adv_in, **self.cfg.advantage_kwargs())
        metrics |= {f"advantage/{k}": v for k, v in masked_stats(adv_out.advantages, action).items()}
        metrics |= {f"adv_{k}": v for k, v in adv_out.metrics.items()}
        lengths = [len(s.response_ids) for s in valid]

        def rows(t: torch.Tensor) -> list[list[float]]:
            return [t[i, :n].tolist() for i, n in enumerate(lengths)]

        per_token: dict[str, list[list[float]]] = {"old_logprobs": [s.old_logprobs for s in valid],
                                                   "advantages": rows(adv_out.advantages)}
        if self.cfg.tis_cap is not None:
            # Truncated importance sampling (as verl and slime): the PPO ratio is taken against the
            # trainer's own log-probs before the update, and each token's loss is weighted by
            # min(π_trainer/π_sampler, cap), which corrects for sampling with a slightly different policy.
            per_token["old_logprobs"] = pre["policy_logprobs"]
            raw = torch.exp((trainer_lp - old_lp).clamp(-20.0, 20.0))
            per_token["is_weights"] = rows(raw.clamp(max=self.cfg.tis_cap))
            metrics |= {"tis/weight_mean": float(masked_mean(raw.clamp(max=self.cfg.tis_cap), action)),
                        "tis/capped_share": float(masked_mean((raw > self.cfg.tis_cap).float(), action))}
        if "ref_logprobs" in pre:
            per_token["ref_logprobs"] = pre["ref_logprobs"]
        if self.critic is not None:
            per_token["old_values"] = pre["values"]
            per_token["returns"] = rows(adv_out.returns)
        return Prepared(per_token, [self._train_mask(s) for s in valid], beta, rollout_kl, values,
                         adv_out.returns, action, metrics, measure_mismatch="policy_logprobs" not in pre)

    def _summarise(self, sums: dict[str, float], norms: dict[str, list[float]], steps: int, skipped: int,
                   prep: "Prepared") -> dict[str, float]:
        sums = self._all_reduce(sums)
        done = steps - skipped
        out: dict[str, float] = {"optimizer_steps": done, "nonfinite_steps": skipped, "kl_coef": prep.beta,
                                 "lr": float(self.engine.optimizer.param_groups[0]["lr"]),
                                 "tokens": sums.get("tokens", 0.0), "micro_batches": sums.get("micro_batches", 0.0)}
        if self.cfg.max_tokens_per_micro_batch:
            out["micro/over_budget"] = sums.get("over_budget", 0.0)
        if n := sums.get("mm_tokens", 0.0):  # measured in the first optimizer step (see _micro_loss)
            out |= {"mismatch/abs_mean": sums["mm_abs_tok"] / n, "mismatch/abs_max": sums.get("mm_abs_max", 0.0),
                    "mismatch/share_above": sums["mm_above_tok"] / n, "mismatch/kl": sums["mm_kl_tok"] / n,
                    "mismatch/tokens": n}
        if done == 0:
            return out
        tokens = max(sums.get("tokens", 0.0), 1.0)
        pg = sums.get("pg_loss_sum", 0.0) / done
        kl_loss = sums.get("kl_loss_sum", 0.0) / done
        ent_loss = sums.get("entropy_loss_sum", 0.0) / done
        out |= {
            "loss": pg + prep.beta * kl_loss - self.cfg.entropy_coef * ent_loss,
            "pg_loss": pg,
            "kl_loss": kl_loss,
            "entropy": sums.get("entropy_tok", 0.0) / tokens,
            "clip_frac": sums.get("clip_frac_tok", 0.0) / tokens,
            "approx_kl_old": sums.get("approx_kl_old_tok", 0.0) / tokens,
            "ratio/mean": sums.get("ratio_tok", 0.0) / tokens,
            "ratio/max": sums.get("ratio_max", 1.0),
            "ratio/min": sums.get("ratio_min", 1.0),
            "grad_norm": float(np.mean(norms["policy"])),
        }
        if self.critic is not None:
            ctok = max(sums.get("critic_tokens", 0.0), 1.0)
            out |= {
                "vf_loss": sums.get("vf_loss_sum", 0.0) / done,
                "vf_clip_frac": sums.get("vf_clip_frac_tok", 0.0) / ctok,
                "value_mse": sums.get("value_mse_tok", 0.0) / ctok,
                "explained_variance": explained_variance(prep.values, prep.returns, prep.action),
                "critic_grad_norm": float(np.mean(norms["critic"])) if norms["critic"] else float("nan"),
            }
        return out

    def _all_reduce(self, sums: dict[str, float]) -> dict[str, float]:
        if self.world == 1:
            return sums
        import torch.distributed as dist

        t = torch.tensor([sums.get(k, 0.0) for k in _STAT_KEYS], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        out = dict(zip(_STAT_KEYS, t.tolist()))
        for keys, op, empty in ((_MAX_KEYS, dist.ReduceOp.MAX, -math.inf), (_MIN_KEYS, dist.ReduceOp.MIN, math.inf)):
            t = torch.tensor([sums.get(k, empty) for k in keys], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=op)
            out |= {k: v for k, v in zip(keys, t.tolist()) if math.isfinite(v)}
        return out
