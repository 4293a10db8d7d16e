"""Explicit pyarrow schemas of the tables rlpipe writes (see ARCHITECTURE.md, "Data")."""

from __future__ import annotations

import pyarrow as pa

PROMPT_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        # Plain text, or (chat=True) a JSON list of {"role", "content"} messages.
        pa.field("prompt", pa.string(), nullable=False),
        pa.field("chat", pa.bool_(), nullable=False),
        pa.field("task", pa.string(), nullable=False),  # verifier name
        pa.field("ground_truth", pa.string()),
        pa.field("tests", pa.string()),  # JSON (code tasks)
        pa.field("split", pa.string(), nullable=False),  # train | test | validation
        pa.field("source", pa.string()),
        # A reference response for SFT when it differs from ground_truth (e.g. an expression whose
        # value is the ground truth); null: SFT trains on ground_truth.
        pa.field("solution", pa.string()),
    ],
    metadata={"rlpipe.table": "prompts", "rlpipe.schema_version": "1"},
)

REWARD_STATUSES = ("ok", "unparseable", "timeout", "error", "skipped")

_STEP = pa.struct(
    [
        pa.field("action", pa.string()),
        pa.field("observation", pa.string()),
        pa.field("reward", pa.float64()),
        pa.field("env_s", pa.float64()),  # the environment's time for this step
        pa.field("info", pa.string()),  # the step's info mapping as JSON (tool, tool_error, ...)
    ]
)

TRAJECTORY_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("iteration", pa.int32(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("sample_index", pa.int32(), nullable=False),
        pa.field("policy_version", pa.string(), nullable=False),  # sha256 of the weights that sampled
        # The last update in those weights (-1: the run's start policy), and how many updates the batch's
        # policy lags the one it trains (0 on-policy; 1 with rollout.async_steps: 1). Null in tables from before.
        pa.field("policy_iteration", pa.int32()),
        pa.field("staleness", pa.int32()),
        pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_text", pa.string()),
        pa.field("logprobs", pa.list_(pa.float32())),  # sampling log-probs, one per response token
        pa.field("loss_mask", pa.list_(pa.int8())),  # 0 for agent observations inside the response
        pa.field("steps", pa.list_(_STEP)),  # agentic episodes only
        pa.field("reward", pa.float64()),  # null unless reward_status == "ok"
        pa.field("reward_status", pa.string(), nullable=False),
        pa.field("reward_reason", pa.string()),
        pa.field("verifier", pa.string()),
        pa.field("verifier_version", pa.string()),
        # Sandbox isolation level the verdict was produced at (verifiers that run code), else null.
        pa.field("isolation", pa.string()),
        pa.field("truncated", pa.bool_()),
        pa.field("generate_s", pa.float64()),
        pa.field("verify_s", pa.float64()),
    ],
    metadata={"rlpipe.table": "trajectories", "rlpipe.schema_version": "4"},
)
