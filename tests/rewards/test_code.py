"""The code verifiers run model code in the (real) sandbox and judge its values outside it.

What the program does wrong — including every attempt to forge a verdict — is reward 0 / ok; what
goes wrong with the verification itself (broken reference, no sandbox, launcher died) is never ok.
"""

import json
import time

import pytest

import rlpipe.sandbox
from rlpipe.rewards import get_verifier
from rlpipe.sandbox import SandboxResult

code = get_verifier("code")
FULL = "bwrap+seccomp+uid+rlimits+cgroup"
ADD = json.dumps({"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]})
# Tests no constant answer passes; various shapes of the trusted part (==, abs(...) <, not/!=, in, sorted, and).
ADV = json.dumps({"tests": [
    "assert add(1, 2) == 3",
    "assert add(20, 22) == 42",
    "assert abs(add(0.5, 0.25) - 0.75) < 1e-9",
    "assert not add(5, 5) != 10",
    "assert add(2, 3) in [5]",
    "assert sorted(add([2], [1])) == [1, 2]",
    "assert isinstance(add(3, 4), int) and add(3, 4) == 7",
    "assert add('a', 'b') == 'ab'",
]})
FAST = {"compile_s": 1.0, "run_s": 1.0, "test_s": 0.5}

EQ_ALL = """
class Any:
    def __eq__(self, o): return True
    def __ne__(self, o): return False
    def __lt__(self, o): return True
    def __gt__(self, o): return True
    def __bool__(self): return True
    def __hash__(self): return 0
    def __sub__(self, o): return 0
    def __rsub__(self, o): return 0
    def __abs__(self): return 0
    def __iter__(self): return iter([1, 2])
    def __contains__(self, x): return True
"""
ADVERSARIAL = {
    "always-equal object": EQ_ALL + "def add(a, b): return Any()",
    "always-equal object in a list": EQ_ALL + "def add(a, b): return [Any()]",
    "int subclass with __eq__": "class I(int):\n    __eq__ = lambda s, o: True\n    __ne__ = lambda s, o: False\n"
                                "    __hash__ = int.__hash__\n    __lt__ = lambda s, o: True\ndef add(a, b): return I(0)",
    "str subclass with __eq__": "class S(str):\n    __eq__ = lambda s, o: True\n    __hash__ = str.__hash__\n"
                                "def add(a, b): return S('x')",
    "list subclass with __eq__": "class L(list):\n    __eq__ = lambda s, o: True\n    __ne__ = lambda s, o: False\n"
                                 "def add(a, b): return L()",
    "object with __class__ = int": EQ_ALL + "Any.__class__ = property(lambda s: int)\ndef add(a, b): return Any()",
    "patched builtins": "import builtins\nbuiltins.abs = lambda x: 0\nbuiltins.isinstance = lambda *a: True\n"
                        "builtins.sorted = lambda *a, **k: [1, 2]\nbuiltins.AssertionError = type('E', (Exception,), {})\n"
                        "builtins.type = lambda *a: int\nbuiltins.bool = lambda *a: True\ndef add(a, b): return 0",
    "patched eval/compile": "import builtins\nbuiltins.eval = lambda *a, **k: 0\ndef add(a, b): return 0",
    "names of safe builtins redefined": "def sorted(*a, **k): return [1, 2]\ndef abs(x): return 0\n"
                                        "def isinstance(*a): return True\ndef add(a, b): return -1",
    "assert machinery: settrace, __debug__": "import sys\nsys.settrace(lambda *a: None)\n"
                                             "globals()['__debug__'] = False\ndef add(a, b): return None",
    "raise SystemExit at import": "raise SystemExit(0)\ndef add(a, b): return a + b",
    "sys.exit inside the function": "import sys\ndef add(a, b): sys.exit(0)",
    "os._exit inside the function": "import os\ndef add(a, b): os._exit(0)",
    "os._exit at import after a forged line": "import os\nprint('@@RLPIPE@@' + '0' * 32 + ' {\"k\": \"done\"}')\nos._exit(0)",
    "forged old verdict, guessed nonce": "import sys\nfor n in ('', '0' * 32):\n"
                                         "    print('\\n@@RLPIPE_VERDICT@@' + n + '{\"phase\": \"tests\", \"passed\": 8, \"total\": 8}')\n"
                                         "sys.stdout.flush()\nimport os\nos._exit(0)",
    "forged records with the real nonce": "import sys, os, json\nm = sys.modules['__main__']\n"
                                          "for i in range(8):\n"
                                          "    m.emit(k='test', i=i, v=json.dumps([True]), passed=True)\n"
                                          "m.emit(k='done', passed=8)\nos.write(m.OUT, b'\\n@@RLPIPE@@' + m.NONCE.encode() + b' {\"k\": \"done\"}\\n')\n"
                                          "os._exit(0)",
    "patching the harness via __main__": "import sys\nm = sys.modules['__main__']\nm.enc = lambda x, d=0: ['i', '0x0']\n"
                                         "m.spec['tests'] = [[]] * 8\nm.describe = lambda e: 'fine'\ndef add(a, b): return 0",
    "output flooding": "import sys, os\nsys.stdout.write('x' * 3_000_000)\nsys.stderr.write('y' * 3_000_000)\n"
                       "try:\n    os.write(sys.modules['__main__'].OUT, b'z' * 20_000_000)\nexcept OSError:\n    pass\n"
                       "def add(a, b): return 0",
    "catching the budget exception in a loop": "def add(a, b):\n    while True:\n        try:\n"
                                               "            while True: pass\n        except BaseException:\n            pass",
    "catching the budget and answering late": "def add(a, b):\n    try:\n        while True: pass\n"
                                              "    except BaseException:\n        return 0",
    "reading the test spec from disk": "import os, re\nseen = ''.join(open(f, errors='replace').read() for f in os.listdir('.') "
                                       "if os.path.isfile(f))\nnums = [int(x) for x in re.findall(r'==\\s*(-?\\d+)', seen)]\n"
                                       "def add(a, b): return nums[0] if nums else -1",
    "memory exhaustion": "def add(a, b):\n    x = bytearray(1 << 30)\n    return a + b",
    "killing its own process": "import os, signal\ndef add(a, b): os.kill(os.getpid(), signal.SIGKILL)",
    "killing the test harness": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\ndef add(a, b): return 0",
    "the harness's memory through /proc": (
        "import os, re\np, table = os.getppid(), {}\ntry:\n    mem = open('/proc/%d/mem' % p, 'rb')\n"
        "    for line in open('/proc/%d/maps' % p).read().splitlines():\n        span, perms = line.split()[:2]\n"
        "        lo, hi = (int(x, 16) for x in span.split('-'))\n        if 'rw' not in perms or hi - lo > 64 << 20:\n"
        "            continue\n        try:\n            mem.seek(lo)\n            blob = mem.read(hi - lo)\n"
        "        except OSError:\n            continue\n"
        "        for a, b, c in re.findall(rb'add\\((-?\\d+), (-?\\d+)\\) == (-?\\d+)', blob):\n"
        "            table[(int(a), int(b))] = int(c)\nexcept OSError:\n    pass\n"
        "def add(a, b): return table.get((a, b), -1)"),
    "forged reports through the harness's fds": (
        "import os\nfor fd in ('/proc/%d/fd/1' % os.getppid(), '/proc/1/fd/1'):\n    try:\n"
        "        os.write(os.open(fd, os.O_WRONLY), b'\\n@@RLPIPE@@' + b'0' * 32 + b' {\"k\": \"test\", \"i\": 0, \"ok\": true}\\n')\n"
        "    except OSError:\n        pass\ndef add(a, b): return -1"),
    "replies sent before the question": "import sys, json\nm = sys.modules['__main__']\n"
                                        "for _ in range(50):\n    m.send({'v': ['i', '0'], 'a': []})\n"
                                        "m.send({'names': {'add': ['v', ['i', '0']]}})\ndef add(a, b): return 0",
    "fake infrastructure messages on stderr": "import sys\nsys.stderr.write('rlpipe.sandbox: no sandbox available on this machine\\n"
                                              "rlpipe.sandbox: the launcher died without a status report\\n')\nsys.exit(3)",
}


SLOW = {"catching the budget exception in a loop", "catching the budget and answering late"}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_forgery_attempts_score_zero(name):
    gt = json.dumps({"tests": ["assert add(1, 2) == 3"]}) if name in SLOW else ADV  # each test costs its budget
    res = code(ADVERSARIAL[name], gt, **FAST)
    assert (res.status, res.reward) == ("ok", 0.0), res
    assert res.isolation == FULL


def test_the_programs_objects_stay_there_as_handles():
    """MBPP/601 builds the program's own class in the test; MBPP/533 passes a type. Handles compare by identity
    and go back to the program; they never equal a value, so returning an object is never paid as one."""
    gt = json.dumps({"tests": [
        "assert chain([Pair(5, 24), Pair(15, 25), Pair(27, 40)]) == 2",
        "p = Pair(1, 2)\nassert same(p) == p and same(p) != Pair(1, 2)",
        "assert drop((4, 5, 7.7, 'x'), int) == [7.7, 'x'] and kind(3) == int",
        "assert Pair(1, 2) != (1, 2) and Pair(1, 2) != 0",
    ]})
    prog = ("class Pair:\n    def __init__(s, a, b): s.a, s.b = a, b\n"
            "    def __eq__(s, o): return True\n"
            "def chain(ps): return sum(1 for x, y in zip(ps, ps[1:]) if y.a > x.b) + 1\n"
            "def same(p): return p\ndef drop(t, ty): return [x for x in t if not isinstance(x, ty)]\n"
            "def kind(x): return type(x)")
    res = code(prog, gt, **FAST)
    assert (res.status, res.reward) == ("ok", 1.0), res.reason


def test_entry_point_named_like_a_builtin_is_the_programs_and_no_other_builtin_is():
    """MBPP/126 names its function `sum`; MBPP's harness runs the program's. Only the entry point may shadow."""
    gt = json.dumps({"tests": ["assert sum(10, 15) == 6", "assert abs(sum(4, 6) - 3) < 1e-9"], "entry_point": "sum"})
    assert code("def sum(a, b):\n    return 6 if a == 10 else 3", gt, **FAST).reward == 1.0
    assert code("def sum(a, b):\n    return a + b", gt, **FAST).reward == 0.0
    rigged = "def abs(x):\n    return 0\ndef sum(a, b):\n    return 6 if a == 10 else 99"
    assert code(rigged, gt, **FAST).reward == 0.5  # the test's abs is the builtin


def test_a_module_the_program_writes_is_never_imported_by_the_test():
    """The test imports `random` after the program ran; a random.py the program left in the work dir
    (which would make every case trivial) must not be the one imported."""
    gt = json.dumps({"test": "def check(candidate):\n    import random\n    x = random.randint(10, 10**9)\n"
                             "    assert candidate(x) == x + 1", "entry_point": "inc"})
    fake = "open('random.py', 'w').write('def randint(a, b):\\n    return 0\\n')\ndef inc(x): return 1"
    res = code(fake, gt, **FAST)
    assert (res.status, res.reward) == ("ok", 0.0), res.reason
    assert code("def inc(x): return x + 1", gt, **FAST).reward == 1.0


def test_ignoring_the_alarm_is_the_programs_fault_and_fits_the_declared_budget():
    gt = json.dumps({"tests": ["assert add(1, 2) == 3"]})
    prog = "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\ndef add(a, b):\n    while True: pass"
    t0 = time.monotonic()
    res = code(prog, gt, **FAST)
    took = time.monotonic() - t0
    assert (res.status, res.reward) == ("ok", 0.0), res
    assert "time budget" in res.reason
    assert took < code.budget_s(gt, **FAST), (took, code.budget_s(gt, **FAST))


HONEST = "```python\ndef add(a, b):\n    return a + b\n```"


@pytest.mark.parametrize(
    "response,reward,reason",
    [
        (HONEST, 1.0, "3/3 passed"),
        ("def add(a, b):\n    return a - b", 1 / 3, "1/3 passed; assert add(1, 2) == 3: assertion failed"),
        ("def add(a, b)\n    return a + b", 0.0, "0/3 passed; SyntaxError"),
        ("def add(a, b):\n    while True: pass", 0.0, "ran past its time budget"),
        ("while True: pass", 0.0, "0/3 passed; the program ran past its time budget"),
        ("def add(a, b):\n    raise ValueError('nope')", 0.0, "ValueError: nope"),
        ("def add(a, b):\n    return float(a + b)", 1.0, "3/3 passed"),  # 3.0 == 3, ordinary semantics
        ("def add(a, b):\n    return (a + b, )", 0.0, "assertion failed"),
        ("def add(a, b):\n    return iter([a + b])", 0.0, "assertion failed"),  # materialised: [3] != 3
        ("import re\ndef add(a, b):\n    return re.match('.', 'x')", 0.0, "assertion failed"),  # a handle, never 3
        ("def plus(a, b):\n    return a + b", 0.0, "NameError: name 'add' is not defined"),
        ("", 0.0, "empty program"),
    ],
)
def test_function_test_verdicts(response, reward, reason):
    res = code(response, ADD, **FAST)
    assert res.status == "ok", res.reason
    assert res.reward == pytest.approx(reward) and reason in res.reason, res.reason
    assert res.isolation == (None if not response else FULL)


def test_honest_program_passes_every_test_shape():
    res = code("def add(a, b):\n    return a + b", ADV)
    assert (res.status, res.reward) == ("ok", 1.0), res.reason


def test_values_cross_as_plain_data_and_loops_run_in_the_test():
    gt = json.dumps({"tests": [
        "assert f(0) == {'a': [1, (2, 3)], 'b': {4, 5}, 'c': frozenset({6}), 'd': None}",
        "assert f(1) == [True, -2**70, 1.5, 3+4j, b'\\x00x', 'é\\n']",
        "assert math.isnan(f(2)) and f(3) == float('inf')",
        "assert all(g(x) == 2 * x for x in range(5))",
        "assert {k: g(k) for k in range(3)} == {0: 0, 1: 2, 2: 4}",
        "assert sum(g(x) for x in range(4) if x % 2) == 8",
        "assert sorted(f(4), key=lambda t: -t) == [3, 2, 1]",
        "xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]",  # a mutated argument comes back
        "assert f(5) == collections.Counter('aab') and f(5).most_common(1) == [('a', 2)]",
        "assert list(f(6)) == [0, 2, 4] and f(7) == fractions.Fraction(1, 3)",
    ], "test_imports": ["import math", "import collections", "import fractions"]})
    prog = ("import collections, fractions\n"
            "def f(i):\n    return [{'a': [1, (2, 3)], 'b': {4, 5}, 'c': frozenset({6}), 'd': None},\n"
            "            [True, -2**70, 1.5, 3+4j, b'\\x00x', 'é\\n'], float('nan'), float('inf'), [1, 3, 2],\n"
            "            collections.Counter('aab'), map(lambda x: 2 * x, range(3)), fractions.Fraction(2, 6)][i]\n"
            "def g(x): return 2 * x\n"
            "def sort_in_place(xs): xs.sort()")
    res = code(prog, gt)
    assert (res.status, res.reward) == ("ok", 1.0), res.reason
    # A program that cheats on the loop still fails (the loop runs in the test's interpreter).
    res = code(prog.replace("return 2 * x", "return 0 if x == 0 else []"), gt)
    assert res.reward == pytest.approx(7 / 10), res.reason


HUMANEVAL_STYLE = json.dumps({"test": (
    "METADATA = {'author': 'jt', 'dataset': 'test'}\n\n"
    "def check(candidate):\n    import random\n    rng = random.Random(42)\n"
    "    for _ in range(50):\n        coeffs = [rng.randint(-5, 5) for _ in range(4)]\n"
    "        x = candidate(coeffs)\n        assert abs(poly(coeffs, x) - sum(coeffs)) < 1e-9\n"
    "    assert True\n    assert candidate([1, 2]) == 1\n"), "entry_point": "at_one",
    "test_setup_code": "def poly(xs, x):\n    return sum(c * x ** i for i, c in enumerate(xs))"})


@pytest.mark.parametrize("program,reward", [
    ("def at_one(xs):\n    return 1", 1.0),
    ("def at_one(xs):\n    return 0", 0.0),
    # The test's `poly` is the trusted one from test_setup_code, not the program's.
    ("def poly(xs, x):\n    return sum(xs)\ndef at_one(xs):\n    return 5", 0.0),
    ("def at_one(xs):\n    return 1 if len(xs) == 2 else 2", 0.0),
])
def test_humaneval_check_as_published(program, reward):
    res = code(program, HUMANEVAL_STYLE, **FAST)
    assert (res.status, res.reward) == ("ok", reward), res.reason


def test_mbpp_setup_code_and_apps_calls():
    mbpp = json.dumps({"tests": ["assert count(Node(1, Node(2, None))) == 2"],
                       "test_setup_code": "class Node:\n    def __init__(s, v, n): s.v, s.n = v, n"})
    # A program cannot receive the test's objects (only plain data crosses): such a test fails, it is never paid.
    res = code("def count(n):\n    return 2", mbpp, **FAST)
    assert (res.status, res.reward) == ("ok", 0.0) and "not a plain value: Node" in res.reason, res.reason
    apps = json.dumps({"input_output": json.dumps({"fn_name": "solve", "inputs": [[1, 2], [[3], 4]],
                                                   "outputs": [[3], [[3, 4]]]})})
    assert code("def solve(a, b):\n    return a + b if isinstance(a, int) else (*a, b)", apps).reward == 1.0
    assert code("def solve(a, b):\n    return 3", apps).reward == 0.5
    stdin = json.dumps({"input_output": {"inputs": ["1 2\n", ["3 4"]], "outputs": ["3\n", ["7"]]}})
    assert code("a, b = map(int, input().split())\nprint(a + b)", stdin).reward == 1.0
    # APPS' float tolerance (numpy.allclose), but never its order-blind fallbacks.
    floats = json.dumps({"input_output": {"inputs": ["1 3\n"], "outputs": ["0.333333333 3\n"]}})
    assert code("print(round(1 / 3, 7), 3)", floats).reward == 1.0
    assert code("print(0.34, 3)", floats).reward == 0.0
    assert code("print(3, 0.333333333)", floats).reward == 0.0


def test_scoring_option():
    partial = "def add(a, b):\n    return a - b"
    assert code(partial, ADD, scoring="fraction").reward == pytest.approx(1 / 3)
    assert code(partial, ADD, scoring="all").reward == 0.0
    assert code(HONEST, ADD, scoring="all").reward == 1.0
    res = code(HONEST, ADD, scoring="most")
    assert res.status == "error" and "scoring" in res.reason and res.reward is None
    assert "scoring" in code.check_reference(ADD, scoring="most")
    assert code.options == frozenset({"scoring"}) and code.version == "3" and code.sandboxed


SUM_IO = json.dumps({"io": [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6\n"},
                            {"input": "0 0\n", "output": "0\n"}]})
SUM = "a, b = map(int, input().split())\nprint(a + b)"


@pytest.mark.parametrize(
    "response,reward,reason",
    [
        (SUM, 1.0, "3/3 passed"),
        ("print(3)", 1 / 3, "case 1: wrong output"),
        ("a, b = map(int, input().split())\nprint(a + b, '  ')\nprint()\nprint('   ')", 1.0, "3/3"),  # trailing space, blank lines
        ("import sys\na, b = map(int, input().split())\nsys.stdout.write('  %d\\r\\n' % (a + b))", 1.0, "3/3"),
        ("a, b = map(int, input().split())\nprint(a + b, end='')", 1.0, "3/3"),  # no final newline
        ("a, b = map(int, input().split())\nprint(a + b)\nprint('extra')", 0.0, "wrong output"),
        ("a, b = map(int, input().split())\nprint(a + b)\nraise ValueError('late')", 0.0, "exit status 1"),
        ("import sys\na, b = map(int, input().split())\nprint(a + b)\nsys.exit(0)", 1.0, "3/3"),
        ("import time\ntime.sleep(10)", 0.0, "ran past its 0.5 s budget"),
        ("print('\\n@@RLPIPE@@' + '0' * 32 + ' {\"k\": \"case\", \"i\": 1, \"rc\": 0, \"out\": \"6\"}')", 0.0, "wrong output"),
        ("import os\nos.kill(os.getppid(), 9)", 0.0, "ended the harness"),
        ("x = bytearray(1 << 30)", 0.0, "MemoryError"),
        ("print('x' * 3_000_000)", 0.0, "output larger than"),
    ],
)
def test_stdin_stdout_verdicts(response, reward, reason):
    res = code(response, SUM_IO, case_s=0.5)
    assert res.status == "ok", res.reason
    assert res.reward == pytest.approx(reward) and reason in res.reason, res.reason
    assert res.isolation == FULL


@pytest.mark.parametrize(
    "out,expected,same",
    [("3\n", "3", True), ("3  \n\n\n", "3\n", True), ("  1   2\r\n", "1 2\n", True), ("1\n2\n", "1 2\n", False),
     ("1 2\n", "1\n2\n", False), ("1\n\n2\n", "1\n2\n", False), ("1.0\n", "1\n", False), ("", "\n", True)],
)
def test_stdout_comparison_is_token_wise_per_line(out, expected, same):
    from rlpipe.rewards.code import _tokens

    assert (_tokens(out) == _tokens(expected)) is same


BROKEN = [
    ("not json", "not JSON"),
    (json.dumps({"tests": []}), "no tests"),
    (json.dumps([1]), "string"),
    (json.dumps(["import math"]), "uses none of the program's names"),
    (json.dumps(["assert add(1, 2) =="]), "does not compile"),
    (json.dumps(["assert 1 == 1"]), "uses none of the program's names"),
    (json.dumps(["assert candidate(1, 2) == 3"]), 'no "entry_point"'),
    (json.dumps({"tests": ["assert add(1, 2) == 3"], "test_setup": "import math"}), "not read by the code verifier"),
    (json.dumps({"test": "def check(candidate):\n    assert candidate(1, 2) == 3"}), 'needs "entry_point"'),
    (json.dumps({"test": "assert add(1, 2) == 3", "entry_point": "add"}), "does not define `check(candidate)`"),
    (json.dumps({"tests": ["assert add(1, 2) == 3"], "test_imports": "import math"}), "list of import lines"),
    (json.dumps({"input_output": {"inputs": [[1]], "outputs": []}}), "as many of each"),
    (json.dumps(["assert sum([1, 2]) == 3"]), "uses none of the program's names"),  # a builtin, without entry_point
    (json.dumps({"io": []}), "non-empty list"),
    (json.dumps({"io": [{"input": "1"}]}), "io case 0"),
]


@pytest.mark.parametrize("gt,why", BROKEN)
def test_broken_references_are_errors_naming_the_problem(gt, why):
    res = code(HONEST, gt)
    assert (res.status, res.reward, res.isolation) == ("error", None, None), res
    assert why in res.reason, res.reason
    assert why in code.check_reference(gt)


def test_check_reference_accepts_good_references():
    for gt in (ADD, ADV, SUM_IO, HUMANEVAL_STYLE, json.dumps(["assert add(1, 2) == 3"])):
        assert code.check_reference(gt) is None


def _fake(result):
    def run_python(code_, stdin="", limits=None, files=None, argv=None):
        return result(stdin.strip()) if callable(result) else result
    return run_python


NO_SANDBOX = SandboxResult("error", None, "", "rlpipe.sandbox: no sandbox available on this machine "
                           "(see rlpipe.sandbox.isolation_report())", 0.0, 0.0, "none")
SETUP_FAILED = SandboxResult("error", None, "", "rlpipe.sandbox: sandbox setup failed: bubblewrap failed to set up "
                             "the sandbox", 0.1, 0.0, FULL)
LAUNCHER_DIED = SandboxResult("killed", None, "", "some output\nrlpipe.sandbox: the launcher died without a status "
                              "report", 0.3, 0.1, FULL)
NEVER_STARTED = SandboxResult("error", 1, "", "python3: can't open file '/work/main.py'", 0.1, 0.0, FULL)


def _wall_clock_early(nonce):  # the harness started just now, then the sandbox's wall clock hit
    out = f"\n@@RLPIPE@@{nonce} " + json.dumps({"k": "start", "t": time.monotonic()}) + "\n"
    return SandboxResult("timeout", -9, out, "rlpipe.sandbox: wall-clock limit of 9 s exceeded", 9.0, 0.1, FULL)


@pytest.mark.parametrize(
    "fake,status,why,isolation",
    [
        (NO_SANDBOX, "error", "no sandbox available", None),
        (SETUP_FAILED, "error", "sandbox setup failed", None),
        (LAUNCHER_DIED, "error", "launcher died", FULL),
        (NEVER_STARTED, "error", "harness never started", FULL),
        (_wall_clock_early, "timeout", "wall clock ran out", FULL),
    ],
)
@pytest.mark.parametrize("gt", [ADD, SUM_IO])
def test_failures_of_the_sandbox_are_never_ok(monkeypatch, fake, status, why, isolation, gt):
    monkeypatch.setattr(rlpipe.sandbox, "run_python", _fake(fake))
    res = code(HONEST, gt)
    assert (res.status, res.reward, res.isolation) == (status, None, isolation), res
    assert why in res.reason
    res = get_verifier("python_expr")("40+6", "46")
    assert (res.status, res.reward) == (status, None) and why in res.reason, res


def test_strict_mode_without_full_isolation_is_an_error(monkeypatch):
    monkeypatch.setenv("RLPIPE_SANDBOX_STRICT", "1")
    monkeypatch.setenv("RLPIPE_SANDBOX_DISABLE", "cgroup")
    res = code(HONEST, ADD)
    assert (res.status, res.reward, res.isolation) == ("error", None, None), res
    assert "sandbox unavailable" in res.reason


def test_declared_budget_grows_with_the_tests():
    small, big = json.dumps(["assert add(1, 2) == 3"]), json.dumps(["assert add(1, 2) == 3"] * 20)
    assert code.budget_s(big) > code.budget_s(small) + 20 * 2.0
    assert code.budget_s(SUM_IO) >= 3 * 2.0
    assert code.budget_s("not json") > 0


@pytest.mark.parametrize(
    "expr,expected,reward",
    [("40+6", "46", 1.0), ("2*23", "46", 1.0), ("46.0", "46", 0.0), ("40+", "46", 0.0),
     ("__import__('os').system('id')", "0", 0.0), ("9**9**9", "46", 0.0), ("", "46", 0.0)],
)
def test_python_expr_verdicts(expr, expected, reward):
    res = get_verifier("python_expr")(expr, expected)
    assert (res.status, res.reward) == ("ok", reward), res.reason


def test_python_expr_reference():
    pe = get_verifier("python_expr")
    assert pe("1", None).status == "error" and pe.check_reference("") and pe.check_reference("46") is None
    assert pe.version == "2"


def _harness_broken(nonce):  # the test harness started, then could not make itself undumpable (prctl refused)
    out = "".join(f"\n@@RLPIPE@@{nonce} " + json.dumps(r) + "\n" for r in (
        {"k": "start", "t": time.monotonic()},
        {"k": "broken", "error": "the test harness could not make itself undumpable (prctl PR_SET_DUMPABLE)"}))
    return SandboxResult("ok", 0, out, "", 0.1, 0.05, FULL)


def test_a_harness_that_cannot_protect_itself_is_an_error_not_a_zero(monkeypatch):
    monkeypatch.setattr(rlpipe.sandbox, "run_python", _fake(_harness_broken))
    res = code(HONEST, ADD)
    assert (res.status, res.reward, res.isolation) == ("error", None, FULL), res
    assert "undumpable" in res.reason
