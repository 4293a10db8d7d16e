"""Run config sections for what is trained on what: the task, the synthetic dataset, the tiny model's shape."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlpipe.yamlio import Strict


class TaskConfig(Strict):
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


class DataConfig(Strict):
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
    redact: bool = Field(
        False,
        description="De-identify what reaches the store: e-mail addresses, phone numbers, national IDs, IP addresses "
        "and credentials in the prompt set and in each trajectory become typed placeholders ([EMAIL]), the tokens "
        "that spell them the pad token, kept out of the loss; the evaluation samples logged to MLflow are redacted "
        "too. The verifier then scores the redacted text. See "
        "docs/data.md, \"Personal data and secrets\".",
    )


class ModelConfig(Strict):
    """Shape of rlpipe's tiny Qwen2 (used when `task.policy_model` is 'tiny')."""

    hidden_size: int = Field(256, ge=8, description="Width of the residual stream.")
    num_layers: int = Field(4, ge=1, description="Transformer blocks.")
    num_heads: int = Field(4, ge=1, description="Attention heads (also key/value heads).")
    intermediate_size: int = Field(768, ge=8, description="Width of the MLP.")
    max_position_embeddings: int = Field(256, ge=16, description="Longest sequence (prompt + response).")
