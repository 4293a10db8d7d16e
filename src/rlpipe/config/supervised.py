"""Run config sections of the supervised stages: the SFT warm-up (``sft:``) and reward-model training (``rm:``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlpipe.config.train import LoraConfig
from rlpipe.yamlio import Strict


class SFTConfig(Strict):
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


class RewardModelConfig(Strict):
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
