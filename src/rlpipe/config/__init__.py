"""The run config: pydantic models loaded from YAML, validated strictly, fingerprinted.

A run config says *what* to train. *Where* things live (endpoints, credentials) comes from
``RLPIPE_*`` environment variables (see :class:`Settings`), never from the YAML: a config file
is shared, committed and logged to MLflow, so it must not carry secrets or one machine's hosts.

    cfg = load_config("configs/demo.yaml", overrides=["sft.steps=300"])
    cfg.fingerprint()  # sha256 of the canonical JSON of the validated config
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from rlpipe.envs.spec import EnvSpec, env_class, tool_free_envs
from rlpipe.yamlio import ConfigError, Strict as _Strict, read_yaml, validate_model

__all__ = [
    "ConfigError",
    "RewardModelConfig",
    "RunConfig",
    "Settings",
    "apply_overrides",
    "canonical_json",
    "load_config",
    "settings",
]


def _reject_network_endpoint(value: str | None, env_var: str) -> str | None:
    if value and "://" in value and value.split("://", 1)[0] in ("http", "https", "grpc"):
        raise ValueError(
            f"network endpoints are not read from the config file; remove this key and set {env_var}={value} instead"
        )
    return value


class TaskConfig(_Strict):
    name: str = Field("arithmetic", description="Short name of the task; used in run and model names.")
    policy_model: str = Field(
        "tiny",
        description="Model to train: 'tiny' builds rlpipe's small Qwen2 from `model`; otherwise a local HF "
        "folder or an MLflow model URI ('models:/NAME@ALIAS').",
    )
    ref_model: str | None = Field(
        None, description="Reference model for the KL penalty; defaults to the starting policy."
    )
    dataset: str = Field(
        "builtin:arithmetic",
        description="Prompt set: 'builtin:arithmetic', 'builtin:expressions' or 'builtin:arithmetic-rlhf' (arithmetic whose "
        "rows are judged by the hidden 'closeness' quality; built from `data`), or a path to a "
        "JSONL/Parquet prompt file.",
    )


class DataConfig(_Strict):
    operations: list[Literal["add", "sub", "mul"]] = Field(
        default_factory=lambda: ["add"], description="Arithmetic operations in the synthetic task family."
    )
    digits: int = Field(2, ge=1, le=6, description="Digits per operand (operands span 10^(d-1)..10^d-1).")
    test_size: int = Field(500, ge=1, description="Held-out questions (split 'test'); never seen in training.")
    validation_size: int = Field(
        200, ge=0, description="Questions (split 'validation') for early stopping and model selection, kept apart from test."
    )
    train_size: int | None = Field(
        None, ge=1, description="Training questions; default: every remaining question of the family."
    )
    seed: int = Field(0, description="Seed of the split; the same seed gives the same dataset version.")


class ModelConfig(_Strict):
    """Shape of rlpipe's tiny Qwen2 (used when `task.policy_model` is 'tiny')."""

    hidden_size: int = Field(256, ge=8, description="Width of the residual stream.")
    num_layers: int = Field(4, ge=1, description="Transformer blocks.")
    num_heads: int = Field(4, ge=1, description="Attention heads (also key/value heads).")
    intermediate_size: int = Field(768, ge=8, description="Width of the MLP.")
    max_position_embeddings: int = Field(256, ge=16, description="Longest sequence (prompt + response).")


class SFTConfig(_Strict):
    steps: int = Field(2000, ge=1, description="Optimizer steps of supervised warm-up (at most; see stop_at_accuracy).")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate (linear warm-up, then constant).")
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up steps.")
    batch_size: int = Field(64, ge=1, description="Prompt/solution pairs per step.")
    micro_batch_size: int | None = Field(
        None, ge=1, description="Pairs per forward/backward; the step accumulates batch_size / micro_batch_size of them "
        "(the gradient is the whole batch's: the loss is normalised by the batch's response tokens). null: one pass."
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in the backward pass (as train.gradient_checkpointing).")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16: the forward and backward under bfloat16 autocast; weights and AdamW state float32."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    pack_sequences: bool = Field(
        False, description="Each micro-batch's examples end to end in rows (position ids restart at each example, as "
        "train.pack_sequences): no compute on padding when lengths differ. The model is checked at start to keep "
        "packed examples apart."
    )
    zero_stage: int = Field(0, ge=0, le=2, description="DeepSpeed ZeRO stage of the SFT engine (0, 1 or 2), as train.zero_stage.")
    nproc: int = Field(
        1, ge=1, description="Data-parallel DeepSpeed ranks on this machine (`rlpipe sft --nproc N`): each rank takes "
        "every N-th example of a step's batch, the gradients are reduced before the step; the validation checks run "
        "on rank 0. One process per GPU where there are GPUs."
    )
    eval_every: int = Field(20, ge=1, description="Steps between validation accuracy checks (greedy).")
    eval_size: int | None = Field(
        None, ge=1, description="Validation questions per periodic check; default: the whole validation split."
    )
    eval_verifier: str | None = Field(
        "exact", description="Verifier for SFT accuracy checks; null: each row's own verifier (task column)."
    )
    stop_at_accuracy: float | None = Field(
        0.3,
        gt=0,
        le=1,
        description="Stop early once a periodic check reaches this greedy validation accuracy (keeps a base "
        "model middling so RL has room to improve); null: train all steps.",
    )

    @model_validator(mode="after")
    def _micro_divides(self) -> "SFTConfig":
        if self.micro_batch_size is not None and self.batch_size % self.micro_batch_size:
            raise ValueError(f"@micro_batch_size@{self.micro_batch_size} does not divide sft.batch_size {self.batch_size}")
        if self.batch_size % self.nproc:
            raise ValueError(f"@nproc@{self.nproc} ranks do not divide sft.batch_size {self.batch_size}")
        return self


# Advantage estimators that read token-level rewards (and so per-step rewards of episodes).
TOKEN_LEVEL_ADVANTAGES = frozenset({"gae", "reinforce_pp", "reinforce_pp_baseline"})

SANDBOX_COMPONENTS = ("bwrap", "seccomp", "uid", "rlimits", "cgroup")

# Keys that name features rlpipe does not have yet. They are refused with this message rather than
# accepted and ignored (a config key nothing implements is an error, not a silent no-op).
_NOT_IMPLEMENTED = {
    "reward.type=model_based": "the reward-model type is called 'model': use type: model (and reward.model)",
    "reward.endpoint": "the verifier service is not read from the config: remove this key and set "
    "RLPIPE_VERIFIER_URL=<url>",
    "reward.timeout_s": "removed: each sample's hard deadline is its verifier's declared budget plus "
    "reward.grace_s; remove this key (or set reward.grace_s)",
}


class RewardConfig(_Strict):
    type: Literal["rule_based", "model"] = Field(
        "rule_based", description="rule_based: verifiers score answers; model: a reward model scores them (RLHF; "
        "in-process, or the service at RLPIPE_REWARD_MODEL_URL)."
    )
    model: str | None = Field(
        None, description="type model: the reward model (a folder or 'models:/NAME@ALIAS'); default: "
        "models:/rlpipe-<task.name>-rm@best."
    )
    weights: dict[str, float] = Field(
        default_factory=dict, description="Mix several reward sources: {'model': w, '<verifier>': w, ...} — the reward "
        "is the weighted sum; a sample is scored only when every source judged it. Empty: the type's one source "
        "(the reward model, or each row's own verifier)."
    )
    normalize: bool = Field(
        False, description="type model: standardise the reward model's score with a running mean/std (seeded with "
        "the statistics registered with the model), then clip to ±clip (PPO-RLHF style)."
    )
    clip: float | None = Field(5.0, gt=0, description="Clip of the normalised reward-model score (normalize only).")
    hacking_window: int = Field(
        3, ge=2, description="Reward-hacking alert: fires when, over this many held-out evaluations, the reward "
        "model's score rose while the task's true score (its verifier's) fell."
    )
    verifier: str = Field("math", description="Verifier for prompt rows that name none (e.g. math, code, format).")
    workers: int = Field(2, ge=1, le=64, description="Verifier worker processes (bounded concurrency).")
    grace_s: float = Field(
        5.0, gt=0, description="Added to each verifier's declared budget for a sample to get the pool's hard "
        "wall-clock deadline (a worker past it is killed and the sample gets status 'timeout'). The budget "
        "itself comes from the verifier, so the pool never pre-empts a verdict the verifier would give."
    )
    plugins: list[str] = Field(default_factory=list, description="Python modules imported in verifier workers to register extra verifiers.")
    code_scoring: Literal["fraction", "all"] = Field(
        "fraction", description="Code verifier: 'fraction' rewards the share of tests passed; 'all' gives 1 only "
        "when every test passes, else 0."
    )
    sandbox_min_level: str = Field(
        "full", description="Least sandbox isolation a run that executes model code may score at: 'full' (all of "
        "bwrap+seccomp+uid+rlimits+cgroup) or the '+'-joined components required, e.g. 'seccomp+rlimits'. "
        "The run refuses to start below it; the level used is stored on every trajectory row."
    )
    max_invalid_share: float = Field(
        0.5, ge=0, le=1, description="Circuit breaker: an iteration whose share of samples not 'ok' is above this "
        "counts as invalid."
    )
    max_invalid_iterations: int = Field(
        3, ge=1, description="Circuit breaker: stop the run (resumably) after this many invalid iterations in a row."
    )
    overlong_buffer: int | None = Field(
        None, ge=1, description="DAPO soft overlong punishment: responses longer than max_new_tokens − buffer lose "
        "up to overlong_penalty linearly (null: off)."
    )
    overlong_penalty: float = Field(1.0, ge=0, description="Largest overlong punishment (reached at max_new_tokens).")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if data.get("type") == "model_based":
                raise ValueError(f"@type@{_NOT_IMPLEMENTED['reward.type=model_based']}")
            for key in ("endpoint", "timeout_s"):
                if key in data:
                    raise ValueError(f"@{key}@{_NOT_IMPLEMENTED['reward.' + key]}")
        return data

    @field_validator("sandbox_min_level")
    @classmethod
    def _known_components(cls, v: str) -> str:
        if v == "full":
            return v
        parts = v.split("+")
        bad = [p for p in parts if p not in SANDBOX_COMPONENTS]
        if bad or not v:
            raise ValueError(f"unknown sandbox component(s) {bad or [v]}; use 'full' or a '+'-joined subset of "
                             f"{'+'.join(SANDBOX_COMPONENTS)}")
        return v

    @model_validator(mode="after")
    def _sources(self) -> "RewardConfig":
        if self.type == "rule_based" and "model" in self.weights:
            raise ValueError("@weights@names 'model' but reward.type is rule_based; set type: model")
        if self.type == "model" and self.weights and "model" not in self.weights:
            raise ValueError("@weights@type model needs a 'model' weight, e.g. {model: 1.0, format: 0.2}")
        if self.normalize and self.type != "model":
            raise ValueError("@normalize@normalises the reward model's score; it needs type: model")
        return self

    def source_weights(self) -> dict[str, float]:
        """Reward source → weight; 'model' is the reward model, any other name a verifier, '' each row's own."""
        if self.weights:
            return dict(self.weights)
        return {"model": 1.0} if self.type == "model" else {"": 1.0}

    def required_sandbox_components(self) -> tuple[str, ...]:
        if self.sandbox_min_level == "full":
            return SANDBOX_COMPONENTS
        return tuple(c for c in SANDBOX_COMPONENTS if c in self.sandbox_min_level.split("+"))

    def verifier_options(self) -> dict[str, dict[str, Any]]:
        """Per-verifier options the pool passes to each call."""
        return {"code": {"scoring": self.code_scoring}}


class RolloutConfig(_Strict):
    engine: Literal["vllm", "hf"] = Field("vllm", description="Generation engine: vLLM, or HF generate (fallback).")
    batch_size: int = Field(32, ge=1, description="Prompts per iteration.")
    samples_per_prompt: int = Field(8, ge=1, description="Completions per prompt (the GRPO group size).")
    max_new_tokens: int = Field(8, ge=1, description="Longest response in tokens.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    dynamic_sampling: bool = Field(
        False, description="DAPO dynamic sampling: drop groups whose rewards are all equal and draw more prompts "
        "until batch_size groups with signal are in hand (or max_extra_draws is spent)."
    )
    max_extra_draws: int = Field(3, ge=0, description="Dynamic sampling: most extra draws of batch_size prompts per iteration.")
    async_steps: int = Field(
        0, ge=0, le=1, description="1: one-step off-policy rollout (as verl's and AReaL's): iteration k+1's batch is "
        "generated while iteration k trains, by the policy before update k. Every row records the update its "
        "policy came after (policy_iteration) and its staleness; a batch staler than async_steps is refused; the "
        "PPO ratio is taken against the sampling policy's log-probs (with train.tis_cap: the trainer's, "
        "importance-weighted against the sampler's). 0: on-policy, generation waits for the sync."
    )
    prefetch: bool = Field(
        True, description="On-policy overlap: right after iteration k's weight sync (and its metrics), iteration "
        "k+1's first batch is generated in the background by the policy just synced, while iteration k's flow run "
        "finishes and k+1's starts; k+1's rollout task takes that batch (the same batch, seed and policy as without "
        "it; on 2 CPU cores 7% less time per iteration, benchmarks/README.md). false: generate inside k+1's rollout "
        "task. With async_steps: 1 the batch is generated during the update instead, and prefetch is off (setting it "
        "true there is an error)."
    )
    max_model_len: int | None = Field(
        None, ge=16, description="The engine's context (prompt + response tokens). null: what the prompt set and "
        "max_new_tokens need (an agent: agent.max_context), up to the model's own max_position_embeddings; "
        "larger than the model's own is an error."
    )
    gpu_memory_utilization: float = Field(
        0.3, gt=0, le=1, description="vLLM on a GPU: the share of the GPU's memory the engine may take (weights + "
        "KV cache). The trainer shares the GPU in-process, so the default leaves it most; a rollout service "
        "alone on its GPU can take 0.9."
    )
    max_num_seqs: int | None = Field(None, ge=1, description="vLLM: most sequences in one engine step; null: vLLM's default.")
    tensor_parallel_size: int = Field(
        1, ge=1, description="vLLM: GPUs one engine spans (tensor parallelism). Above 1 the read-back after a "
        "sync covers the unsharded tensors and the probe the rest."
    )
    enable_prefix_caching: bool = Field(
        False, description="vLLM: reuse the KV cache of shared prompt prefixes (the samples of a group share "
        "theirs). The cache is reset at every weight sync."
    )
    lora_sync: Literal["adapter", "merged"] = Field(
        "adapter", description="With train.lora, what a weight sync moves to the engine. adapter: the in-process "
        "vLLM engine keeps the start model and takes each iteration's LoRA adapter (vLLM's LoRA support: megabytes, "
        "not the model); the probe proves the adapted policy as before. merged: the merged weights. The HF engine "
        "and engines behind rollout or trainer services always take the merged weights (the run's start log says "
        "which)."
    )
    stop_tokens: list[int | str] | None = Field(
        None, description="Tokens (ids or strings) that end a response; null: the model's generation_config.json "
        "eos_token_id (an int or a list) and its tokenizer's EOS; []: none, every response runs to max_new_tokens."
    )
    sync_tolerance: float | None = Field(
        None, gt=0, description="Weight-sync proof: after each reload the engine's log-probs of a fixed probe batch "
        "must equal the trainer's within this (max |Δ log-prob|); null: 1e-3 for a float32 engine, 0.05 for 16-bit."
    )

    @model_validator(mode="after")
    def _one_overlap(self) -> "RolloutConfig":
        if self.async_steps and self.prefetch:
            if "prefetch" in self.model_fields_set:
                raise ValueError("rollout.prefetch: true and rollout.async_steps: 1 both generate the next batch early; "
                                 "async_steps generates it during the update, so drop rollout.prefetch")
            object.__setattr__(self, "prefetch", False)
        return self


class CriticConfig(_Strict):
    """The value model of estimators that need one (``gae``: PPO). A separate model with its own optimizer."""

    model: str | None = Field(
        None, description="Where the critic's trunk starts (same forms as task.policy_model); default: the policy's "
        "starting weights. A scalar value head is added on top."
    )
    lr: float = Field(1e-4, gt=0, description="Critic learning rate (its own AdamW inside the same trainer).")
    value_clip: float | None = Field(0.2, gt=0, description="Clip of V − V_old in the value loss; null: unclipped.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the critic's global gradient norm to this value.")


class LoraConfig(_Strict):
    """Low-rank adapters (peft's LoRA) on the policy: only the adapters train; the base weights stay frozen."""

    r: int = Field(16, ge=1, description="Rank of each adapter.")
    alpha: float = Field(32.0, gt=0, description="Scale numerator: an adapter's update is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Module names (or name suffixes, e.g. [q_proj, v_proj]) that get an adapter; "
        "'all-linear': every linear layer but the output layer. A name that matches no module is an error."
    )


class TrainConfig(_Strict):
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
        "once for up to rollout.samples_per_prompt responses: at the demo's size the update is 28-49% shorter, but "
        "after 80 iterations held-out accuracy was 3-9 points lower in 3 of 3 seeds (benchmarks/README.md). Advantages "
        "are computed over the whole batch before either."
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
    offload_optimizer: bool = Field(
        False, description="ZeRO-Offload: the optimizer's fp32 master weights and Adam moments live in CPU memory "
        "and the step runs there (needs zero_stage 1, 2 or 3); the GPU keeps the weights, gradients and "
        "activations. On a CPU-only machine it changes where nothing lives but runs the same code path."
    )
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16: the policy's, the reference's and the critic's forward passes (and so their "
        "backward) run under bfloat16 autocast, as TRL's bf16=True: weights, gradients, Adam moments, log-probs and "
        "losses stay float32. It pays where the matrices are large enough for a GPU's bf16 units; at 3M-400M "
        "parameters on an H200 and on CPU it was slower than fp32 (benchmarks/README.md, 'One GPU'). The weight-sync "
        "probe still compares the engine with the trainer's float32 forward."
    )
    zero_stage: int = Field(
        0, ge=0, le=3, description="DeepSpeed ZeRO stage: 0 (none), 1 (optimizer state split over the ranks), 2 "
        "(and gradients), 3 (and the weights themselves: each rank holds 1/N of them and gathers a layer's when it "
        "runs; the export, the sync and every checkpoint gather them into a whole HF folder on rank 0). Not with "
        "train.lora (its trainable state is small: use 2)."
    )
    total_iterations: int = Field(80, ge=1, description="RL iterations (one Prefect flow run each).")
    save_interval: int = Field(20, ge=1, description="Register a checkpoint every this many iterations (and at the end).")
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
            raise ValueError(f"unknown algorithm {self.algorithm!r}; valid: {', '.join(sorted(ALGORITHMS))}")
        if self.advantage is not None and self.advantage not in ADVANTAGES:
            raise ValueError(f"unknown advantage {self.advantage!r}; valid: {', '.join(ADVANTAGES.names())}")
        if self.policy_loss is not None and self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"unknown policy_loss {self.policy_loss!r}; valid: {', '.join(POLICY_LOSSES.names())}")
        if self.kl_target is not None and self.kl_coef <= 0:
            raise ValueError("kl_target (adaptive KL) needs a starting kl_coef > 0, e.g. 0.01")
        if self.zero_stage == 3 and self.lora:
            raise ValueError("@zero_stage@ZeRO stage 3 with train.lora is refused: the adapters' merge runs on whole "
                             "weights; LoRA's trainable state is small, so use zero_stage 2 (or drop train.lora)")
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("@offload_optimizer@train.offload_optimizer needs ZeRO (DeepSpeed offloads the "
                             "optimizer of stage 1, 2 or 3); set train.zero_stage: 2")
        return self


class RewardModelConfig(_Strict):
    """Reward-model training (``rlpipe rm-train``): a scalar head on a causal-LM trunk, fitted to preference pairs."""

    base_model: str | None = Field(
        None, description="Where the trunk starts (a folder or 'models:/NAME@ALIAS'); default: task.policy_model "
        "(the SFT model, as OpenRLHF and TRL do)."
    )
    dataset: str = Field(
        "builtin:synthetic-preferences", description="Preference pairs: 'builtin:synthetic-preferences' (answers to "
        "the arithmetic prompts of `data`, labelled by the hidden closeness quality) or a JSONL/Parquet file with "
        "prompt/chosen/rejected[/margin] (see `rlpipe data validate`)."
    )
    pairs_per_prompt: int = Field(4, ge=1, le=10, description="Synthetic pairs drawn per prompt (at most the 10 a prompt's 5 candidate answers make).")
    label_noise: float = Field(0.1, ge=0, lt=0.5, description="Synthetic training pairs whose label is flipped.")
    loss: Literal["bradley_terry"] = Field("bradley_terry", description="Registered preference loss.")
    use_margin: bool = Field(True, description="Use the pairs' margin column (−log σ(r_w − r_l − m)) where given.")
    steps: int = Field(500, ge=1, description="Optimizer steps at most (early stopping may end sooner).")
    lr: float = Field(3e-4, gt=0, description="AdamW peak learning rate.")
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up steps, then cosine decay to min_lr_ratio × lr at `steps`.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="The learning rate at the last step, as a share of lr.")
    batch_size: int = Field(64, ge=1, description="Pairs per optimizer step.")
    micro_batch_size: int = Field(64, ge=1, description="Pairs per forward/backward per rank.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the global gradient norm.")
    zero_stage: int = Field(0, ge=0, le=2, description="DeepSpeed ZeRO stage (0, 1 or 2).")
    lora: LoraConfig | None = Field(
        None, description="Train LoRA adapters on the trunk (peft) and the scalar head in full, instead of every "
        "weight. The saved reward model is a plain HF folder of the merged weights (what the scorer and the reward "
        "service load), with the adapter beside it in adapter/. null: every weight."
    )
    eval_every: int = Field(25, ge=1, description="Steps between validation pair-accuracy checks.")
    patience: int = Field(6, ge=1, description="Stop after this many checks without a better validation pair accuracy.")
    registered_model: str | None = Field(None, description="Registry name; default 'rlpipe-<task.name>-rm'.")

    @model_validator(mode="after")
    def _micro_fits(self) -> "RewardModelConfig":
        if self.batch_size % self.micro_batch_size:
            raise ValueError(f"@micro_batch_size@{self.micro_batch_size} does not divide rm.batch_size {self.batch_size}")
        return self


class StorageConfig(_Strict):
    uri: str | None = Field(
        None,
        description="Where runs are stored: a local folder or 's3://bucket/prefix'. Default: "
        "$RLPIPE_STORAGE_URI, else $RLPIPE_HOME/store. The S3 endpoint and keys come from RLPIPE_S3_*.",
    )

    @field_validator("uri")
    @classmethod
    def _no_credentials(cls, v: str | None) -> str | None:
        if v and "@" in urlsplit(v).netloc:
            raise ValueError("credentials in the storage URI; set RLPIPE_S3_ACCESS_KEY_ID/SECRET_ACCESS_KEY instead")
        return _reject_network_endpoint(v, "RLPIPE_S3_ENDPOINT_URL")


class TrackingConfig(_Strict):
    uri: str | None = Field(
        None,
        description="MLflow tracking URI; set RLPIPE_TRACKING_URI for a server. Default: a sqlite file in $RLPIPE_HOME.",
    )
    experiment: str = Field("rlpipe", description="MLflow experiment the runs are logged to.")
    registered_model: str | None = Field(
        None, description="Registry name for checkpoints; default: 'rlpipe-<task.name>'."
    )
    register_models: bool = Field(
        True, description="Register checkpoints as model versions (each with an rlpipe.checkpoint.registered event). "
        "false: a smoke or debug run registers nothing and moves no alias; its checkpoints stay in the store and "
        "it still resumes.")
    stage_task_runs: bool = Field(
        False, description="Record each stage of an iteration (rollout, verify, update, sync-weights, "
        "upload-checkpoint) as a Prefect task run of the iteration's flow run, for a box per stage in the UI. "
        "It costs the demo's iteration ~0.11 s (12%) on 2 cores, the Prefect server storing the task runs' events "
        "on the same cores, and next to nothing beside an iteration of seconds. false: the stages run as calls; "
        "their retries, timeouts and log lines are the same, the stage times are in the run's metrics (time/*) "
        "and in each iteration's log line. register-checkpoint, at save points, is a task run either way.")
    system_metrics_s: float | None = Field(
        10.0, gt=0, description="MLflow system metrics (system/cpu_utilization_percentage, memory, disk, network, "
        "GPU) sampled every this many seconds while an RL run trains; null: off.")

    @field_validator("uri")
    @classmethod
    def _uri_from_env(cls, v: str | None) -> str | None:
        return _reject_network_endpoint(v, "RLPIPE_TRACKING_URI")


def _check_tool_share(share: float, spec: EnvSpec) -> None:
    if share < 1 and not env_class(spec.env).tool_free:
        raise ValueError(f"@sft_tool_share@the {spec.env!r} expert cannot solve its tasks without the tool; "
                         f"set 1 (environments whose expert can: {', '.join(tool_free_envs())})")


class AgentConfig(_Strict):
    """Multi-step agentic RL: the policy acts in an environment over several turns (see ``rlpipe.envs``)."""

    env: Any = Field(description="The environment: a path to its spec YAML (configs/envs/*.yaml) or the spec inline "
                     "({env, params, limits, tools}).")
    max_steps: int | None = Field(None, ge=1, le=1000, description="Override of the spec's limits.max_steps.")
    episode_timeout_s: float | None = Field(None, gt=0, description="Override of the spec's limits.episode_timeout_s.")
    executor: Literal["local", "sandbox"] = Field(
        "local", description="Where environment steps run: local (in-process pool), or sandbox (each call in its own "
        "sandbox on this machine). The environment service is not read from here: set RLPIPE_ENV_URL.")
    step_timeout_s: float = Field(10.0, gt=0, description="sandbox/service: seconds one step may take; past it the episode is an error.")
    allow_hosts: list[str] = Field(default_factory=list, description="executor sandbox: 'host:port' pairs the environment may "
                                   "reach (through rlpipe.envs.net.connect and an allow-list proxy); empty: no network.")
    step_workers: int = Field(8, ge=1, le=256, description="sandbox/service: environment steps run at once within a turn.")
    max_context: int = Field(256, ge=16, description="Tokens of an episode's whole context (prompt, actions, observations); "
                             "an episode that would outgrow it is cut and flagged truncated.")
    chat: bool = Field(True, description="Turns through the model's chat template (observations as tool messages).")
    system: str | None = Field(None, description="A system message before the first observation.")
    step_rewards: bool = Field(False, description="Credit each step's reward at its own action (token-level estimators: gae, "
                               "reinforce_pp*); false: the episode's total reward at its end (outcome).")
    sft_traces: int = Field(2000, ge=1, description="SFT warm-up: expert demonstrations drawn from the training tasks.")
    sft_tool_share: float = Field(1.0, gt=0, le=1, description="SFT warm-up: the share of demonstrations in which the "
                                  "expert calls the tool; in the others it answers at once, in its head (calculator "
                                  "only). Below 1 the base calls the tool only sometimes, and RL learns when it pays.")

    @model_validator(mode="before")
    @classmethod
    def _read_env(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("env"), str):
            path = Path(data["env"])
            data = dict(data, env=read_yaml(path))
            try:
                EnvSpec.model_validate(data["env"])
            except ValidationError as e:  # report the problem in the spec's own file
                raise ValueError(f"@env@{path}: {e.errors()[0]['msg'].removeprefix('Value error, ')}") from None
        return data

    @model_validator(mode="after")
    def _spec(self) -> "AgentConfig":
        if self.allow_hosts and self.executor != "sandbox":
            raise ValueError("@allow_hosts@only a sandboxed environment has an allow-list (in-process environments are "
                             "trusted and unrestricted); set executor: sandbox, or give the service --allow-host")
        bad = [h for h in self.allow_hosts if not h.rpartition(":")[2].isdigit() or not h.rpartition(":")[0]]
        if bad:
            raise ValueError(f"@allow_hosts@{bad}: give each as host:port")

        if isinstance(self.env, EnvSpec):
            _check_tool_share(self.sft_tool_share, self.env)
            return self
        try:
            spec = EnvSpec.model_validate(self.env)
        except ValidationError as e:
            first = e.errors()[0]
            loc, msg = ".".join(map(str, first["loc"])), first["msg"].removeprefix("Value error, ")
            if msg.startswith("@"):  # the spec's own validator naming its key
                key, msg = msg[1:].split("@", 1)
                loc = f"{loc}.{key}" if loc else key
            raise ValueError(f"@env.{loc}@{msg}") from None
        _check_tool_share(self.sft_tool_share, spec)
        self.env = spec  # validate_assignment runs these checks again, on the spec
        return self

    def spec(self):
        """The environment spec with this section's limit overrides applied."""
        limits = self.env.limits.model_copy(update={k: v for k, v in (("max_steps", self.max_steps),
                                                                      ("episode_timeout_s", self.episode_timeout_s)) if v is not None})
        return self.env.model_copy(update={"limits": limits})


Severity = Literal["info", "warning", "critical"]


_SEVERITY = ("info, warning or critical: the shipped Prefect automations cancel a run on a critical alert "
             "(infra/prefect/automations.yaml).")


class _Rule(_Strict):
    enabled: bool = Field(True, description="Evaluate this rule each iteration.")
    severity: Severity = Field("warning", description=_SEVERITY)


class RewardFlatRule(_Rule):
    severity: Severity = Field("critical", description=_SEVERITY)
    for_iterations: int = Field(3, ge=1, description="Fires when every scored reward of the batch was 0, or every "
                                "one 1, in this many iterations in a row: no learning signal.")


class KLHighRule(_Rule):
    factor: float = Field(3.0, gt=0, description="Fires when KL to the reference exceeds train.kl_target × factor …")
    max_kl: float = Field(0.5, gt=0, description="… or, with no kl_target, this value.")


class EntropyCollapseRule(_Rule):
    window: int = Field(5, ge=2, description="Over the last this many iterations (first vs last) …")
    drop: float = Field(0.5, gt=0, lt=1, description="… entropy fell by more than this share while the reward rose.")


class NonFiniteLossRule(_Rule):
    severity: Severity = Field("critical", description=_SEVERITY)


class VerifierErrorRule(_Rule):
    max_rate: float = Field(0.1, ge=0, lt=1, description="Fires when more than this share of samples was not scored "
                            "(status other than ok), or a service's error rate is above it.")


class ThroughputDropRule(_Rule):
    factor: float = Field(0.5, gt=0, lt=1, description="Fires when generation or training throughput stays below "
                          "factor × the median of the (up to 200) iterations before …")
    for_iterations: int = Field(3, ge=1, description="… for this many iterations in a row …")
    min_history: int = Field(3, ge=1, description="… once the run has this many earlier iterations for the median.")


class MemoryGrowthRule(_Rule):
    iterations: int = Field(5, ge=2, description="RSS rose at each of this many iterations in a row …")
    mb: float = Field(256.0, gt=0, description="… and by more than this many MiB in all.")


class MismatchRule(_Rule):
    max_share: float = Field(0.1, gt=0, le=1, description="Fires when more than this share of sampled tokens has "
                             "|log π_trainer − log π_sampler| above train.mismatch_threshold (mismatch/share_above).")


class RewardHackingRule(_Rule):
    pass  # its window is reward.hacking_window


class AlertsConfig(_Strict):
    """Alert rules, evaluated after each iteration. A rule that fires logs ``alerts/<rule>`` = 1 to MLflow, an
    ``ALERT`` line, a row of the run's ``alerts.json`` table and a Prefect event ``rlpipe.alert.<rule>`` with
    its severity, which the shipped automations act on (``rlpipe automations install``)."""

    reward_flat: RewardFlatRule = Field(default_factory=RewardFlatRule, description="Rewards all 0 or all 1.")
    kl_high: KLHighRule = Field(default_factory=KLHighRule, description="KL to the reference above its target.")
    entropy_collapse: EntropyCollapseRule = Field(default_factory=EntropyCollapseRule,
                                                  description="Entropy collapsing while the reward rises.")
    nonfinite_loss: NonFiniteLossRule = Field(default_factory=NonFiniteLossRule,
                                              description="A non-finite loss or gradient in the update.")
    verifier_errors: VerifierErrorRule = Field(default_factory=VerifierErrorRule, description="Verifier error rate.")
    throughput_drop: ThroughputDropRule = Field(default_factory=ThroughputDropRule,
                                                description="Throughput against the run's median.")
    memory_growth: MemoryGrowthRule = Field(default_factory=MemoryGrowthRule, description="Steady memory growth.")
    mismatch: MismatchRule = Field(default_factory=MismatchRule, description="Train/inference log-prob mismatch.")
    reward_hacking: RewardHackingRule = Field(default_factory=RewardHackingRule,
                                              description="Reward-model score up while the true score falls (RLHF).")
    events: bool = Field(True, description="Emit each alert as a Prefect event (false: MLflow and the log only).")
    critical_grace_s: float = Field(15.0, ge=0, description="After a critical alert the run waits up to this long "
                                    "for an automation to cancel it before it starts the next iteration.")


class ServicesConfig(_Strict):
    """Where a run's services run. Unset: in this process (a local verifier pool, an in-process engine and
    trainer). Each ``RLPIPE_<SERVICE>_URL`` variable overrides its key on a machine; tokens come only from
    the environment (``RLPIPE_<SERVICE>_TOKEN``), never from a config."""

    rollout: list[str] = Field(default_factory=list, description="Rollout service replicas (rlpipe serve rollout): prompts "
                               "are split across them and a dead one's share goes to the others. Env: RLPIPE_ROLLOUT_URL.")
    trainer: str | None = Field(None, description="The trainer service (rlpipe serve trainer). Env: RLPIPE_TRAINER_URL.")
    verifier: str | None = Field(None, description="The verifier service (rlpipe serve verifier). Env: RLPIPE_VERIFIER_URL.")
    reward_model: str | None = Field(None, description="The reward-model service (rlpipe serve reward-model). "
                                     "Env: RLPIPE_REWARD_MODEL_URL.")
    env: str | None = Field(None, description="The environment service of agent runs (rlpipe serve env). Env: RLPIPE_ENV_URL.")

    @field_validator("rollout", "trainer", "verifier", "reward_model", "env")
    @classmethod
    def _http(cls, v: Any) -> Any:
        for url in (v if isinstance(v, list) else [v]):
            if url is not None and not str(url).startswith(("http://", "https://")):
                raise ValueError(f"{url!r} is not a service URL: give http(s)://HOST:PORT")
        return v


class RetentionConfig(_Strict):
    """What ``rlpipe gc`` keeps in the object store and the registry. It never deletes a checkpoint a registry
    alias points to (best, latest, base, …), a run's resume point, a model version a run's config names, or
    the trajectories of an iteration a run has not finished."""

    keep_checkpoints: int | None = Field(None, ge=1, description="Per run, keep the newest this many checkpoints "
                                         "(beside the protected ones); the rest and their registry versions go. "
                                         "null: keep all.")
    trajectory_days: float | None = Field(None, ge=0, description="Delete a finished iteration's trajectory stages "
                                          "(rollout, verify Parquet) this many days after they were written. "
                                          "null: keep them.")


class RunConfig(_Strict):
    """Everything that defines a run. Its fingerprint identifies the experiment."""

    task: TaskConfig = Field(default_factory=TaskConfig, description="What is trained, on what.")
    data: DataConfig = Field(default_factory=DataConfig, description="The synthetic dataset (builtin tasks).")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Shape of the tiny base model.")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="Supervised warm-up.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Where rewards come from.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Sampling of completions.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="The RL update.")
    rm: RewardModelConfig = Field(default_factory=RewardModelConfig, description="Reward-model training (RLHF).")
    storage: StorageConfig = Field(default_factory=StorageConfig, description="Object store for runs.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking.")
    agent: AgentConfig | None = Field(None, description="Multi-step agentic RL in an environment; null: single-turn.")
    alerts: AlertsConfig = Field(default_factory=AlertsConfig, description="Alert rules on a run's metrics.")
    retention: RetentionConfig = Field(default_factory=RetentionConfig, description="What `rlpipe gc` keeps.")
    services: ServicesConfig = Field(default_factory=ServicesConfig, description="Where the run's services run "
                                     "(default: in this process).")
    seed: int = Field(0, description="Seed for model init, sampling and data order.")

    @model_validator(mode="after")
    def _cross_checks(self) -> "RunConfig":
        if self.agent is not None:
            if self.reward.type != "rule_based" or self.reward.weights:
                raise ValueError("@reward.type@an agent run's reward is its environment's (the episode reward); "
                                 "remove reward.type/reward.weights")
            if self.task.dataset != "builtin:episodes":
                raise ValueError("@task.dataset@an agent run draws its tasks from the environment: use builtin:episodes")
            if self.rollout.dynamic_sampling:
                raise ValueError("@rollout.dynamic_sampling@not supported with agent: yet; set it to false")
            if self.sft.nproc > 1:  # its validation runs episodes on the caller's engine, not on a rank
                raise ValueError("@sft.nproc@agent SFT on expert traces runs in one process; set sft.nproc: 1")
            if self.agent.step_rewards and self.train.resolved()["advantage"] not in TOKEN_LEVEL_ADVANTAGES:
                raise ValueError(f"@agent.step_rewards@the {self.train.resolved()['advantage']!r} estimator sees only the episode's "
                                 f"total reward; per-step credit needs one of {', '.join(sorted(TOKEN_LEVEL_ADVANTAGES))} "
                                 "(train.algorithm: ppo, or train.advantage)")
        if self.rollout.temperature == 0:
            raise ValueError("@rollout.temperature@0 (greedy) cannot train with RL: a greedy sample has no "
                             "log-probability under the policy the trainer differentiates; use a temperature > 0 "
                             "(1.0 is the usual)")
        if self.rollout.top_p < 1:
            raise ValueError(f"@rollout.top_p@{self.rollout.top_p} truncates the sampler's distribution, which the "
                             "trainer's log-probs do not reproduce (the importance ratio would be wrong); use 1.0")
        buf = self.reward.overlong_buffer
        if buf is not None and buf >= self.rollout.max_new_tokens:
            raise ValueError(
                f"reward.overlong_buffer ({buf}) must be below rollout.max_new_tokens ({self.rollout.max_new_tokens})"
            )
        return self

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON of this config (defaults filled in), without ``services``: where a
        run's services run is not the experiment."""
        return hashlib.sha256(canonical_json(self.model_dump(mode="json", exclude={"services"})).encode()).hexdigest()

    def flat(self) -> dict[str, Any]:
        """Dotted keys → values, for MLflow params."""
        return _flatten(self.model_dump(mode="json"))

    @property
    def registered_model(self) -> str:
        return self.tracking.registered_model or f"rlpipe-{self.task.name}"

    @property
    def registered_reward_model(self) -> str:
        return self.rm.registered_model or f"rlpipe-{self.task.name}-rm"

    @property
    def reward_model_spec(self) -> str:
        return self.reward.model or f"models:/{self.registered_reward_model}@best"


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _parse_scalar(text: str) -> Any:
    # YAML rules, so `--set train.lr=1e-5` and `--set data.operations=[add,mul]` read as in the file.
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: list[str] | None, source: str = "--set") -> dict[str, Any]:
    """Apply ``dotted.key=value`` overrides to a raw config dict (before validation)."""
    raw = json.loads(json.dumps(raw))  # deep copy of plain data
    problems = []
    for item in overrides or []:
        if "=" not in item:
            problems.append((item, "an override is 'dotted.key=value'"))
            continue
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node = raw
        for p in parts[:-1]:
            if not isinstance(node.get(p, {}), dict):
                problems.append((key, f"'{p}' is not a section"))
                break
            node = node.setdefault(p, {})
        else:
            node[parts[-1]] = _parse_scalar(value)
    if problems:
        raise ConfigError(source, problems)
    return raw


def validate_raw(raw: Any, source: str = "<config>") -> RunConfig:
    return validate_model(RunConfig, raw, source)


def load_config(path: str | os.PathLike[str] | None, overrides: list[str] | None = None) -> RunConfig:
    """Read, override and validate a config. ``path=None`` gives the embedded defaults.

    A file may start from another with ``extends: base.yaml`` (relative to itself); its own keys
    are merged over the base's, section by section."""
    source = str(path) if path else "<defaults>"
    raw: Any = read_yaml(Path(path)) if path else {}
    if overrides:
        if not isinstance(raw, dict):
            raise ConfigError(source, [("", "the top level must be a mapping")])
        raw = apply_overrides(raw, overrides)
    return validate_raw(raw, source)


class Settings(BaseModel):
    """Where things live on this machine; read from ``RLPIPE_*`` environment variables."""

    home: Path = Field(description="RLPIPE_HOME: project state (runs, store, MLflow); default ./.rlpipe")
    storage_uri: str | None = Field(None, description="RLPIPE_STORAGE_URI: overrides storage.uri")
    tracking_uri: str | None = Field(None, description="RLPIPE_TRACKING_URI: an MLflow server or sqlite URI")
    s3_endpoint_url: str | None = Field(None, description="RLPIPE_S3_ENDPOINT_URL: S3-compatible endpoint")
    s3_access_key_id: str | None = Field(None, description="RLPIPE_S3_ACCESS_KEY_ID (else AWS_ACCESS_KEY_ID)")
    s3_secret_access_key: str | None = Field(
        None, description="RLPIPE_S3_SECRET_ACCESS_KEY (else AWS_SECRET_ACCESS_KEY)", repr=False
    )
    s3_region: str | None = Field(None, description="RLPIPE_S3_REGION (else AWS_DEFAULT_REGION)")
    verifier_url: str | None = Field(None, description="RLPIPE_VERIFIER_URL: score through the verifier service")
    env_url: str | None = Field(None, description="RLPIPE_ENV_URL: agent runs step their environments through this service")
    reward_model_url: str | None = Field(
        None, description="RLPIPE_REWARD_MODEL_URL: score with the reward-model service instead of in-process")
    rollout_urls: tuple[str, ...] = Field(
        (), description="RLPIPE_ROLLOUT_URL: rollout service replicas (comma-separated) instead of an in-process engine")
    trainer_url: str | None = Field(None, description="RLPIPE_TRAINER_URL: update through the trainer service")

    def for_run(self, cfg: RunConfig) -> "Settings":
        """These settings with the service URLs the config names where no RLPIPE_*_URL variable set one."""
        sv = cfg.services
        return self.model_copy(update={
            "rollout_urls": self.rollout_urls or tuple(sv.rollout), "trainer_url": self.trainer_url or sv.trainer,
            "verifier_url": self.verifier_url or sv.verifier, "reward_model_url": self.reward_model_url or sv.reward_model,
            "env_url": self.env_url or sv.env})

    def resolve_storage_uri(self, cfg: RunConfig | None = None) -> str:
        if self.storage_uri:
            return self.storage_uri
        if cfg is not None and cfg.storage.uri:
            return cfg.storage.uri
        return str((self.home / "store").resolve())

    def resolve_tracking_uri(self, cfg: RunConfig | None = None) -> str:
        if self.tracking_uri:
            return self.tracking_uri
        if cfg is not None and cfg.tracking.uri:
            return cfg.tracking.uri
        return f"sqlite:///{(self.home / 'mlflow.db').resolve()}"

    @property
    def artifact_root(self) -> Path:
        return (self.home / "mlartifacts").resolve()

    def run_dir(self, run_id: str) -> Path:
        return (self.home / "runs" / run_id).resolve()


def settings(environ: dict[str, str] | None = None) -> Settings:
    """Read settings from the environment now (never at import time)."""
    env = os.environ if environ is None else environ
    return Settings(
        home=Path(env.get("RLPIPE_HOME", ".rlpipe")),
        storage_uri=env.get("RLPIPE_STORAGE_URI") or None,
        tracking_uri=env.get("RLPIPE_TRACKING_URI") or None,
        s3_endpoint_url=env.get("RLPIPE_S3_ENDPOINT_URL") or None,
        s3_access_key_id=env.get("RLPIPE_S3_ACCESS_KEY_ID") or env.get("AWS_ACCESS_KEY_ID") or None,
        s3_secret_access_key=env.get("RLPIPE_S3_SECRET_ACCESS_KEY") or env.get("AWS_SECRET_ACCESS_KEY") or None,
        s3_region=env.get("RLPIPE_S3_REGION") or env.get("AWS_DEFAULT_REGION") or None,
        verifier_url=env.get("RLPIPE_VERIFIER_URL") or None,
        env_url=env.get("RLPIPE_ENV_URL") or None,
        reward_model_url=env.get("RLPIPE_REWARD_MODEL_URL") or None,
        rollout_urls=tuple(u.strip() for u in env.get("RLPIPE_ROLLOUT_URL", "").split(",") if u.strip()),
        trainer_url=env.get("RLPIPE_TRAINER_URL") or None,
    )
