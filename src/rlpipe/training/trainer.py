"""The policy trainer: DeepSpeed engines that keep policy, critic and optimizers in memory across iterations.

One :meth:`PolicyTrainer.update` call per RL iteration:

1. a no-grad pass gives the reference log-probs (when a KL term is on) and the critic's values
   (for ``gae``) of every sample;
2. the configured advantage estimator turns rewards (minus β·KL when KL is in the reward) into
   per-token advantages (and value targets): :mod:`rlpipe.training.update_math`;
3. ``ppo_epochs`` passes of optimizer steps over mini-batches and micro-batches: :mod:`rlpipe.training.steps`.

Micro-batches are laid out by :mod:`rlpipe.training.packing` (padded, packed, shared prompts); the engines are built
by :mod:`rlpipe.training.engines`, LoRA by :mod:`rlpipe.training.lora`, save points by :mod:`rlpipe.training.saving`.
This module holds the trainer's state and its forward passes.

The critic (``gae`` only) is a separate model (the policy's trunk + a scalar head) with its own
AdamW in a second DeepSpeed engine; it steps with the policy. deepspeed is imported inside the
trainer, never at module import.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, wait
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlpipe.algorithms import NEEDS_CRITIC, kl_controller
from rlpipe.algorithms.functional import entropy_from_logits, token_logprobs
from rlpipe.config import TrainConfig
from rlpipe.storage.samples import Sample
from rlpipe.tokens import load_tokenizer
from rlpipe.training.checkpoint import ADAPTER
from rlpipe.training.engines import EngineSetup, checkpoint_activations, init_distributed
from rlpipe.training.head import check_chunked_head, chunked_logprobs
from rlpipe.training.lora import float_weights, upcast_frozen, with_lora
from rlpipe.training.packing import MicroBatch, check_packing, collate, logits_at, token_bins
from rlpipe.training.saving import Saving
from rlpipe.training.steps import OptimizerSteps
from rlpipe.training.update_math import UpdateMath

__all__ = ["PolicyTrainer"]


@dataclass
class PolicyTrainer(EngineSetup, UpdateMath, OptimizerSteps, Saving):
    """Holds the DeepSpeed engines (policy + optimizer, critic + optimizer) and the frozen reference model."""

    model_dir: str
    cfg: TrainConfig
    temperature: float = 1.0
    seed: int = 0
    ref_model_dir: str | None = None
    resume_dir: str | None = None
    max_new_tokens: int | None = None  # the constant of loss_agg_mode 'constant' unless loss_agg_constant is set
    state: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from transformers import AutoModelForCausalLM

        self.rank, self.world = init_distributed()
        slots = self.cfg.batch_size // self.cfg.micro_batch_size
        if self.cfg.batch_size % (self.cfg.micro_batch_size * self.world) or slots % self.world:
            raise ValueError(
                f"train.batch_size ({self.cfg.batch_size}) must be a multiple of micro_batch_size "
                f"({self.cfg.micro_batch_size}) × ranks ({self.world})"
            )
        self.gas = slots // self.world
        self.parts = self.cfg.resolved()
        self.agg_constant = self.cfg.loss_agg_constant or self.max_new_tokens
        if self.parts["loss_agg_mode"] == "constant" and not self.agg_constant:
            raise ValueError("loss_agg_mode 'constant' needs train.loss_agg_constant (or the rollout's max_new_tokens)")
        # handoff(): the sha256 (a future) and the tensors, until the next update
        self._handoff: tuple[Future, dict[str, torch.Tensor]] | None = None
        self._raw_state: dict[str, torch.Tensor] | None = None
        torch.manual_seed(self.seed)
        # LoRA: the base weights are the start model's, the adapter a save point's (its merged weights are the
        # engine's, not a base to put the adapter on again).
        src = self.model_dir if self.cfg.lora else (self.resume_dir or self.model_dir)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=self._base_dtype(src))
        self.tokenizer = load_tokenizer(self.resume_dir or self.model_dir)
        if self.cfg.pack_sequences:
            check_packing(model, src, self.cfg.share_prompts)
        if self.cfg.logits_chunk:
            check_chunked_head(model, src)
        if self.cfg.gradient_checkpointing:
            checkpoint_activations(model)
        if self.cfg.lora:
            model = with_lora(model, self.cfg.lora, Path(self.resume_dir) / ADAPTER if self.resume_dir else None)
            if self.cfg.precision == "fp32":
                upcast_frozen(model)
        self.engine = self._engine(model, self.cfg.lr, self.cfg.grad_clip)
        self.device = torch.device(self.engine.device)  # DeepSpeed placed the model: inputs follow it
        self.ref = None
        # LoRA with the start model as reference: the reference is the policy with its adapters off.
        self.ref_is_base = bool(self.cfg.lora) and self.cfg.uses_reference and self.ref_model_dir in (None, self.model_dir)
        if self.cfg.uses_reference and not self.ref_is_base:
            self.ref = self._reference()
        self.critic = None
        if self.parts["advantage"] in NEEDS_CRITIC:
            critic = self._build_critic()
            if self.cfg.pack_sequences:
                check_packing(critic, self.cfg.critic.model or self.model_dir, self.cfg.share_prompts)
            self.critic = self._engine(critic, self.cfg.critic.lr, self.cfg.critic.grad_clip)
        self.kl_ctl = kl_controller(self.cfg.kl_coef, self.cfg.kl_target, self.cfg.kl_horizon)
        if self.resume_dir:
            self._load_state(Path(self.resume_dir))

    def _ref_logprobs(self, micro: MicroBatch) -> torch.Tensor:
        if self.ref_is_base:
            with self.engine.module.disable_adapter():
                return self._forward(micro, self.engine.module)[0]
        return self._forward(micro, self.ref)[0]

    @property
    def has_reference(self) -> bool:
        return self.ref is not None or self.ref_is_base

    # -- the update -------------------------------------------------------------------------
    def _forward(self, micro: MicroBatch, model: Any, entropy: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs of the targets in the padded layout (0 where no response token is predicted) and the entropy
        there (``entropy`` "train": with its gradient, "stats": without, None: not computed), from the logits of
        the positions that predict a response token only (:func:`logits_at`); with train.logits_chunk, of that
        many positions at a time (:mod:`rlpipe.training.head`)."""
        at, dst = micro.predicting
        p = micro.packed
        inputs = ({"input_ids": micro.input_ids, "attention_mask": micro.attention_mask} if p is None else
                  {"input_ids": p.input_ids, "position_ids": p.position_ids, "attention_mask": p.attention_mask,
                   "use_cache": False})
        chunk, targets = self.cfg.logits_chunk, micro.targets.reshape(-1)[dst]
        with self._autocast():
            with logits_at(model, at, hold=chunk is not None) as held:
                logits = model(**inputs).logits  # with chunks: the gathered hidden states, (1, n, d)
            if logits.shape[:-1].numel() != at.numel() or (chunk and (held.hidden is None or logits.data_ptr() !=
                                                                      held.hidden.data_ptr())):
                raise RuntimeError(f"the model's forward gave logits of shape {tuple(logits.shape)} where its output "
                                   f"layer was asked for {at.numel()} positions: it does not compute its logits "
                                   "through get_output_embeddings() alone, which rlpipe's trainer needs")
            if chunk is not None:  # from the model's output: its backward starts where DeepSpeed's hooks are
                lp, ent = chunked_logprobs(held.head, logits.reshape(-1, logits.shape[-1]), targets, self.temperature,
                                           chunk, bool(entropy))
                ent = ent.detach() if entropy == "stats" else ent
        if chunk is None:
            logits = logits.reshape(-1, logits.shape[-1])
            lp = token_logprobs(logits, targets, self.temperature)
            with nullcontext() if entropy == "train" else torch.no_grad():
                ent = entropy_from_logits(logits, self.temperature) if entropy else None
        return micro.scatter(lp, dst), None if ent is None else micro.scatter(ent, dst)

    def _values(self, micro: MicroBatch, model: Any) -> torch.Tensor:
        """V(s_t) at each position that predicts a token: (b, L-1)."""
        with self._autocast():
            if micro.packed is None:
                return model(input_ids=micro.input_ids, attention_mask=micro.attention_mask).logits[:, :-1, 0].float()
            p = micro.packed
            return micro.unpack(model(input_ids=p.input_ids, position_ids=p.position_ids, attention_mask=p.attention_mask,
                                      use_cache=False).logits[:, :-1, 0].float())

    def _autocast(self) -> Any:
        """train.precision bf16: the forward under bfloat16 autocast (float32 master weights; log-probs, entropy and
        losses are taken in float32 from the bf16 logits). fp32, and bf16_weights (the weights are bfloat16
        already): nothing."""
        if self.cfg.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    @torch.no_grad()
    def _precompute(self, samples: Sequence[Sample]) -> dict[str, list[list[float]]]:
        """Before any optimizer step, what is needed of: the trainer's own log-probs of the sampled tokens
        (TIS; the mismatch with train.mismatch_full_pass), the reference log-probs and the critic's values,
        response-aligned."""
        out: dict[str, list[list[float]]] = {}
        if self.cfg.mismatch_full_pass or self.cfg.tis_cap is not None:
            out["policy_logprobs"] = []
            self.engine.module.eval()
        if self.has_reference:
            out["ref_logprobs"] = []
        if self.critic is not None:
            out["values"] = []
            self.critic.module.eval()
        if not out:  # nothing needs a pass before the first step (GRPO without KL, TIS or full mismatch pass)
            return out
        found_at: dict[int, dict[str, list[float]]] = {}
        for part in self._chunks(samples):
            chunk = [samples[i] for i in part]
            micro = collate(chunk, {}, self.tokenizer.pad_token_id, pack=self.cfg.pack_sequences,
                             share=self.cfg.share_prompts).to(self.device)
            found = {"policy_logprobs": self._forward(micro, self.engine.module)[0]} if "policy_logprobs" in out else {}
            if self.has_reference:
                found["ref_logprobs"] = self._ref_logprobs(micro)
            if self.critic is not None:
                found["values"] = self._values(micro, self.critic.module)
            for row, (i, s) in enumerate(zip(part, chunk)):
                p, r = len(s.prompt_ids), len(s.response_ids)
                found_at[i] = {key: t[row, p - 1 : p - 1 + r].tolist() for key, t in found.items()}
        for i in range(len(samples)):
            for key, values in found_at[i].items():
                out[key].append(values)
        return out

    @torch.no_grad()
    def _chunks(self, samples: Sequence[Sample]) -> list[list[int]]:
        """The forward passes of a no-grad pass over all ``samples`` (every rank runs all of them): by token budget
        (train.max_tokens_per_micro_batch), else length-sorted chunks of micro_batch_size, each padded to its own
        longest sequence, not the batch's."""
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        if self.cfg.max_tokens_per_micro_batch:
            return token_bins(lengths, list(range(len(samples))), self.cfg.max_tokens_per_micro_batch, self.cfg.pack_sequences)
        order = sorted(range(len(samples)), key=lambda i: lengths[i])
        step = self.cfg.micro_batch_size
        return [order[start : start + step] for start in range(0, len(order), step)]

    @torch.no_grad()  # also on the probe's own thread (SyncProof.trainer_ahead), where grad mode is on by default
    def sequence_logprobs(self, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]) -> list[list[float]]:
        """log π(c_t | prompt, c_<t) of each continuation token under the trainer's weights at temperature 1
        (the weight-sync probe compares these with the engine's)."""
        samples = [Sample(list(p), list(c), [0.0] * len(c), 0.0, i) for i, (p, c) in enumerate(zip(prompts, continuations))]
        was_training = self.engine.module.training
        self.engine.module.eval()
        micro = collate(samples, {}, self.tokenizer.pad_token_id).to(self.device)
        at, dst = micro.predicting
        # 16-bit weights (a LoRA base under bf16; all of them under bf16_weights): in float32 for the probe's forward,
        # the engine's forward of the weights it was handed (under fp32 a 16-bit LoRA base's layers already upcast)
        with float_weights(self.engine.module) if self.cfg.precision != "fp32" else nullcontext(), \
                logits_at(self.engine.module, at):
            logits = self.engine.module(input_ids=micro.input_ids, attention_mask=micro.attention_mask).logits
        lp = micro.scatter(token_logprobs(logits.reshape(-1, logits.shape[-1]), micro.targets.reshape(-1)[dst], 1.0), dst)
        self.engine.module.train(was_training)
        return [lp[i, len(s.prompt_ids) - 1 : len(s.prompt_ids) - 1 + len(s.response_ids)].tolist() for i, s in enumerate(samples)]

    def update(self, samples: Sequence[Sample], iteration: int) -> dict[str, float]:
        """One iteration's optimizer steps on scored samples; invalid ones are left out and counted.

        A mini-batch whose loss or gradient is not finite is skipped (no parameter or optimizer-state
        change) and counted in ``nonfinite_steps``."""
        if self._handoff is not None:  # a hash still reading the last weights must finish before they change
            wait([self._handoff[0]])
        self._handoff = None  # the weights change: the next policy_tensors() hashes them anew
        valid = [s for s in samples if s.valid]
        metrics: dict[str, float] = {"samples": len(samples), "samples_excluded": len(samples) - len(valid)}
        if not valid:
            return metrics | {"optimizer_steps": 0, "nonfinite_steps": 0}
        prep = self._prepare(valid)
        sums, norms, steps, skipped = self._optimize(valid, prep, iteration)
        metrics |= prep.metrics | self._summarise(sums, norms, steps, skipped, prep)
        if prep.rollout_kl is not None:
            self.kl_ctl.update(prep.rollout_kl, len(valid))
        self.state["iteration"] = iteration
        self.state["kl_controller"] = self.kl_ctl.state_dict()
        return metrics
