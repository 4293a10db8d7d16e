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

import ast
import builtins
import copy
import functools
import json
import math
import re
import secrets
import time
import types
from dataclasses import dataclass
from typing import Any

from rlpipe.rewards.base import VerifyResult, register_verifier

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)
MARK = "@@RLPIPE@@"
SANDBOX_SLACK_S = 4.0  # interpreter start-up inside the sandbox, beyond the harness's own budget
HARD_GRACE_S = 1.0  # the harness gives up on a phase that ignores its alarm this long after it
TEST_OUT_CAP = 256 * 1024  # serialised values of one test (bytes)
CASE_OUT_CAP = 1 << 20  # stdout of one stdin/stdout case (bytes)
MAX_TESTS = 1000
MAX_UNROLL = 1000  # cases one comprehension may unroll into
SCORINGS = ("fraction", "all")

SAFE_NAMES = frozenset({
    "abs", "all", "any", "bool", "bytes", "chr", "complex", "dict", "divmod", "enumerate", "filter",
    "float", "frozenset", "int", "isinstance", "len", "list", "map", "max", "min", "ord", "pow", "range",
    "repr", "reversed", "round", "set", "sorted", "str", "sum", "tuple", "type", "zip", "math",
})


class _RefError(ValueError):
    """The reference (ground truth) cannot be used; the message says why."""


class _Costly(Exception):
    """Evaluating a test here would take too much time or memory (a pathological value)."""


def extract_program(response: str) -> str:
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


# --------------------------------------------------------------------------- harnesses (sandbox side)

_PRELUDE = r'''
import json, os, sys, time
_write, _exit, _mono, _dumps = os.write, os._exit, time.monotonic, json.dumps
NONCE = sys.stdin.readline().strip()
OUT = os.dup(1)

def emit(_ascii=True, **kw):
    data = ("\n@@RLPIPE@@" + NONCE + " " + _dumps(kw, ensure_ascii=_ascii) + "\n").encode("utf-8", "replace")
    while data:
        data = data[_write(OUT, data):]

emit(k="start", t=_mono())
spec = json.load(open("spec.json"))
'''

# Function tests. The program runs in this process (it must: the operands call it); its stdout goes
# to /dev/null, the report to a private dup of the real stdout. Only values are reported.
FUNC_HARNESS = _PRELUDE + r'''
import builtins, math, signal
_type, _hex, _repr, _len, _eval, _compile = type, hex, repr, len, eval, compile
_CLEAN = dict(builtins.__dict__)
_null = os.open(os.devnull, os.O_WRONLY)
os.dup2(_null, 1)

class Budget(BaseException):
    pass

state = {"active": False, "hard": 0.0, "what": ""}

def _alarm(signum, frame):
    if state["active"] and _mono() > state["hard"]:
        emit(k="done", error=state["what"] + " did not give control back after its time budget")
        _exit(0)
    if state["active"]:
        raise Budget()

signal.signal(signal.SIGALRM, _alarm)

def phase(what, seconds, fn):
    state.update(what=what, hard=_mono() + seconds + spec["hard_grace_s"], active=True)
    t0 = _mono()
    signal.setitimer(signal.ITIMER_REAL, seconds, 0.05)
    try:
        out = fn()
    finally:
        state["active"] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
    if _mono() - t0 > seconds:
        raise Budget()
    return out

def describe(e):
    try:
        return phase("describing an exception", 0.2, lambda: (_type(e).__name__ + ": " + str(e))[:300])
    except BaseException:
        return "exception"

_SEQ = {list: "l", tuple: "t", set: "S", frozenset: "F"}

def enc(x, depth=0):
    if depth > 100:
        raise ValueError("value nested too deeply")
    t = _type(x)
    if x is None or t is bool:
        return x
    if t is int:
        return ["i", _hex(x)]
    if t is float:
        return ["f", _repr(x)]
    if t is complex:
        return ["c", _repr(x.real), _repr(x.imag)]
    if t is str:
        return ["s", x]
    if t is bytes:
        return ["y", x.hex()]
    if t in _SEQ:
        return [_SEQ[t], [enc(y, depth + 1) for y in x]]
    if t is dict:
        return ["d", [[enc(k, depth + 1), enc(v, depth + 1)] for k, v in x.items()]]
    raise TypeError("not a plain value: " + t.__name__)

src = open("solution.py").read()
ns = {"__name__": "__solution__"}
try:
    code = phase("compiling the program", spec["compile_s"], lambda: compile(src, "solution.py", "exec"))
    phase("running the program", spec["run_s"], lambda: exec(code, ns))
except Budget:
    emit(k="fatal", error="the program ran past its time budget"); _exit(0)
except BaseException as e:
    emit(k="fatal", error=describe(e)); _exit(0)
for i, ops in enumerate(spec["tests"]):
    env = dict(ns)
    env.update({n: _CLEAN[n] for n in spec["safe"] if n in _CLEAN})
    env["math"] = math
    def run_ops():
        vals = [enc(_eval(_compile(o, "<test %d>" % i, "eval"), env)) for o in ops]
        out = _dumps(vals)
        if _len(out) > spec["out_cap"]:
            raise ValueError("value too large (%d bytes serialised)" % _len(out))
        return out
    try:
        emit(k="test", i=i, v=phase("test %d" % i, spec["test_s"], run_ops))
    except Budget:
        emit(k="test", i=i, error="ran past its time budget")
    except BaseException as e:
        emit(k="test", i=i, error=describe(e))
emit(k="done")
_exit(0)
'''

# stdin/stdout cases: the program runs in a forked child per case (a fresh copy of this harness, which
# holds nothing secret), as ``__main__`` with the case's files as fds 0/1/2; this process never runs it.
IO_HARNESS = _PRELUDE + r"""
import builtins, signal, traceback
src = open("solution.py").read()

def child(i):
    for fd, name, flags in ((0, "in%d.txt", os.O_RDONLY), (1, "out%d.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, "err%d.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        os.dup2(os.open(name % i, flags, 0o600), fd)
    os.close(OUT)
    sys.stdin, sys.stdout, sys.stderr = open(0, "r"), open(1, "w"), open(2, "w")
    sys.argv = ["solution.py"]
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    rc = 0
    try:
        exec(compile(src, "solution.py", "exec"), {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as e:
        rc = e.code if type(e.code) is int else 0 if e.code is None else 1
        if rc == 1 and e.code is not None:
            sys.stderr.write(str(e.code) + "\n")
    except BaseException:
        traceback.print_exc()
        rc = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        rc = rc or 1
    _exit(rc & 0xFF)

def run_case(i):
    pid = os.fork()
    if pid == 0:
        try:
            child(i)
        finally:
            _exit(1)
    deadline, pause = _mono() + spec["case_s"], 0.001
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if _mono() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(pause)
        pause = min(pause * 2, 0.005)

for i, text in enumerate(spec["inputs"]):
    with open("in%d.txt" % i, "w") as f:
        f.write(text)
for i in range(len(spec["inputs"])):
    t0 = _mono()
    rc = run_case(i)
    with open("out%d.txt" % i, "rb") as f:
        out = f.read(spec["out_cap"] + 1)
    with open("err%d.txt" % i, "rb") as f:
        f.seek(max(0, os.path.getsize("err%d.txt" % i) - 300))
        err = f.read().decode("utf-8", "replace")[-300:]
    big = len(out) > spec["out_cap"]
    emit(False, k="case", i=i, rc=rc, big=big, err=err, s=round(_mono() - t0, 3),
         out="" if big else out.decode("utf-8", "replace"))
emit(k="done")
"""

EXPR_HARNESS = _PRELUDE + r'''
import signal
def _alarm(s, f):
    raise TimeoutError("expression ran past its time budget")
signal.signal(signal.SIGALRM, _alarm)
expr = open("solution.py").read().strip()
signal.setitimer(signal.ITIMER_REAL, spec["budget_s"])
try:
    value = eval(compile(expr, "<expr>", "eval"), {"__builtins__": {}}, {})
    out = {"repr": repr(value)[:100000]}
except BaseException as e:
    out = {"error": (type(e).__name__ + ": " + str(e))[:200]}
signal.setitimer(signal.ITIMER_REAL, 0)
emit(k="result", **out)
emit(k="done")
'''


# --------------------------------------------------------------------------- trusted evaluation

def _cost_check(op: str, a: Any, b: Any) -> None:
    ints = type(a) in (int, bool) and type(b) in (int, bool)
    if op == "**" and ints and abs(a) > 1 and b > 10_000:
        raise _Costly(f"{op} with exponent {b}")
    if op == "<<" and ints and b > 100_000:
        raise _Costly(f"{op} by {b}")
    if op == "*":
        for seq, n in ((a, b), (b, a)):
            if type(seq) in (str, bytes, list, tuple) and type(n) in (int, bool) and len(seq) * n > 10**7:
                raise _Costly("repetition longer than 10**7")


_OPS = {"**": lambda a, b: a ** b, "*": lambda a, b: a * b, "<<": lambda a, b: a << b}


def _binop(op: str, a: Any, b: Any) -> Any:
    _cost_check(op, a, b)
    return _OPS[op](a, b)


def _range(*args: Any) -> range:
    r = range(*args)
    try:
        if len(r) <= 10**6:
            return r
    except OverflowError:
        pass
    raise _Costly("range longer than 10**6")


def _pow(a: Any, b: Any, m: Any = None) -> Any:
    if m is None:
        _cost_check("**", a, b)
        return a ** b
    return pow(a, b, m)


def _capped(fn: Any, limit: int = 100_000) -> Any:
    def wrapped(*args: Any) -> Any:
        if any(type(a) is int and a > limit for a in args):
            raise _Costly(f"{fn.__name__} of a number above {limit}")
        return fn(*args)
    return wrapped


_MATH = types.SimpleNamespace(**{k: getattr(math, k) for k in dir(math) if not k.startswith("_")})
for _f in ("factorial", "comb", "perm"):
    setattr(_MATH, _f, _capped(getattr(math, _f)))
_BUILTINS = {n: getattr(builtins, n) for n in SAFE_NAMES - {"math"}}
_BUILTINS.update(range=_range, pow=_pow)
_TRUSTED_ENV = {"__builtins__": _BUILTINS, "math": _MATH, "_rl_binop": _binop}


class _Guard(ast.NodeTransformer):
    """``a ** b``, ``a * b``, ``a << b`` → ``_rl_binop(op, a, b)``, which refuses pathological sizes."""

    _SYM = {ast.Pow: "**", ast.Mult: "*", ast.LShift: "<<"}

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        sym = self._SYM.get(type(node.op))
        if sym is None:
            return node
        return ast.Call(ast.Name("_rl_binop", ast.Load()), [ast.Constant(sym), node.left, node.right], [])


def _compile_trusted(expr: ast.expr) -> Any:
    tree = ast.fix_missing_locations(_Guard().visit(ast.Expression(copy.deepcopy(expr))))
    return compile(tree, "<test>", "eval")


# --------------------------------------------------------------------------- splitting tests (trusted side)

_COMPS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)
_TRUSTED_KINDS = (ast.Compare, ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.IfExp, ast.List, ast.Tuple, ast.Set,
                  ast.Dict, ast.Subscript, ast.Slice, ast.Starred, *_COMPS)
_ALLOWED = (ast.expr_context, ast.operator, ast.unaryop, ast.cmpop, ast.boolop, ast.Constant, ast.Name,
            ast.Attribute, ast.Call, ast.Lambda, ast.arguments, ast.arg, ast.keyword, ast.comprehension,
            ast.JoinedStr, ast.FormattedValue, *_TRUSTED_KINDS)
_PLAIN = (int, float, complex, str, bytes, bool, type(None), list, tuple, dict, set, frozenset)


@dataclass(frozen=True)
class _Test:
    source: str
    code: Any  # the trusted part, compiled; operand k's value is bound to _rl_v{k}
    operands: tuple[str, ...]


def _bound_names(tree: ast.AST) -> set[str]:
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.comprehension):
            out |= {t.id for t in ast.walk(n.target) if isinstance(t, ast.Name)}
        elif isinstance(n, ast.Lambda):
            a = n.args
            out |= {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x}
    return out


def _program_names(node: ast.AST, local: set[str]) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id not in SAFE_NAMES and n.id not in local}


def _literal(v: Any) -> ast.expr:
    try:
        if type(v) in _PLAIN and ast.literal_eval(repr(v)) == v:
            return ast.parse(repr(v), mode="eval").body
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        pass
    raise _RefError(f"loop value {repr(v)[:40]} is not a literal")


class _Substitute(ast.NodeTransformer):
    def __init__(self, values: dict[str, Any]):
        self.values = values

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return _literal(self.values[node.id]) if node.id in self.values else node


class _Unroll(ast.NodeTransformer):
    """A comprehension whose body calls the program becomes a literal list (set, dict) of its cases."""

    def __init__(self, local: set[str]):
        self.local = local

    def _comp(self, node: Any) -> ast.AST:
        self.generic_visit(node)
        body = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
        ifs = [c for g in node.generators for c in g.ifs]
        if not any(_program_names(b, self.local) for b in body + ifs):
            return node
        if any(_program_names(g.iter, self.local) for g in node.generators):
            raise _RefError(f"`{ast.unparse(node)[:80]}` loops over the program's results and calls the program "
                            "inside the loop; write one assert per case")
        if any(_program_names(c, self.local) for c in ifs):
            raise _RefError(f"`{ast.unparse(node)[:80]}` filters its loop with the program; write one assert per case")
        targets = sorted({t.id for g in node.generators for t in ast.walk(g.target) if isinstance(t, ast.Name)})
        probe = ast.ListComp(ast.Tuple([ast.Name(t, ast.Load()) for t in targets], ast.Load()), node.generators)
        try:
            bindings = eval(_compile_trusted(probe), dict(_TRUSTED_ENV))  # noqa: S307 - reference text, plain values
        except Exception as e:  # noqa: BLE001
            raise _RefError(f"cannot unroll `{ast.unparse(node)[:80]}`: {type(e).__name__}: {e}") from None
        if len(bindings) > MAX_UNROLL:
            raise _RefError(f"`{ast.unparse(node)[:80]}` unrolls into more than {MAX_UNROLL} cases")
        items = [[_Substitute(dict(zip(targets, vals))).visit(copy.deepcopy(b)) for b in body] for vals in bindings]
        if isinstance(node, ast.DictComp):
            return ast.Dict([k for k, _ in items], [v for _, v in items])
        if isinstance(node, ast.SetComp):
            return ast.Call(ast.Name("set", ast.Load()), [ast.List([e for (e,) in items], ast.Load())], [])
        return ast.List([e for (e,) in items], ast.Load())

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _comp


def _check_trusted(node: ast.AST) -> None:
    for n in ast.walk(node):
        if not isinstance(n, _ALLOWED):
            raise _RefError(f"unsupported expression `{ast.unparse(n)[:60]}` ({type(n).__name__})")
        if isinstance(n, ast.Attribute) and n.attr.startswith("_"):
            raise _RefError(f"private attribute `{n.attr}` in a test")
        if isinstance(n, ast.comprehension) and n.is_async:
            raise _RefError("async comprehension in a test")


def _check_operand(node: ast.AST, local: set[str]) -> None:
    """The operand runs in the sandbox: it must not carry a loop variable or mix a program value with
    test data (``g(f(x) - 3)``: that is how an expected value would leak into the program's hands)."""
    free_locals = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in local} - _bound_names(node)
    text = ast.unparse(node)[:80]
    if free_locals or isinstance(node, ast.Lambda):
        raise _RefError(f"`{text}` passes a loop or lambda variable to the program; write one assert per case")
    for n in ast.walk(node):
        kids = ([n.left, *n.comparators] if isinstance(n, ast.Compare) else [n.left, n.right]
                if isinstance(n, ast.BinOp) else n.values if isinstance(n, ast.BoolOp)
                else [n.test, n.body, n.orelse] if isinstance(n, ast.IfExp) else [])
        taint = [bool(_program_names(k, local)) for k in kids]
        if any(taint) and not all(taint):
            raise _RefError(f"`{ast.unparse(n)[:60]}` inside `{text}` combines the program's value with test data "
                            "within a call to the program; the comparison must be the outermost part of the assert")


def _split(node: Any, local: set[str], ops: list[str]) -> Any:
    if isinstance(node, ast.keyword):
        node.value = _split(node.value, local, ops)
        return node
    if isinstance(node, ast.comprehension):
        node.iter = _split(node.iter, local, ops)
        node.ifs = [_split(c, local, ops) for c in node.ifs]
        return node
    if not _program_names(node, local):
        _check_trusted(node)
        return node
    safe_call = isinstance(node, ast.Call) and not _program_names(node.func, local) and (
        isinstance(node.func, ast.Attribute) or (isinstance(node.func, ast.Name) and node.func.id in SAFE_NAMES))
    if isinstance(node, _TRUSTED_KINDS) or safe_call:
        if safe_call:
            _check_trusted(node.func)
        for field, value in ast.iter_fields(node):
            if isinstance(value, (ast.expr, ast.keyword, ast.comprehension)):
                setattr(node, field, _split(value, local, ops))
            elif isinstance(value, list):
                setattr(node, field, [_split(v, local, ops) if isinstance(v, (ast.expr, ast.keyword, ast.comprehension))
                                      else v for v in value])
        return node
    _check_operand(node, local)
    ops.append(ast.unparse(node))
    return ast.Name(f"_rl_v{len(ops) - 1}", ast.Load())


def _compile_test(i: int, src: str) -> _Test:
    try:
        mod = ast.parse(src, mode="exec")
    except (SyntaxError, ValueError) as e:
        raise _RefError(f"test {i} does not parse: {e}") from None
    if len(mod.body) != 1 or not isinstance(mod.body[0], ast.Assert):
        kinds = ", ".join(type(s).__name__ for s in mod.body) or "nothing"
        raise _RefError(f"test {i} must be a single `assert <expr>` statement, got {kinds}: {src[:80]!r}")
    expr = mod.body[0].test
    local = _bound_names(expr)
    try:
        expr = _Unroll(local).visit(expr)
        ops: list[str] = []
        expr = _split(expr, local, ops)
    except _RefError as e:
        raise _RefError(f"test {i}: {e}") from None
    if not ops:
        raise _RefError(f"test {i} does not use any of the program's names: {src[:80]!r}")
    try:
        code = _compile_trusted(expr)
    except (SyntaxError, ValueError, TypeError) as e:
        raise _RefError(f"test {i} cannot be compiled after splitting: {e}") from None
    return _Test(src, code, tuple(ops))


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


def _decode(x: Any, depth: int = 0) -> Any:
    """Rebuild a plain value from the harness's tagged JSON (anything else raises ValueError)."""
    if x is None or type(x) is bool:
        return x
    if depth > 100 or type(x) is not list or not x or type(x[0]) is not str:
        raise ValueError("malformed value")
    tag, rest = x[0], x[1:]
    if tag == "i" and len(rest) == 1 and type(rest[0]) is str and len(rest[0]) <= 100_000:
        return int(rest[0], 16)
    if tag == "f" and len(rest) == 1 and type(rest[0]) is str and len(rest[0]) <= 40:
        return float(rest[0])
    if tag == "c" and len(rest) == 2 and all(type(r) is str and len(r) <= 40 for r in rest):
        return complex(float(rest[0]), float(rest[1]))
    if tag == "s" and len(rest) == 1 and type(rest[0]) is str:
        return rest[0]
    if tag == "y" and len(rest) == 1 and type(rest[0]) is str:
        return bytes.fromhex(rest[0])
    seq = {"l": list, "t": tuple, "S": set, "F": frozenset}
    if tag in seq and len(rest) == 1 and type(rest[0]) is list:
        return seq[tag](_decode(v, depth + 1) for v in rest[0])
    if tag == "d" and len(rest) == 1 and type(rest[0]) is list:
        if not all(type(kv) is list and len(kv) == 2 for kv in rest[0]):
            raise ValueError("malformed dict")
        return {_decode(k, depth + 1): _decode(v, depth + 1) for k, v in rest[0]}
    raise ValueError(f"malformed value (tag {tag[:5]!r})")


def _judge(test: _Test, encoded: str) -> tuple[bool, str]:
    """Rebuild the operands' values and evaluate the rest of the test here, on plain values."""
    try:
        raw = json.loads(encoded)
        if type(raw) is not list or len(raw) != len(test.operands):
            raise ValueError("wrong number of values")
        values = [_decode(v) for v in raw]
    except (ValueError, TypeError, RecursionError) as e:
        return False, f"the harness sent an unreadable value ({e})"
    env = dict(_TRUSTED_ENV)
    env.update((f"_rl_v{k}", v) for k, v in enumerate(values))
    try:
        return bool(eval(test.code, env)), "assertion failed"  # noqa: S307 - reference text, plain values
    except _Costly as e:
        return False, f"evaluating the test would be too costly ({e})"
    except Exception as e:  # noqa: BLE001 - e.g. TypeError comparing values of the wrong types
        return False, f"{type(e).__name__}: {e}"[:200]


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
