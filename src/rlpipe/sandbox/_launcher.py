"""Sandbox launcher: run by the *system* Python (``python3 -I -S _launcher.py SPEC``), never imported.

It is the trusted process between rlpipe and the sandbox. It stays with the privileges it was
started with (root in the full level) so the sandboxed code, running under another uid, can
neither signal nor ptrace it. It

1. makes itself a child subreaper, so nothing the sandbox starts (``setsid``, double fork) can be
   re-parented away from it, and asks for SIGTERM if rlpipe dies;
2. waits until rlpipe has moved it into the run's cgroups (so all it forks is born inside; it
   shields itself from the run's OOM killer), then forks the sandbox process, which drops to the
   worker uid/gid (no supplementary groups), sets its rlimits, optionally installs the seccomp
   filter itself (the no-bubblewrap fallback; bubblewrap installs it otherwise) and execs;
3. reaps everything, and once the sandbox process has exited -- or SIGTERM arrives (wall-clock
   timeout) -- SIGKILLs every process that is left: its own descendants and, when it has a worker
   uid to itself, every process of that uid; if rlpipe died, it also removes the run's cgroups;
4. writes one status record to the status fd: the wait status of the sandbox process, the CPU
   time of everything it reaped, timestamps, bubblewrap's own status.

Kept to the standard library, to syntax old system Pythons accept, and to cheap imports (it
starts once per run): the spec and the status travel as ``marshal`` (format 2: plain dicts, lists,
strings, numbers), ``_signal`` avoids ``signal``'s enum machinery.

It is one file of over 400 lines because it runs as a script under ``-I``: no module beside it
can be imported, so everything it needs lives here.
"""

import _signal as signal
import ctypes
import errno
import marshal
import os
import resource
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
PR_SET_CHILD_SUBREAPER = 36


class _Terminate(Exception):
    pass


def _on_term(signum, frame):
    raise _Terminate()


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _prctl(libc, *args):
    args = [ctypes.c_ulong(a) if isinstance(a, int) else a for a in args]
    while len(args) < 5:
        args.append(ctypes.c_ulong(0))
    if libc.prctl(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, "prctl(%s): %s" % (args[0].value, os.strerror(err)))


def _seccomp_prog(bpf):
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    return buf, _SockFprog(len(bpf) // 8, ctypes.addressof(buf))


def _install_seccomp(libc, prog):
    _prctl(libc, PR_SET_NO_NEW_PRIVS, 1)
    _prctl(libc, PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog))


def _read_all(fd):
    chunks = []
    os.lseek(fd, 0, os.SEEK_SET)
    while True:
        b = os.read(fd, 1 << 16)
        if not b:
            break
        chunks.append(b)
    os.close(fd)
    return b"".join(chunks)


def _proc_table():
    """{pid: (ppid, uids, state)} for every process we can see."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/status" % name) as fh:
                text = fh.read()
        except OSError:
            continue
        ppid, uids, state = 0, (), "?"
        for line in text.splitlines():
            if line.startswith("PPid:"):
                ppid = int(line.split()[1])
            elif line.startswith("Uid:"):
                uids = tuple(int(x) for x in line.split()[1:5])
            elif line.startswith("State:"):
                state = line.split()[1]
        table[int(name)] = (ppid, uids, state)
    return table


def _status_of(pid):
    try:
        with open("/proc/%d/status" % pid) as fh:
            text = fh.read()
    except OSError:
        return None
    ppid, uids = 0, ()
    for line in text.splitlines():
        if line.startswith("PPid:"):
            ppid = int(line.split()[1])
        elif line.startswith("Uid:"):
            uids = tuple(int(x) for x in line.split()[1:5])
    return ppid, uids


def _signal_pid(pid, sig, still_ours):
    """Signal pid if still_ours(ppid, uids) holds once we hold a pidfd on it (no pid-reuse race)."""
    opener = getattr(os, "pidfd_open", None)
    sender = getattr(signal, "pidfd_send_signal", None)
    try:
        if opener and sender:
            fd = opener(pid)
            try:
                st = _status_of(pid)
                if st is not None and still_ours(*st):
                    sender(fd, sig)
            finally:
                os.close(fd)
        else:
            st = _status_of(pid)
            if st is not None and still_ours(*st):
                os.kill(pid, sig)
    except OSError:
        pass


def _kill_leftovers(kill_uid):
    """SIGKILL our descendants and (if given) every process of kill_uid. Returns how many."""
    me = os.getpid()
    table = _proc_table()
    children = {}
    for pid, (ppid, _uids, _state) in table.items():
        children.setdefault(ppid, []).append(pid)
    doomed = set()
    stack = list(children.get(me, ()))
    while stack:
        pid = stack.pop()
        if pid in doomed:
            continue
        doomed.add(pid)
        stack.extend(children.get(pid, ()))
    if kill_uid is not None:
        for pid, (_ppid, uids, _state) in table.items():
            if kill_uid in uids:
                doomed.add(pid)
    parents = doomed | {me}

    def still_ours(ppid, uids):
        return ppid in parents or (kill_uid is not None and kill_uid in uids)

    live = [p for p in doomed if table[p][2] != "Z"]
    for pid in live:
        _signal_pid(pid, signal.SIGKILL, still_ours)
    return len(live)


def _reap_all(kill_uid, main_pid, result, grace=0.05):
    """Reap until we have no children; SIGKILL what is left after `grace` seconds (and again every
    50 ms). Fills result['status'] if the main child is reaped here.

    Everything the sandbox starts descends from us (we are its subreaper), so once we have no
    children there is nothing left; the /proc sweeps only run while children remain."""
    now = time.monotonic()
    deadline = now + 10.0
    next_sweep = now + grace
    while True:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                break
            if pid == main_pid and result.get("status") is None:
                result["status"] = status
        now = time.monotonic()
        if now >= next_sweep:
            _kill_leftovers(kill_uid)
            next_sweep = now + 0.05
        if now > deadline:
            result["reap_timeout"] = True
            return
        time.sleep(0.001)


def _in_group(pid, name):
    try:
        with open("/proc/%d/cgroup" % pid) as fh:
            return any(line.rstrip().endswith("/" + name) for line in fh)
    except OSError:
        return False


def _remove_groups(groups, wait_s=5.0):
    """Step out of the run's cgroups (into their parents) and rmdir them. Everything we started
    is reaped by now, but the kernel may still count a task that is leaving (EBUSY): SIGKILL what
    the group lists (re-checked under a pidfd) and retry, for at most wait_s. A group still there
    after that is swept by rlpipe's next start (its owner is dead)."""
    me = os.getpid()
    for group in groups:
        try:
            with open(os.path.join(os.path.dirname(group), "cgroup.procs"), "w") as fh:
                fh.write(str(me))
        except OSError:
            pass
    deadline = time.monotonic() + wait_s
    left = list(groups)
    while left:
        for group in list(left):
            try:
                os.rmdir(group)
                left.remove(group)
            except FileNotFoundError:
                left.remove(group)
            except OSError as e:
                if e.errno != errno.EBUSY:
                    left.remove(group)
        if not left or time.monotonic() > deadline:
            return
        for group in left:
            name = os.path.basename(group)
            try:
                with open(os.path.join(group, "cgroup.procs")) as fh:
                    pids = [int(x) for x in fh.read().split()]
            except (OSError, ValueError):
                pids = []
            for pid in pids:
                if pid != me:
                    _signal_pid(pid, signal.SIGKILL, lambda _ppid, _uids, pid=pid, name=name: _in_group(pid, name))
        time.sleep(0.01)


def _parse_bwrap_status(fd):
    """bubblewrap's JSON status documents, flattened: {"child-pid": N, "exit-code": N, ...}.

    Every value bubblewrap writes is an integer, so a tiny scanner does (no json import)."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while len(data) < 65536:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    except BlockingIOError:
        pass
    os.close(fd)
    out = {}
    text = data.decode("utf-8", "replace")
    for part in text.replace("{", ",").replace("}", ",").replace("\n", ",").split(","):
        key, sep, value = part.partition(":")
        key, value = key.strip().strip('"'), value.strip()
        if sep and key and value.lstrip("-").isdigit():
            out[key] = int(value)
    return out


def _child(spec, libc, bpf, status_fd, errpipe_w, launcher_pid):
    """In the forked child: confine ourselves, then exec. Never returns."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.close(status_fd)
        # The launcher is shielded from the run's OOM killer; the sandbox must not be.
        try:
            with open("/proc/self/oom_score_adj", "w") as fh:
                fh.write("0")
        except OSError:
            pass
        limits = [(getattr(resource, name), (soft, hard)) for name, soft, hard in spec.get("rlimits", [])]
        keep = _seccomp_prog(bpf) if bpf is not None else None  # buffer must outlive the prctl
        prog = keep[1] if keep is not None else None
        argv = spec["argv"]
        env = spec.get("env", {})
        uid = spec.get("uid")
        if uid is not None:
            gid = spec["gid"]
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            if os.getuid() != uid or os.geteuid() != uid:
                raise OSError("uid switch failed")
        # Die with the launcher, whatever happens to it (set after the uid switch, which clears it).
        _prctl(libc, PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != launcher_pid:
            raise OSError("launcher exited")
        os.chdir(spec.get("cwd", "/"))
        if spec.get("umask") is not None:
            os.umask(spec["umask"])
        # Limits last (after the uid switch: RLIMIT_NPROC then counts the worker uid), as little
        # Python as possible runs under them.
        for res, pair in limits:
            resource.setrlimit(res, pair)
        if prog is not None:
            _install_seccomp(libc, prog)
        os.execve(argv[0], argv, env)
    except BaseException as exc:  # report to the launcher, never to the sandbox's stderr
        try:
            os.write(errpipe_w, ("%s: %s" % (type(exc).__name__, exc)).encode("utf-8", "replace"))
        finally:
            os._exit(127)


class _Launch:
    """One run as the launcher sees it: rlpipe's spec, the sandbox process, the status record."""

    def __init__(self, spec, t_start, libc):
        self.spec = spec
        self.status_fd = spec["status_fd"]
        self.kill_uid = spec.get("kill_uid")
        self.result = {"status": None, "t_launcher": t_start}
        self.libc = libc
        self.main_pid = None

    def finish(self, extra):
        """Write the status record and exit; never returns."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.result.update(extra)
        if os.getppid() != self.spec["parent_pid"]:
            # rlpipe is gone and cannot clean up; we outlive it, so the run's groups go with us.
            _remove_groups([os.path.dirname(p) for p in self.spec.get("cgroup_procs", [])])
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.result["cpu_s"] = ru.ru_utime + ru.ru_stime
        self.result["maxrss_kb"] = ru.ru_maxrss
        try:
            os.write(self.status_fd, marshal.dumps(self.result, 2))
        finally:
            os._exit(0)

    def settle(self):
        """Step 1 and the start of step 2: become the subreaper, tied to rlpipe; wait for "go"."""
        spec = self.spec
        _prctl(self.libc, PR_SET_CHILD_SUBREAPER, 1)
        _prctl(self.libc, PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != spec["parent_pid"]:  # rlpipe died before the line above
            self.finish({"setup_error": "parent exited"})
        if spec.get("go_fd") is None:
            return
        # rlpipe moves us into the run's cgroups while we start up (a cgroup migration takes a
        # while; this hides it), then says go. Everything we fork is born inside.
        if os.getuid() == 0:
            try:
                with open("/proc/self/oom_score_adj", "w") as fh:
                    fh.write("-1000")
            except OSError:
                pass
        go = os.read(spec["go_fd"], 1)
        os.close(spec["go_fd"])
        if go != b"1":
            self.finish({"setup_error": "rlpipe did not start the run"})

    def start_sandbox(self):
        """Step 2: fork the sandbox process and wait until it has exec'd (a setup error ends the
        run). Returns the read end of bubblewrap's JSON status pipe, or None."""
        spec = self.spec
        bpf = _read_all(spec["seccomp_fd"]) if spec.get("seccomp_fd") is not None else None
        js_r = js_w = None
        if spec.get("bwrap_json_status"):
            # bubblewrap reports {"child-pid": N} once the sandbox is up: proof that a failure
            # was the code's and not bubblewrap's own setup.
            js_r, js_w = os.pipe()
            os.set_inheritable(js_r, False)
            os.set_inheritable(js_w, True)
            spec["argv"] = [spec["argv"][0], "--json-status-fd", str(js_w)] + spec["argv"][1:]
        r, w = os.pipe()  # the child's setup error, if any; closed on exec
        os.set_inheritable(r, False)
        os.set_inheritable(w, False)
        launcher_pid = os.getpid()
        self.result["t_fork"] = time.monotonic()
        self.main_pid = os.fork()
        if self.main_pid == 0:
            os.close(r)
            _child(spec, self.libc, bpf, self.status_fd, w, launcher_pid)
        os.close(w)
        if js_w is not None:
            os.close(js_w)
        if spec.get("seccomp_fd") is not None:
            try:
                os.close(spec["seccomp_fd"])
            except OSError:
                pass
        err = _read_to_end(r)
        self.result["started"] = time.monotonic()
        if err:
            _reap_all(self.kill_uid, self.main_pid, self.result, grace=0.0)
            self.finish({"setup_error": err.decode("utf-8", "replace")})
        return js_r

    def wait_sandbox(self, js_r):
        """Steps 3 and 4: wait for the sandbox process, reaping orphans re-parented to us as they
        come; then kill and reap what is left and report."""
        result = self.result
        while result.get("status") is None:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            if pid == self.main_pid:
                result["status"] = status
        result["ended"] = time.monotonic()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _reap_all(self.kill_uid, self.main_pid, result)
        if js_r is not None:
            result["bwrap_status"] = _parse_bwrap_status(js_r)
        self.finish({})


def _read_to_end(fd):
    """Everything a pipe delivers until EOF; closes it."""
    data = b""
    while True:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    os.close(fd)
    return data


def main():
    t_start = time.monotonic()
    spec = marshal.loads(bytes.fromhex(sys.argv[1]))
    os.set_inheritable(spec["status_fd"], False)
    signal.signal(signal.SIGTERM, _on_term)
    run = _Launch(spec, t_start, _libc())
    try:
        run.settle()
        run.wait_sandbox(run.start_sandbox())
    except _Terminate:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        run.result["terminated"] = True
        run.result["ended"] = time.monotonic()
        _reap_all(run.kill_uid, run.main_pid, run.result, grace=0.0)
        run.finish({})
    except BaseException as exc:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _reap_all(run.kill_uid, run.main_pid, run.result, grace=0.0)
        run.finish({"setup_error": "launcher: %s: %s" % (type(exc).__name__, exc)})


if __name__ == "__main__":
    main()
