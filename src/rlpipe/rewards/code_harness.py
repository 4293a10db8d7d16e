"""The programs that run *inside* the sandbox for the code verifiers (stdlib only, /usr/bin/python3).

Function tests: the test harness (CHECK_HARNESS, the test code's interpreter) reports one pass/fail per
test; the program runs in a second interpreter (PROGRAM_SERVER) that only answers calls with plain data.
stdin/stdout cases and expressions: the harness only reports the program's stdout or an expression's
``repr``, judged outside the sandbox. Every report line carries the run's nonce and goes to a
private copy of the real stdout, which the program never holds.

Over 400 lines as one idea: the source text of the three programs and of the pieces pasted into them
(the prelude, the value codec both interpreters share, the program server); each program reads top to
bottom here as the one script the sandbox runs.
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

# Values cross between the test harness and the program's interpreter as tagged JSON, in both
# directions (arguments one way, results the other). Each side rebuilds real objects of the types
# below and nothing else, so nothing the program built is ever compared. Subclasses of builtins are
# sent as their base type's value; iterators, generators, maps, filters, zips and dict views are
# materialised as lists (at most MAX_ITEMS items); namedtuples become tuples and defaultdicts dicts.
CODEC = r"""
import collections as _co, fractions as _fr, decimal as _dc
_MAX_ITEMS = 1000000

def enc(x, depth=0):
    if depth > 100:
        raise ValueError("value nested too deeply")
    if x is None or x is True or x is False:
        return x
    if isinstance(x, int):
        return ["i", int.__format__(int.__int__(x), "x")]
    if isinstance(x, float):
        return ["f", float.__repr__(x)]
    if isinstance(x, complex):
        return ["c", float.__repr__(complex.real.__get__(x)), float.__repr__(complex.imag.__get__(x))]
    if isinstance(x, str):
        return ["s", str.__str__(x)]
    if isinstance(x, (bytes, bytearray)):
        return ["y", bytes(x).hex()]
    if isinstance(x, _fr.Fraction):
        return ["Q", format(int(x.numerator), "x"), format(int(x.denominator), "x")]
    if isinstance(x, _dc.Decimal):
        return ["D", _dc.Decimal.__str__(x)]
    if isinstance(x, range):
        return ["R", x.start, x.stop, x.step]
    if isinstance(x, dict):
        tag = "C" if isinstance(x, _co.Counter) else "O" if isinstance(x, _co.OrderedDict) else "d"
        return [tag, [[enc(k, depth + 1), enc(v, depth + 1)] for k, v in list(dict.items(x))]]
    for cls, tag in ((list, "l"), (tuple, "t"), (set, "S"), (frozenset, "F"), (_co.deque, "Q_")):
        if isinstance(x, cls):
            return ["q" if tag == "Q_" else tag, [enc(y, depth + 1) for y in list(cls.__iter__(x))]]
    if hasattr(type(x), "__next__") or type(x).__name__ in ("dict_keys", "dict_values", "dict_items"):
        items = []
        for y in x:
            items.append(enc(y, depth + 1))
            if len(items) > _MAX_ITEMS:
                raise ValueError("iterator longer than %d items" % _MAX_ITEMS)
        return ["l", items]
    if any(x is t for t in _TYPES.values()):
        return ["T", x.__name__]
    return enc_other(x)

_TYPES = {t.__name__: t for t in (int, float, complex, str, bytes, bool, list, tuple, dict, set, frozenset, type(None))}
# A set is rebuilt through a frozenset, as a set literal of the test is: same table layout, so the same
# iteration order on both sides for ints (a test that depends on it, MBPP/341, judges as in MBPP's harness).
_SEQ = {"l": list, "t": tuple, "S": lambda it: set(frozenset(it)), "F": frozenset, "q": _co.deque}
_MAP = {"d": dict, "C": _co.Counter, "O": _co.OrderedDict}

def dec(x, depth=0):
    if x is None or type(x) is bool:
        return x
    if depth > 100 or type(x) is not list or not x or type(x[0]) is not str:
        raise ValueError("malformed value")
    tag, rest = x[0], x[1:]
    if tag == "i" and len(rest) == 1 and type(rest[0]) is str and len(rest[0]) <= 100000:
        return int(rest[0], 16)
    if tag == "f" and len(rest) == 1 and type(rest[0]) is str and len(rest[0]) <= 40:
        return float(rest[0])
    if tag == "c" and len(rest) == 2 and all(type(r) is str and len(r) <= 40 for r in rest):
        return complex(float(rest[0]), float(rest[1]))
    if tag == "s" and len(rest) == 1 and type(rest[0]) is str:
        return rest[0]
    if tag == "y" and len(rest) == 1 and type(rest[0]) is str:
        return bytes.fromhex(rest[0])
    if tag == "Q" and len(rest) == 2 and all(type(r) is str and len(r) <= 100000 for r in rest):
        return _fr.Fraction(int(rest[0], 16), int(rest[1], 16))
    if tag == "D" and len(rest) == 1 and type(rest[0]) is str and len(rest[0]) <= 1000:
        return _dc.Decimal(rest[0])
    if tag == "R" and len(rest) == 3 and all(type(r) is int for r in rest):
        return range(*rest)
    if tag == "T" and len(rest) == 1 and rest[0] in _TYPES:
        return _TYPES[rest[0]]
    if tag == "H" and len(rest) == 2 and type(rest[0]) is int and type(rest[1]) is str:
        return dec_handle(rest[0], rest[1][:80])
    if tag in _SEQ and len(rest) == 1 and type(rest[0]) is list:
        return _SEQ[tag](dec(v, depth + 1) for v in rest[0])
    if tag in _MAP and len(rest) == 1 and type(rest[0]) is list:
        if not all(type(kv) is list and len(kv) == 2 for kv in rest[0]):
            raise ValueError("malformed dict")
        return _MAP[tag](dict([(dec(k, depth + 1), dec(v, depth + 1)) for k, v in rest[0]]))
    raise ValueError("malformed value (tag %r)" % tag[:5])
"""

# The program's interpreter: a fresh /usr/bin/python3 started by the test harness. It runs the program
# as module ``__solution__`` (its ``if __name__ == "__main__":`` block does not run), then answers
# requests on a private pipe: which of the test's names the program defines, and calls. fds 0-2 are
# /dev/null, so the program's prints and reads never touch the channel.
PROGRAM_SERVER = r"""
import builtins, json, os, sys
_rd, _wr = os.dup(0), os.dup(1)
_null = os.open(os.devnull, os.O_RDWR)
for _fd in (0, 1, 2):
    os.dup2(_null, _fd)
sys.stdin, sys.stdout, sys.stderr = open(os.devnull), open(os.devnull, "w"), open(os.devnull, "w")
_inbox = os.fdopen(_rd, "rb")
_write, _exit, _dumps, _loads = os.write, os._exit, json.dumps, json.loads
""" + CODEC + r"""
objs, _index = [], {}

def enc_other(x):
    # An object that is not plain data stays here; the test gets a handle it can only pass back
    # (the same object, the same handle: they are kept alive, so id() stays theirs).
    i = _index.get(id(x))
    if i is None:
        objs.append(x)
        i = _index[id(x)] = len(objs) - 1
    return ["H", i, type(x).__name__]

def dec_handle(i, kind):
    return objs[i]

def send(obj):
    data = (_dumps(obj) + "\n").encode("utf-8", "replace")
    while data:
        data = data[_write(_wr, data):]

def describe(e):
    try:
        return (type(e).__name__ + ": " + str(e))[:300]
    except BaseException:
        return type(e).__name__

ns = {"__name__": "__solution__", "__builtins__": builtins}
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), ns)
except BaseException as e:
    send({"fatal": describe(e)})
    _exit(0)
if os.path.exists("setup.py"):
    # The test's setup code that builds objects from the program's classes (MBPP's test_setup_code):
    # it runs here, after the program; what it binds reaches the test as handles.
    try:
        exec(compile(open("setup.py").read(), "<test setup>", "exec"), ns)
    except BaseException as e:
        send({"fatal": "the test's setup code raised " + describe(e)})
        _exit(0)
send({"ready": True})

def name_kind(n):
    if n not in ns:
        return ["missing"]
    if callable(ns[n]):
        return ["f"]
    return ["v", enc(ns[n])]

def answer(req):
    if req.get("op") == "names":
        return {"names": {n: name_kind(n) for n in req["names"]}}
    args = [dec(a) for a in req["a"]]
    kwargs = {k: dec(v) for k, v in req["k"].items()}
    result = ns[req["n"]](*args, **kwargs)
    after = [enc(a) if isinstance(a, (list, dict, set)) else None for a in args]
    return {"v": enc(result), "a": after}

while True:
    line = _inbox.readline()
    if not line:
        _exit(0)
    try:
        reply = answer(_loads(line))
    except BaseException as e:
        reply = {"e": describe(e)}
    try:
        send(reply)
    except BaseException as e:
        send({"e": "the result cannot be sent: " + describe(e)})
"""

# Function tests, as published: the test code (reference text from the dataset) runs here, in the
# harness's own interpreter inside the sandbox; every name it takes from the program is a proxy whose
# calls go to the program's interpreter (PROGRAM_SERVER) and come back as plain data. Before the
# program starts the harness deletes the spec from disk, makes itself undumpable (so the program, the
# same uid, cannot read its memory or fds through /proc) and drops the writable work dir from
# sys.path (so a module the program writes there is never imported by a test). It reports one
# pass/fail per test; the program never sees the nonce, the spec or the report channel.
CHECK_HARNESS = _PRELUDE + r"""
import builtins, ctypes, select, signal, subprocess
os.unlink("spec.json")
sys.path[:] = [p for p in sys.path if p and not p.startswith(os.getcwd())]
try:
    _undumpable = ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE = 0
except Exception:
    _undumpable = False
if not _undumpable:  # without it the program could read the tests from this process's memory: no verdict
    emit(k="broken", error="the test harness could not make itself undumpable (prctl PR_SET_DUMPABLE)")
    _exit(0)
""" + CODEC + r"""
_mono, _loads = time.monotonic, json.loads

class Budget(BaseException):
    pass

class ProgramFault(Exception):
    pass

state = {"deadline": 0.0, "hard": 0.0}

def _alarm(signum, frame):
    if _mono() > state["hard"]:
        emit(k="done", error="a test did not give control back after its time budget")
        _exit(0)
    raise Budget()

signal.signal(signal.SIGALRM, _alarm)

class Program:
    # The program's interpreter; restarted after it dies or is killed for its time.
    def __init__(self):
        self.proc, self.buf, self.fatal = None, b"", None

    def start(self, seconds):
        self.proc = subprocess.Popen([sys.executable, "-B", "-I", "server.py"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        self.buf = b""
        try:
            first = self.recv(_mono() + seconds)
        except ProgramFault as e:
            first = {"fatal": str(e)}
        self.fatal = first.get("fatal") if "ready" not in first else None
        if self.fatal is not None:
            self.kill()

    def kill(self):
        if self.proc is not None:
            try:
                self.proc.kill()
                self.proc.wait()
            except Exception:
                pass
        self.proc = None

    def recv(self, deadline):
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - _mono()
            if left <= 0:
                self.kill()
                raise ProgramFault("the program ran past its time budget")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    self.kill()
                    raise ProgramFault("the program's interpreter exited")
                self.buf += chunk
                if len(self.buf) > spec["out_cap"]:
                    self.kill()
                    raise ProgramFault("the program sent a value larger than %d bytes" % spec["out_cap"])
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            msg = _loads(line)
        except ValueError:
            msg = None
        if type(msg) is not dict:
            raise ProgramFault("the program sent an unreadable reply")
        return msg

    def ask(self, req):
        if self.proc is None:
            raise ProgramFault("the program is not running")
        try:
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            self.kill()
            raise ProgramFault("the program's interpreter exited")
        return self.recv(state["deadline"])

program = Program()

class Handle:
    # An object of the program's (an instance of its class, a function it returned): it stays in the
    # program's interpreter; the test can compare handles by identity and pass them back, nothing more.
    def __init__(self, i, kind):
        self._id, self._kind = i, kind

    def __eq__(self, other):
        return isinstance(other, Handle) and other._id == self._id

    def __hash__(self):
        return hash(("rlpipe-handle", self._id))

    def __repr__(self):
        return "<program object of type %s>" % self._kind

def enc_other(x):
    if isinstance(x, Handle):
        return ["H", x._id, x._kind]
    raise TypeError("not a plain value: " + type(x).__name__)

def dec_handle(i, kind):
    return Handle(i, kind)

class Proxy:
    # A name the test takes from the program: calling it calls the program's function.
    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        reply = program.ask({"op": "call", "n": self._name, "a": [enc(a) for a in args],
                             "k": {str(k): enc(v) for k, v in kwargs.items()}})
        if "e" in reply:
            raise ProgramFault("%s raised %s" % (self._name, str(reply["e"])[:250]))
        try:
            value = dec(reply.get("v"))
            after = reply.get("a") or []
            for a, new in zip(args, after):
                if new is not None and type(a) in (list, dict, set):
                    new = dec(new)
                    if type(new) is type(a) and new != a:
                        a.clear()
                        (a.extend if type(a) is list else a.update)(new)
        except (ValueError, TypeError, RecursionError) as e:
            raise ProgramFault("the program sent an unreadable value (%s)" % e)
        return value

    def __repr__(self):
        return "<program function %s>" % self._name

def bind(env, seconds):
    # The program's names into a fresh test namespace: functions as proxies, other values rebuilt.
    if program.fatal is not None:
        raise ProgramFault(program.fatal)
    if program.proc is None:
        raise ProgramFault("the program was not restarted after it failed %d times" % (state["starts"] - 1))
    state["deadline"] = _mono() + seconds
    if spec["names"]:
        names = program.ask({"op": "names", "names": spec["names"]}).get("names") or {}
        for n in spec["names"]:
            kind = names.get(n) or ["missing"]
            if type(kind) is list and kind[0] == "f":
                env[n] = Proxy(n)
            elif type(kind) is list and kind[0] == "v" and len(kind) == 2:
                env[n] = dec(kind[1])
    if spec["entry_point"]:
        env["candidate"] = Proxy(spec["entry_point"])

def restart():
    # A fresh interpreter for the next test after the program died or was killed (a few times at most).
    if program.proc is None and program.fatal is None and state["starts"] <= spec["restarts"]:
        state["starts"] += 1
        try:
            program.start(spec["compile_s"] + spec["run_s"])
        except OSError as e:  # the first start is the harness's failure; a later one follows the program's doing
            if state["starts"] == 1:
                emit(k="broken", error="could not start the program's interpreter: %s" % e)
                _exit(0)
            program.proc = None
            return
        if program.fatal is not None:
            emit(k="fatal", error=program.fatal)
            _exit(0)

def apps_equal(out, expected):
    # APPS' own rule for call-based problems (testing_util.run_test).
    if isinstance(out, tuple):
        out = list(out)
    ok = out == expected
    if isinstance(expected, list) and expected:
        ok = ok or out == expected[0]
    return bool(ok)

def run_test(test, env):
    kind = test["kind"]
    if kind == "call":
        out = Proxy(spec["entry_point"])(*test["args"])
        if not apps_equal(out, test["expected"]):
            raise AssertionError("got %s" % repr(out)[:80])
        return
    exec(compile(test["code"], "<test %d>" % test["i"], "exec"), env)
    if kind == "check":
        env["check"](env["candidate"])

setup = {"__name__": "__test__", "__builtins__": builtins}
try:
    exec(compile(spec["setup"], "<test setup>", "exec"), setup)
except BaseException as e:
    emit(k="fatal", error="the reference's setup code raised " + (type(e).__name__ + ": " + str(e))[:200])
    _exit(0)
state["starts"] = 0
for test in spec["tests"]:
    env, seconds = dict(setup), test["s"]
    restart()
    state["hard"] = _mono() + seconds + spec["hard_grace_s"]
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds, 0.05)
        try:
            bind(env, seconds)
            run_test(test, env)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        emit(k="test", i=test["i"], ok=True)
    except Budget:
        program.kill()
        emit(k="test", i=test["i"], ok=False, error="ran past its time budget")
    except AssertionError as e:
        emit(k="test", i=test["i"], ok=False, error=("assertion failed " + str(e))[:300])
    except ProgramFault as e:
        emit(k="test", i=test["i"], ok=False, error=str(e)[:300])
    except BaseException as e:
        emit(k="test", i=test["i"], ok=False, error=(type(e).__name__ + ": " + str(e))[:300])
program.kill()
emit(k="done")
_exit(0)
"""

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
