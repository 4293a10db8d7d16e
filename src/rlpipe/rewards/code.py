"""Code verifiers: run model-written Python in the sandbox; judge its results *outside* it.

- ``code``: ``ground_truth`` is either function tests, ``{"tests": ["assert f(1) == 2", …]}`` (or a
  bare list), or stdin/stdout cases, ``{"io": [{"input": "1 2\\n", "output": "3\\n"}, …]}``. The
  response's program is the last fenced ```python block, else the whole text. Option ``scoring``:
  ``"fraction"`` (default; passed/total) or ``"all"`` (1.0 only when every test passes).
- ``python_expr``: ``ground_truth`` is the expected value's ``repr``; the response is one Python
  expression, evaluated in the sandbox without builtins; its ``repr`` comes back and is compared here.

**How a function test is judged.** Each test must be one ``assert <expr>`` statement. It is parsed
here, in the trusted process, and split: the sub-expressions that use the program's names (anything
but literals, the safe builtins of ``SAFE_NAMES`` and ``math``) are *operands*; only they go into the
sandbox, where the harness runs the program (compile, run, then each test's operands, each phase
under its own SIGALRM budget) and serialises every operand's value as a plain literal: exact
builtin types only (``type(x) is int``, not ``isinstance``: subclasses and custom objects are "not a
plain value" and fail the test). Here the values are rebuilt from a tagged JSON form and the rest of
the test (the comparison, ``abs(…) < 1e-6``, ``not``, ``in``, ``sorted(…)``…) is evaluated with
ordinary Python semantics on plain values, with the real builtins (a safe builtin's name in a test
always means the builtin, even if the program defines one of that name; the program is executed as
module ``__solution__``, so its ``if __name__ == "__main__":`` block does not run). Comprehensions whose body calls
the program are unrolled here first (``all(f(x) == 2 * x for x in range(3))`` becomes
``all([f(0) == 0, f(1) == 2, f(2) == 4])``), so their loop and conditions never run in the sandbox.
Tests that cannot be split safely are rejected by ``check_reference`` (see ``_split``).

**How an stdin/stdout case is judged.** One sandbox run per item: a trusted harness (main.py) forks
a child per case that runs the program as ``__main__`` with that case's input on stdin, under a
per-case time budget, and sends back its stdout, exit status and a stderr tail (a fork costs a few
ms a case; a fresh interpreter per case cost 50-100 ms, a sandbox run per case ~80-150 ms). Here
the output is compared with the expected one, token-wise per line: each line is split into
whitespace-separated tokens (so spacing inside a line, leading/trailing whitespace and ``\r\n``
vs ``\n`` do not matter), trailing blank lines are dropped, and the lists of lines must then be
equal (a line break where a space was expected fails; blank lines elsewhere count). No numeric
tolerance. A case passes only when the program also exited with status 0 within its budget.

**Threat model — protected.** Expected values and expected outputs never enter the sandbox, and no
verdict is computed there: the harness only reports values/outputs, so a program that forges the
report (prints fake lines, finds the nonce and the harness's output fd, patches the harness through
``sys.modules['__main__']``, monkeypatches builtins, defines ``__eq__``/``__bool__``/``__hash__`` on
its results, subclasses int/str/list, raises or exits early) can at most claim values it could have
returned anyway; it cannot learn the expected ones from the spec on disk or from the harness.
Operands whose value is shaped by the test (loops) are evaluated here, not there.

**Not protected.** (1) A program that *guesses* the expected value passes that test: boolean tests
(``assert is_prime(7)``), ``assert f(x) is not None`` or tests over tiny answer spaces are cheap to
guess, and a program may special-case the visible test inputs (hard-coding). (2) Inside an operand,
everything the test passes to the program is an input the program sees; we reject the usual way an
expected value leaks in (a comparison or arithmetic mixing a program value with test data inside a
call to the program, e.g. ``check(f(x) - 3)``), but a test such as ``assert check(f(x), 4)`` hands
``4`` to the program's ``check``. (3) Side channels: timing, memory use, the order of operations;
the inputs of all tests are visible to the program. (4) Anything the sandbox itself does not protect
(see ``rlpipe.sandbox``). (5) Values that are not plain (custom classes, numpy arrays, generators)
always fail, so tasks whose answers are objects need tests that convert them inside the call.

**Verdict rule.** ``ok`` means the program was judged: what the program does wrong (syntax error,
exception, wrong or non-plain value, its own budget exceeded even if it catches the budget
exception, memory limit, ending or killing the harness before it reports, flooding the output) is
reward 0 for the affected tests, status ``ok``. Failures of the verification itself — no sandbox,
sandbox setup failed, the sandbox launcher died, the harness never started, the sandbox's wall clock
hit while the harness still had budget — are ``error`` / ``timeout`` with a reason; a broken
reference is ``error`` naming the problem. Every verdict carries the sandbox ``isolation`` level
(None where the sandbox never ran).
"""

from __future__ import annotations

import functools
import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from rlpipe.rewards.base import VerifyResult, register_verifier
from rlpipe.rewards.code_harness import EXPR_HARNESS, FUNC_HARNESS, IO_HARNESS
from rlpipe.rewards.code_split import SAFE_NAMES, _compile_test, _judge, _RefError, _Test

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)
MARK = "@@RLPIPE@@"
SANDBOX_SLACK_S = 4.0  # interpreter start-up inside the sandbox, beyond the harness's own budget
HARD_GRACE_S = 1.0  # the harness gives up on a phase that ignores its alarm this long after it
TEST_OUT_CAP = 256 * 1024  # serialised values of one test (bytes)
CASE_OUT_CAP = 1 << 20  # stdout of one stdin/stdout case (bytes)
MAX_TESTS = 1000
SCORINGS = ("fraction", "all")

__all__ = ["SAFE_NAMES", "code_tests", "extract_program", "python_expr"]


def extract_program(response: str) -> str:
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


# --------------------------------------------------------------------------- references

@dataclass(frozen=True)
class _Ref:
    kind: str  # "tests" | "io"
    tests: tuple[_Test, ...] = ()
    cases: tuple[tuple[str, str], ...] = ()


def _parse_io(cases: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(cases, list) or not cases:
        raise _RefError('"io" must be a non-empty list of {"input": "...", "output": "..."}')
    if len(cases) > MAX_TESTS:
        raise _RefError(f"{len(cases)} io cases; at most {MAX_TESTS}")
    out = []
    for i, c in enumerate(cases):
        if not (isinstance(c, dict) and isinstance(c.get("input"), str) and isinstance(c.get("output"), str)):
            raise _RefError(f'io case {i} must be {{"input": <str>, "output": <str>}}, got {str(c)[:80]}')
        out.append((c["input"], c["output"]))
    return tuple(out)


@functools.lru_cache(maxsize=512)
def _parse_reference(ground_truth: str | None) -> _Ref:
    """The parsed, split reference; raises _RefError saying what is wrong with it."""
    try:
        spec = json.loads(ground_truth or "")
    except (json.JSONDecodeError, RecursionError) as e:
        raise _RefError(f'ground truth is not JSON ({getattr(e, "msg", e)}): give {{"tests": [...]}}, '
                        'a list of tests, or {"io": [...]}') from None
    if isinstance(spec, dict) and "io" in spec:
        return _Ref("io", cases=_parse_io(spec["io"]))
    tests = spec.get("tests") if isinstance(spec, dict) else spec
    if not isinstance(tests, list) or not tests:
        raise _RefError('no tests: give {"tests": ["assert f(1) == 2", ...]} (non-empty), a list of tests, '
                        'or {"io": [{"input": ..., "output": ...}]}')
    if len(tests) > MAX_TESTS:
        raise _RefError(f"{len(tests)} tests; at most {MAX_TESTS}")
    if not all(isinstance(t, str) for t in tests):
        raise _RefError("every test must be a string holding one `assert <expr>` statement")
    return _Ref("tests", tests=tuple(_compile_test(i, t) for i, t in enumerate(tests)))


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

_BUDGETS = {"compile_s": 2.0, "run_s": 3.0, "test_s": 2.0, "case_s": 2.0}
_CASE_OVERHEAD_S = 0.5  # forking the program and reading its output, per io case (generous)
_TEARDOWN_S = 5.0  # killing the sandbox after its wall clock, parsing and judging here


def _harness_budget(ref: _Ref, compile_s: float, run_s: float, test_s: float, case_s: float) -> float:
    if ref.kind == "io":
        return len(ref.cases) * (case_s + _CASE_OVERHEAD_S) + 1.0
    # per test: its budget + describing an exception (0.2 s); once: a phase that ignores its alarm
    return compile_s + run_s + 0.5 + HARD_GRACE_S + len(ref.tests) * (test_s + 0.3)


def _code_budget(ground_truth: str | None, compile_s: float = 2.0, run_s: float = 3.0, test_s: float = 2.0,
                 case_s: float = 2.0, **_: Any) -> float:
    try:
        ref = _parse_reference(ground_truth)
    except _RefError:
        return 1.0
    return _harness_budget(ref, compile_s, run_s, test_s, case_s) + SANDBOX_SLACK_S + _TEARDOWN_S


def _code_check(ground_truth: str | None, scoring: str = "fraction", **_: Any) -> str | None:
    if scoring not in SCORINGS:
        return f"option scoring={scoring!r} is not one of {SCORINGS}"
    try:
        _parse_reference(ground_truth)
    except _RefError as e:
        return str(e)
    return None


def _run_tests(program: str, tests: tuple[_Test, ...], b: dict[str, float]) -> tuple[list[bool], str, Any]:
    spec = {"tests": [t.operands for t in tests], "compile_s": b["compile_s"], "run_s": b["run_s"],
            "test_s": b["test_s"], "hard_grace_s": HARD_GRACE_S, "out_cap": TEST_OUT_CAP,
            "safe": sorted(SAFE_NAMES - {"math"})}
    budget = _harness_budget(_Ref("tests", tests=tests), b["compile_s"], b["run_s"], b["test_s"], b["case_s"])
    out_bytes = min(len(tests) * (2 * TEST_OUT_CAP + 256) + 4096, 32 << 20)
    res, records = _sandbox(FUNC_HARNESS, {"solution.py": program, "spec.json": json.dumps(spec)}, budget, out_bytes)
    if isinstance(res, VerifyResult):
        return [], "", res
    fatal = next((r for r in records if r.get("k") == "fatal"), None)
    got: dict[int, dict] = {}
    for r in records:
        if r.get("k") == "test" and type(r.get("i")) is int and 0 <= r["i"] < len(tests):
            got.setdefault(r["i"], r)
    passed, why = [], ""
    for i, t in enumerate(tests):
        r = got.get(i)
        if r is None:
            ok, err = False, str(fatal.get("error"))[:300] if fatal else _unfinished(res, records)
        elif "error" in r or not isinstance(r.get("v"), str):
            ok, err = False, f"{t.source[:80]}: {str(r.get('error'))[:200]}"
        else:
            ok, err = _judge(t, r["v"])
            err = f"{t.source[:80]}: {err}"
        passed.append(ok)
        why = why or ("" if ok else err)
    return passed, why, res


def _tokens(text: str) -> list[list[str]]:
    lines = [line.split() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _run_io(program: str, cases: tuple[tuple[str, str], ...], case_s: float) -> tuple[list[bool], str, Any]:
    spec = {"inputs": [c[0] for c in cases], "case_s": case_s, "out_cap": CASE_OUT_CAP}
    budget = _harness_budget(_Ref("io", cases=cases), 0, 0, 0, case_s)
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
            ok = isinstance(r.get("out"), str) and _tokens(r["out"]) == _tokens(expected)
            err = f"case {i}: wrong output {str(r.get('out'))[:60]!r}"
        passed.append(ok)
        why = why or ("" if ok else err)
    return passed, why, res


@register_verifier("code", version="2", budget_s=_code_budget, check_reference=_code_check, options=("scoring",),
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
        ref = _parse_reference(ground_truth)
    except _RefError as e:
        return VerifyResult(None, "error", f"reference: {e}"[:400])
    program = extract_program(response)
    if not program.strip():
        return VerifyResult(0.0, "ok", "empty program")
    if ref.kind == "io":
        passed, why, res = _run_io(program, ref.cases, b["case_s"])
    else:
        passed, why, res = _run_tests(program, ref.tests, b)
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
