"""The run config's ``train:`` section: the RL update (algorithm, losses, KL, clipping, batching, memory, the
iteration schedule), with the critic of PPO and LoRA adapters.

Long for a module because most of it is field documentation: one field, one description the schema and the
Prefect UI show. The algorithms are imported inside methods: they bring torch, which a config must not need.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlpipe.yamlio import Strict


# Advantage estimators that read token-level rewards (and so per-step rewards of episodes).
TOKEN_LEVEL_ADVANTAGES = frozenset({"gae", "reinforce_pp", "reinforce_pp_baseline"})


class CriticConfig(Strict):
    """The value model of estimators that need one (``gae``: PPO). A separate model with its own optimizer."""

    model: str | None = Field(
        None, description="Where the critic's trunk starts (same forms as task.policy_model); default: the policy's "
        "starting weights. A scalar value head is added on top."
    )
    lr: float = Field(1e-4, gt=0, description="Critic learning rate (its own AdamW inside the same trainer).")
    value_clip: float | None = Field(0.2, gt=0, description="Clip of V − V_old in the value loss; null: unclipped.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the critic's global gradient norm to this value.")


class LoraConfig(Strict):
    """Low-rank adapters (peft's LoRA) on the policy: only the adapters train; the base weights stay frozen."""

    r: int = Field(16, ge=1, description="Rank of each adapter.")
    alpha: float = Field(32.0, gt=0, description="Scale numerator: an adapter's update is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Module names (or name suffixes, e.g. [q_proj, v_proj]) that get an adapter; "
        "'all-linear': every linear layer but the output layer. A name that matches no module is an error."
    )


class TrainConfig(Strict):
    algorithm: str = Field(
        "grpo", description="Registered algorithm: grpo, dr_grpo, dapo, gspo, rloo, reinforce_pp, reinforce_pp_baseline, "
        "ppo (advantage estimator + policy loss + loss aggregation; see rlpipe.algorithms)."
    )
    advantage: str | None = Field(None, description="Override the algorithm's advantage estimator (registered name).")
    policy_loss: str | None = Field(None, description="Override the algorithm's policy loss (registered name).")
    loss_agg_mode: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "constant"] | None = Field(
        None, description="How token losses are reduced; null: the algorithm's own (grpo token_mean, dr_grpo constant, "
        "gspo seq_mean_token_mean)."
    )
    loss_agg_constant: float | None = Field(
        None, gt=0, description="Per-sequence normaliser of loss_agg_mode 'constant'; default: rollout.max_new_tokens."
    )
    lr: float = Field(3e-5, gt=0, description="Policy learning rate.")
    warmup_steps: int = Field(
        0, ge=0, description="Linear learning-rate warm-up over the first N optimizer steps of the run (policy and "
        "critic), as verl's lr_warmup_steps: step k uses lr × min(1, k/N). Adam's first steps move every weight by "
        "about lr whatever the gradient's size; a warm-up lets its moment estimates settle first. 0: no warm-up."
    )
    kl_coef: float = Field(0.0, ge=0, description="KL coefficient β to the reference model (0 = none; the adaptive "
                           "controller's start value when kl_target is set).")
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = Field(
        "k3", description="Per-token KL estimator (Schulman 2020); low_var_kl is k3 clamped to ±10."
    )
    kl_in: Literal["loss", "reward"] = Field(
        "loss", description="Where the KL penalty goes: a loss term (GRPO) or subtracted from the token rewards "
        "(PPO/REINFORCE++ style)."
    )
    kl_target: float | None = Field(
        None, gt=0, description="Adaptive KL controller (Ziegler et al. 2019): steer β so the measured KL tracks this "
        "value; null: β fixed at kl_coef."
    )
    kl_horizon: int = Field(10_000, ge=1, description="Adaptive KL controller horizon, in samples.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus: loss −= coef · entropy of the policy.")
    norm_adv_by_std: bool = Field(True, description="GRPO: divide group-centred rewards by the group's std.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount of token rewards (gae, reinforce_pp).")
    lam: float = Field(0.95, ge=0, le=1, description="GAE λ (gae).")
    grad_clip: float = Field(1.0, gt=0, description="Clip the global gradient norm to this value.")
    clip_ratio: float | None = Field(
        None, gt=0, description="PPO clip range ε of the importance ratio; default: the algorithm's own (0.2; gspo "
        "3e-4/4e-4 and dapo 0.2/0.28 as low/high)."
    )
    clip_ratio_low: float | None = Field(None, gt=0, description="Lower clip range ε_low; default: clip_ratio.")
    clip_ratio_high: float | None = Field(
        None, gt=0, description="Upper clip range ε_high (DAPO 'clip-higher': larger than ε_low); default: clip_ratio."
    )
    tis_cap: float | None = Field(
        None, gt=0, description="Truncated importance sampling (as verl and slime): the trainer recomputes the "
        "old log-probs and weights each token's loss by min(π_trainer/π_sampler, tis_cap), correcting the "
        "train/inference mismatch; null: off (the sampler's log-probs are the old policy)."
    )
    mismatch_full_pass: bool = Field(
        False, description="Measure the train/inference mismatch on every sampled token with a forward pass before "
        "the first optimizer step (one more forward per update). false: measure it in the first optimizer step's "
        "forward, where the policy has not moved yet: the tokens of one mini-batch (1/steps of the batch), no extra "
        "pass. The optimization is the same either way; train.tis_cap always makes the pass (it needs every token). "
        "The first step's forward runs in training mode: for a model with dropout, set this true."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute each transformer block's activations in the backward pass instead of keeping "
        "them (transformers' gradient checkpointing, non-reentrant): activation memory falls from one set per layer "
        "to about one layer's, for about one more forward pass of compute. The policy and the critic."
    )
    lora: LoraConfig | None = Field(
        None, description="Train LoRA adapters instead of every weight (peft). The reference model is the same "
        "base with the adapters switched off (no second copy of the weights); the engine receives the merged "
        "weights at each sync (proven by the probe as before); each save point holds the adapter beside them. "
        "null: full fine-tuning."
    )
    pack_sequences: bool = Field(
        True, description="The policy's, the reference's and the critic's forward passes run on the micro-batch's sequences laid "
        "end to end in rows (position ids restart at each sequence; no compute on padding) instead of one padded "
        "row per sequence, wherever that computes at least 10% fewer positions (sequences of unequal length). The "
        "losses are the padded ones up to float rounding; the trainer checks at start that "
        "the model keeps packed sequences apart (transformers' packed position ids) and refuses it otherwise. "
        "false: pad every sequence to the micro-batch's longest."
    )
    share_prompts: bool = Field(
        True, description="With train.pack_sequences: samples of a micro-batch with the same prompt (a GRPO group's) "
        "share one copy of it in the packed rows; each response's positions continue the prompt's and it attends to "
        "the prompt and to itself only (an explicit attention mask), so the prompt is computed once, not once per "
        "sample. Used wherever it computes at least 10% fewer positions than packing without it; the losses are the "
        "padded ones up to float rounding, and the trainer checks at start that the model honours the mask. "
        "false: every sample carries its own prompt."
    )
    mismatch_threshold: float = Field(
        0.1, gt=0, description="Train/inference mismatch: the share of sampled tokens whose |log π_trainer − "
        "log π_sampler| exceeds this is logged each iteration (mismatch/share_above)."
    )
    max_nonfinite_steps: int = Field(
        3, ge=1, description="A mini-batch whose loss or gradient is not finite is skipped (counted, alerted); "
        "this many skipped in one iteration stops the run."
    )
    dual_clip: float | None = Field(
        None, gt=1, description="Dual-clip bound c > 1: tokens with negative advantage lose at most −A·c (null: off)."
    )
    ppo_epochs: int = Field(1, ge=1, description="Passes over each iteration's samples.")
    shuffle: Literal["samples", "groups"] = Field(
        "samples", description="How an iteration's samples are dealt into mini-batches (a seeded order per iteration "
        "and epoch, the same after a resume). samples: each sample on its own, as TRL's GRPOTrainer shuffles them. "
        "groups: whole groups (the samples of one prompt) in a shuffled order of groups, as a split of the batch in "
        "generation order keeps them, so a mini-batch holds fewer prompts and train.share_prompts computes each of them "
        "once for up to rollout.samples_per_prompt responses. Advantages are computed over the whole batch before "
        "either."
    )
    mask_truncated: bool = Field(
        False, description="DAPO overlong filtering: responses cut at max_new_tokens take no part in the loss."
    )
    critic: CriticConfig = Field(default_factory=CriticConfig, description="Value model (only built for 'gae').")
    batch_size: int = Field(64, ge=1, description="Completions per optimizer step (global).")
    micro_batch_size: int = Field(64, ge=1, description="Completions per forward/backward (per rank).")
    max_tokens_per_micro_batch: int | None = Field(
        None, ge=1, description="Micro-batches by token budget instead of by count (verl's use_dynamic_bsz, "
        "OpenRLHF's packing budget): each rank's share of a mini-batch is cut into micro-batches of at most this "
        "many prompt+response tokens (as packed: the sum of the lengths; padded: rows × the longest), longest "
        "first, so short responses share a forward and a long one gets its own. A sequence longer than the budget "
        "is a micro-batch alone (counted in micro/over_budget). Ranks take the same number of micro-batches (an "
        "empty one still joins the step). The loss is the same as with count micro-batches: it is normalised by "
        "the mini-batch's totals. null: micro_batch_size completions each."
    )
    logits_chunk: int | None = Field(
        None, ge=1, description="The output layer in chunks of this many positions in the trainer's forwards (what "
        "Liger's fused linear cross-entropy does on a GPU): the log-probs and entropy of a response's positions are "
        "taken from the logits of at most this many positions at a time, and the backward recomputes each chunk's "
        "logits instead of keeping them. Bounds the logits' memory (at a 151,936-token vocabulary, 0.6 MB per "
        "position and copy) for one more pass of the output layer in the backward. Proven at start on the model "
        "(its logits must be its output layer's alone: no logit scale or soft cap). null: the logits of every "
        "position that predicts a response token at once (a prompt's positions get none either way)."
    )
    offload_optimizer: bool = Field(
        False, description="ZeRO-Offload: the optimizer's fp32 master weights and Adam moments live in CPU memory "
        "and the step runs there (needs zero_stage 1, 2 or 3); the GPU keeps the weights, gradients and "
        "activations. On a CPU-only machine it changes where nothing lives but runs the same code path."
    )
    precision: Literal["fp32", "bf16", "bf16_weights"] = Field(
        "fp32", description="bf16: the policy's, the reference's and the critic's forward passes (and so their "
        "backward) run under bfloat16 autocast, as TRL's bf16=True: weights, gradients, Adam moments, log-probs and "
        "losses stay float32, and each layer casts its float32 weight to bfloat16 in every forward and backward. "
        "bf16_weights: the models' weights themselves are held in bfloat16, so nothing is cast per op, and the "
        "optimizer keeps float32 master weights, float32 gradient accumulation and float32 Adam moments "
        "(DeepSpeed's bf16 mode, as OpenRLHF's --bf16 and verl's FSDP mixed precision); a float32 start checkpoint "
        "is rounded to bfloat16 once, the engine is handed the bfloat16 weights, and a save point keeps the float32 "
        "masters, so a resume continues from them. Needs zero_stage 1 or 2 (at one rank stage 1 splits "
        "nothing; not 3) and no train.lora (use bf16 there: its trainable state is small). Either pays where the "
        "matrices are large enough for a GPU's bf16 units. The weight-sync probe still compares the engine with "
        "the trainer's float32 forward of the weights it holds."
    )
    zero_stage: int = Field(
        0, ge=0, le=3, description="DeepSpeed ZeRO stage: 0 (none), 1 (optimizer state split over the ranks), 2 "
        "(and gradients), 3 (and the weights themselves: each rank holds 1/N of them and gathers a layer's when it "
        "runs; the export, the sync and every checkpoint gather them into a whole HF folder on rank 0). Not with "
        "train.lora (its trainable state is small: use 2)."
    )
    total_iterations: int = Field(80, ge=1, description="RL iterations (one Prefect flow run each).")
    save_interval: int = Field(
        20, ge=1, description="A save point every this many iterations (and at the end): the trainer's resumable "
        "state (weights, optimizer, RNG) written locally and to the object store, and a model version registered. "
        "Between save points the weights reach the engine in memory and nothing is written; a resume continues "
        "from the last save point and redoes the iterations after it (their stored batches are reused where the "
        "policy matches).")
    async_save: bool = Field(
        True, description="Write a save point's local state in a background thread while the sync, the evaluation "
        "and the next batch's generation go on (joined before the next update), then upload it to the object store "
        "behind the run: the next iteration registers its model version and records the save point once the upload "
        "is whole, after its own update (the last iteration's save point is recorded at once, and a run that stops "
        "between iterations records it first). A kill before that resumes from the previous complete save point. "
        "For the in-process trainer; a trainer service writes and uploads its state before it answers.")

    def save_point(self, iteration: int) -> bool:
        """Whether ``iteration`` ends with a save point: every ``save_interval``-th iteration and the last."""
        return (iteration + 1) % self.save_interval == 0 or iteration == self.total_iterations - 1
    eval_interval: int = Field(10, ge=1, description="Greedy held-out accuracy every this many iterations (and at the end).")
    eval_size: int | None = Field(None, ge=1, description="Held-out questions per evaluation; default: the whole test split.")

    def resolved(self) -> dict[str, str]:
        """The advantage estimator, policy loss and loss aggregation this config trains with."""
        from rlpipe.algorithms import algorithm

        base = algorithm(self.algorithm)
        return {
            "advantage": self.advantage or base["advantage"],
            "policy_loss": self.policy_loss or base["policy_loss"],
            "loss_agg_mode": self.loss_agg_mode or base["loss_agg_mode"],
        }

    def advantage_kwargs(self) -> dict[str, object]:
        return {"norm_by_std": self.norm_adv_by_std, "gamma": self.gamma, "lam": self.lam}

    def clip_range(self) -> tuple[float, float]:
        """(ε_low, ε_high): explicit keys first, then clip_ratio, then the algorithm's published range."""
        from rlpipe.algorithms import algorithm

        low, high = algorithm(self.algorithm).get("clip", (0.2, 0.2))
        if self.clip_ratio is not None:
            low = high = self.clip_ratio
        return self.clip_ratio_low or low, self.clip_ratio_high or high

    def loss_kwargs(self) -> dict[str, object]:
        low, high = self.clip_range()
        return {"clip_low": low, "clip_high": high, "dual_clip": self.dual_clip}

    @property
    def uses_reference(self) -> bool:
        return self.kl_coef > 0 or self.kl_target is not None

    @model_validator(mode="after")
    def _micro_fits(self) -> "TrainConfig":
        from rlpipe.algorithms import ADVANTAGES, ALGORITHMS, POLICY_LOSSES

        if self.share_prompts and not self.pack_sequences and "share_prompts" in self.model_fields_set:
            raise ValueError("train.share_prompts needs train.pack_sequences: true (the shared prompt lives in the "
                             "packed rows); set train.share_prompts: false or pack_sequences: true")
        if self.micro_batch_size > self.batch_size:
            raise ValueError(
                f"micro_batch_size ({self.micro_batch_size}) exceeds batch_size ({self.batch_size}); lower it"
            )
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {self.algorithm!r}; valid: {', '.join(ALGORITHMS.names())}")
        if self.advantage is not None and self.advantage not in ADVANTAGES:
            raise ValueError(f"unknown advantage {self.advantage!r}; valid: {', '.join(ADVANTAGES.names())}")
        if self.policy_loss is not None and self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"unknown policy_loss {self.policy_loss!r}; valid: {', '.join(POLICY_LOSSES.names())}")
        if self.kl_target is not None and self.kl_coef <= 0:
            raise ValueError("kl_target (adaptive KL) needs a starting kl_coef > 0, e.g. 0.01")
        if self.zero_stage == 3 and self.lora:
            raise ValueError("@zero_stage@ZeRO stage 3 with train.lora is refused: the adapters' merge runs on whole "
                             "weights; LoRA's trainable state is small, so use zero_stage 2 (or drop train.lora)")
        if self.precision == "bf16_weights" and (self.zero_stage == 0 or self.lora):
            raise ValueError("@precision@train.precision bf16_weights needs DeepSpeed's bf16 optimizer (float32 master "
                             "weights beside the bfloat16 ones), which ZeRO stage 0 and train.lora do not have: set "
                             "train.zero_stage: 1 (at one rank it splits nothing), or precision: bf16 with train.lora")
        if self.precision == "bf16_weights" and self.zero_stage == 3:
            raise ValueError("@precision@train.precision bf16_weights with ZeRO stage 3 is refused: the weight-sync "
                             "probe's float32 forward of partitioned bfloat16 weights is not built; use zero_stage 1 or "
                             "2 (the masters and moments still split over the ranks), or precision: bf16")
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("@offload_optimizer@train.offload_optimizer needs ZeRO (DeepSpeed offloads the "
                             "optimizer of stage 1, 2 or 3); set train.zero_stage: 2")
        return self
