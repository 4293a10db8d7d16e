"""Format and rule verifiers: required tags, a regex, JSON that parses and fits a schema.

Each takes its rule from ``ground_truth`` (so one prompt set can mix rules):

- ``format``: a JSON object with at least one of ``{"tags": ["think", "answer"], "regex": "...",
  "answer": "46"}``. ``tags``: each ``<tag>…</tag>`` appears exactly once, non-empty, in the given
  order, with nothing after the last one; ``regex``: the whole response matches (Python ``re``,
  DOTALL); ``answer``: the content of the last tag (or the whole response) equals it (after stripping).
- ``json``: ``ground_truth`` is a JSON Schema (or null: any JSON value). The response may wrap the
  JSON in a ```json fence. Reward 1 when it parses and conforms; the reason names the failing path.

The verdict rule (see :mod:`rlpipe.rewards.base`): a rule or schema that cannot be read or applied
is the prompt set's fault — status ``error`` with a reason, never a 0 reward. Both verifiers read
their rule through the same function as their ``check_reference``, so ``rlpipe data validate``
rejects exactly the rows that would score ``error``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rlpipe.rewards.base import VerifyResult, register_verifier

_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.S)
_TAG_NAME = re.compile(r"[A-Za-z_][\w.:-]*")
_FORMAT_KEYS = ("tags", "regex", "answer")


# -- format ---------------------------------------------------------------------------------


def _tags_problem(tags: Any) -> str | None:
    if not isinstance(tags, list) or not tags:
        return 'tags must be a non-empty list of tag names, e.g. "tags": ["think", "answer"]'
    bad = [t for t in tags if not isinstance(t, str) or not _TAG_NAME.fullmatch(t)]
    if bad:
        return f"tags {bad!r} are not tag names; write names without brackets, e.g. \"answer\" for <answer>"
    twice = sorted({t for t in tags if tags.count(t) > 1})
    if twice:
        return f"tag(s) {twice} listed twice, so no response can pass; list each tag once"
    return None


def _regex_problem(regex: Any) -> str | None:
    if not isinstance(regex, str) or not regex:
        return "regex must be a non-empty string (a Python regular expression)"
    try:
        re.compile(regex)
    except re.error as e:
        return f"regex {regex[:60]!r} does not compile ({e}); fix the pattern (Python re syntax)"
    return None


def _read_format_rule(ground_truth: str | None) -> tuple[dict[str, Any] | None, str | None]:
    """``(rule, None)`` when usable, else ``(None, what is wrong and how to fix it)``."""
    example = 'e.g. {"tags": ["think", "answer"], "answer": "46"}'
    if ground_truth is None or not ground_truth.strip():
        return None, f"no rule; write a JSON object with tags, regex and/or answer, {example}"
    try:
        rule = json.loads(ground_truth)
    except json.JSONDecodeError as e:
        return None, f"rule is not JSON ({e.msg} at char {e.pos}); write a JSON object, {example}"
    if not isinstance(rule, dict):
        return None, f"rule is a JSON {type(rule).__name__}, not an object; write {example}"
    unknown = sorted(set(rule) - set(_FORMAT_KEYS))
    if unknown:
        return None, f"unknown key(s) {unknown} in the rule; use only {', '.join(_FORMAT_KEYS)}"
    if not rule:
        return None, f"empty rule: every response would score 1; give tags, regex and/or answer, {example}"
    problem = (("tags" in rule and _tags_problem(rule["tags"]))
               or ("regex" in rule and _regex_problem(rule["regex"])))
    if problem:
        return None, problem
    if "answer" in rule and (isinstance(rule["answer"], bool) or not isinstance(rule["answer"], (str, int, float))):
        return None, f"answer must be a string or a number, not {json.dumps(rule['answer'])[:40]}"
    return rule, None


def check_format_rule(ground_truth: str | None, **options: Any) -> str | None:
    """The ``format`` verifier's reference check: ``None`` when the rule is usable, else what to fix."""
    return _read_format_rule(ground_truth)[1]


def _check_tags(text: str, tags: list[str]) -> tuple[VerifyResult | None, str | None]:
    """``(failure, None)`` when the response breaks the tag rule, else ``(None, last tag's content)``."""
    pos, content = 0, None
    for tag in tags:
        opens = [m.start() for m in re.finditer(re.escape(f"<{tag}>"), text)]
        closes = [m.start() for m in re.finditer(re.escape(f"</{tag}>"), text)]
        if len(opens) != 1 or len(closes) != 1:
            return VerifyResult(0.0, "ok", f"<{tag}> must appear exactly once, closed"), None
        start, end = opens[0] + len(tag) + 2, closes[0]
        if opens[0] < pos or end < start:
            return VerifyResult(0.0, "ok", f"<{tag}> is out of order or not closed"), None
        content = text[start:end].strip()
        if not content:
            return VerifyResult(0.0, "ok", f"<{tag}> is empty"), None
        pos = end + len(tag) + 3
    if text[pos:].strip():
        return VerifyResult(0.0, "ok", "text after the last required tag"), None
    return None, content


@register_verifier("format", version="2", check_reference=check_format_rule)
def format_rule(response: str, ground_truth: str | None) -> VerifyResult:
    rule, problem = _read_format_rule(ground_truth)
    if rule is None:
        return VerifyResult(None, "error", f"format rule in ground_truth: {problem}")
    text = response.strip()
    last_content = None
    if "tags" in rule:
        failed, last_content = _check_tags(text, rule["tags"])
        if failed:
            return failed
    if "regex" in rule and not re.fullmatch(rule["regex"], text, re.S):
        return VerifyResult(0.0, "ok", "does not match the required pattern")
    if "answer" in rule:
        got = last_content if last_content is not None else text
        if got != str(rule["answer"]).strip():
            return VerifyResult(0.0, "ok", "format ok, wrong answer")
    return VerifyResult(1.0, "ok")


# -- json -----------------------------------------------------------------------------------


def _read_schema(ground_truth: str | None) -> tuple[Any, str | None]:
    """``(validator or None for 'any JSON', None)`` when usable, else ``(None, what is wrong + fix)``."""
    if ground_truth is None or not ground_truth.strip():
        return None, None
    try:
        schema = json.loads(ground_truth)
    except json.JSONDecodeError as e:
        return None, f"ground_truth is not a JSON schema: {e.msg} at char {e.pos}; write the schema as JSON (or null for any JSON)"
    if not isinstance(schema, (dict, bool)):
        return None, f"invalid schema: a JSON {type(schema).__name__}; a JSON Schema is an object (or true/false)"
    import jsonschema

    try:
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
        validator = cls(schema)
        list(validator.iter_errors(None))  # resolves a top-level $ref that points nowhere
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "<root>"
        return None, f"invalid schema at {where}: {e.message[:120]}; fix it to follow {cls.META_SCHEMA.get('$schema', 'JSON Schema')}"
    except Exception as e:  # noqa: BLE001 - e.g. an unresolvable $ref
        return None, f"invalid schema: {type(e).__name__}: {str(e)[:120]}; fix or inline the $ref"
    return validator, None


def check_json_schema(ground_truth: str | None, **options: Any) -> str | None:
    """The ``json`` verifier's reference check: ``None`` for a usable schema (or none: any JSON), else what to fix."""
    return _read_schema(ground_truth)[1]


def _parse_response(response: str) -> tuple[Any, VerifyResult | None]:
    fenced = _FENCE.findall(response)
    text = (fenced[-1] if fenced else response).strip()
    if not text:
        return None, VerifyResult(0.0, "ok", "empty response")
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, VerifyResult(0.0, "ok", f"not JSON: {e.msg} at char {e.pos}")


@register_verifier("json", version="2", check_reference=check_json_schema)
def json_schema(response: str, ground_truth: str | None) -> VerifyResult:
    validator, problem = _read_schema(ground_truth)
    if problem:
        return VerifyResult(None, "error", problem)
    value, failed = _parse_response(response)
    if failed:
        return failed
    if validator is None:
        return VerifyResult(1.0, "ok")
    try:
        errors = sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path))
    except Exception as e:  # noqa: BLE001 - the schema could not be applied (e.g. a nested $ref to nowhere)
        return VerifyResult(None, "error", f"schema in ground_truth cannot be applied: {type(e).__name__}: {str(e)[:120]}")
    if errors:
        where = "/".join(str(p) for p in errors[0].absolute_path) or "<root>"
        return VerifyResult(0.0, "ok", f"{where}: {errors[0].message}"[:200])
    return VerifyResult(1.0, "ok")
