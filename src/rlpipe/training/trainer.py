"""The policy trainer: DeepSpeed engines that keep policy, critic and optimizers in memory across iterations.

One :meth:`PolicyTrainer.update` call per RL iteration:

1. a no-grad pass gives the reference log-probs (when a KL term is on) and the critic's values
   (for ``gae``) of every sample;
2. the configured advantage estimator turns rewards (minus β·KL when KL is in the reward) into
   per-token advantages (and value targets);
3. ``ppo_epochs`` passes split the samples into mini-batches of ``train.batch_size`` completions
   (one optimizer step each) and every mini-batch into ``gradient_accumulation_steps × world_size``
   micro-batch slots (slot s runs on rank s mod world). The loss is aggregated with the counts of
   the whole mini-batch and pre-multiplied by (GAS × world) to undo DeepSpeed's averaging, so any
   split into micro-batches or ranks yields the same gradient (tested: 2 ranks == 1 rank).

Each micro-batch's sequences are packed end to end in rows (``train.pack_sequences``; position ids restart
at each sequence) wherever that computes PACK_MIN_SAVING fewer positions than padding; samples with the same
prompt (a GRPO group) share one copy of it there (``train.share_prompts``: each response attends to the prompt
and to itself, an explicit attention mask). The losses are computed in the padded layout either way
(``_Micro.unpack`` and ``_Micro.scatter``).

The critic (``gae`` only) is a separate model (the policy's trunk + a scalar head) with its own
AdamW in a second DeepSpeed engine; it steps with the policy. deepspeed is imported inside the
trainer, never at module import.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlpipe.algorithms import (
    NEEDS_CRITIC, AdvantageInput, LossAgg, aggregate, compute_advantages, explained_variance, kl_controller,
    kl_penalty, policy_loss, value_loss,
)
from rlpipe.algorithms.functional import entropy_from_logits, logprob_gap, masked_mean, masked_stats, token_logprobs
from rlpipe.config import TrainConfig
from rlpipe.net import free_port
from rlpipe.storage.samples import Sample
from rlpipe.tokens import load_tokenizer
from rlpipe.training.checkpoint import (
    ADAPTER, TRAINER_STATE, RecyclingSafetensors, RecyclingWrites, Spare, file_weights_sha256, read_trainer_state, rng_state, set_rng_state,
    weights_sha256,
)

__all__ = ["ADAPTER", "PolicyTrainer", "Sample", "init_distributed", "merged_state_dict", "with_lora"]



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
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


# A packed row holds at least this many tokens: rows of sequences, not one short sequence per row (the
# attention's per-row cost dominates at a few tokens per sequence). 64 came out of an informal sweep of 16–256
# on the demo's batch shapes (not kept); benchmarks/packing.py measures this value.
PACK_ROW = 64
# Packing is used where it computes at least this share fewer positions than padding.
PACK_MIN_SAVING = 0.1
# A shared prompt and the responses after it (a 'unit') hold at most this many tokens unless one sequence is longer,
# and a row of units is at least this wide: attention over a row is dense (an explicit mask), so a long unit would
# trade the prompt's linear work for attention work. From an informal sweep on the demo's shapes (not kept): with
# whole groups per micro-batch, rows of 64 left more tail padding than rows of 256 (352 against 283 positions);
# with the default shuffle, 64, 128 and 256 were within the machine's noise.
SHARE_UNIT = 256

@dataclass
class _Packing:
    """The micro-batch's sequences laid end to end in rows (position ids restart at each sequence, so the
    model attends within a sequence only): the forward computes no padding but the rows' short tails."""

    input_ids: torch.Tensor  # (R, C)
    position_ids: torch.Tensor  # (R, C)
    src: torch.Tensor  # flat indices in (R, C-1) of every position that predicts a token of its own sequence
    dst: torch.Tensor  # the same positions' flat indices in the padded (b, L-1) layout
    # Shared prompts: (R, 1, C, C), True where a query position may attend to a key position; src may then
    # repeat (a shared prompt's last position predicts every response's first token). None: position ids
    # alone keep the sequences apart.
    attention_mask: torch.Tensor | None = None

    def to(self, device: torch.device) -> "_Packing":
        return _Packing(*(t.to(device) for t in (self.input_ids, self.position_ids, self.src, self.dst)),
                        None if self.attention_mask is None else self.attention_mask.to(device))


@dataclass
class _Micro:
    input_ids: torch.Tensor  # (b, L)
    attention_mask: torch.Tensor  # (b, L)
    targets: torch.Tensor  # (b, L-1) next-token ids
    mask: torch.Tensor  # (b, L-1) 1 where the target is a trained response token
    action: torch.Tensor  # (b, L-1) 1 on the policy's response tokens (the critic's mask)
    tok: dict[str, torch.Tensor]  # (b, L-1) per-token inputs: old_logprobs, advantages, ref_logprobs, …
    packed: _Packing | None = None  # train.pack_sequences, where it saves: the layout the forward passes run in

    def to(self, device: torch.device) -> "_Micro":
        """The same micro-batch on ``device`` (the engine's: CPU, or the rank's GPU)."""
        if self.input_ids.device == device:
            return self
        packed = self.packed and self.packed.to(device)
        return _Micro(self.input_ids.to(device), self.attention_mask.to(device), self.targets.to(device),
                      self.mask.to(device), self.action.to(device), {k: v.to(device) for k, v in self.tok.items()}, packed)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """A per-position (R, C-1, …) tensor of the packed forward in the padded (b, L-1, …) layout (0 elsewhere);
        gradients flow through."""
        if self.packed is None:
            return x
        return self.scatter(x.reshape(-1, *x.shape[2:])[self.packed.src])

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Values (n, …) of the packed layout's predicting positions, in ``src`` order, in the padded (b, L-1, …)
        layout (0 elsewhere); gradients flow through."""
        rest = x.shape[1:]
        flat = torch.zeros((self.targets.numel(), *rest), dtype=x.dtype, device=x.device)
        return flat.index_put((self.packed.dst,), x).view(*self.targets.shape, *rest)


def _rows(lengths: Sequence[int], row: int) -> tuple[list[list[int]], int]:
    """ceil(tokens / max(longest, row)) rows, each item (longest first) into the least-filled row; the rows'
    members and their common width (the fullest row's load)."""
    n_rows = -(-sum(lengths) // max(max(lengths), row))
    rows: list[list[int]] = [[] for _ in range(n_rows)]
    load = [0] * n_rows
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        j = min(range(n_rows), key=load.__getitem__)
        rows[j].append(i)
        load[j] += lengths[i]
    return rows, max(load)


def _pack(seqs: Sequence[Sequence[int]], width: int, pad_id: int) -> _Packing:
    """Sequences end to end in rows of at least PACK_ROW tokens (:func:`_rows`); a row's tail is padding with
    its own positions (a separate 'sequence' no real token attends to)."""
    lengths = [len(s) for s in seqs]
    rows, c = _rows(lengths, PACK_ROW)
    ids: list[int] = []  # built as flat lists, one tensor each at the end (per-sequence tensors cost more)
    pos: list[int] = []
    src: list[int] = []
    dst: list[int] = []
    for j, members in enumerate(rows):
        o = 0
        for i in members:
            n = lengths[i]
            ids.extend(seqs[i])
            pos.extend(range(n))
            src.extend(range(j * (c - 1) + o, j * (c - 1) + o + n - 1))
            dst.extend(range(i * (width - 1), i * (width - 1) + n - 1))
            o += n
        ids.extend([pad_id] * (c - o))
        pos.extend(range(c - o))
    shape = (len(rows), c)
    return _Packing(torch.tensor(ids, dtype=torch.long).view(shape), torch.tensor(pos, dtype=torch.long).view(shape),
                    torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long))


def _units(samples: Sequence[Sample]) -> list[tuple[list[int], list[int]]]:
    """The micro-batch's samples by prompt, in order of first appearance: (prompt ids, sample indices). A unit
    takes no more responses once it holds SHARE_UNIT tokens (the prompt then starts a new one)."""
    units: list[tuple[list[int], list[int]]] = []
    load: list[int] = []
    open_: dict[tuple[int, ...], int] = {}
    for i, s in enumerate(samples):
        key, n = tuple(s.prompt_ids), len(s.response_ids)
        u = open_.get(key)
        if u is None or load[u] + n > SHARE_UNIT:
            u = open_[key] = len(units)
            units.append((list(s.prompt_ids), []))
            load.append(len(s.prompt_ids))
        units[u][1].append(i)
        load[u] += n
    return units


def _pack_shared(samples: Sequence[Sample], units: list[tuple[list[int], list[int]]], width: int, pad_id: int) -> _Packing:
    """Each unit as one prompt followed by its responses, units in rows of at least SHARE_UNIT tokens (:func:`_rows`).
    A response's positions continue the prompt's; it attends to its prompt and to itself (the attention mask), so
    it computes what it would alone. Its first token is predicted at the prompt's last position."""
    lengths = [len(pr) + sum(len(samples[i].response_ids) for i in members) for pr, members in units]
    rows, c = _rows(lengths, SHARE_UNIT)
    ids: list[int] = []
    pos: list[int] = []
    unit: list[int] = []  # per position: its unit (a row's tail: a unit of its own per position)
    resp: list[int] = []  # per position: its sample, -1 on a prompt
    src: list[int] = []
    dst: list[int] = []
    for j, members in enumerate(rows):
        o = 0
        for u in members:
            prompt, which = units[u]
            n_p = len(prompt)
            ids += prompt
            pos += range(n_p)
            unit += [u] * n_p
            resp += [-1] * n_p
            last, o = j * (c - 1) + o + n_p - 1, o + n_p
            for i in which:
                r = samples[i].response_ids
                ids += r
                pos += range(n_p, n_p + len(r))
                unit += [u] * len(r)
                resp += [i] * len(r)
                src += [last, *range(j * (c - 1) + o, j * (c - 1) + o + len(r) - 1)][: len(r)]
                dst += range(i * (width - 1) + n_p - 1, i * (width - 1) + n_p - 1 + len(r))
                o += len(r)
        ids += [pad_id] * (c - o)
        pos += range(c - o)
        unit += range(-1, -1 - (c - o), -1)
        resp += [-1] * (c - o)
    shape = (len(rows), c)
    un, rs = torch.tensor(unit).view(shape), torch.tensor(resp).view(shape)
    mask = (torch.ones(c, c, dtype=torch.bool).tril() & (un[:, :, None] == un[:, None, :])
            & ((rs[:, None, :] == -1) | (rs[:, :, None] == rs[:, None, :])))
    return _Packing(torch.tensor(ids, dtype=torch.long).view(shape), torch.tensor(pos, dtype=torch.long).view(shape),
                    torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long), mask[:, None])


@torch.no_grad()
def check_packing(model: Any, where: str, share: bool = False) -> float:
    """Proof that this model's forward honours the packed layouts: its outputs (logits, or a critic's values) at
    every position that predicts a response token equal their padded outputs for two sequences packed in one row
    (position ids) and, with ``share``, for three responses after one shared prompt (the attention mask); else
    a clear error rather than a loss that crosses sequence boundaries. The largest gap."""
    vocab = int(model.get_input_embeddings().num_embeddings)
    seqs = [[(3 + 5 * k) % vocab for k in range(6)], [(4 + 7 * k) % vocab for k in range(4)]]
    samples = [Sample(q[:2], q[2:], [0.0] * (len(q) - 2), 0.0, i) for i, q in enumerate(seqs)]
    layouts = [(samples, _collate(samples, {}, 0, pack=True).packed, "train.pack_sequences: false")]
    if share:
        shared = [Sample(seqs[0][:3], r, [0.0] * len(r), 0.0, 0) for r in (seqs[1][:2], seqs[1][1:], seqs[0][3:4])]
        shared.append(samples[1])
        width = max(len(x.prompt_ids) + len(x.response_ids) for x in shared)
        layouts.append((shared, _pack_shared(shared, _units(shared), width, 0), "train.share_prompts: false"))
    was_training = model.training
    model.eval()
    worst = 0.0
    # A 16-bit model (a reference kept in its checkpoint's dtype) rounds its logits to ~3 digits: the probe's
    # 16-bit tolerance. Attention across a sequence boundary moves them by far more.
    tol = 1e-4 if next(model.parameters()).dtype == torch.float32 else 5e-2
    for group, p, fix in layouts:
        padded = _collate(group, {}, 0)
        plain = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits[:, :-1]
        rows = model(input_ids=p.input_ids, position_ids=p.position_ids, attention_mask=p.attention_mask,
                     use_cache=False).logits[:, :-1]
        got = rows.reshape(-1, rows.shape[-1])[p.src]
        gap = float((got - plain.reshape(-1, plain.shape[-1])[p.dst]).abs().max())
        if not gap <= tol:
            model.train(was_training)
            raise ValueError(f"{where}: this model's forward does not keep packed sequences apart (outputs packed vs "
                             f"padded differ by {gap:.3g}); set {fix}")
        worst = max(worst, gap)
    model.train(was_training)
    return worst


def _collate(samples: Sequence[Sample], per_token: dict[str, Sequence[Sequence[float]]], pad_id: int,
             train_masks: Sequence[Sequence[float]] | None = None, pack: bool = False, share: bool = False) -> _Micro:
    """Pad prompt+response sequences; place response-aligned values at the positions that predict them;
    ``pack``: also the packed layout of the same sequences, where it saves PACK_MIN_SAVING of the positions;
    ``share``: with one copy of each shared prompt, where that saves PACK_MIN_SAVING of the packed positions."""
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    ids = torch.tensor([q + [pad_id] * (width - len(q)) for q in seqs], dtype=torch.long)
    att = torch.tensor([[1] * len(q) + [0] * (width - len(q)) for q in seqs], dtype=torch.long)

    def aligned(rows: Sequence[Sequence[float]]) -> torch.Tensor:
        # Position t predicts token t+1: response token j sits at p+j and is predicted at p+j-1.
        out = []
        for i, (s, r) in enumerate(zip(samples, rows)):
            if len(r) != len(s.response_ids):
                raise ValueError(f"sample {i}: {len(r)} per-token values for its {len(s.response_ids)} response tokens")
            lead = len(s.prompt_ids) - 1 if len(r) else width - 1
            out.append([0.0] * lead + list(r) + [0.0] * (width - 1 - lead - len(r)))
        return torch.tensor(out, dtype=torch.float32).view(len(samples), width - 1)

    action = aligned([s.action_mask for s in samples])
    mask = aligned(train_masks if train_masks is not None else [s.action_mask for s in samples])
    tok = {k: aligned(rows) for k, rows in per_token.items()}
    packed = None
    if pack:
        units = _units(samples) if share else []
        shared = sum(len(pr) for pr, _ in units) + sum(len(x.response_ids) for x in samples)
        if units and shared <= (1.0 - PACK_MIN_SAVING) * sum(map(len, seqs)):
            packed = _pack_shared(samples, units, width, pad_id)
        else:
            packed = _pack(seqs, width, pad_id)
    if packed is not None and packed.input_ids.numel() > (1.0 - PACK_MIN_SAVING) * ids.numel():
        packed = None  # little padding to save: rows of sequences would only add attention work
    return _Micro(ids, att, ids[:, 1:], mask, action, tok, packed)


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


@dataclass
class _Prepared:
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


def token_bins(lengths: Sequence[int], ids: Sequence[int], budget: int, packed: bool) -> list[list[int]]:
    """``ids`` cut into bins of at most ``budget`` tokens, first fit, longest first. A bin costs the sum of its
    lengths when packed, its rows × its longest when padded; a sequence over the budget is a bin alone."""
    bins: list[list[int]] = []
    cost: list[tuple[int, int]] = []  # (tokens, longest) per bin
    for n, i in sorted(zip(lengths, ids), key=lambda t: -t[0]):
        for b, (tok, top) in enumerate(cost):
            if (tok + n if packed else (len(bins[b]) + 1) * max(top, n)) <= budget:
                bins[b].append(i)
                cost[b] = (tok + n, max(top, n))
                break
        else:
            bins.append([i])
            cost.append((n, n))
    return bins


def _merge_stats(into: dict[str, float], stats: dict[str, float]) -> None:
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


@dataclass
class PolicyTrainer:
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
        import deepspeed
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
        torch.manual_seed(self.seed)
        # LoRA: the base weights are the start model's, the adapter a save point's (its merged weights are the
        # engine's, not a base to put the adapter on again).
        src = self.model_dir if self.cfg.lora else (self.resume_dir or self.model_dir)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=self._base_dtype(src))
        self.tokenizer = load_tokenizer(self.resume_dir or self.model_dir)
        if self.cfg.pack_sequences:
            check_packing(model, src, self.cfg.share_prompts)
        if self.cfg.gradient_checkpointing:
            _checkpoint_activations(model)
        if self.cfg.lora:
            model = with_lora(model, self.cfg.lora, Path(self.resume_dir) / ADAPTER if self.resume_dir else None)
            if self.cfg.precision == "fp32":
                _upcast_frozen(model)
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

    def _base_dtype(self, src: str) -> torch.dtype:
        """float32, but LoRA keeps the frozen base in 16 bits: nothing optimizes those weights, so no float32
        master copy is needed, and the base takes half the memory (the adapters stay float32, peft). A 16-bit
        checkpoint stays in its own dtype, under fp32 too, where each layer computes in float32 from its 16-bit
        weight (:func:`_upcast_frozen`: the same numbers as a float32 copy, every 16-bit value being a float32
        one); under bf16 a float32 checkpoint is held in bfloat16 as well, as TRL and OpenRLHF load it."""
        if not self.cfg.lora:
            return torch.float32
        saved = json.loads((Path(src) / "config.json").read_text())
        named = saved.get("dtype") or saved.get("torch_dtype")
        if named in ("float16", "bfloat16"):
            return getattr(torch, named)
        return torch.bfloat16 if self.cfg.precision == "bf16" else torch.float32

    def _reference(self) -> Any:
        """The frozen reference model. Under bf16 it is kept in the checkpoint's own dtype (a 16-bit checkpoint
        takes half the memory of a float32 copy; its forward runs under the same autocast as the policy's);
        under fp32, in float32 as the policy."""
        from transformers import AutoModelForCausalLM

        src = self.ref_model_dir or self.model_dir
        ref = AutoModelForCausalLM.from_pretrained(src, dtype="auto" if self.cfg.precision == "bf16" else torch.float32)
        ref.eval().requires_grad_(False)
        if self.cfg.pack_sequences:
            check_packing(ref, src, self.cfg.share_prompts)
        return ref.to(self.device)

    def _ref_logprobs(self, micro: _Micro) -> torch.Tensor:
        if self.ref_is_base:
            with self.engine.module.disable_adapter():
                return self._forward(micro, self.engine.module)[0]
        return self._forward(micro, self.ref)[0]

    @property
    def has_reference(self) -> bool:
        return self.ref is not None or self.ref_is_base

    def _engine(self, model: Any, lr: float, grad_clip: float) -> Any:
        import deepspeed
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

        # torch's fused AdamW (one kernel per tensor, CPU and CUDA): the demo's 4 optimizer steps 0.066 → 0.020 s on
        # CPU against the default single-tensor loop (benchmarks/profile_update.py); TRL's default too.
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.99), weight_decay=0.0, fused=True)
        ds_config = {
            "train_batch_size": self.cfg.batch_size,
            "train_micro_batch_size_per_gpu": self.cfg.micro_batch_size,
            "gradient_accumulation_steps": self.gas,
            # ZeRO 0: the trainer clips with the norm it computes anyway (_step); DeepSpeed's own clipping would
            # compute it a second time and all-reduce it, even on one rank. ZeRO 1/2 clip in DeepSpeed's optimizer.
            "gradient_clipping": grad_clip if self.cfg.zero_stage > 0 else 0.0,
            "zero_optimization": self._zero_config(),
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        if self.cfg.offload_optimizer:  # torch's AdamW on the CPU partitions (DeepSpeedCPUAdam would compile an op)
            ds_config["zero_force_ds_cpu_optimizer"] = False
        if self.cfg.precision == "bf16":
            # DeepSpeed turns an outer torch.autocast off inside its engine's forward unless this section asks for it
            # (seen on CUDA: the forward ran in float32). No lower-precision modules: gradients reduce in float32.
            ds_config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        if isinstance(engine.checkpoint_engine, TorchCheckpointEngine):
            engine.checkpoint_engine = RecyclingWrites(engine.checkpoint_engine)
        if self.world == 1 and self.cfg.zero_stage == 0:
            # One rank, no ZeRO partitions: nothing to reduce, but DeepSpeed would still flatten, all-reduce and
            # copy back every gradient after each backward (7 ms of the demo's 200 ms step).
            engine.enable_backward_allreduce = False
        return engine

    def _zero_config(self) -> dict[str, Any]:
        zero: dict[str, Any] = {"stage": self.cfg.zero_stage}
        if self.cfg.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        return zero

    def _build_critic(self) -> Any:
        """The policy's trunk with a scalar head (HF token classification, 1 label, no dropout)."""
        from transformers import AutoConfig, AutoModelForTokenClassification

        src = self.cfg.critic.model or self.model_dir
        config = AutoConfig.from_pretrained(src, num_labels=1)
        config.classifier_dropout = 0.0  # else 0.1: noisy values
        # The head is new: seed its init so every rank (and a rerun) starts from the same critic.
        torch.manual_seed(self.seed + 17)
        critic = AutoModelForTokenClassification.from_pretrained(src, config=config, dtype=torch.float32)
        torch.manual_seed(self.seed)
        if self.cfg.gradient_checkpointing:
            _checkpoint_activations(critic)
        return critic

    # -- the update -------------------------------------------------------------------------
    def _forward(self, micro: _Micro, model: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of the targets in the padded layout, and the logits in the layout the forward ran in
        (``micro.unpack`` maps what is computed from them)."""
        if micro.packed is None:
            with self._autocast():
                logits = model(input_ids=micro.input_ids, attention_mask=micro.attention_mask).logits[:, :-1]
            return token_logprobs(logits, micro.targets, self.temperature), logits
        p = micro.packed
        with self._autocast():
            logits = model(input_ids=p.input_ids, position_ids=p.position_ids, attention_mask=p.attention_mask,
                           use_cache=False).logits[:, :-1]
        picked = logits.reshape(-1, logits.shape[-1])[p.src]  # the predicting positions only (a shared prompt's repeats)
        return micro.scatter(token_logprobs(picked, micro.targets.reshape(-1)[p.dst], self.temperature)), logits

    def _values(self, micro: _Micro, model: Any) -> torch.Tensor:
        """V(s_t) at each position that predicts a token: (b, L-1)."""
        with self._autocast():
            if micro.packed is None:
                return model(input_ids=micro.input_ids, attention_mask=micro.attention_mask).logits[:, :-1, 0].float()
            p = micro.packed
            return micro.unpack(model(input_ids=p.input_ids, position_ids=p.position_ids, attention_mask=p.attention_mask,
                                      use_cache=False).logits[:, :-1, 0].float())

    def _autocast(self) -> Any:
        """train.precision bf16: the forward under bfloat16 autocast (float32 master weights; log-probs, entropy and
        losses are taken in float32 from the bf16 logits). fp32: nothing."""
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
            micro = _collate(chunk, {}, self.tokenizer.pad_token_id, pack=self.cfg.pack_sequences,
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

    def sequence_logprobs(self, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]) -> list[list[float]]:
        """log π(c_t | prompt, c_<t) of each continuation token under the trainer's weights at temperature 1
        (the weight-sync probe compares these with the engine's)."""
        samples = [Sample(list(p), list(c), [0.0] * len(c), 0.0, i) for i, (p, c) in enumerate(zip(prompts, continuations))]
        was_training = self.engine.module.training
        self.engine.module.eval()
        micro = _collate(samples, {}, self.tokenizer.pad_token_id).to(self.device)
        # A 16-bit LoRA base under bf16: in float32 for the probe's forward (under fp32 its layers already upcast)
        with _float_weights(self.engine.module) if self.cfg.precision == "bf16" else nullcontext():
            logits = self.engine.module(input_ids=micro.input_ids, attention_mask=micro.attention_mask).logits[:, :-1]
        lp = token_logprobs(logits, micro.targets, 1.0)
        self.engine.module.train(was_training)
        return [lp[i, len(s.prompt_ids) - 1 : len(s.prompt_ids) - 1 + len(s.response_ids)].tolist() for i, s in enumerate(samples)]

    def _micro_loss(self, micro: _Micro, agg: LossAgg, beta: float, measure: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
        """The micro-batch's loss (scaled for DeepSpeed) and its statistics; ``measure``: also the train/inference
        mismatch of its tokens (only while the weights are still the sampling policy's)."""
        logprobs, logits = self._forward(micro, self.engine)
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
            ent = micro.unpack(entropy_from_logits(logits, self.temperature))
            ent_term = aggregate(ent, micro.mask, agg)
            loss = loss - self.cfg.entropy_coef * ent_term
            stats["entropy_loss_sum"] = float(ent_term.detach())
        else:
            with torch.no_grad():
                ent = micro.unpack(entropy_from_logits(logits, self.temperature))
        stats["entropy_tok"] = float((ent.detach() * micro.mask).sum())
        if self.has_reference and self.cfg.kl_in == "loss":
            kl = kl_penalty(logprobs, micro.tok["ref_logprobs"], self.cfg.kl_estimator)
            kl_term = aggregate(kl, micro.mask, agg)
            loss = loss + beta * kl_term
            stats["kl_loss_sum"] = float(kl_term.detach())
        return loss * scale, stats

    def _critic_loss(self, micro: _Micro, agg: LossAgg) -> tuple[torch.Tensor, dict[str, float]]:
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

    def update(self, samples: Sequence[Sample], iteration: int) -> dict[str, float]:
        """One iteration's optimizer steps on scored samples; invalid ones are left out and counted.

        A mini-batch whose loss or gradient is not finite is skipped (no parameter or optimizer-state
        change) and counted in ``nonfinite_steps``."""
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

    def _prepare(self, valid: Sequence[Sample]) -> "_Prepared":
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
        return _Prepared(per_token, [self._train_mask(s) for s in valid], beta, rollout_kl, values,
                         adv_out.returns, action, metrics, measure_mismatch="policy_logprobs" not in pre)

    def _optimize(self, valid: Sequence[Sample], prep: "_Prepared", iteration: int) -> tuple[dict[str, float], dict[str, list[float]], int, int]:
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

    def _minibatch(self, valid: Sequence[Sample], prep: "_Prepared", idx: list[int], sums: dict[str, float],
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
                micro = _collate([valid[i] for i in slot], {key: [rows[i] for i in slot] for key, rows in prep.per_token.items()},
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
            _merge_stats(collected, stats)
        ok = finite["policy"] and finite["critic"]
        if not ok:  # a skipped step's statistics are not averaged into the iteration's, but its mismatch is what
            collected = {k: v for k, v in collected.items() if k.startswith("mm_")}  # tells why it was skipped
        _merge_stats(sums, collected)
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
        weights from every rank."""
        if self.cfg.zero_stage < 3:
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
            if ok:  # clip ×min(1, max/(norm + 1e-6)), as DeepSpeed and torch do
                torch.nn.utils.clip_grads_with_norm_(params, clip, total, foreach=True)
                engine.step()
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

    def _summarise(self, sums: dict[str, float], norms: dict[str, list[float]], steps: int, skipped: int,
                   prep: "_Prepared") -> dict[str, float]:
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

    @staticmethod
    def _ds_grad_norm(engine: Any) -> float:
        gn = engine.get_global_grad_norm()
        return float(gn) if gn is not None else float("nan")

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

    # -- weights and state ------------------------------------------------------------------
    @property
    def module(self) -> Any:
        return self.engine.module

    def export_weights(self, folder: str | Path, spare: Spare | str | Path | None = None) -> str:
        """HF weights + tokenizer (rank 0); returns the sha256 of the saved safetensors (``weights_sha256``).
        ``spare``: an earlier save point no longer needed, whose safetensors files are written over."""
        folder = Path(folder)
        # ZeRO-3: each rank holds 1/N of every weight; all ranks gather them layer by layer onto rank 0.
        gathered = self.engine._zero3_consolidated_16bit_state_dict() if self.cfg.zero_stage == 3 else None
        if self.rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            with RecyclingSafetensors(folder, Spare.of(spare)) as files:
                if self.cfg.lora:  # the engine computes with the merged weights: a plain HF checkpoint of them
                    self.engine.module.get_base_model().save_pretrained(
                        folder, state_dict=merged_state_dict(self.engine.module), safe_serialization=True)
                else:
                    self.engine.module.save_pretrained(folder, state_dict=gathered, safe_serialization=True)
            self.tokenizer.save_pretrained(folder)
            digest = files.digest() or file_weights_sha256(folder)
        else:
            digest = ""
        if self.world > 1:
            import torch.distributed as dist

            box = [digest]
            dist.broadcast_object_list(box, src=0)
            digest = box[0]
        return digest

    def save(self, folder: str | Path, extra_state: dict[str, Any] | None = None, spare: str | Path | None = None) -> str:
        """A resumable checkpoint: HF weights + tokenizer + DeepSpeed optimizer state (+ the critic's) + trainer state.
        ``spare``: an earlier save point no longer needed, whose files are written over (RecyclingSafetensors for the
        weights, RecyclingWrites for DeepSpeed's)."""
        folder, spare = Path(folder), Spare.of(spare)  # one Spare: this process's maps read once per save
        digest = self.export_weights(folder, spare)
        if self.cfg.lora and self.rank == 0:  # what a resume puts back on the start model's base weights
            self.engine.module.save_pretrained(folder / ADAPTER, safe_serialization=True)
        with _module_left_out(self.engine):  # the HF weights above are the module's: not written twice
            _recycling(self.engine, folder, spare).save_checkpoint(str(folder / "deepspeed"), tag="state", save_latest=False)
        if self.critic is not None:
            _recycling(self.critic, folder, spare).save_checkpoint(str(folder / "critic"), tag="state", save_latest=False)
        if self.rank == 0:
            state = dict(self.state) | (extra_state or {}) | {"weights_sha256": digest, "world_size": self.world}
            if self.cfg.lora:  # the adapter's hash from memory: an engine fed adapter/ must read the same tensors
                from peft import get_peft_model_state_dict

                state |= {"lora_base": str(self.model_dir),
                          "adapter_sha256": weights_sha256(get_peft_model_state_dict(self.engine.module))}
            (folder / TRAINER_STATE).write_text(json.dumps(state, indent=2, sort_keys=True, default=str))
            torch.save(rng_state(), folder / "rng.pt")
        return digest

    def _load_state(self, folder: Path) -> None:
        saved = read_trainer_state(folder)
        if self.cfg.zero_stage > 0 and int(saved.get("world_size", self.world)) != self.world:
            raise ValueError(f"{folder} was saved by {saved['world_size']} rank(s) with ZeRO stage {self.cfg.zero_stage}, "
                             f"which splits the optimizer state by rank; resume it with {saved['world_size']} rank(s)")
        path, _ = self.engine.load_checkpoint(str(folder / "deepspeed"), tag="state", load_optimizer_states=True,
                                              custom_load_fn=_module_from_hf_weights)
        if path is None:
            raise FileNotFoundError(f"{folder}/deepspeed holds no DeepSpeed checkpoint 'state'")
        if self.critic is not None:
            path, _ = self.critic.load_checkpoint(str(folder / "critic"), tag="state", load_optimizer_states=True)
            if path is None:
                raise FileNotFoundError(f"{folder}/critic holds no critic checkpoint; was it saved by a run without a critic?")
        self.state = saved
        if "kl_controller" in self.state:
            self.kl_ctl.load_state_dict(self.state["kl_controller"])
        rng = folder / "rng.pt"
        if rng.exists():
            set_rng_state(torch.load(rng, weights_only=False))


def _checkpoint_activations(model: Any) -> None:
    """transformers' gradient checkpointing, non-reentrant (the reentrant form needs an input that requires
    grad, which a frozen-embedding LoRA model does not have); the KV cache is off, as it must be with it."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def with_lora(model: Any, cfg: Any, adapter_dir: Path | None = None) -> Any:
    """``model`` with peft LoRA adapters per ``train.lora``; the adapter weights of ``adapter_dir`` when resuming.
    A target that matches no module is refused with the model's linear layer names."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if adapter_dir is not None:
        if not (adapter_dir / "adapter_config.json").exists():
            raise FileNotFoundError(f"{adapter_dir} holds no LoRA adapter (adapter_config.json); was the save point "
                                    "written by a run without train.lora?")
        return PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
    peft_cfg = LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=lora_targets(model, cfg.target_modules),
                          bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, peft_cfg)


def lora_targets(model: Any, targets: str | list[str], exclude: str | None = None, key: str = "train.lora") -> str | list[str]:
    """``targets`` checked against the model's linear layers (a name that matches none is refused, with the
    names there are). ``exclude``: a module kept out of 'all-linear' (a scalar head trained in full): the
    linear layers' leaf names but its own."""
    names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if targets == "all-linear":
        if exclude is None:
            return targets
        return sorted({n.rsplit(".", 1)[-1] for n in names if not (n == exclude or n.startswith(exclude + "."))})
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise ValueError(f"{key}.target_modules: {missing} match no linear module of the model; its linear "
                         f"layers are named {leaves} (or use 'all-linear')")
    return targets


class _UpcastLinear(torch.autograd.Function):
    """``F.linear`` with a frozen 16-bit weight computed in the input's float32: the backward upcasts the weight
    again instead of keeping a float32 copy of it alive between forward and backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return torch.nn.functional.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (weight,) = ctx.saved_tensors
        return grad @ weight.to(grad.dtype), None, None


def _upcast_frozen(model: Any) -> None:
    """Each frozen 16-bit layer of ``model`` computes in float32 (train.precision fp32 over a 16-bit LoRA base):
    linear layers through :class:`_UpcastLinear`, embeddings by upcasting what they look up; the small 16-bit
    parameters left (norms) are made float32."""
    for module in model.modules():
        low = [p for p in module.parameters(recurse=False) if p.dtype in (torch.bfloat16, torch.float16)]
        if not low or any(p.requires_grad for p in low):
            continue
        if isinstance(module, torch.nn.Linear):
            module.forward = lambda x, m=module: _UpcastLinear.apply(x, m.weight, m.bias)
        elif isinstance(module, torch.nn.Embedding):
            plain = module.forward
            module.forward = lambda ids, f=plain: f(ids).float()
        else:
            module.float()


@contextmanager
def _float_weights(model: Any):
    """The model's 16-bit parameters (a LoRA base kept in 16 bits) in float32 while the block runs, then back:
    lossless both ways (every 16-bit value is a float32 one), so the forward inside is the float32 forward of
    exactly the weights the trainer holds, which the merged float32 export gives the engine."""
    low = [p for p in model.parameters() if p.dtype in (torch.bfloat16, torch.float16)]
    dtypes = [p.dtype for p in low]
    for p in low:
        p.data = p.data.float()
    try:
        yield
    finally:
        for p, dt in zip(low, dtypes):
            p.data = p.data.to(dt)


def merged_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The weights a LoRA model computes with, under the base model's own names: each adapted layer's base
    weight plus its adapter's delta (peft's ``get_delta_weight``: B·A·alpha/r). What the engine is synced with
    and what ``save_pretrained`` writes as a plain HF checkpoint; the model itself is not changed. Tensors the
    base shares (tied embeddings) stay shared, so the tied copy is dropped on save as before."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {name: m.get_delta_weight(m.active_adapters[0]) for name, m in base.named_modules()
              if isinstance(m, LoraLayer) and m.active_adapters}
    out: dict[str, torch.Tensor] = {}
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        owner, _, leaf = key.rpartition(".base_layer.")
        if owner:
            key = f"{owner}.{leaf}"
            if leaf == "weight" and owner in deltas:  # in float32: a 16-bit base would round the adapter's delta
                value = value.float() + deltas[owner].float()
        out[key] = value.detach()
    if any(v.dtype != torch.float32 for v in out.values()):  # a 16-bit base: the engine gets float32 throughout,
        done: dict[int, torch.Tensor] = {}  # exactly the weights the trainer computes with (tied ones stay shared)
        out = {k: done.setdefault(v.data_ptr(), v.float()) for k, v in out.items()}
    return out


def _recycling(engine: Any, folder: Path, spare: Spare | None) -> Any:
    if isinstance(engine.checkpoint_engine, RecyclingWrites):
        engine.checkpoint_engine.recycle(folder, spare)
    return engine


@contextmanager
def _module_left_out(engine: Any):
    """DeepSpeed's checkpoint without the module's weights. They are the HF weights saved beside it, from
    which the trainer is built on resume (``from_pretrained(resume_dir)``), so writing them again cost a
    third of every save (14 of 41 MB at the demo size). The optimizer state (with any fp32 master weights)
    is saved as before."""
    engine.module_state_dict = lambda *args, **kwargs: {}
    try:
        yield
    finally:
        del engine.module_state_dict


def _module_from_hf_weights(src: dict[str, Any], dst: Any) -> None:
    """Loads the module part of a DeepSpeed checkpoint: nothing when it was left out (the trainer was built
    from the same folder's HF weights, ``from_pretrained(resume_dir)``); the weights themselves from a state
    saved before they were left out."""
    if src:
        dst.load_state_dict(src)
