"""The run config's ``rollout:`` section: how completions are sampled, by which engine, and how the engine's
weights are proven to match the trainer's after each sync."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlpipe.yamlio import Strict


class RolloutConfig(Strict):
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
        "it). false: generate inside k+1's rollout task. With async_steps: 1 the batch is generated during the update instead, and prefetch is off (setting it "
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
        "adapter", description="With train.lora, what a weight sync moves to the engine. adapter: the engine keeps "
        "the start model and takes each iteration's LoRA adapter (vLLM's LoRA support: megabytes, not the model); the "
        "probe proves the adapted policy as before. This holds for the in-process vLLM engine and for rollout "
        "replicas started with `rlpipe serve rollout --lora-rank R` (R ≥ train.lora.r); replicas without it are an "
        "error at the run's start. merged: the merged weights. The HF engine and runs with a trainer service always "
        "take the merged weights (the run's start log says which)."
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
