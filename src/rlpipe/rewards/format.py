"""Format and rule verifiers: required tags, a regex, JSON that parses and fits a schema.

Each takes its rule from ``ground_truth`` (so one prompt set can mix rules):

- ``format``: a JSON object ``{"tags": ["think", "answer"], "regex": "...", "answer": "46"}``; every
  key optional. ``tags``: each ``<tag>…</tag>`` appears exactly once, non-empty, in the given
  order, with nothing after the last one; ``regex``: the whole response matches (Python ``re``,
  DOTALL); ``answer``: the content of the last tag equals it (after stripping).
- ``json``: ``ground_truth`` is a JSON Schema (or null: any JSON value). The response may wrap the
  JSON in a ```json fence. Reward 1 when it parses and conforms; the reason names the failing path.

A rule that cannot be read is the prompt set's fault: status ``error``, never a 0 reward.
"""

from __future__ import annotations

import json
import re

from rlpipe.rewards.base import VerifyResult, register_verifier

_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.S)


def _rule(ground_truth: str | None) -> dict | None:
    if ground_truth is None or not ground_truth.strip():
        return {}
    try:
        rule = json.loads(ground_truth)
    except json.JSONDecodeError:
        return None
    return rule if isinstance(rule, dict) else None


@register_verifier("format", version="1")
def format_rule(response: str, ground_truth: str | None) -> VerifyResult:
    rule = _rule(ground_truth)
    if rule is None or not set(rule) <= {"tags", "regex", "answer"}:
        return VerifyResult(None, "error", "ground_truth must be a JSON object with keys tags/regex/answer")
    text = response.strip()
    last_content = None
    if rule.get("tags"):
        pos = 0
        for tag in rule["tags"]:
            opens = [m.start() for m in re.finditer(re.escape(f"<{tag}>"), text)]
            closes = [m.start() for m in re.finditer(re.escape(f"</{tag}>"), text)]
            if len(opens) != 1 or len(closes) != 1:
                return VerifyResult(0.0, "ok", f"<{tag}> must appear exactly once, closed")
            start, end = opens[0] + len(tag) + 2, closes[0]
            if opens[0] < pos or end < start:
                return VerifyResult(0.0, "ok", f"<{tag}> is out of order or not closed")
            last_content = text[start:end].strip()
            if not last_content:
                return VerifyResult(0.0, "ok", f"<{tag}> is empty")
            pos = end + len(tag) + 3
        if text[pos:].strip():
            return VerifyResult(0.0, "ok", "text after the last required tag")
    if rule.get("regex"):
        try:
            if not re.fullmatch(rule["regex"], text, re.S):
                return VerifyResult(0.0, "ok", "does not match the required pattern")
        except re.error as e:
            return VerifyResult(None, "error", f"bad regex in ground_truth: {e}")
    if "answer" in rule:
        got = last_content if last_content is not None else text
        if got != str(rule["answer"]).strip():
            return VerifyResult(0.0, "ok", "format ok, wrong answer")
    return VerifyResult(1.0, "ok")


@register_verifier("json", version="1")
def json_schema(response: str, ground_truth: str | None) -> VerifyResult:
    schema = None
    if ground_truth is not None and ground_truth.strip():
        try:
            schema = json.loads(ground_truth)
        except json.JSONDecodeError as e:
            return VerifyResult(None, "error", f"ground_truth is not a JSON schema: {e.msg}")
    fenced = _FENCE.findall(response)
    text = (fenced[-1] if fenced else response).strip()
    if not text:
        return VerifyResult(None, "unparseable", "empty response")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return VerifyResult(0.0, "ok", f"not JSON: {e.msg} at char {e.pos}")
    if schema is None:
        return VerifyResult(1.0, "ok")
    import jsonschema

    try:
        validator = jsonschema.validators.validator_for(schema)(schema)
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        return VerifyResult(None, "error", f"invalid schema in ground_truth: {e.message}")
    errors = sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path))
    if errors:
        where = "/".join(str(p) for p in errors[0].absolute_path) or "<root>"
        return VerifyResult(0.0, "ok", f"{where}: {errors[0].message}"[:200])
    return VerifyResult(1.0, "ok")
