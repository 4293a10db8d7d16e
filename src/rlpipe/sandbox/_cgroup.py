"""Per-run cgroups with a memory and a pids limit (cgroup v1 ``memory`` + ``pids``, or v2).

v1: the run's groups are made *under rlpipe's own* memory/pids groups (``…/rlpipe-sandbox/<run>``),
so whatever limits a container or job scheduler put on rlpipe still cover the sandbox.
v2: under ``<mount>/rlpipe-sandbox`` with ``+memory +pids`` delegated to it (needs a writable
root cgroup; inside a container whose namespace root holds processes this fails and the
sandbox runs without a cgroup, saying so).

Groups are named ``slot<N>-<pid>-<start>`` (``probe<ns>-<pid>-<start>`` while probing): the pid
and start time (``/proc/<pid>/stat``, clock ticks since boot) of the rlpipe process that made them,
so a group can always be told apart from one a dead process with a reused pid left behind. Who
removes a group:

* the process that made it, at exit (``atexit``; multiprocessing children, which leave through
  ``os._exit``, by multiprocessing's own exit hook);
* the run's launcher, when rlpipe died during a run: it outlives rlpipe, reaps the run and removes
  the run's groups before it exits (retrying while the kernel still reports them busy);
* anything else -- a process SIGKILLed between runs, a launcher killed too -- is swept by the next
  rlpipe process that sets the sandbox up (:meth:`CgroupManager.remove_stale`, run by
  :func:`detect`), or that takes over a slot a crashed run left dirty: every group whose owner is
  no longer alive is emptied and removed. An owner rlpipe cannot see (another pid namespace sharing
  the same cgroup base) looks dead: do not share a base across pid namespaces.

Nothing here runs at import time. The module is over 400 lines because it is one idea (the run's
cgroups: where they live, their limits, who removes them) told twice, for cgroup v1 and for v2.
"""

from __future__ import annotations

import atexit
import errno
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

BASE_NAME = "rlpipe-sandbox"
# slot3-8422-1234567 (also the older slot3-8422, without the start time) and probe groups (the
# older probe-<pid>-<ns> is not matched: its ns would pass for a start time).
_GROUP_NAME = re.compile(r"^(?:slot\d+|probe\d+)-(?P<pid>\d+)(?:-(?P<start>\d+))?$")
_RMDIR_WAIT_S = 2.0  # how long a removal waits for a group's last tasks to leave it


def process_start(pid: int) -> int | None:
    """Start time of pid in clock ticks since boot (``/proc/<pid>/stat`` field 22); None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def owner_id(pid: int | None = None) -> str | None:
    """``<pid>-<start>``: what names a process's groups (None when pid is not alive)."""
    pid = os.getpid() if pid is None else pid
    start = process_start(pid)
    return None if start is None else f"{pid}-{start}"


def owner_of(name: str) -> str | None:
    """The owner id in a group's name (just the pid for an old-style name), or None."""
    m = _GROUP_NAME.match(name)
    return None if m is None else m["pid"] + (f"-{m['start']}" if m["start"] else "")


def owner_alive(name: str) -> bool | None:
    """Is the process that made group `name` still alive? None when `name` is not one of ours."""
    m = _GROUP_NAME.match(name)
    if m is None:
        return None
    start = process_start(int(m["pid"]))
    if start is None:
        return False
    # An old-style name (no start time) cannot be told from a reused pid: alive if the pid is.
    return m["start"] is None or int(m["start"]) == start


def _mountinfo() -> list[tuple[str, str, str, set[str]]]:
    """(root-within-hierarchy, mountpoint, fstype, super options) per cgroup mount."""
    out = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        left, _, right = line.partition(" - ")
        f = left.split()
        r = right.split()
        if len(f) < 5 or len(r) < 3 or r[0] not in ("cgroup", "cgroup2"):
            continue
        out.append((f[3], f[4].replace("\\040", " "), r[0], set(r[2].split(","))))
    return out


def _own_paths() -> dict[str, str]:
    """controller -> our cgroup path ('' key for the v2 unified hierarchy)."""
    paths = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrls, path = line.split(":", 2)
            for c in ctrls.split(",") if ctrls else [""]:
                paths[c] = path
    except (OSError, ValueError):
        pass
    return paths


def _write(path: Path, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def _pids_in(procs_files: list[Path]) -> set[int]:
    pids: set[int] = set()
    for f in procs_files:
        try:
            pids.update(int(x) for x in f.read_text().split())
        except (OSError, ValueError):
            pass
    return pids


def _kill_pid_in(pid: int, marker: str) -> None:
    """SIGKILL pid if /proc/pid/cgroup still puts it in our group (checked while holding a pidfd)."""
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        fd = None
    try:
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            return
        inside = any(line.rstrip().endswith(marker) for line in lines)
        if not inside:
            return
        if fd is not None:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
    finally:
        if fd is not None:
            os.close(fd)


@dataclass
class RunCgroup:
    """The cgroup(s) a run executes in: one per worker slot and rlpipe process, reused by the
    slot's successive runs (attaching to a freshly made memory cgroup costs ~10 ms; a reused one
    ~0.5 ms). It is emptied after every run and removed when rlpipe exits."""

    version: int
    mem_dir: Path
    pids_dir: Path
    name: str
    oom_base: int = 0

    @property
    def dirs(self) -> list[Path]:
        return [self.mem_dir] if self.mem_dir == self.pids_dir else [self.mem_dir, self.pids_dir]

    @property
    def procs_files(self) -> list[Path]:
        return [d / "cgroup.procs" for d in self.dirs]

    def pids(self) -> set[int]:
        return _pids_in(self.procs_files)

    def oom_kills(self) -> int:
        f = self.mem_dir / ("memory.oom_control" if self.version == 1 else "memory.events")
        try:
            for line in f.read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == "oom_kill":
                    return int(v)
        except (OSError, ValueError):
            pass
        return 0

    def oom_killed(self) -> bool:
        """Did the OOM killer act in this group since :meth:`CgroupManager.prepare`?"""
        return self.oom_kills() > self.oom_base

    def kill_all(self, timeout: float = 5.0) -> bool:
        """Stop forks, SIGKILL every member until none is left. True when empty."""
        if not self.pids():
            return True
        try:
            _write(self.pids_dir / "pids.max", "0")
        except OSError:
            pass
        if self.version == 2 and (self.mem_dir / "cgroup.kill").exists():
            try:
                _write(self.mem_dir / "cgroup.kill", "1")
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        while True:
            left = self.pids()
            if not left:
                return True
            if time.monotonic() > deadline:
                return False
            for pid in left:
                _kill_pid_in(pid, "/" + self.name)
            time.sleep(0.005)

    def remove(self, timeout: float = _RMDIR_WAIT_S) -> bool:
        """rmdir the group; while the kernel says EBUSY (tasks still leaving), SIGKILL what is
        listed and retry for up to `timeout` s. True when it is gone."""
        deadline = time.monotonic() + timeout
        gone = True
        for d in self.dirs:
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or time.monotonic() > deadline:
                        gone = False
                        break
                for pid in _pids_in([d / "cgroup.procs"]):
                    _kill_pid_in(pid, "/" + self.name)
                time.sleep(0.01)
        return gone


class CgroupManager:
    """Prepares run cgroups under a base (found and probed by :func:`detect`)."""

    def __init__(self, version: int, mem_base: Path, pids_base: Path):
        self.version = version
        self.mem_base = mem_base
        self.pids_base = pids_base
        self._lock = threading.Lock()
        self._made: dict[str, RunCgroup] = {}
        self._hooked_pid = 0  # the process whose exit hooks are registered (a fork needs its own)
        self.made_bases: list[Path] = []
        self._base_owner = os.getpid()

    @property
    def bases(self) -> list[Path]:
        return [self.mem_base] if self.mem_base == self.pids_base else [self.mem_base, self.pids_base]

    def describe(self) -> str:
        return f"cgroup v{self.version}: " + ", ".join(str(b) for b in self.bases)

    def prepare(self, name: str, memory_bytes: int, max_pids: int) -> RunCgroup:
        """The (empty) group `name` with these limits, made if needed."""
        cg = RunCgroup(self.version, self.mem_base / name, self.pids_base / name, name)
        for d in cg.dirs:
            if not d.is_dir():
                d.parent.mkdir(mode=0o755, exist_ok=True)  # another rlpipe may have removed it at exit
                d.mkdir(mode=0o755, exist_ok=True)
        with self._lock:
            self._made[name] = cg
            if self._hooked_pid != os.getpid():
                self._hooked_pid = os.getpid()
                self._hook_exit()
        if not cg.kill_all(timeout=2.0):
            raise OSError(errno.EBUSY, f"cgroup {name} still has processes from an earlier run")
        mem = cg.mem_dir
        if self.version == 1:
            _set_v1_memory(mem, memory_bytes)
        else:
            _write(mem / "memory.max", str(memory_bytes))
            if (mem / "memory.swap.max").exists():
                _write(mem / "memory.swap.max", "0")
        _write(cg.pids_dir / "pids.max", str(max_pids))
        cg.oom_base = cg.oom_kills()
        return cg

    def forget(self, name: str) -> None:
        with self._lock:
            self._made.pop(name, None)

    def _hook_exit(self) -> None:
        """Remove this process's groups when it exits. atexit covers a normal exit; a
        multiprocessing child (e.g. a verifier pool worker) leaves through os._exit, which skips
        atexit but runs multiprocessing's own finalizers first."""
        atexit.register(self._remove_all)
        mp_util = sys.modules.get("multiprocessing.util")
        mp = sys.modules.get("multiprocessing")
        if mp_util is not None and mp is not None and mp.parent_process() is not None:
            mp_util.Finalize(None, self._remove_all, exitpriority=100)

    def _remove_all(self) -> None:
        """Remove the groups this process made (a forked child inherits, and keeps its hands off,
        its parent's: their names carry the parent's owner id)."""
        me = owner_id()
        with self._lock:
            mine = [n for n in self._made if me is not None and owner_of(n) == me]
            groups = [self._made.pop(n) for n in mine]
        for cg in groups:
            if cg.kill_all(timeout=2.0):
                cg.remove()
        if os.getpid() != self._base_owner:
            return
        for d in self.made_bases:  # only if empty: another rlpipe may be using it
            try:
                os.rmdir(d)
            except OSError:
                pass

    def remove_stale(self) -> int:
        """Empty and remove every group whose owner is dead (left by an rlpipe process that was
        killed, or whose launcher was). Returns how many were found."""
        names: set[str] = set()
        for b in self.bases:
            try:
                names.update(p.name for p in b.iterdir() if p.is_dir() and owner_alive(p.name) is False)
            except OSError:
                pass
        for name in names:
            cg = RunCgroup(self.version, self.mem_base / name, self.pids_base / name, name)
            cg.kill_all(timeout=2.0)
            cg.remove()
        return len(names)


def _set_v1_memory(mem: Path, limit: int) -> None:
    """memory.limit_in_bytes (and memsw, which must never be below it: order the writes)."""
    memsw = mem / "memory.memsw.limit_in_bytes"
    has_memsw = memsw.exists()
    try:
        current = int((mem / "memory.limit_in_bytes").read_text())
    except (OSError, ValueError):
        current = 0
    if has_memsw and limit > current:
        _try_write(memsw, str(limit))
    _write(mem / "memory.limit_in_bytes", str(limit))
    if has_memsw:
        _try_write(memsw, str(limit))  # no swapping past the limit (where swap accounting is on)
    _try_write(mem / "memory.swappiness", "0")


def _try_write(path: Path, value: str) -> None:
    try:
        _write(path, value)
    except OSError:
        pass


def detect() -> tuple[CgroupManager | None, str]:
    """A working manager and a description, or (None, why not). Creates the base dirs and sweeps
    the groups dead rlpipe processes left in them."""
    mounts = _mountinfo()
    own = _own_paths()
    v1 = {}
    for root, mnt, fstype, opts in mounts:
        if fstype != "cgroup":
            continue
        for ctrl in ("memory", "pids"):
            if ctrl in opts and ctrl not in v1:
                rel = own.get(ctrl, "/")
                if rel.startswith(root):
                    rel = rel[len(root):]
                base = Path(mnt) / rel.lstrip("/") / BASE_NAME
                v1[ctrl] = base
    reasons = []
    if "memory" in v1 and "pids" in v1:
        mgr = CgroupManager(1, v1["memory"], v1["pids"])
        ok, why = _probe(mgr)
        if ok:
            mgr.remove_stale()
            return mgr, mgr.describe()
        reasons.append(f"v1: {why}")
    elif v1:
        reasons.append("v1: only " + ", ".join(sorted(v1)) + " mounted (need memory and pids)")
    for root, mnt, fstype, _opts in mounts:
        if fstype != "cgroup2" or root != "/":
            continue
        try:
            ctrls = set((Path(mnt) / "cgroup.controllers").read_text().split())
        except OSError:
            continue
        if not {"memory", "pids"} <= ctrls:
            reasons.append(f"v2 at {mnt}: controllers {sorted(ctrls)} lack memory/pids")
            continue
        base = Path(mnt) / BASE_NAME
        try:
            _write(Path(mnt) / "cgroup.subtree_control", "+memory +pids")
            base.mkdir(mode=0o755, exist_ok=True)
            _write(base / "cgroup.subtree_control", "+memory +pids")
        except OSError as e:
            reasons.append(f"v2 at {mnt}: cannot delegate memory+pids ({e})")
            continue
        mgr = CgroupManager(2, base, base)
        ok, why = _probe(mgr)
        if ok:
            mgr.remove_stale()
            return mgr, mgr.describe()
        reasons.append(f"v2: {why}")
    if not mounts:
        reasons.append("no cgroup filesystem mounted")
    return None, "; ".join(reasons) or "no usable cgroup hierarchy"


def _probe(mgr: CgroupManager) -> tuple[bool, str]:
    try:
        made = []
        for b in mgr.bases:
            if not b.is_dir():
                b.mkdir(mode=0o755)
                made.append(b)
        name = f"probe{time.monotonic_ns()}-{owner_id()}"
        cg = mgr.prepare(name, 64 << 20, 8)
        mgr.forget(name)
        cg.remove()
        mgr.made_bases = made  # leave no empty group in someone else's hierarchy when rlpipe exits
        return True, "ok"
    except OSError as e:
        return False, str(e)
