"""Code references as benchmarks publish them, parsed and checked before any program runs.

A reference is a JSON object; these keys are read, under the names the benchmarks use, and any
other key is an error (a key nothing reads would otherwise be silently ignored):

- ``tests``: a list of Python snippets, each one test (MBPP's ``test_list``; usually one ``assert``).
  Optional ``test_setup_code`` (a string) and ``test_imports`` (a list of import lines) run before
  them, in the test's namespace — MBPP's own fields. Setup code that uses the program's names (a
  tree of the program's ``Node`` class) runs in the program's interpreter instead, after the program. A bare JSON list is ``{"tests": [...]}``.
- ``test`` + ``entry_point``: HumanEval's published test, code that defines ``check(candidate)``;
  ``check`` is called with the program's ``entry_point`` function. One test: it passes or not.
  ``test_setup_code`` works here too (the prompt's helper functions, e.g. HumanEval/32's ``poly``).
- ``input_output``: APPS' field (a dict or its JSON string): ``inputs``/``outputs`` lists; with
  ``fn_name`` each input is an argument list for that function, judged by APPS' rule (a tuple is read
  as a list; an expected list ``[x]`` also accepts ``x``); without it they are stdin/stdout texts (a
  list of lines is joined with newlines).
- ``io``: rlpipe's stdin/stdout cases, ``[{"input": "...", "output": "..."}]``.

The names a test takes from the program are its free names: used but not defined by the test code,
its setup, an import or the builtins — and ``entry_point`` even where it is a builtin's name (MBPP
has a function called ``sum``); no other builtin is ever taken from the program. ``candidate`` stands for ``entry_point`` and is an error
without one (the usual slip when copying asserts out of a HumanEval ``check``). A test that uses no
program name would pass for any program, and is refused.
"""

from __future__ import annotations

import ast
import builtins
import functools
import json
import symtable
from dataclasses import dataclass
from typing import Any

MAX_TESTS = 1000
KEYS = ("tests", "test", "entry_point", "test_setup_code", "test_imports", "input_output", "io")
_BUILTIN_NAMES = frozenset(dir(builtins)) | {"__name__", "__file__", "__builtins__"}


class RefError(ValueError):
    """The reference (ground truth) cannot be used; the message says why and what to give instead."""


@dataclass(frozen=True)
class Test:
    kind: str  # "assert": a snippet; "check": HumanEval's check(candidate); "call": an APPS call
    source: str
    args: Any = None  # "call": the argument list
    expected: Any = None  # "call": the expected value


@dataclass(frozen=True)
class Ref:
    kind: str  # "tests" | "io"
    tests: tuple[Test, ...] = ()
    cases: tuple[tuple[str, str], ...] = ()
    setup: str = ""  # runs in the test's interpreter
    program_setup: str = ""  # setup code that uses the program's names: runs in the program's interpreter
    entry_point: str | None = None
    names: tuple[str, ...] = ()  # the names the tests take from the program
    float_tol: bool = False  # stdin/stdout: decimals compared with APPS' tolerance


def _compiles(src: str, what: str) -> ast.Module:
    try:
        tree = ast.parse(src, mode="exec")
        compile(tree, what, "exec")
    except (SyntaxError, ValueError) as e:
        raise RefError(f"{what} does not compile: {e}") from None
    return tree


def _free_names(src: str) -> set[str]:
    """Names referenced as globals anywhere in ``src`` that the module itself never binds."""
    top = symtable.symtable(src, "<test>", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    used: set[str] = set()
    stack = [top]
    while stack:
        table = stack.pop()
        stack.extend(table.get_children())
        for s in table.get_symbols():
            if s.is_referenced() and (table is top or s.is_global()) and not s.is_declared_global():
                used.add(s.get_name())
    return used - bound - _BUILTIN_NAMES


def _setup(spec: dict[str, Any]) -> tuple[str, str]:
    """(setup for the test's interpreter, setup for the program's). Setup code that uses a name only the
    program defines (MBPP builds trees of the program's ``Node`` class) runs after the program, in its
    interpreter; the objects it binds reach the test as handles it can pass back to the program."""
    imports = spec.get("test_imports") or []
    setup = spec.get("test_setup_code") or ""
    if not isinstance(imports, list) or not all(isinstance(x, str) for x in imports):
        raise RefError('"test_imports" must be a list of import lines, e.g. ["import math"]')
    if not isinstance(setup, str):
        raise RefError('"test_setup_code" must be a string of Python code')
    text = "\n".join([*imports, setup]).strip()
    if not text:
        return "", ""
    _compiles(text, "the test setup code")
    if _free_names(text):
        return "\n".join(imports), text
    return text, ""


def _entry_point(spec: dict[str, Any]) -> str | None:
    ep = spec.get("entry_point")
    if ep is not None and not (isinstance(ep, str) and ep.isidentifier()):
        raise RefError(f'"entry_point" must be the program\'s function name, got {str(ep)[:40]!r}')
    return ep


def _uses(src: str, name: str) -> bool:
    try:
        return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(ast.parse(src)))
    except SyntaxError:
        return False


def _names(sources: list[str], setup: str, entry_point: str | None) -> tuple[str, ...]:
    names = _free_names("\n".join([setup, *sources]))
    if entry_point in _BUILTIN_NAMES and any(_uses(s, entry_point) for s in sources):
        names.add(entry_point)  # MBPP's `sum`: the program's function shadows the builtin, as in MBPP's harness
    if "candidate" in names and entry_point is None:
        raise RefError('the tests call `candidate` but the reference has no "entry_point": add '
                       '"entry_point": "<the function\'s name>" (HumanEval\'s convention), or rename it in the tests')
    return tuple(sorted(names - {"candidate"}))


def _function_tests(spec: dict[str, Any]) -> Ref:
    (setup, in_program), ep = _setup(spec), _entry_point(spec)
    if "test" in spec:
        if "tests" in spec or not isinstance(spec["test"], str):
            raise RefError('"test" is one string of test code (HumanEval); give either it or "tests", not both')
        if ep is None:
            raise RefError('"test" (HumanEval\'s check(candidate)) needs "entry_point": the function check is called with')
        tree = _compiles(spec["test"], "the test code")
        if not any(isinstance(n, ast.FunctionDef) and n.name == "check" for n in tree.body):
            raise RefError('the test code does not define `check(candidate)`; give a list of asserts as "tests" instead')
        return Ref("tests", tests=(Test("check", spec["test"]),), setup=setup, program_setup=in_program,
                   entry_point=ep, names=_names([spec["test"]], setup, ep))
    tests = spec.get("tests")
    if not isinstance(tests, list) or not tests:
        raise RefError('no tests: give {"tests": ["assert f(1) == 2", ...]} (non-empty), {"test": ..., '
                       '"entry_point": ...}, {"input_output": ...} or {"io": [...]}')
    if len(tests) > MAX_TESTS:
        raise RefError(f"{len(tests)} tests; at most {MAX_TESTS}")
    if not all(isinstance(t, str) and t.strip() for t in tests):
        raise RefError("every test must be a non-empty string of Python code, e.g. `assert f(1) == 2`")
    for i, t in enumerate(tests):
        _compiles(t, f"test {i}")
        if not _free_names(f"{setup}\n{t}") and not (ep and _uses(t, ep)):
            raise RefError(f"test {i} uses none of the program's names, so any program passes it: {t[:80]!r}")
    return Ref("tests", tests=tuple(Test("assert", t) for t in tests), setup=setup, program_setup=in_program,
               entry_point=ep, names=_names(tests, setup, ep))


def _apps_text(x: Any, what: str) -> str:
    if isinstance(x, list) and all(isinstance(y, str) for y in x):
        return "\n".join(x)
    if not isinstance(x, str):
        raise RefError(f"input_output: {what} must be a string (or a list of lines) without fn_name, got {str(x)[:60]}")
    return x


def _apps(raw: Any) -> Ref:
    spec = raw
    if isinstance(raw, str):
        try:
            spec = json.loads(raw)
        except (json.JSONDecodeError, RecursionError) as e:
            raise RefError(f'"input_output" is a string but not JSON ({getattr(e, "msg", e)})') from None
    if not isinstance(spec, dict) or not isinstance(spec.get("inputs"), list) or not isinstance(spec.get("outputs"), list):
        raise RefError('"input_output" must hold {"inputs": [...], "outputs": [...]} (APPS), optionally "fn_name"')
    ins, outs = spec["inputs"], spec["outputs"]
    if not ins or len(ins) != len(outs) or len(ins) > MAX_TESTS:
        raise RefError(f"input_output: {len(ins)} inputs and {len(outs)} outputs; need as many of each, 1 to {MAX_TESTS}")
    unknown = set(spec) - {"inputs", "outputs", "fn_name"}
    if unknown:
        raise RefError(f"input_output: unknown key(s) {sorted(unknown)}; APPS uses inputs, outputs, fn_name")
    fn = spec.get("fn_name")
    if fn is None:
        return Ref("io", cases=tuple((_apps_text(i, "an input"), _apps_text(o, "an output")) for i, o in zip(ins, outs)),
                   float_tol=True)
    if not (isinstance(fn, str) and fn.isidentifier()):
        raise RefError(f"input_output: fn_name must be a function name, got {str(fn)[:40]!r}")
    if not all(isinstance(i, list) for i in ins):
        raise RefError("input_output: with fn_name every input must be the list of the call's arguments")
    tests = tuple(Test("call", f"{fn}(*{json.dumps(i)[:60]})", args=i, expected=o) for i, o in zip(ins, outs))
    return Ref("tests", tests=tests, entry_point=fn, names=(fn,))


def _io(cases: Any) -> Ref:
    if not isinstance(cases, list) or not cases:
        raise RefError('"io" must be a non-empty list of {"input": "...", "output": "..."}')
    if len(cases) > MAX_TESTS:
        raise RefError(f"{len(cases)} io cases; at most {MAX_TESTS}")
    out = []
    for i, c in enumerate(cases):
        if not (isinstance(c, dict) and isinstance(c.get("input"), str) and isinstance(c.get("output"), str)):
            raise RefError(f'io case {i} must be {{"input": <str>, "output": <str>}}, got {str(c)[:80]}')
        out.append((c["input"], c["output"]))
    return Ref("io", cases=tuple(out))


@functools.lru_cache(maxsize=512)
def parse_reference(ground_truth: str | None) -> Ref:
    """The parsed reference; raises RefError saying what is wrong with it and what to give."""
    try:
        spec = json.loads(ground_truth or "")
    except (json.JSONDecodeError, RecursionError) as e:
        raise RefError(f'ground truth is not JSON ({getattr(e, "msg", e)}): give {{"tests": [...]}}, '
                       'a list of tests, {"test": ..., "entry_point": ...}, {"input_output": ...} or {"io": [...]}') from None
    if isinstance(spec, list):
        spec = {"tests": spec}
    if not isinstance(spec, dict):
        raise RefError(f"ground truth must be a JSON object or a list of tests, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(KEYS))
    if unknown:
        raise RefError(f"key(s) {unknown} are not read by the code verifier (it reads {', '.join(KEYS)}); "
                       "rename or remove them")
    forms = [k for k in ("io", "input_output", "tests", "test") if k in spec]
    if len(forms) > 1 and set(forms) != {"tests"}:
        raise RefError(f"give one kind of test, not {forms}")
    if "io" in spec:
        return _io(spec["io"])
    if "input_output" in spec:
        return _apps(spec["input_output"])
    try:
        return _function_tests(spec)
    except (SyntaxError, RecursionError, MemoryError) as e:
        raise RefError(f"the test code cannot be analysed: {type(e).__name__}: {e}") from None


def defined_names(program: str) -> set[str] | None:
    """The names a program binds at its top level (None when it does not parse)."""
    try:
        top = symtable.symtable(program, "<solution>", "exec")
    except (SyntaxError, ValueError, RecursionError):
        return None
    return {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}


def undefined_names(ground_truth: str | None, program: str) -> list[str]:
    """The names the tests take from the program that ``program`` (a row's canonical solution) lacks."""
    try:
        ref = parse_reference(ground_truth)
    except RefError:
        return []
    have = defined_names(program)
    if have is None:
        return []
    have |= defined_names(ref.program_setup) or set() if ref.program_setup else set()
    wanted = set(ref.names) | ({ref.entry_point} if ref.entry_point else set())
    wanted |= _free_names(ref.program_setup) if ref.program_setup else set()
    return sorted(wanted - have)
