"""Every problem of a public code benchmark, as published, through rlpipe's `code` verifier.

For each problem: is the published reference accepted without edits (``check_reference``)? Then the
canonical program and up to two wrong ones (mutants of it: a comparison flipped, a constant moved, + and
- swapped; and an empty body) are judged twice, by rlpipe's sandboxed verifier (``scoring=all``) and by the
benchmark's own harness (the program, the test code and the check run together in one plain interpreter,
HumanEval's ``check(entry_point)`` / MBPP's asserts, 10 s timeout). Agreement is over the programs both
judged; a false positive is rlpipe passing a program the benchmark's harness fails.

    python benchmarks/published_code.py humaneval data/HumanEval.jsonl[.gz] [--limit N] [--out report.json]
    python benchmarks/published_code.py mbpp mbpp.jsonl
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from rlpipe.rewards import get_verifier  # noqa: E402

_FLIP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}


def _rows(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _mutants(program: str) -> list[str]:
    """Up to two programs that differ from ``program`` in one small place, plus one whose function returns None."""
    try:
        tree = ast.parse(program)
    except SyntaxError:
        return []
    out = []
    for kind in ("compare", "const", "binop"):
        t = ast.parse(program)
        for node in ast.walk(t):
            if kind == "compare" and isinstance(node, ast.Compare) and type(node.ops[0]) in _FLIP:
                node.ops[0] = _FLIP[type(node.ops[0])]()
                break
            if kind == "const" and isinstance(node, ast.Constant) and type(node.value) is int:
                node.value += 1
                break
            if kind == "binop" and isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
                node.op = ast.Sub() if isinstance(node.op, ast.Add) else ast.Add()
                break
        else:
            continue
        src = ast.unparse(t)
        if src != ast.unparse(tree) and src not in out:
            out.append(src)
        if len(out) == 2:
            break
    funcs = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    if funcs:
        out.append(program + f"\n\ndef {funcs[-1]}(*args, **kwargs):\n    return None\n")
    return out


def _humaneval(row: dict) -> tuple[dict, str, str]:
    ref = {"test": row["test"], "entry_point": row["entry_point"]}
    program = row["prompt"] + row["canonical_solution"]
    return ref, program, f"{row['test']}\ncheck({row['entry_point']})\n"


def _mbpp(row: dict) -> tuple[dict, str, str]:
    tests = row.get("test_list") or row["tests"]
    ref = {"tests": tests}
    setup = row.get("test_setup_code") or ""
    imports = row.get("test_imports") or []
    if setup:
        ref["test_setup_code"] = setup
    if imports:
        ref["test_imports"] = imports
    program = row.get("code") or row["canonical_solution"]
    return ref, program, "\n".join([*imports, setup, *tests]) + "\n"


def _their_verdict(program: str, check: str) -> bool | None:
    """The benchmark's own way: program + tests in one interpreter (a plain subprocess, trusted code)."""
    try:
        p = subprocess.run([sys.executable, "-c", program + "\n" + check], capture_output=True, timeout=10)
    except subprocess.TimeoutExpired:
        return False
    return p.returncode == 0


def run(fmt: str, path: Path, limit: int | None) -> dict:
    code = get_verifier("code")
    rows = _rows(path)[:limit]
    build = _humaneval if fmt == "humaneval" else _mbpp
    report = {"benchmark": fmt, "file": str(path), "problems": len(rows), "accepted": 0, "refused": [],
              "programs": 0, "agree": 0, "false_positive": [], "false_negative": [], "not_ok": [], "canonical_pass": 0}
    t0 = time.monotonic()
    for k, row in enumerate(rows, 1):
        ref, program, check = build(row)
        gt = json.dumps(ref)
        problem = code.check_reference(gt)
        pid = row.get("task_id", k)
        if problem:
            report["refused"].append({"id": pid, "why": problem[:200]})
            continue
        report["accepted"] += 1
        for n, prog in enumerate([program, *_mutants(program)]):
            theirs = _their_verdict(prog, check)
            ours = code(f"```python\n{prog}\n```", gt, scoring="all")
            report["programs"] += 1
            label = {"id": pid, "program": n, "reason": ours.reason[:200]}
            if ours.status != "ok":
                report["not_ok"].append(label)
            elif (ours.reward == 1.0) == theirs:
                report["agree"] += 1
                report["canonical_pass"] += int(n == 0 and theirs)
            elif ours.reward == 1.0:
                report["false_positive"].append(label)
            else:
                report["false_negative"].append(label)
        if k % 25 == 0 or k == len(rows):
            eta = (time.monotonic() - t0) / k * (len(rows) - k)
            print(f"{k}/{len(rows)} problems, {report['agree']}/{report['programs']} agree, ETA {eta:.0f} s", flush=True)
    report["seconds"] = round(time.monotonic() - t0, 1)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("format", choices=["humaneval", "mbpp"])
    ap.add_argument("path", type=Path)
    ap.add_argument("--limit", type=int)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    r = run(args.format, args.path, args.limit)
    n = max(r["programs"], 1)
    print(f"{r['benchmark']}: accepted {r['accepted']}/{r['problems']} ({100 * r['accepted'] / max(r['problems'], 1):.1f}%), "
          f"agreement {r['agree']}/{r['programs']} ({100 * r['agree'] / n:.1f}%), false positives {len(r['false_positive'])}, "
          f"false negatives {len(r['false_negative'])}, not ok {len(r['not_ok'])}, {r['seconds']} s")
    for key in ("refused", "false_positive", "false_negative", "not_ok"):
        for item in r[key][:10]:
            print(f"  {key}: {item}")
    if args.out:
        args.out.write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
