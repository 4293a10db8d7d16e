"""Preference tables: ``prompt``, ``chosen``, ``rejected``, optional ``margin`` — load, validate, version.

Accepted row conventions (JSONL or Parquet), all normalised to :data:`PREFERENCE_SCHEMA`:

- rlpipe's own: ``prompt`` text, ``chosen`` / ``rejected`` response texts, optional ``margin``,
  ``split``, ``id``, ``source``.
- Chat-message lists, as in UltraFeedback-binarized exports: ``chosen`` and ``rejected`` are lists
  of ``{"role", "content"}`` messages ending in the assistant's answer; the messages before it are
  the prompt (stored as JSON, ``chat`` true) and must be the same in both. A ``prompt`` field, if
  given, must agree with the last user message.
- Anthropic HH-RLHF exports: ``chosen`` / ``rejected`` are whole transcripts
  (``"\\n\\nHuman: …\\n\\nAssistant: …"``) without a ``prompt``; the text up to the last
  ``"\\n\\nAssistant:"`` is the prompt and must be the same in both.

Loading never drops a row: what cannot be read becomes a :class:`~rlpipe.data.prompts.Finding` that
names the row, the field and the fix, and a table with findings is refused by the flows.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlpipe.config import canonical_json
from rlpipe.jsonl import jsonl_objects
from rlpipe.data.prompts import SPLITS, Finding

__all__ = ["PREFERENCE_SCHEMA", "PreferenceFileError", "build_synthetic_preferences", "load_preferences", "preference_version", "is_preference_file"]

PREFERENCE_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("prompt", pa.string(), nullable=False),  # text, or (chat) a JSON list of messages
        pa.field("chat", pa.bool_(), nullable=False),
        pa.field("chosen", pa.string(), nullable=False),  # the preferred response
        pa.field("rejected", pa.string(), nullable=False),
        pa.field("margin", pa.float64()),  # how much chosen is preferred (≥ 0), null: unknown
        pa.field("split", pa.string(), nullable=False),
        pa.field("source", pa.string()),
    ],
    metadata={"rlpipe.table": "preferences", "rlpipe.schema_version": "1"},
)

_HH_TURN = "\n\nAssistant:"


class PreferenceFileError(ValueError):
    """A preference file that cannot be read at all (not JSON lines, not Parquet)."""


def is_preference_file(path: str | Path) -> bool:
    """Whether a JSONL/Parquet file holds preference pairs (has ``chosen`` and ``rejected``)."""
    path = Path(path)
    if path.suffix == ".parquet":
        try:
            names = pq.read_schema(path).names
        except Exception:  # noqa: BLE001 - not readable: the prompt loader says why
            return False
        return "chosen" in names and "rejected" in names
    if path.suffix not in (".jsonl", ".json", ".ndjson"):  # not a file of preference pairs: the prompt loader says why
        return False
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                return False
            return isinstance(obj, dict) and "chosen" in obj and "rejected" in obj
    return False


def _split_messages(messages: Any, field: str) -> tuple[list[dict[str, str]] | None, str | None, str | None]:
    """(prompt messages, final assistant content, problem) of a chat-message list."""
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)
    if not ok:
        return None, None, f"{field} is not a list of {{role, content}} messages"
    if messages[-1]["role"] != "assistant":
        return None, None, f"{field}'s last message is from {messages[-1]['role']!r}, not the assistant's answer"
    return [{"role": m["role"], "content": m["content"]} for m in messages[:-1]], messages[-1]["content"], None


def _from_messages(obj: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str, str]]]:
    (pc, chosen, p1), (pr, rejected, p2) = _split_messages(obj["chosen"], "chosen"), _split_messages(obj["rejected"], "rejected")
    problems = [(f, p, "give a list of messages ending with {\"role\": \"assistant\", ...}")
                for f, p in (("chosen", p1), ("rejected", p2)) if p]
    if problems:
        return {}, problems
    if pc != pr:
        problems.append(("prompt", "chosen and rejected answer different conversations",
                         "both must share every message before the final assistant answer"))
    prompt = obj.get("prompt")
    users = [m["content"] for m in pc if m["role"] == "user"]
    if not pc and isinstance(prompt, str):  # only the answers are message lists
        return {"prompt": prompt, "chat": False, "chosen": chosen, "rejected": rejected}, problems
    if isinstance(prompt, str) and users and prompt.strip() != users[-1].strip():
        problems.append(("prompt", "the prompt field differs from the conversation's last user message",
                         "drop the prompt field or make it equal that message"))
    return {"prompt": json.dumps(pc, ensure_ascii=False), "chat": True, "chosen": chosen, "rejected": rejected}, problems


def _from_transcripts(obj: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str, str]]]:
    """HH-RLHF: whole transcripts; the prompt is everything up to the last assistant turn."""
    parts = [t.rpartition(_HH_TURN) for t in (obj["chosen"], obj["rejected"])]
    if not all(p[1] for p in parts):
        return {}, [("chosen", "no prompt field, and the texts are not Human/Assistant transcripts",
                     "add a prompt field, or give transcripts with '\\n\\nAssistant:' turns")]
    problems = []
    if parts[0][0] != parts[1][0]:
        problems.append(("prompt", "chosen and rejected transcripts differ before the last assistant turn",
                         "both must share the conversation and differ only in the final answer"))
    return {"prompt": parts[0][0] + _HH_TURN, "chat": False, "chosen": parts[0][2].lstrip(" "),
            "rejected": parts[1][2].lstrip(" ")}, problems


def _normalise(obj: dict[str, Any], rid: str) -> tuple[dict[str, Any], list[Finding]]:
    """One input object → a schema row (best effort, nothing dropped) and what is wrong with it."""
    missing = [k for k in ("chosen", "rejected") if obj.get(k) is None]
    if missing:
        return {}, [Finding(rid, k, "missing", "every row needs a chosen and a rejected response") for k in missing]
    if isinstance(obj["chosen"], list) or isinstance(obj["rejected"], list):
        row, problems = _from_messages(obj)
    elif isinstance(obj.get("prompt"), (str, list)):
        prompt = obj["prompt"]
        row = {"prompt": json.dumps(prompt, ensure_ascii=False) if isinstance(prompt, list) else prompt,
               "chat": isinstance(prompt, list) or obj.get("chat") is True, "chosen": obj["chosen"], "rejected": obj["rejected"]}
        problems = []
    else:
        row, problems = _from_transcripts(obj)
    findings = [Finding(rid, f, p, fix) for f, p, fix in problems]
    if row:
        findings += _content_findings(row, obj, rid)
    margin = obj.get("margin")
    return row | {"id": rid, "margin": margin, "split": obj.get("split", "train"), "source": obj.get("source")}, findings


def _content_findings(row: dict[str, Any], obj: dict[str, Any], rid: str) -> list[Finding]:
    out = []
    for k in ("chosen", "rejected"):
        if not isinstance(row[k], str):
            out.append(Finding(rid, k, f"is a {type(row[k]).__name__}, not text", "give the response as a string"))
        elif not row[k].strip():
            out.append(Finding(rid, k, "is empty", "give the response text, or remove the row"))
    if not isinstance(row["prompt"], str) or not row["prompt"].strip():
        out.append(Finding(rid, "prompt", "is empty", "give the prompt the responses answer"))
    if not out and row["chosen"] == row["rejected"]:
        out.append(Finding(rid, "rejected", "is the same text as chosen: the pair says nothing",
                           "remove the row or give two different responses"))
    margin = obj.get("margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                               or not math.isfinite(margin) or margin < 0):
        out.append(Finding(rid, "margin", f"{margin!r} is not a finite number ≥ 0",
                           "give how much chosen is preferred (≥ 0), or null"))
    if obj.get("split", "train") not in SPLITS:
        out.append(Finding(rid, "split", f"{obj.get('split')!r} is not one of {', '.join(SPLITS)}", "use train, validation or test"))
    return out


def _objects(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:  # noqa: BLE001
            raise PreferenceFileError(f"{path}: not a readable Parquet file: {e}") from None
    if path.suffix not in (".jsonl", ".json", ".ndjson"):
        raise PreferenceFileError(f"{path}: unknown preference file type {path.suffix!r}; use .jsonl or .parquet")
    return [obj | {"_line": n} for n, obj in jsonl_objects(path, PreferenceFileError)]


def load_preferences(path: str | Path) -> tuple[pa.Table, list[Finding]]:
    """Read a preference file into :data:`PREFERENCE_SCHEMA` plus every finding (rows with findings
    are kept, their unreadable fields as JSON text, so nothing is lost)."""
    path = Path(path)
    if not path.exists():
        raise PreferenceFileError(f"{path}: file not found")
    rows, findings = [], []
    for n, obj in enumerate(_objects(path), start=1):
        line = obj.pop("_line", n)
        rid = str(obj["id"]) if obj.get("id") not in (None, "") else f"{path.stem}-{line}"
        row, found = _normalise(obj, rid)
        findings += found
        rows.append(_as_row(row, obj, rid))
    ids = Counter(r["id"] for r in rows)
    findings += [Finding(i, "id", f"appears {c} times", "give every row its own id") for i, c in ids.items() if c > 1]
    return pa.Table.from_pylist(rows, schema=PREFERENCE_SCHEMA), findings


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def _as_row(row: dict[str, Any], obj: dict[str, Any], rid: str) -> dict[str, Any]:
    margin = row.get("margin")
    ok_margin = isinstance(margin, (int, float)) and not isinstance(margin, bool) and math.isfinite(margin)
    return {"id": rid, "prompt": _text(row.get("prompt", obj.get("prompt", ""))), "chat": bool(row.get("chat", False)),
            "chosen": _text(row.get("chosen", obj.get("chosen", ""))), "rejected": _text(row.get("rejected", obj.get("rejected", ""))),
            "margin": float(margin) if ok_margin else None, "split": str(row.get("split") or "train"),
            "source": None if row.get("source") is None else str(row["source"])}


def preference_version(table: pa.Table) -> str:
    """sha256 of the rows' canonical JSON, sorted: independent of row order and file format."""
    h = hashlib.sha256()
    for r in sorted(canonical_json(r) for r in table.select(PREFERENCE_SCHEMA.names).to_pylist()):
        h.update(r.encode())
        h.update(b"\n")
    return h.hexdigest()


# -- the synthetic preference task ------------------------------------------------------------
def _candidates(truth: int, rng: Any) -> list[str]:
    """Answers a policy might give: the right one, near misses, one wrong digit, far off, an extra digit."""
    text = str(truth)
    i = rng.randrange(len(text))
    digit = text[:i] + str((int(text[i]) + rng.randint(1, 9)) % 10) + text[i + 1:]
    if digit.startswith("0") and len(digit) > 1:
        digit = digit.lstrip("0") or "0"
    return [text, str(truth + rng.choice((-1, 1)) * rng.randint(1, 4)), digit,
            str(max(0, truth + rng.randint(-60, 60))), text + str(rng.randint(0, 9))]


def build_synthetic_preferences(prompts: pa.Table, pairs_per_prompt: int = 2, label_noise: float = 0.1,
                                min_gap: float = 0.05, seed: int = 0) -> pa.Table:
    """Pairs of answers to arithmetic prompts, labelled by the hidden true quality (``closeness``).

    Training pairs have their label flipped with probability ``label_noise`` (annotators err);
    validation and test pairs are labelled by the true quality alone, so the reward model's
    held-out pair accuracy is its agreement with true quality. Pairs whose qualities differ by
    less than ``min_gap`` are not drawn (nobody can tell them apart). Each prompt keeps its split,
    so a reward model never sees a test prompt."""
    import random

    from rlpipe.rewards.closeness import closeness_quality

    rng = random.Random(seed)
    rows = []
    for p in prompts.to_pylist():
        truth = int(p["ground_truth"])
        cands = sorted(set(_candidates(truth, rng)))
        pairs = [(a, b) for a in cands for b in cands
                 if a < b and abs(closeness_quality(int(a), truth) - closeness_quality(int(b), truth)) >= min_gap]
        rng.shuffle(pairs)
        for k, (a, b) in enumerate(pairs[:pairs_per_prompt]):
            good, bad = (a, b) if closeness_quality(int(a), truth) > closeness_quality(int(b), truth) else (b, a)
            if p["split"] == "train" and rng.random() < label_noise:
                good, bad = bad, good
            rows.append({"id": f"{p['id']}-pair{k}", "prompt": p["prompt"], "chat": p["chat"], "chosen": good,
                         "rejected": bad, "margin": None, "split": p["split"],
                         "source": f"synthetic-closeness/noise{label_noise:g}"})
    return pa.Table.from_pylist(rows, schema=PREFERENCE_SCHEMA)
