"""The programs that run *inside* the sandbox for the code verifiers (stdlib only, /usr/bin/python3).

They only report: values of test operands (function tests), a program's stdout per case
(stdin/stdout tests) or an expression's ``repr`` — never a verdict. Every report line carries the
run's nonce and goes to a private copy of the real stdout. Judging happens in
:mod:`rlpipe.rewards.code_split`, outside the sandbox.
"""


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
