"""Verifier audits: run a labelled set through the verifiers and count where they disagree with people.

A labels file is JSONL, one case a line:
``{"task": "math", "response": "…the model's full output…", "ground_truth": "…" | {"tests": […]}, "expected": 0|1}``,
optionally with ``"category"`` (counted apart in the report) and ``"note"`` (why the label is what it is).
A false positive is a verdict of 1 on a case labelled 0 (the verifier would reward a wrong answer);
a false negative the reverse. Verdicts that are not ``ok`` are counted apart (``not_ok``) and are
disagreements too: a verifier that cannot decide is not agreeing.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from rlpipe.jsonl import jsonl_objects
from rlpipe.rewards.pool import VerifierPool, VerifyItem


class LabelsError(ValueError):
    """A labels file that cannot be read as cases; the message names the file and the line."""


def load_labels(path: str | Path) -> list[dict[str, Any]]:
    """The cases of a labels file, each with its ``line``; :class:`LabelsError` names the line that is wrong."""
    cases = []
    for n, c in jsonl_objects(Path(path), LabelsError):
        missing = {"task", "response", "expected"} - set(c)
        if missing:
            raise LabelsError(f"{path} line {n}: missing {sorted(missing)}")
        if c["expected"] not in (0, 1):
            raise LabelsError(f"{path} line {n}: expected must be 0 or 1, got {c['expected']!r}")
        gt = c.get("ground_truth")
        c["ground_truth"] = json.dumps(gt) if isinstance(gt, (dict, list)) else gt
        c["line"] = n
        cases.append(c)
    return cases


def _tally() -> dict[str, Any]:
    return {"n": 0, "agree": 0, "false_positive": 0, "false_negative": 0, "not_ok": 0}


def _count(t: dict[str, Any], kind: str) -> None:
    t["n"] += 1
    t["agree" if kind == "agree" else kind] += 1


def _kind(expected: int, status: str, reward: float | None, threshold: float) -> str:
    """agree / false_positive / false_negative / not_ok for one case."""
    if status != "ok":
        return "not_ok"
    said = int(reward is not None and reward >= threshold)
    if said == expected:
        return "agree"
    return "false_positive" if said == 1 else "false_negative"


def _finish(t: dict[str, Any]) -> dict[str, Any]:
    t["agreement"] = round(t["agree"] / t["n"], 4) if t["n"] else None
    return t


def audit(cases: list[dict[str, Any]], pool: VerifierPool, threshold: float = 1.0) -> dict[str, Any]:
    """Per verifier: n, agreement, false positives/negatives, not-ok verdicts, each disagreement, and the
    same counts per case ``category`` (cases without one are counted under ``"-"``).

    A verdict counts as 1 when reward >= ``threshold`` (code rewards are pass fractions). Per-category
    counts are there because one overall number hides a verifier that fails a whole kind of answer."""
    verdicts = pool.score([VerifyItem(c["task"], c["response"], c["ground_truth"]) for c in cases])
    per: dict[str, dict[str, Any]] = defaultdict(lambda: {**_tally(), "disagreements": [],
                                                           "categories": defaultdict(_tally)})
    for c, v in zip(cases, verdicts):
        p = per[c["task"]]
        kind = _kind(c["expected"], v.status, v.reward, threshold)
        _count(p, kind)
        _count(p["categories"][str(c.get("category") or "-")], kind)
        if kind == "agree":
            continue
        p["disagreements"].append({"line": c["line"], "kind": kind, "status": v.status, "reward": v.reward,
                                   "reason": v.reason, "response": c["response"][:120], "ground_truth": c["ground_truth"],
                                   "category": c.get("category"), "note": c.get("note")})
    out = {}
    for task, p in sorted(per.items()):
        p["categories"] = {k: _finish(t) for k, t in sorted(p["categories"].items())}
        out[task] = _finish(p)
    return out


def totals(report: dict[str, Any]) -> dict[str, Any]:
    """The counts summed over every verifier of an :func:`audit` report."""
    t = _tally()
    for r in report.values():
        for k in t:
            t[k] += r[k]
    return _finish(t)
