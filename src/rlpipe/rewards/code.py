"""Code verifiers: run model-written Python in the sandbox; nothing the program builds is compared where it could lie.

- ``code``: ``ground_truth`` is a code benchmark's tests *as published* (see :mod:`rlpipe.rewards.code_ref`
  for the keys: MBPP's ``tests``/``test_setup_code``/``test_imports``, HumanEval's ``test`` +
  ``entry_point``, APPS' ``input_output``) or rlpipe's stdin/stdout cases ``{"io": [...]}``. The
  response's program is the last fenced ```python block, else the whole text. Option ``scoring``:
  ``"fraction"`` (default; passed/total) or ``"all"`` (1.0 only when every test passes).
- ``python_expr``: ``ground_truth`` is the expected value's ``repr``; the response is one Python
  expression, evaluated in the sandbox without builtins; its ``repr`` comes back and is compared here.

**How a function test is judged.** Two interpreters run in one sandbox. The test harness runs the
test code (reference text: loops, seeded ``random``, helper functions, ``check(candidate)``) in its
own interpreter; every name the test takes from the program is a proxy there. The program runs in a
second, fresh interpreter (``__name__ == "__solution__"``, so its ``__main__`` block does not run),
which answers calls on a private pipe: the arguments go over as plain data, the result comes back as
plain data (tagged JSON: builtins and builtin types, ``Fraction``, ``Decimal``, ``Counter``,
``OrderedDict``, ``deque``, ``range``; subclasses as their base type's value; iterators, generators,
``map``/``filter``/``zip`` and dict views materialised as lists; a set rebuilt as a set literal is, so
int sets iterate in the same order). Anything else — an instance of the program's class, a regex
match — stays in the program's interpreter: the test holds a *handle* to it, which equals only a
handle to the same object and can only be passed back to the program (MBPP's ``Pair(5, 24)``), so it
never equals a value the test expects. A list, dict or set argument the function mutates comes
back mutated. Setup code that builds objects of the program's own classes runs in the program's
interpreter; the test holds them as handles too. The harness rebuilds real values and evaluates the
test on them, so a result cannot carry ``__eq__``, ``__bool__`` or any other code into the comparison. Each test has its own budget
(``test_s``; ``check_s`` for a whole HumanEval ``check``); a program that hangs is killed and, at
most ``RESTARTS`` times, started afresh for the next test.

**How an stdin/stdout case is judged.** One sandbox run per item: a trusted harness (main.py) forks
a child per case that runs the program as ``__main__`` with that case's input on stdin, under a
per-case time budget, and sends back its stdout, exit status and a stderr tail. Here the output is
compared with the expected one, token-wise per line: each line is split into whitespace-separated
tokens (so spacing inside a line, leading/trailing whitespace and ``\r\n`` vs ``\n`` do not matter),
trailing blank lines are dropped, and the lists of lines must then be equal. No numeric tolerance,
except for APPS' ``input_output``, whose own harness compares numbers with ``numpy.allclose``: there
two decimals within 1e-8 + 1e-5·|expected| are the same token (APPS' further fallbacks, which compare
lines as unordered sets of tokens, are not taken: they pay outputs in the wrong order). A
case passes only when the program also exited with status 0 within its budget.

**Threat model — protected.** The program never sees the test code, the expected values or the
report channel: the harness deletes the spec from disk and makes itself undumpable (so the program,
the same uid, cannot read its memory or open its fds through ``/proc``) before the program starts,
and drops the writable work dir from ``sys.path`` (a module the program writes there is never
imported by a test). Reports carry a nonce the program never sees. A program that forges reports,
replies before it is asked, patches its own interpreter, returns objects with rigged ``__eq__``,
subclasses builtins, raises or exits, or kills the harness can at most claim values it could have
returned anyway (see the forgery table in ``tests/rewards/test_code.py``).

**Not protected.** (1) A program that *guesses* the expected value passes that test (boolean tests,
tiny answer spaces, hard-coding visible inputs). (2) Whatever the test passes to the program is an
input it sees. (3) Side channels: timing, memory use, the order of calls. (4) A program can stop
(SIGSTOP) its harness: the verdict is then a timeout, never a pass. (5) Anything the sandbox itself
does not protect (see ``rlpipe.sandbox``).

**Verdict rule.** ``ok`` means the program was judged: what the program does wrong (syntax error,
exception, wrong value, a name the tests need that it does not define, its own budget
exceeded, memory limit, ending or killing the harness before it reports, flooding the output) is
reward 0 for the affected tests, status ``ok``. Failures of the verification itself — no sandbox,
sandbox setup failed, the sandbox launcher died, the harness never started, the sandbox's wall clock
hit while the harness still had budget — are ``error`` / ``timeout`` with a reason; a broken
reference (or a key no verifier reads) is ``error`` naming the problem. Every verdict carries the
sandbox ``isolation`` level (None where the sandbox never ran).
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
from typing import Any

from rlpipe.rewards.base import VerifyResult, register_verifier
from rlpipe.rewards.code_harness import CHECK_HARNESS, EXPR_HARNESS, IO_HARNESS, PROGRAM_SERVER
from rlpipe.rewards.code_ref import KEYS, Ref, RefError, Test, parse_reference, undefined_names

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)
MARK = "@@RLPIPE@@"
SANDBOX_SLACK_S = 4.0  # interpreter start-up inside the sandbox, beyond the harness's own budget
HARD_GRACE_S = 1.0  # the harness gives up on a phase that ignores its alarm this long after it
TEST_OUT_CAP = 256 * 1024  # serialised values of one test (bytes)
CASE_OUT_CAP = 1 << 20  # stdout of one stdin/stdout case (bytes)
SCORINGS = ("fraction", "all")

__all__ = ["KEYS", "code_tests", "extract_program", "python_expr", "undefined_names"]


def extract_program(response: str) -> str:
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


# --------------------------------------------------------------------------- running the sandbox

def _records(stdout: str, nonce: str) -> list[dict]:
    prefix = f"{MARK}{nonce} "
    out = []
    for line in stdout.split("\n"):
        if line.startswith(prefix):
            try:
                r = json.loads(line[len(prefix):])
            except (ValueError, RecursionError):
                continue
            if isinstance(r, dict):
                out.append(r)
    return out


def _sandbox_fault(res: Any, records: list[dict], harness_budget: float, t_call: float,
                   t_end: float) -> VerifyResult | None:
    """A verdict for failures of the verification itself; None when the program is to blame (or fine)."""
    tail = (res.stderr or "").rstrip().rsplit("\n", 1)[-1]
    if res.exit_code is None and "rlpipe.sandbox: no sandbox available" in tail:
        return VerifyResult(None, "error", "no sandbox available on this machine (see `rlpipe sandbox`)", None)
    if res.exit_code is None and res.status == "error":
        return VerifyResult(None, "error", f"sandbox setup failed: {tail[-200:]}", None)
    if res.exit_code is None and "the launcher died without a status report" in tail:
        return VerifyResult(None, "error", "the sandbox launcher died without a status report", res.isolation)
    start = records[0].get("t") if records and records[0].get("k") == "start" else None
    if not isinstance(start, (int, float)):
        status = "timeout" if res.status == "timeout" else "error"
        return VerifyResult(None, status, f"the verification harness never started (sandbox status {res.status}, "
                                          f"exit {res.exit_code}): {tail[-200:]}", res.isolation)
    in_harness = t_end - start if t_call - 1.0 <= start <= t_end else float("inf")
    if res.status == "timeout" and "wall-clock limit" in tail and in_harness < harness_budget:
        return VerifyResult(None, "timeout", f"the sandbox's wall clock ran out {in_harness:.1f} s into the harness's "
                                             f"{harness_budget:.1f} s budget", res.isolation)
    return None


def _sandbox(harness: str, files: dict[str, str], harness_budget: float, out_bytes: int) -> tuple[Any, list[dict]]:
    """(SandboxResult, records) or (VerifyResult for a failure of the verification, [])."""
    from rlpipe.sandbox import SandboxLimits, run_python

    nonce = secrets.token_hex(16)
    limits = SandboxLimits(wall_s=harness_budget + SANDBOX_SLACK_S, cpu_s=harness_budget + 2.0, memory_mb=256,
                           max_output_bytes=out_bytes)
    t_call = time.monotonic()
    try:
        res = run_python(harness, stdin=nonce + "\n", files=files, limits=limits)
    except Exception as e:  # noqa: BLE001 - SandboxUnavailableError (strict mode) or a sandbox bug
        return VerifyResult(None, "error", f"sandbox unavailable: {type(e).__name__}: {e}"[:300]), []
    records = _records(res.stdout, nonce)
    fault = _sandbox_fault(res, records, harness_budget, t_call, time.monotonic())
    return (fault, []) if fault else (res, records)


def _unfinished(res: Any, records: list[dict]) -> str:
    """Why the harness did not report everything (the program's doing: the harness had started)."""
    done = next((r for r in records if r.get("k") == "done"), None)
    if done is not None:
        return str(done.get("error") or "the harness's report is incomplete")[:200]
    if res.status == "memory":
        return "the program exceeded the memory limit"
    if res.status == "timeout":
        return "the program ran past its time budget without giving control back"
    if res.truncated:
        return "the program flooded the output"
    return f"the program ended the harness before it reported (status {res.status}, exit {res.exit_code})"


def _score(passed: list[bool], scoring: str, reason: str, isolation: str | None) -> VerifyResult:
    n, p = len(passed), sum(passed)
    reward = p / n if scoring == "fraction" else float(p == n)
    return VerifyResult(reward, "ok", f"{p}/{n} passed" + (f"; {reason}" if reason else ""), isolation)


# --------------------------------------------------------------------------- the verifiers

_BUDGETS = {"compile_s": 2.0, "run_s": 3.0, "test_s": 2.0, "check_s": 6.0, "case_s": 2.0}
_CASE_OVERHEAD_S = 0.5  # forking the program and reading its output, per io case (generous)
_TEARDOWN_S = 5.0  # killing the sandbox after its wall clock, parsing and judging here
RESTARTS = 2  # fresh program interpreters after one died or was killed for its time


def _seconds(t: Test, b: dict[str, float]) -> float:
    return b["check_s"] if t.kind == "check" else b["test_s"]


def _harness_budget(ref: Ref, b: dict[str, float]) -> float:
    if ref.kind == "io":
        return len(ref.cases) * (b["case_s"] + _CASE_OVERHEAD_S) + 1.0
    # per test: its budget + reporting; per (re)start of the program: compiling and running it
    starts = (1 + min(RESTARTS, len(ref.tests))) * (b["compile_s"] + b["run_s"] + 0.5)
    return 1.0 + starts + HARD_GRACE_S + sum(_seconds(t, b) + 0.2 for t in ref.tests)


def _code_budget(ground_truth: str | None, **options: Any) -> float:
    try:
        ref = parse_reference(ground_truth)
    except RefError:
        return 1.0
    b = {**_BUDGETS, **{k: v for k, v in options.items() if k in _BUDGETS}}
    return _harness_budget(ref, b) + SANDBOX_SLACK_S + _TEARDOWN_S


def _code_check(ground_truth: str | None, scoring: str = "fraction", **_: Any) -> str | None:
    if scoring not in SCORINGS:
        return f"option scoring={scoring!r} is not one of {SCORINGS}"
    try:
        parse_reference(ground_truth)
    except RefError as e:
        return str(e)
    return None


def _run_tests(program: str, ref: Ref, b: dict[str, float]) -> tuple[list[bool], str, Any]:
    tests = [{"i": i, "kind": t.kind, "code": t.source, "args": t.args, "expected": t.expected, "s": _seconds(t, b)}
             for i, t in enumerate(ref.tests)]
    spec = {"tests": tests, "setup": ref.setup, "names": list(ref.names), "entry_point": ref.entry_point,
            "compile_s": b["compile_s"], "run_s": b["run_s"], "hard_grace_s": HARD_GRACE_S, "out_cap": TEST_OUT_CAP,
            "restarts": RESTARTS}
    files = {"solution.py": program, "spec.json": json.dumps(spec), "server.py": PROGRAM_SERVER}
    if ref.program_setup:
        files["setup.py"] = ref.program_setup
    out_bytes = min(len(tests) * 1024 + 8192, 8 << 20)
    res, records = _sandbox(CHECK_HARNESS, files, _harness_budget(ref, b), out_bytes)
    if isinstance(res, VerifyResult):
        return [], "", res
    broken = next((r for r in records if r.get("k") == "broken"), None)
    if broken is not None:  # the harness could not set itself up: a failure of the verification, never a 0
        return [], "", VerifyResult(None, "error", f"the test harness failed: {str(broken.get('error'))[:250]}", res.isolation)
    fatal = next((r for r in records if r.get("k") == "fatal"), None)
    got: dict[int, dict] = {}
    for r in records:
        if r.get("k") == "test" and type(r.get("i")) is int and 0 <= r["i"] < len(tests):
            got.setdefault(r["i"], r)
    passed, why = [], ""
    for i, t in enumerate(ref.tests):
        r = got.get(i)
        if r is None:
            ok, err = False, str(fatal.get("error"))[:300] if fatal else _unfinished(res, records)
        else:
            ok, err = r.get("ok") is True, f"{t.source[:80]}: {str(r.get('error'))[:200]}"
        passed.append(ok)
        why = why or ("" if ok else err)
    return passed, why, res


def _tokens(text: str) -> list[list[str]]:
    lines = [line.split() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _close(a: str, b: str) -> bool:
    """Two output tokens: equal, or both numbers with a decimal point within APPS' tolerance
    (``numpy.allclose``: |a - b| <= 1e-8 + 1e-5 |b|)."""
    if a == b:
        return True
    if "." not in a + b:
        return False
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return math.isfinite(x) and math.isfinite(y) and abs(x - y) <= 1e-8 + 1e-5 * abs(y)


def same_output(out: str, expected: str, float_tol: bool = False) -> bool:
    """Token-wise per line (see the module docstring); with ``float_tol`` decimals may differ within APPS' tolerance."""
    got, want = _tokens(out), _tokens(expected)
    if got == want:
        return True
    if not float_tol or len(got) != len(want):
        return False
    return all(len(g) == len(w) and all(_close(a, b) for a, b in zip(g, w)) for g, w in zip(got, want))


def _run_io(program: str, cases: tuple[tuple[str, str], ...], case_s: float,
            float_tol: bool = False) -> tuple[list[bool], str, Any]:
    spec = {"inputs": [c[0] for c in cases], "case_s": case_s, "out_cap": CASE_OUT_CAP}
    budget = _harness_budget(Ref("io", cases=cases), {**_BUDGETS, "case_s": case_s})
    out_bytes = min(len(cases) * (2 * CASE_OUT_CAP + 1024) + 4096, 64 << 20)
    res, records = _sandbox(IO_HARNESS, {"solution.py": program, "spec.json": json.dumps(spec)}, budget, out_bytes)
    if isinstance(res, VerifyResult):
        return [], "", res
    got: dict[int, dict] = {}
    for r in records:
        if r.get("k") == "case" and type(r.get("i")) is int and 0 <= r["i"] < len(cases):
            got.setdefault(r["i"], r)
    passed, why = [], ""
    for i, (_, expected) in enumerate(cases):
        r = got.get(i)
        if r is None:
            ok, err = False, _unfinished(res, records)
        elif r.get("rc") == "timeout":
            ok, err = False, f"case {i}: ran past its {case_s:g} s budget"
        elif r.get("big"):
            ok, err = False, f"case {i}: output larger than {CASE_OUT_CAP} bytes"
        elif r.get("rc") != 0:
            ok, err = False, f"case {i}: exit status {r.get('rc')}: {str(r.get('err'))[-150:]}"
        else:
            ok = isinstance(r.get("out"), str) and same_output(r["out"], expected, float_tol)
            err = f"case {i}: wrong output {str(r.get('out'))[:60]!r}"
        passed.append(ok)
        why = why or ("" if ok else err)
    return passed, why, res


@register_verifier("code", version="3", budget_s=_code_budget, check_reference=_code_check, options=("scoring",),
                   sandboxed=True)
def code_tests(response: str, ground_truth: str | None, scoring: str = "fraction", **budgets: float) -> VerifyResult:
    """Function tests or stdin/stdout cases; ``budgets``: compile_s, run_s, test_s, case_s (direct callers)."""
    if scoring not in SCORINGS:
        return VerifyResult(None, "error", f"option scoring={scoring!r} is not one of {SCORINGS}")
    unknown = set(budgets) - set(_BUDGETS)
    if unknown:
        return VerifyResult(None, "error", f"unknown option(s) {sorted(unknown)}")
    b = {**_BUDGETS, **budgets}
    try:
        ref = parse_reference(ground_truth)
    except RefError as e:
        return VerifyResult(None, "error", f"reference: {e}"[:400])
    program = extract_program(response)
    if not program.strip():
        return VerifyResult(0.0, "ok", "empty program")
    if ref.kind == "io":
        passed, why, res = _run_io(program, ref.cases, b["case_s"], ref.float_tol)
    else:
        passed, why, res = _run_tests(program, ref, b)
    if isinstance(res, VerifyResult):
        return res
    return _score(passed, scoring, why[:300], res.isolation)


def _expr_check(ground_truth: str | None, **_: Any) -> str | None:
    return None if ground_truth and ground_truth.strip() else "no expected value: give the expected value's repr"


@register_verifier("python_expr", version="2", budget_s=lambda gt, budget_s=1.0, **_: budget_s + 1.0 + SANDBOX_SLACK_S
                   + _TEARDOWN_S, check_reference=_expr_check, sandboxed=True)
def python_expr(response: str, ground_truth: str | None, budget_s: float = 1.0) -> VerifyResult:
    """The expression's repr comes back from the sandbox; it is compared with the expected repr here."""
    problem = _expr_check(ground_truth)
    if problem:
        return VerifyResult(None, "error", problem)
    expr = response.strip()
    if not expr:
        return VerifyResult(0.0, "ok", "empty expression")
    spec = json.dumps({"budget_s": budget_s})
    res, records = _sandbox(EXPR_HARNESS, {"solution.py": expr, "spec.json": spec}, budget_s + 1.0, 1 << 20)
    if isinstance(res, VerifyResult):
        return res
    got = next((r for r in records if r.get("k") == "result"), None)
    if got is None:
        return VerifyResult(0.0, "ok", _unfinished(res, records), res.isolation)
    if "error" in got or not isinstance(got.get("repr"), str):
        return VerifyResult(0.0, "ok", str(got.get("error"))[:200], res.isolation)
    return VerifyResult(float(got["repr"] == ground_truth.strip()), "ok", f"value {got['repr'][:60]}", res.isolation)
