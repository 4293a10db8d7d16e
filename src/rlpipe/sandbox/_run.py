"""One run of a program under a plan: prepare the host side (slot, uid, cgroup, memfds or a work
dir), spawn the launcher, collect its output under the wall clock, classify how the program ended,
and release everything the run held, whatever happened."""

from __future__ import annotations

import itertools
import logging
import marshal
import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlpipe.sandbox import _cgroup
from rlpipe.sandbox._bwrap import _bwrap_spec
from rlpipe.sandbox._program import _SANDBOX_ENV, _check_files, _enc, _memfd, _python_cmd, _rlimits
from rlpipe.sandbox._slots import _pool, _uid_base
from rlpipe.sandbox._sweep import _kill_uid, _remove_files_of
from rlpipe.sandbox._types import SandboxLimits, SandboxResult, _Plan

log = logging.getLogger("rlpipe.sandbox")

_LAUNCHER = str(Path(__file__).with_name("_launcher.py"))
_MEMORY_HEADROOM = 16 << 20  # cgroup allowance for the launcher and bubblewrap's two helpers
_TERM_GRACE_S = 3.0  # SIGTERM to the launcher -> SIGKILL
_DRAIN_GRACE_S = 1.0  # after the launcher is gone, how long pipes may stay open
_SIGNAL_NAMES = {s.value: s.name for s in signal.Signals}
_MEMORY_ERROR = re.compile(rb"(^|\n)(MemoryError\b|Fatal Python error: .*(memory|MemoryError))")

_run_counter = itertools.count()


@dataclass
class _Run:
    """What one run holds on the host; :func:`_release` gives back whatever of it was taken."""

    slot: int
    lock_fd: int
    uid: int | None  # the worker uid (None: the caller's own)
    name: str
    t_begin: float
    fds: list[int] = field(default_factory=list)  # ours to close
    cg: _cgroup.RunCgroup | None = None
    workdir: str | None = None  # the host work dir of a run without bubblewrap
    proc: subprocess.Popen | None = None  # the launcher
    stdin_fd: int | None = None
    status_r: int | None = None  # the launcher's status record arrives here
    go_w: int | None = None  # "go" to the launcher once it is in the run's cgroups
    clean: bool = False  # nothing of the run survived: the slot is not dirty

    def memfd(self, name: str, data: bytes) -> int:
        fd = _memfd(name, data)
        self.fds.append(fd)
        return fd

    def pipe(self) -> tuple[int, int]:
        r, w = os.pipe()
        self.fds += [r, w]
        return r, w


def _execute(code: str, stdin: str, limits: SandboxLimits, files: dict[str, str] | None,
             argv: list[str] | None, plan: _Plan, binds: list[tuple[str, str]] | None = None,
             ro_binds: list[tuple[str, str]] | None = None) -> SandboxResult:
    files = _check_files(files)
    argv = [str(x) for x in (argv or [])]
    if any("\0" in x for x in argv):
        raise ValueError("argv entries may not contain NUL")
    t_begin = time.monotonic()
    slot, lock_fd, dirty = _pool.acquire(max(60.0, 3 * limits.wall_s), check_uid=plan.uid_switch)
    uid = _uid_base() + slot if plan.uid_switch else None
    run = _Run(slot, lock_fd, uid, f"slot{slot}-{os.getpid()}-{next(_run_counter)}", t_begin)
    try:
        _prepare_host(run, plan, limits, dirty)
        spec, pass_fds = _launch_spec(run, plan, limits, stdin)
        if plan.bwrap:
            more, fds = _bwrap_spec(plan, uid, limits, code, files, argv, binds, ro_binds, run.memfd)
        else:
            more, fds = _direct_spec(run, plan, code, files, argv)
        spec.update(more)
        t_spawn = _spawn(run, plan, spec, pass_fds + fds)
        out, err, status, timed_out, truncated = _collect(run.proc, run.status_r, limits, t_spawn)
        os.close(run.status_r)
        run.fds.remove(run.status_r)
        oom = run.cg.oom_killed() if run.cg is not None else False
        run.clean = True
        return _classify(plan, limits, out, err, status, timed_out, truncated, oom, time.monotonic() - t_spawn)
    finally:
        _release(run)


def _prepare_host(run: _Run, plan: _Plan, limits: SandboxLimits, dirty: bool) -> None:
    """Sweep what a crashed last holder of the slot left, and make the run's cgroup."""
    if dirty and run.uid is not None:
        _kill_uid(run.uid)
    if plan.cgroup is not None:
        if dirty:  # its last holder crashed mid-run: sweep what dead processes left
            plan.cgroup.remove_stale()
        # Named by pid and start time, so a dead process's leftovers are never taken for ours.
        name = f"slot{run.slot}-{_cgroup.owner_id() or os.getpid()}"
        # +1 task for the launcher, +2 for bubblewrap's monitor and reaper.
        run.cg = plan.cgroup.prepare(name, (limits.memory_mb << 20) + _MEMORY_HEADROOM,
                                     limits.max_processes + 1 + (2 if plan.bwrap else 0))


def _launch_spec(run: _Run, plan: _Plan, limits: SandboxLimits, stdin: str) -> tuple[dict, list[int]]:
    """The launcher's spec and the fds it inherits, as far as they do not depend on bubblewrap:
    stdin (a read-only view of a memfd), the status pipe, rlimits, the cgroup "go" pipe, the uid."""
    stdin_mem = run.memfd("stdin", _enc(stdin))
    run.stdin_fd = os.open(f"/proc/self/fd/{stdin_mem}", os.O_RDONLY | os.O_CLOEXEC)  # read-only view
    run.fds.append(run.stdin_fd)
    run.status_r, status_w = run.pipe()
    pass_fds = [status_w]
    spec: dict = {"status_fd": status_w, "parent_pid": os.getpid(), "rlimits": _rlimits(
        limits, 2 if plan.bwrap else 0, shared_uid=run.uid is None)}
    if run.cg is not None:
        spec["cgroup_procs"] = [str(p) for p in run.cg.procs_files]  # the launcher removes them if we die
        go_r, run.go_w = run.pipe()
        pass_fds.append(go_r)
        spec["go_fd"] = go_r
    if run.uid is not None:
        spec.update(uid=run.uid, gid=run.uid, kill_uid=run.uid)
    return spec, pass_fds


def _direct_spec(run: _Run, plan: _Plan, code: str, files: dict[str, str],
                 argv: list[str]) -> tuple[dict, list[int]]:
    """Without bubblewrap: a private host work dir owned by the worker uid; the launcher installs
    the seccomp filter itself."""
    run.workdir = tempfile.mkdtemp(prefix=f"rlpipe-sbx-{run.name}-")  # 0700, ours
    wd, tmp = Path(run.workdir) / "work", Path(run.workdir) / "tmp"
    wd.mkdir()
    tmp.mkdir()
    (wd / "main.py").write_bytes(_enc(code))
    for rel, content in files.items():
        (wd / rel).parent.mkdir(parents=True, exist_ok=True)
        (wd / rel).write_bytes(_enc(content))
    if run.uid is not None:
        for root, dnames, fnames in os.walk(run.workdir):
            for n in [*dnames, *fnames]:
                os.chown(os.path.join(root, n), run.uid, run.uid)
        os.chown(run.workdir, run.uid, run.uid)
    spec: dict = {}
    pass_fds = []
    if plan.bpf is not None:
        spec["seccomp_fd"] = run.memfd("seccomp", plan.bpf)
        pass_fds.append(spec["seccomp_fd"])
    env = dict(_SANDBOX_ENV, HOME=str(wd), TMPDIR=str(tmp))
    spec.update(argv=_python_cmd(plan.python, argv), env=env, cwd=str(wd), umask=0o077)
    return spec, pass_fds


def _spawn(run: _Run, plan: _Plan, spec: dict, pass_fds: list[int]) -> float:
    """Start the launcher, move it into the run's cgroups, say go; close all but the status pipe.
    Returns the start time."""
    run.proc = subprocess.Popen(
        [plan.python, "-I", "-S", _LAUNCHER, marshal.dumps(spec, 2).hex()],
        stdin=run.stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=pass_fds,
        close_fds=True, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, cwd="/", start_new_session=True,
    )
    t_spawn = time.monotonic()
    if run.cg is not None:
        # Into the run's cgroups before the launcher forks anything (it waits for "go").
        for f in run.cg.procs_files:
            with open(f, "w") as fh:
                fh.write(str(run.proc.pid))
        os.write(run.go_w, b"1")
    for fd in list(run.fds):
        if fd != run.status_r:
            os.close(fd)
            run.fds.remove(fd)
    return t_spawn


def _release(run: _Run) -> None:
    """Kill what is left of the run (launcher, cgroup, uid), remove its files, free its slot.
    The slot stays dirty (swept by its next holder) unless all of that worked."""
    try:
        if run.proc is not None:
            if run.proc.poll() is None:
                run.proc.kill()
                run.proc.wait()
            run.proc.stdout.close()
            run.proc.stderr.close()
        left = True
        if run.cg is not None:
            left = not run.cg.kill_all()
        if run.uid is not None and (left or run.cg is None or not run.clean):
            if not _kill_uid(run.uid):
                run.clean = False
                log.error("rlpipe.sandbox: processes of uid %d survived SIGKILL", run.uid)
        elif run.cg is not None and left:
            run.clean = False
            log.error("rlpipe.sandbox: cgroup %s still has processes", run.cg.name)
        if run.workdir is not None:
            shutil.rmtree(run.workdir, ignore_errors=True)
            if run.uid is not None:
                _remove_files_of(run.uid)
    finally:
        for fd in run.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        _pool.release(run.slot, run.lock_fd, run.clean)
        log.debug("rlpipe.sandbox: run %s took %.3f s", run.name, time.monotonic() - run.t_begin)


class _WallClock:
    """The wall clock of one run: SIGTERM to the launcher at the deadline, SIGKILL
    ``_TERM_GRACE_S`` later; once the launcher is gone its pipes get ``_DRAIN_GRACE_S`` more."""

    def __init__(self, proc: subprocess.Popen, deadline: float) -> None:
        self.proc = proc
        self.deadline = deadline
        self.timed_out = False
        self.term_at: float | None = None
        self.kill_at: float | None = None
        self.gone_at: float | None = None

    def tick(self, now: float) -> bool:
        """Signal the launcher as the clock says; False once reading should stop."""
        if not self.timed_out and now >= self.deadline:
            self.timed_out = True
            self.term_at = now
            _signal_launcher(self.proc, signal.SIGTERM)
        if self.term_at is not None and self.kill_at is None and now >= self.term_at + _TERM_GRACE_S:
            self.kill_at = now
            _signal_launcher(self.proc, signal.SIGKILL)
        if self.gone_at is None and self.proc.poll() is not None:
            self.gone_at = now
        # Past the drain grace something outside the launcher holds a pipe; the caller's sweep kills it.
        return not (self.gone_at is not None and now >= self.gone_at + _DRAIN_GRACE_S)

    def wait_s(self, now: float) -> float:
        """How long to wait for output before the clock must tick again."""
        waits = [t - now for t in (self.deadline if not self.timed_out else None,
                                   self.term_at + _TERM_GRACE_S if self.term_at and not self.kill_at else None,
                                   self.gone_at + _DRAIN_GRACE_S if self.gone_at else None) if t is not None]
        timeout = max(0.0, min(waits)) if waits else 0.05
        return min(timeout, 0.25)


def _collect(proc: subprocess.Popen, status_r: int, limits: SandboxLimits, t0: float):
    """Read stdout/stderr (capped) and the launcher's status line; enforce the wall clock."""
    cap = limits.max_output_bytes
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    status = bytearray()
    truncated = False
    sel = selectors.DefaultSelector()
    for fd in (*bufs, status_r):
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    clock = _WallClock(proc, t0 + limits.wall_s)
    try:
        while sel.get_map():
            now = time.monotonic()
            if not clock.tick(now):
                break
            for key, _ in sel.select(clock.wait_s(now)):
                fd = key.fd
                try:
                    chunk = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                elif fd == status_r:
                    status += chunk[: 1 << 20]
                else:
                    truncated |= _append_capped(bufs[fd], chunk, cap)
    finally:
        sel.close()
    _reap_launcher(proc)
    return (bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), _parse_status(status),
            clock.timed_out, truncated)


def _append_capped(buf: bytearray, chunk: bytes, cap: int) -> bool:
    """Append what fits under cap (the rest is dropped); True if anything was dropped."""
    room = cap - len(buf)
    if room > 0:
        buf += chunk[:room]
    return len(chunk) > room


def _reap_launcher(proc: subprocess.Popen) -> None:
    try:
        proc.wait(timeout=_TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        _signal_launcher(proc, signal.SIGKILL)
        proc.wait()


def _parse_status(status: bytes) -> dict:
    """The launcher's status record ({} if it wrote none or something unreadable)."""
    try:
        st = marshal.loads(bytes(status)) if status else {}
    except (ValueError, EOFError, TypeError):
        st = {}
    return st if isinstance(st, dict) else {}


def _signal_launcher(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except OSError:
        pass


def _classify(plan: _Plan, limits: SandboxLimits, out: bytes, err: bytes, st: dict, timed_out: bool,
              truncated: bool, oom: bool, parent_wall: float) -> SandboxResult:
    stdout = out.decode("utf-8", "replace")
    stderr = err.decode("utf-8", "replace")
    cpu = float(st.get("cpu_s") or 0.0)
    wall = (st["ended"] - st["started"]) if st.get("started") and st.get("ended") else parent_wall
    res = dict(stdout=stdout, stderr=stderr, wall_s=round(max(wall, 0.0), 4), cpu_s=round(cpu, 4),
               isolation=plan.level, truncated=truncated)

    def note(msg: str) -> str:
        return (stderr + ("\n" if stderr and not stderr.endswith("\n") else "") + msg) if msg else stderr

    why = _setup_failure(plan, st, timed_out, oom)
    if why:
        log.error("rlpipe.sandbox: sandbox setup failed: %s | %s", why, stderr[-500:])
        res["stderr"] = note(f"rlpipe.sandbox: sandbox setup failed: {why}")
        failed = SandboxResult(status="error", exit_code=None, **res)
        failed._setup_failed = True  # not a field: run_python raises on it in strict mode
        return failed
    if not st:
        res["stderr"] = note("rlpipe.sandbox: the launcher died without a status report")
        return SandboxResult(status="timeout" if timed_out else "killed", exit_code=None, **res)
    code, sig = _exit_of(plan, st, timed_out)
    status, msg = _verdict(limits, code, sig, cpu, timed_out, oom, err)
    if msg:
        res["stderr"] = note(msg)
    return SandboxResult(status=status, exit_code=-sig if sig is not None else code, **res)


def _setup_failure(plan: _Plan, st: dict, timed_out: bool, oom: bool) -> str | None:
    """Why the program never started (the launcher's or bubblewrap's setup failed), else None."""
    bwrap_status = st.get("bwrap_status") or {}
    # bubblewrap writes "exit-code" once the command has run; without it bubblewrap itself failed
    # (a bad mount, no user namespace, ...) and the code never started.
    bwrap_failed = (plan.bwrap and "--json-status-fd" in plan.bwrap_opts and st.get("status") is not None
                    and not timed_out and not oom and "exit-code" not in bwrap_status and not st.get("terminated"))
    if st.get("setup_error") or bwrap_failed:
        return st.get("setup_error") or "bubblewrap failed to set up the sandbox"
    return None


def _exit_of(plan: _Plan, st: dict, timed_out: bool) -> tuple[int | None, int | None]:
    """(exit code, killing signal) of the program from the launcher's wait status."""
    raw = st.get("status")
    code: int | None = None
    sig: int | None = None
    if raw is not None:
        if os.WIFSIGNALED(raw):
            sig = os.WTERMSIG(raw)
        elif os.WIFEXITED(raw):
            code = os.WEXITSTATUS(raw)
            # bubblewrap reports a command killed by signal N as exit status 128+N.
            if plan.bwrap and 128 < code <= 128 + 64 and (code - 128) in _SIGNAL_NAMES:
                sig, code = code - 128, None
    elif timed_out or st.get("terminated"):
        sig = signal.SIGKILL
    return code, sig


def _verdict(limits: SandboxLimits, code: int | None, sig: int | None, cpu: float, timed_out: bool,
             oom: bool, err: bytes) -> tuple[str, str]:
    """The result's status and the note for stderr ("" for none): the limit hit, else the exit."""
    if timed_out:
        return "timeout", f"rlpipe.sandbox: wall-clock limit of {limits.wall_s:g} s exceeded"
    if oom:
        return "memory", f"rlpipe.sandbox: cgroup memory limit of {limits.memory_mb} MB exceeded (OOM kill)"
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= max(1, math.ceil(limits.cpu_s)) * 0.95):
        return "timeout", f"rlpipe.sandbox: CPU limit of {limits.cpu_s:g} s exceeded"
    if sig is not None:
        return "killed", f"rlpipe.sandbox: killed by {_SIGNAL_NAMES.get(sig, sig)}"
    if code == 0:
        return "ok", ""
    if _MEMORY_ERROR.search(err[-4096:]):
        return "memory", ""
    return "error", ""
