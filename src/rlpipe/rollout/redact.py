"""``data.redact``: trajectories de-identified before they reach the store.

:func:`write_trajectories` is how a rollout and a verify stage write their table. With ``redact`` on:

- the text columns (``response_text``, ``reward_reason``, each step's ``action``/``observation``/``info``)
  get typed placeholders (:func:`rlpipe.data.pii.redact`: ``[EMAIL]``, ``[AWS_ACCESS_KEY]``, ...);
- the token ids would still spell what the text no longer shows, so (given the tokenizer) every prompt or
  response token whose decoded text overlaps a finding becomes the pad token, and such a response token
  gets ``loss_mask`` 0: the update never trains the model to emit it. Lengths and log-probs keep their
  alignment. Where a row's per-token decoding does not add up to its text (a multi-byte character split
  across tokens), all tokens of that sequence are replaced: over-redacting is the safe side.

The dataset stage (``tasks/data.py``) redacts the prompt table the same way before storing it, so the policy
reads de-identified prompts too; the user's file itself is not changed (``rlpipe data validate FILE --redact
OUT`` writes a clean copy).

What it costs: the verifier scores the redacted text (a response whose correct answer *is* a phone number
would no longer match its reference), references are redacted like prompts (the tests of a task *about*
e-mail addresses lose their examples), and the trainer reads pad tokens where the secret was.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from rlpipe.data.pii import find_pii
from rlpipe.data.pii_files import redact_value
from rlpipe.storage.schemas import TRAJECTORY_SCHEMA

__all__ = ["redact_samples", "redact_trajectories", "write_trajectories"]

TEXT_COLUMNS = ("response_text", "reward_reason", "steps")


def write_trajectories(store: Any, prefix: str, table: pa.Table, meta: dict[str, Any], *, redact: bool,
                       tokenizer: Any = None) -> dict[str, Any]:
    """Write a trajectory stage (one part); with ``redact``, de-identified first (see the module docstring)."""
    if redact:
        table, replaced = redact_trajectories(table, tokenizer)
        meta = meta | {"data/redacted_values": float(replaced)}
    return store.write_stage(prefix, [table], meta=meta, schema=TRAJECTORY_SCHEMA)


def redact_samples(result: dict[str, Any], redact: bool) -> dict[str, Any]:
    """An evaluation's result with its ``samples`` (the prompts, responses and references logged to MLflow as
    ``generations.json``) de-identified where ``redact`` (``data.redact``) is on; as it is otherwise."""
    if not redact or not result.get("samples"):
        return result
    return result | {"samples": redact_value(result["samples"])[0]}


def redact_trajectories(table: pa.Table, tokenizer: Any = None) -> tuple[pa.Table, int]:
    """The table with its text redacted and (with ``tokenizer``) the tokens that spell a finding masked;
    and how many text values and tokens were replaced."""
    replaced = 0
    for name in TEXT_COLUMNS:
        values, n = redact_value(table.column(name).to_pylist())
        if n:
            i = table.schema.get_field_index(name)
            table = table.set_column(i, table.schema.field(i), pa.array(values, type=table.schema.field(i).type))
            replaced += n
    if tokenizer is not None:
        table, masked = _mask_tokens(table, tokenizer)
        replaced += masked
    return table, replaced


def _pad_id(tokenizer: Any) -> int:
    for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
        if getattr(tokenizer, name, None) is not None:
            return int(getattr(tokenizer, name))
    raise ValueError("data.redact: the tokenizer has no pad, eos or unk token to put in place of a secret's tokens")


def _hit_positions(ids: list[int], tokenizer: Any) -> set[int]:
    """Positions of the tokens whose decoded text overlaps a finding (all of them if offsets are unclear)."""
    if not ids:
        return set()
    text = tokenizer.decode(ids)
    spans = [(f.start, f.end) for f in find_pii(text)]
    if not spans:
        return set()
    pieces = [tokenizer.decode([t]) for t in ids]
    if "".join(pieces) != text:
        return set(range(len(ids)))
    hit, at = set(), 0
    for pos, piece in enumerate(pieces):
        start, at = at, at + len(piece)
        if any(start < e and s < at for s, e in spans):
            hit.add(pos)
    return hit


def _mask_tokens(table: pa.Table, tokenizer: Any) -> tuple[pa.Table, int]:
    """Pad the prompt and response tokens that spell a finding; masked response tokens get loss_mask 0."""
    pad = _pad_id(tokenizer)
    prompts = table.column("prompt_token_ids").to_pylist()
    responses = table.column("response_token_ids").to_pylist()
    masks = table.column("loss_mask").to_pylist()
    seen: dict[tuple[int, ...], set[int]] = {}  # n samples share a prompt: decode it once
    masked = 0
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        if tuple(prompt) not in seen:
            seen[tuple(prompt)] = _hit_positions(prompt, tokenizer)
        in_prompt = seen[tuple(prompt)]
        in_response = _hit_positions(response, tokenizer)
        if in_prompt:
            prompts[i] = [pad if j in in_prompt else t for j, t in enumerate(prompt)]
        if in_response:
            responses[i] = [pad if j in in_response else t for j, t in enumerate(response)]
            masks[i] = [0 if j in in_response else m for j, m in enumerate(masks[i] or [1] * len(response))]
        masked += len(in_prompt) + len(in_response)
    if masked:
        for name, values in (("prompt_token_ids", prompts), ("response_token_ids", responses), ("loss_mask", masks)):
            i = table.schema.get_field_index(name)
            table = table.set_column(i, table.schema.field(i), pa.array(values, type=table.schema.field(i).type))
    return table, masked
