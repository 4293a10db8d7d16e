"""Verifier audits: run a labelled set through the verifiers and count where they disagree with people.

A labels file is JSONL, one case a line:
``{"task": "math", "response": "…the model's full output…", "ground_truth": "…" | {"tests": […]}, "expected": 0|1}``.
A false positive is a verdict of 1 on a case labelled 0 (the verifier would reward a wrong answer);
a false negative the reverse. Verdicts that are not ``ok`` are counted apart (``not_ok``) and are
disagreements too: a verifier that cannot decide is not agreeing.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from rlpipe.rewards.pool import VerifierPool, VerifyItem


class LabelsError(ValueError):
    pass


def load_labels(path: str | Path) -> list[dict[str, Any]]:
    cases = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            c = json.loads(line)
        except json.JSONDecodeError as e:
            raise LabelsError(f"{path} line {n}: not JSON ({e.msg})") from None
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


def audit(cases: list[dict[str, Any]], pool: VerifierPool, threshold: float = 1.0) -> dict[str, Any]:
    """Per verifier: n, agreement, false positives/negatives, not-ok verdicts, and each disagreement.

    A verdict counts as 1 when reward >= ``threshold`` (code rewards are pass fractions)."""
    verdicts = pool.score([VerifyItem(c["task"], c["response"], c["ground_truth"]) for c in cases])
    per: dict[str, dict[str, Any]] = defaultdict(lambda: {"n": 0, "agree": 0, "false_positive": 0,
                                                           "false_negative": 0, "not_ok": 0, "disagreements": []})
    for c, v in zip(cases, verdicts):
        p = per[c["task"]]
        p["n"] += 1
        if v.status != "ok":
            p["not_ok"] += 1
            kind = "not_ok"
        else:
            said = int(v.reward is not None and v.reward >= threshold)
            if said == c["expected"]:
                p["agree"] += 1
                continue
            kind = "false_positive" if said == 1 else "false_negative"
            p[kind] += 1
        p["disagreements"].append({"line": c["line"], "kind": kind, "status": v.status, "reward": v.reward,
                                   "reason": v.reason, "response": c["response"][:120], "ground_truth": c["ground_truth"],
                                   "note": c.get("note")})
    out = {}
    for task, p in sorted(per.items()):
        p["agreement"] = round(p["agree"] / p["n"], 4) if p["n"] else None
        out[task] = p
    return out
