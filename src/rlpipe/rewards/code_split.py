"""The trusted side of function tests: split each ``assert`` into the operands the sandbox evaluates
and the rest, evaluated here on plain values (see :mod:`rlpipe.rewards.code` for the threat model).

Nothing here runs model code: operands come back from the sandbox as tagged JSON, are rebuilt by
:func:`_decode` (exact builtin types only), and the test's remaining expression — reference text
from the dataset — runs with the real builtins and cost guards against pathological values.
"""

from __future__ import annotations

import ast
import builtins
import copy
import json
import math
import types
from dataclasses import dataclass
from typing import Any

MAX_UNROLL = 1000  # cases one comprehension may unroll into

SAFE_NAMES = frozenset({
    "abs", "all", "any", "bool", "bytes", "chr", "complex", "dict", "divmod", "enumerate", "filter",
    "float", "frozenset", "int", "isinstance", "len", "list", "map", "max", "min", "ord", "pow", "range",
    "repr", "reversed", "round", "set", "sorted", "str", "sum", "tuple", "type", "zip", "math",
})


class _RefError(ValueError):
    """The reference (ground truth) cannot be used; the message says why."""


class _Costly(Exception):
    """Evaluating a test here would take too much time or memory (a pathological value)."""


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
