"""Code verifiers: run model-written Python in the sandbox, never in this process.

- ``code``: ``ground_truth`` is ``{"tests": ["assert f(1) == 2", …]}`` (or a bare list of tests). The
  response's program (the last fenced ```python block, else the whole text) is compiled, run and
  then each test runs against its namespace, with separate time budgets for compile/import, run
  and each test. Reward = fraction of tests passed.
- ``python_expr``: ``ground_truth`` is the expected value's ``repr``; the response is a single
  Python expression evaluated in the sandbox. Reward 1 when ``repr(value)`` matches.

What the model's code does (syntax error, exception, endless loop inside a phase budget, using too
much memory, ending the process before the harness reports) is the model's failure: reward 0,
status ``ok``, with the reason. Only a failure of the verification itself (the sandbox's wall
clock, a sandbox that cannot start) yields ``timeout`` or ``error``.

Verdict forgery: the harness runs the program in its own process, so the program could print a
verdict line itself. Each run gets a random nonce, read by the harness from stdin before any
model code runs; only a verdict line carrying it counts. Code that deliberately searches the
harness's memory for the nonce could still forge one; tests of code you cannot afford to have
gamed should run in a separate process from the code under test.
"""

from __future__ import annotations

import json
import re
import secrets

from rlpipe.rewards.base import VerifyResult, register_verifier

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)
MARK = "@@RLPIPE_VERDICT@@"

# Runs inside the sandbox with the system python. Budgets are enforced with SIGALRM per phase
# (the sandbox's own wall-clock limit is the backstop for anything that ignores signals).
HARNESS = r'''
import json, signal, sys
MARK = "@@RLPIPE_VERDICT@@" + sys.stdin.readline().strip()
spec = json.load(open("spec.json"))
src = open("solution.py").read()

class Budget(Exception):
    pass

def _alarm(signum, frame):
    raise Budget()

signal.signal(signal.SIGALRM, _alarm)

def phase(seconds, fn):
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)

def report(**kw):
    sys.stdout.write("\n" + MARK + json.dumps(kw) + "\n")
    sys.stdout.flush()

ns = {"__name__": "__solution__"}
try:
    code = phase(spec["compile_s"], lambda: compile(src, "solution.py", "exec"))
except Budget:
    report(phase="compile", passed=0, total=len(spec["tests"]), error="compile took too long"); sys.exit(0)
except (SyntaxError, ValueError) as e:
    report(phase="compile", passed=0, total=len(spec["tests"]), error=f"{type(e).__name__}: {e}"[:300]); sys.exit(0)
try:
    phase(spec["run_s"], lambda: exec(code, ns))
except Budget:
    report(phase="run", passed=0, total=len(spec["tests"]), error="program ran past its time budget"); sys.exit(0)
except BaseException as e:
    report(phase="run", passed=0, total=len(spec["tests"]), error=f"{type(e).__name__}: {e}"[:300]); sys.exit(0)
passed, first_error = 0, None
for t in spec["tests"]:
    try:
        phase(spec["test_s"], lambda: exec(compile(t, "test", "exec"), dict(ns)))
        passed += 1
    except Budget:
        first_error = first_error or f"{t[:80]}: ran past its time budget"
    except BaseException as e:
        first_error = first_error or f"{t[:80]}: {type(e).__name__}: {e}"[:300]
report(phase="tests", passed=passed, total=len(spec["tests"]), error=first_error)
'''

EXPR_HARNESS = r'''
import json, signal, sys
MARK = "@@RLPIPE_VERDICT@@" + sys.stdin.readline().strip()
src = open("solution.py").read().strip()
signal.signal(signal.SIGALRM, lambda s, f: (_ for _ in ()).throw(TimeoutError("expression ran past its time budget")))
signal.setitimer(signal.ITIMER_REAL, float(sys.argv[1]))
try:
    value = eval(compile(src, "<expr>", "eval"), {"__builtins__": {}}, {})
    out = {"repr": repr(value)}
except BaseException as e:
    out = {"error": f"{type(e).__name__}: {e}"[:200]}
signal.setitimer(signal.ITIMER_REAL, 0)
sys.stdout.write("\n" + MARK + json.dumps(out) + "\n")
'''


def extract_program(response: str) -> str:
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def _verdict(stdout: str, nonce: str) -> dict | None:
    mark = MARK + nonce
    for line in reversed(stdout.splitlines()):
        if line.startswith(mark):
            try:
                return json.loads(line[len(mark):])
            except json.JSONDecodeError:
                return None
    return None


def _no_verdict(res, what: str) -> VerifyResult:
    """The harness did not report. The sandbox's own wall clock is the verifier's failure; anything
    else (memory, the process ended or was killed early) was caused by the code under test."""
    if res.status == "timeout":
        return VerifyResult(None, "timeout", f"sandbox wall clock exceeded ({res.wall_s:.1f} s)")
    if "rlpipe.sandbox: sandbox setup failed" in (res.stderr or ""):
        return VerifyResult(None, "error", f"sandbox failed: {res.stderr[-200:]}")
    if res.status == "memory":
        return VerifyResult(0.0, "ok", f"{what} exceeded the memory limit")
    return VerifyResult(0.0, "ok", f"{what} ended before the harness could report (status {res.status}, exit {res.exit_code})")


def _limits(**budget: float):
    from rlpipe.sandbox import SandboxLimits

    total = sum(budget.values())
    return SandboxLimits(wall_s=total + 5.0, cpu_s=total + 2.0, memory_mb=256, max_output_bytes=16384)


@register_verifier("code", version="1")
def code_tests(response: str, ground_truth: str | None, compile_s: float = 2.0, run_s: float = 3.0,
               test_s: float = 2.0) -> VerifyResult:
    try:
        spec = json.loads(ground_truth or "")
    except json.JSONDecodeError:
        return VerifyResult(None, "error", "ground_truth/tests must be JSON: {\"tests\": [...]} or a list")
    tests = spec.get("tests") if isinstance(spec, dict) else spec
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        return VerifyResult(None, "error", "no tests: give a non-empty list of test statements")
    program = extract_program(response)
    if not program.strip():
        return VerifyResult(0.0, "ok", "empty program")
    from rlpipe.sandbox import run_python

    budget = {"compile_s": compile_s, "run_s": run_s, "test_s": test_s * len(tests)}
    nonce = secrets.token_hex(16)
    res = run_python(HARNESS, stdin=nonce + "\n", files={"solution.py": program,
                                     "spec.json": json.dumps({"tests": tests, "compile_s": compile_s, "run_s": run_s, "test_s": test_s})},
                     limits=_limits(**budget))
    verdict = _verdict(res.stdout, nonce)
    if verdict is None:
        return _no_verdict(res, "program")
    reward = verdict["passed"] / max(verdict["total"], 1)
    reason = f"{verdict['phase']}: {verdict['passed']}/{verdict['total']} passed"
    if verdict.get("error"):
        reason += f"; {verdict['error']}"
    return VerifyResult(reward, "ok", reason[:300])


@register_verifier("python_expr", version="1")
def python_expr(response: str, ground_truth: str | None, budget_s: float = 1.0) -> VerifyResult:
    if ground_truth is None:
        return VerifyResult(None, "error", "no expected value")
    expr = response.strip()
    if not expr:
        return VerifyResult(0.0, "ok", "empty expression")
    from rlpipe.sandbox import run_python

    nonce = secrets.token_hex(16)
    res = run_python(EXPR_HARNESS, stdin=nonce + "\n", files={"solution.py": expr}, argv=[str(budget_s)],
                     limits=_limits(run_s=budget_s))
    verdict = _verdict(res.stdout, nonce)
    if verdict is None:
        return _no_verdict(res, "expression")
    if "error" in verdict:
        return VerifyResult(0.0, "ok", verdict["error"])
    return VerifyResult(float(verdict["repr"] == ground_truth.strip()), "ok", f"value {verdict['repr'][:60]}")
