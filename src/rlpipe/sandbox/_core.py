"""Implementation of :mod:`rlpipe.sandbox` (see the package docstring for the guarantees)."""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import marshal
import math
import os
import posixpath
import pwd
import re
import selectors
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlpipe.sandbox import _cgroup

log = logging.getLogger("rlpipe.sandbox")

STRICT_ENV = "RLPIPE_SANDBOX_STRICT"
DISABLE_ENV = "RLPIPE_SANDBOX_DISABLE"
PYTHON_ENV = "RLPIPE_SANDBOX_PYTHON"
BWRAP_ENV = "RLPIPE_SANDBOX_BWRAP"
UID_BASE_ENV = "RLPIPE_SANDBOX_UID_BASE"
SLOTS_ENV = "RLPIPE_SANDBOX_SLOTS"

DEFAULT_PYTHON = "/usr/bin/python3"
DEFAULT_UID_BASE = 61000  # below systemd's DynamicUser range (61184-65519)
DEFAULT_SLOTS = 64
COMPONENTS = ("bwrap", "seccomp", "uid", "rlimits", "cgroup")
FULL_LEVEL = "+".join(COMPONENTS)
_DISABLEABLE = ("bwrap", "seccomp", "cgroup")
_LAUNCHER = str(Path(__file__).with_name("_launcher.py"))
_WORK = "/work"
_MAX_FILES = 256
_MEMORY_HEADROOM = 16 << 20  # cgroup allowance for the launcher and bubblewrap's two helpers
_TERM_GRACE_S = 3.0  # SIGTERM to the launcher -> SIGKILL
_DRAIN_GRACE_S = 1.0  # after the launcher is gone, how long pipes may stay open

# The sandboxed program's whole environment (nothing of the caller's is passed on).
_SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "USER": "sandbox",
    "LOGNAME": "sandbox",
    # Fewer, smaller malloc arenas and single-threaded BLAS keep thread-happy libraries inside
    # the address-space limit (and the task count inside max_processes).
    "MALLOC_ARENA_MAX": "2",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
# Read-only files of /etc the interpreter may want; nothing else of /etc is visible.
_ETC_RO = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives")


class SandboxUnavailableError(RuntimeError):
    """The sandbox cannot be set up at the level demanded (``RLPIPE_SANDBOX_STRICT=1``)."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0  # wall-clock timeout
    cpu_s: float = 5.0  # RLIMIT_CPU (per process; whole seconds, rounded up)
    memory_mb: int = 256  # address space (per process) / cgroup memory (whole run)
    max_processes: int = 16  # RLIMIT_NPROC per uid + cgroup pids.max (tasks: threads count)
    max_file_mb: int = 16  # RLIMIT_FSIZE
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 65536  # stdout and stderr each are capped at this (rest discarded, flagged)

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {v!r}")
        for name in ("memory_mb", "max_processes", "max_file_mb", "max_open_files", "max_output_bytes"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v > 0):
                raise ValueError(f"SandboxLimits.{name} must be a positive int, got {v!r}")
        if self.memory_mb < 32:
            raise ValueError("SandboxLimits.memory_mb below 32 cannot start a Python interpreter")
        if self.max_open_files < 16:
            raise ValueError("SandboxLimits.max_open_files below 16 cannot start a Python interpreter")


@dataclass
class SandboxResult:
    status: str  # "ok" | "timeout" | "memory" | "error" | "killed"
    exit_code: int | None  # exit status; -N when killed by signal N; None when it never ran
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float
    isolation: str  # e.g. "bwrap+seccomp+uid+rlimits+cgroup" or the weaker level actually used
    truncated: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- capabilities


@dataclass(frozen=True)
class _Caps:
    python: str | None
    python_detail: str
    root: bool
    bpf: bytes | None
    seccomp_detail: str
    cgroup: _cgroup.CgroupManager | None
    cgroup_detail: str
    bwrap: str | None
    bwrap_detail: str
    bwrap_opts: frozenset


@dataclass(frozen=True)
class _Plan:
    python: str
    bwrap: str | None
    bpf: bytes | None
    uid_switch: bool
    cgroup: _cgroup.CgroupManager | None
    bwrap_opts: frozenset
    level: str
    missing: dict = field(default_factory=dict)

    @property
    def full(self) -> bool:
        return self.level == FULL_LEVEL


_caps_lock = threading.Lock()
_caps: _Caps | None = None
_warned_levels: set[str] = set()
_run_counter = itertools.count()


def _strict() -> bool:
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _disabled() -> set[str]:
    raw = os.environ.get(DISABLE_ENV, "")
    out = {x.strip().lower() for x in raw.split(",") if x.strip()}
    bad = out - set(_DISABLEABLE)
    if bad:
        log.warning("%s: ignoring unknown component(s) %s (can disable: %s)", DISABLE_ENV, sorted(bad), _DISABLEABLE)
    return out & set(_DISABLEABLE)


def _uid_base() -> int:
    return int(os.environ.get(UID_BASE_ENV, DEFAULT_UID_BASE))


def _n_slots() -> int:
    return max(1, min(int(os.environ.get(SLOTS_ENV, DEFAULT_SLOTS)), 1024))


def _find_bwrap() -> str | None:
    explicit = os.environ.get(BWRAP_ENV)
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return shutil.which("bwrap") or next(
        (p for p in ("/usr/bin/bwrap", "/bin/bwrap") if os.access(p, os.X_OK)), None
    )


def _detect() -> _Caps:
    python = os.environ.get(PYTHON_ENV, DEFAULT_PYTHON)
    if os.access(python, os.X_OK):
        try:
            v = subprocess.run([python, "-I", "-S", "-c", "import sys; print(sys.version.split()[0])"],
                               capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
            python_detail = f"{python} (Python {v.stdout.strip()})" if v.returncode == 0 else f"{python}: {v.stderr[-300:]}"
            if v.returncode != 0:
                python = None
        except (OSError, subprocess.SubprocessError) as e:
            python, python_detail = None, f"{python}: {e}"
    else:
        python, python_detail = None, f"{python} not found or not executable (set {PYTHON_ENV})"

    root = os.geteuid() == 0
    try:
        from rlpipe.sandbox import _seccomp

        bpf = _seccomp.build_bpf()
        seccomp_detail = f"{_seccomp.seccomp_version()}, {len(bpf) // 8} BPF instructions"
    except Exception as e:  # ImportError, RuntimeError (no libseccomp), OSError
        bpf, seccomp_detail = None, f"unavailable: {type(e).__name__}: {e} (pip install pyseccomp; needs libseccomp2)"

    try:
        cgroup, cgroup_detail = _cgroup.detect()
    except Exception as e:  # never let a strange /proc break the sandbox
        cgroup, cgroup_detail = None, f"{type(e).__name__}: {e}"

    bwrap = _find_bwrap()
    opts: frozenset = frozenset()
    if bwrap is None:
        bwrap_detail = "bwrap not found (apt-get install bubblewrap)"
    else:
        try:
            out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=30)
            helptext = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30).stdout
            opts = frozenset(re.findall(r"--[a-z][a-z0-9-]*", helptext))
            bwrap_detail = f"{bwrap} ({out.stdout.strip() or 'unknown version'})"
            need = {"--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--clearenv", "--seccomp",
                    "--file", "--ro-bind-data", "--perms", "--remount-ro"}
            if not need <= opts:
                bwrap, bwrap_detail = None, f"{bwrap_detail} lacks {sorted(need - opts)} (need bubblewrap >= 0.5)"
        except (OSError, subprocess.SubprocessError) as e:
            bwrap, bwrap_detail = None, f"{bwrap}: {e}"

    caps = _Caps(python, python_detail, root, bpf, seccomp_detail, cgroup, cgroup_detail, bwrap, bwrap_detail, opts)
    if bwrap is not None and python is not None:
        # Probe the real thing (launcher, uid switch, user namespace, mounts, seccomp) once.
        probe_plan = _Plan(python, bwrap, bpf, root, None, opts, "probe")
        try:
            r = _execute("print('rlpipe-sandbox-probe')", "", SandboxLimits(wall_s=30.0), None, None, probe_plan)
            ok = r.status == "ok" and r.stdout == "rlpipe-sandbox-probe\n"
            why = "" if ok else f"probe run failed: status={r.status} exit={r.exit_code} stderr={r.stderr[-500:]!r}"
        except Exception as e:
            ok, why = False, f"probe run failed: {type(e).__name__}: {e}"
        if not ok:
            caps = _Caps(python, python_detail, root, bpf, seccomp_detail, cgroup, cgroup_detail, None,
                         f"{bwrap_detail}: {why} (are unprivileged user namespaces enabled?)", frozenset())
    return caps


def _capabilities() -> _Caps:
    global _caps
    with _caps_lock:
        if _caps is None:
            _caps = _detect()
        return _caps


def _make_plan(caps: _Caps) -> _Plan | None:
    """The plan for this call (caps minus RLPIPE_SANDBOX_DISABLE), or None if nothing can run."""
    if caps.python is None:
        return None
    off = _disabled()
    have = {
        "bwrap": caps.bwrap is not None and "bwrap" not in off,
        "seccomp": caps.bpf is not None and "seccomp" not in off,
        "uid": caps.root,
        "rlimits": True,
        "cgroup": caps.cgroup is not None and "cgroup" not in off,
    }
    why = {
        "bwrap": caps.bwrap_detail,
        "seccomp": caps.seccomp_detail,
        "uid": "not running as root: the sandbox runs under the caller's own uid",
        "cgroup": caps.cgroup_detail,
    }
    missing = {c: (f"disabled by {DISABLE_ENV}" if c in off else why[c]) for c in COMPONENTS if not have[c]}
    level = "+".join(c for c in COMPONENTS if have[c])
    return _Plan(
        python=caps.python,
        bwrap=caps.bwrap if have["bwrap"] else None,
        bpf=caps.bpf if have["seccomp"] else None,
        uid_switch=have["uid"],
        cgroup=caps.cgroup if have["cgroup"] else None,
        bwrap_opts=caps.bwrap_opts,
        level=level,
        missing=missing,
    )


def _plan_for_run() -> _Plan | None:
    caps = _capabilities()
    plan = _make_plan(caps)
    if plan is None:
        msg = f"rlpipe.sandbox: cannot run sandboxed code: {caps.python_detail}"
        if _strict():
            raise SandboxUnavailableError(msg)
        log.error(msg)
        return None
    if not plan.full:
        detail = "; ".join(f"{k}: {v}" for k, v in plan.missing.items())
        if _strict():
            raise SandboxUnavailableError(
                f"rlpipe.sandbox: full isolation ({FULL_LEVEL}) unavailable, would run at '{plan.level}' "
                f"({detail}); {STRICT_ENV}=1 forbids the fallback"
            )
        if plan.level not in _warned_levels:
            _warned_levels.add(plan.level)
            extra = ""
            if plan.bwrap is None:
                extra = (" WITHOUT namespaces the code can read world-readable host files, see host processes, "
                         "write to world-writable host dirs (e.g. /tmp) and talk to host AF_UNIX sockets.")
            log.warning(
                "rlpipe.sandbox: DEGRADED ISOLATION: running untrusted code at level '%s' instead of '%s' (%s).%s "
                "Set %s=1 to make this an error.", plan.level, FULL_LEVEL, detail, extra, STRICT_ENV,
            )
    return plan


def isolation_report() -> dict:
    """What this machine offers and the level :func:`run_python` will use (probes once, cached)."""
    caps = _capabilities()
    plan = _make_plan(caps)
    n = _n_slots()
    comp = {
        "bwrap": {"available": caps.bwrap is not None, "detail": caps.bwrap_detail,
                  "disable_userns": "--disable-userns" in caps.bwrap_opts},
        "seccomp": {"available": caps.bpf is not None, "detail": caps.seccomp_detail},
        "uid": {"available": caps.root,
                "detail": (f"per-worker uids {_uid_base()}..{_uid_base() + n - 1}" if caps.root
                           else "needs root to switch to per-worker uids")},
        "rlimits": {"available": True, "detail": "CPU, AS, NPROC, FSIZE, NOFILE, CORE=0"},
        "cgroup": {"available": caps.cgroup is not None, "detail": caps.cgroup_detail},
    }
    return {
        "level": plan.level if plan else "none",
        "full": bool(plan and plan.full),
        "full_level": FULL_LEVEL,
        "would_run": plan is not None and (plan.full or not _strict()),
        "strict": _strict(),
        "disabled_by_env": sorted(_disabled()),
        "missing": plan.missing if plan else {"python": caps.python_detail},
        "python": caps.python_detail,
        "components": comp,
        "slots": n,
    }


# --------------------------------------------------------------------------- worker slots


class _SlotPool:
    """Exclusive worker slots (slot -> uid), across threads (a lock) and processes (flock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[int] = set()
        self._next = 0
        self._dir: Path | None = None
        self._foreign_uids: set[int] = set()

    def _lockdir(self) -> Path:
        if self._dir is None:
            euid = os.geteuid()
            if euid == 0 and os.access("/run", os.W_OK):
                d = Path("/run/rlpipe-sandbox")
            else:
                base = os.environ.get("XDG_RUNTIME_DIR") if euid != 0 else None
                d = Path(base or tempfile.gettempdir()) / f"rlpipe-sandbox-{euid}"
            try:
                d.mkdir(mode=0o700)
            except FileExistsError:
                pass
            st = os.lstat(d)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != euid or st.st_mode & 0o022:
                raise OSError(errno.EPERM, f"slot lock dir {d} is not a private directory of uid {euid}")
            self._dir = d
        return self._dir

    def _uid_free(self, uid: int) -> bool:
        if uid in self._foreign_uids:
            return False
        try:
            pw = pwd.getpwuid(uid)
        except KeyError:
            return True
        self._foreign_uids.add(uid)
        log.warning("rlpipe.sandbox: uid %d belongs to user %r; not using it for sandboxes", uid, pw.pw_name)
        return False

    def acquire(self, timeout: float, check_uid: bool) -> tuple[int, int, bool]:
        """(slot, lock fd, previous holder crashed mid-run)."""
        d = self._lockdir()
        n = _n_slots()
        base = _uid_base()
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                for i in range(n):
                    s = (self._next + i) % n
                    if s in self._held or (check_uid and not self._uid_free(base + s)):
                        continue
                    fd = os.open(d / f"slot-{s}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        os.close(fd)
                        continue
                    dirty = os.pread(fd, 1, 0) == b"1"
                    os.pwrite(fd, b"1", 0)
                    self._held.add(s)
                    self._next = s + 1
                    return s, fd, dirty
            if time.monotonic() > deadline:
                raise TimeoutError(f"all {n} sandbox slots stayed busy for {timeout:.0f} s")
            time.sleep(0.01)

    def release(self, slot: int, fd: int, clean: bool) -> None:
        try:
            if clean:
                os.pwrite(fd, b"0", 0)
        finally:
            os.close(fd)
            with self._lock:
                self._held.discard(slot)


_slots = _SlotPool()


# --------------------------------------------------------------------------- process sweeping


def _proc_statuses():
    """(pid, text of /proc/<pid>/status) for every process still there when read."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as fh:
                yield int(name), fh.read()
        except OSError:
            continue


def _uid_pids(uid: int) -> list[int]:
    """Live (non-zombie) processes with uid among their real/effective/saved/fs uids."""
    pids = []
    for pid, text in _proc_statuses():
        m = re.search(r"^Uid:\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)", text, re.M)
        st = re.search(r"^State:\s+(\S)", text, re.M)
        if m and uid in map(int, m.groups()) and not (st and st.group(1) == "Z"):
            pids.append(pid)
    return pids


def _kill_uid(uid: int, timeout: float = 5.0) -> bool:
    """SIGKILL every process of uid (re-checked under a pidfd) until none is left."""
    deadline = time.monotonic() + timeout
    while True:
        pids = _uid_pids(uid)
        if not pids:
            return True
        if time.monotonic() > deadline:
            return False
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                m = re.search(r"^Uid:\s+(.*)$", Path(f"/proc/{pid}/status").read_text(), re.M)
                if m and uid in map(int, m.group(1).split()):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(fd)
        time.sleep(0.005)


def _remove_files_of(uid: int, dirs: tuple[str, ...] = ("/tmp", "/var/tmp", "/dev/shm")) -> int:
    """Without a mount namespace the code can drop files in world-writable host dirs; remove the
    top-level entries there owned by the worker uid so nothing carries over to a later run."""
    n = 0
    for d in dirs:
        try:
            dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            for name in os.listdir(dfd):
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    if st.st_uid != uid:
                        continue
                    if stat.S_ISDIR(st.st_mode):
                        shutil.rmtree(name, dir_fd=dfd)
                    else:
                        os.unlink(name, dir_fd=dfd)
                    n += 1
                except OSError:
                    pass
        finally:
            os.close(dfd)
    return n


# --------------------------------------------------------------------------- one run


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)  # close-on-exec; Popen's pass_fds makes it inheritable in the child
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _check_files(files: dict[str, str] | None) -> dict[str, str]:
    files = dict(files or {})
    if len(files) > _MAX_FILES:
        raise ValueError(f"at most {_MAX_FILES} extra files")
    for name, content in files.items():
        norm = posixpath.normpath(name) if isinstance(name, str) else ""
        if (not isinstance(name, str) or not name or name.startswith("/") or norm != name
                or norm.split("/")[0] in ("..", ".") or "\0" in name):
            raise ValueError(f"bad file name {name!r}: must be a normalised relative path inside the work dir")
        if norm == "main.py":
            raise ValueError("'main.py' is the code itself; pass it as `code`")
        if not isinstance(content, str):
            raise ValueError(f"content of {name!r} must be str")
    for name in files:  # a file may not also be a directory of another
        if any(other.startswith(name + "/") for other in files):
            raise ValueError(f"{name!r} is both a file and a directory")
    return files


def _check_ro_binds(ro_binds: list[tuple[str, str]] | None) -> None:
    for host, dest in ro_binds or ():
        for p in (host, dest):
            if not isinstance(p, str) or not p.startswith("/") or "\0" in p or ".." in p.split("/"):
                raise ValueError(f"ro_binds paths must be absolute, without '..' or NUL: {p!r}")
        if not os.path.exists(host):
            raise ValueError(f"ro_binds: {host} does not exist")
        if dest == "/" or dest.startswith((_WORK, "/tmp", "/dev", "/proc")):
            raise ValueError(f"ro_binds: {dest} would cover the sandbox's own mounts")


def _enc(s: str) -> bytes:
    return s.encode("utf-8", "surrogatepass")


def _tasks_of_uid(uid: int) -> int:
    """Threads of all processes whose real uid is uid (what RLIMIT_NPROC counts)."""
    n = 0
    for _, text in _proc_statuses():
        m = re.search(r"^Uid:\s+(\d+)", text, re.M)
        t = re.search(r"^Threads:\s+(\d+)", text, re.M)
        if m and int(m.group(1)) == uid:
            n += int(t.group(1)) if t else 1
    return n


def _rlimits(limits: SandboxLimits, extra_tasks: int, shared_uid: bool) -> list[list]:
    cpu = max(1, math.ceil(limits.cpu_s))
    nproc = limits.max_processes + extra_tasks
    if shared_uid:
        # Without a uid of its own the sandbox shares RLIMIT_NPROC's count with every process of
        # the caller's uid (also through the user namespace): allow what exists now on top.
        nproc += _tasks_of_uid(os.getuid())
    return [
        ["RLIMIT_CPU", cpu, cpu + 1],
        ["RLIMIT_AS", limits.memory_mb << 20, limits.memory_mb << 20],
        ["RLIMIT_NPROC", nproc, nproc],
        ["RLIMIT_FSIZE", limits.max_file_mb << 20, limits.max_file_mb << 20],
        ["RLIMIT_NOFILE", limits.max_open_files, limits.max_open_files],
        ["RLIMIT_CORE", 0, 0],
    ]


def _python_cmd(python: str, argv: list[str]) -> list[str]:
    # -B: no .pyc; -E -s: ignore PYTHON* variables and the user site dir. Not -I: the work dir
    # must stay on sys.path so extra files are importable.
    return [python, "-B", "-E", "-s", "main.py", *argv]


def _bwrap_args(plan: _Plan, uid: int | None, limits: SandboxLimits, file_fds: list[tuple[int, str]],
                data_fds: dict[str, int], seccomp_fd: int | None, argv: list[str],
                binds: list[tuple[str, str]], ro_binds: list[tuple[str, str]] = ()) -> list[str]:
    a = [plan.bwrap, "--unshare-all", "--unshare-user"]
    if "--disable-userns" in plan.bwrap_opts:
        a.append("--disable-userns")
    a += ["--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv"]
    env = dict(_SANDBOX_ENV, HOME="/tmp", TMPDIR="/tmp")
    for k, v in env.items():
        a += ["--setenv", k, v]
    if uid is not None:
        a += ["--uid", str(uid), "--gid", str(uid)]
    a += ["--ro-bind", "/usr", "/usr"]
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(d):
            a += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            a += ["--ro-bind", d, d]
    for p in _ETC_RO:
        if os.path.exists(p):
            a += ["--ro-bind", p, p]
    for dest, fd in data_fds.items():
        a += ["--perms", "0644", "--ro-bind-data", str(fd), dest]
    a += ["--proc", "/proc", "--dev", "/dev"]
    size = ["--size", str(limits.memory_mb << 20)] if "--size" in plan.bwrap_opts else []
    for m in ("/dev/shm", "/tmp", _WORK):
        a += [*size, "--perms", "0700", "--tmpfs", m]
    made = {_WORK}
    for d in sorted({posixpath.dirname(dest) for _, dest in file_fds}):
        parts = d[len(_WORK) + 1:].split("/") if d != _WORK else []
        for i in range(1, len(parts) + 1):
            sub = posixpath.join(_WORK, *parts[:i])
            if sub not in made:
                made.add(sub)
                a += ["--perms", "0755", "--dir", sub]
    for fd, dest in file_fds:
        a += ["--perms", "0644", "--file", str(fd), dest]
    for host, dest in binds:
        a += ["--bind", host, dest]
    for host, dest in ro_binds:
        a += ["--ro-bind", host, dest]
    # Nothing outside /work, /tmp and /dev/shm stays writable (bubblewrap's root and /dev are
    # tmpfs otherwise writable by the sandbox uid).
    a += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", _WORK]
    if seccomp_fd is not None:
        a += ["--seccomp", str(seccomp_fd)]
    a += ["--", *_python_cmd(plan.python, argv)]
    return a


_SIGNAL_NAMES = {s.value: s.name for s in signal.Signals}


def _execute(code: str, stdin: str, limits: SandboxLimits, files: dict[str, str] | None,
             argv: list[str] | None, plan: _Plan, binds: list[tuple[str, str]] | None = None,
             ro_binds: list[tuple[str, str]] | None = None) -> SandboxResult:
    files = _check_files(files)
    argv = [str(x) for x in (argv or [])]
    if any("\0" in x for x in argv):
        raise ValueError("argv entries may not contain NUL")
    t_begin = time.monotonic()
    slot_timeout = max(60.0, 3 * limits.wall_s)
    uid_mode = plan.uid_switch
    slot, lock_fd, dirty = _slots.acquire(slot_timeout, check_uid=uid_mode)
    uid = _uid_base() + slot if uid_mode else None
    run_name = f"slot{slot}-{os.getpid()}-{next(_run_counter)}"
    # Named by pid and start time, so a dead process's leftovers are never taken for ours.
    cg_name = f"slot{slot}-{_cgroup.owner_id() or os.getpid()}"
    fds: list[int] = []
    cg = None
    workdir = None
    proc = None
    clean = False
    try:
        if dirty and uid is not None:
            _kill_uid(uid)
        if plan.cgroup is not None:
            if dirty:  # its last holder crashed mid-run: sweep what dead processes left
                plan.cgroup.remove_stale()
            extra = _MEMORY_HEADROOM
            # +1 task for the launcher, +2 for bubblewrap's monitor and reaper.
            cg = plan.cgroup.prepare(cg_name, (limits.memory_mb << 20) + extra,
                                     limits.max_processes + 1 + (2 if plan.bwrap else 0))

        stdin_mem = _memfd("stdin", _enc(stdin))
        fds.append(stdin_mem)
        stdin_fd = os.open(f"/proc/self/fd/{stdin_mem}", os.O_RDONLY | os.O_CLOEXEC)  # read-only view
        fds.append(stdin_fd)
        status_r, status_w = os.pipe()
        fds += [status_r, status_w]
        pass_fds = [status_w]
        spec: dict = {"status_fd": status_w, "parent_pid": os.getpid(), "rlimits": _rlimits(
            limits, 2 if plan.bwrap else 0, shared_uid=uid is None)}
        if cg is not None:
            spec["cgroup_procs"] = [str(p) for p in cg.procs_files]  # the launcher removes them if we die
            go_r, go_w = os.pipe()
            fds += [go_r, go_w]
            pass_fds.append(go_r)
            spec["go_fd"] = go_r
        if uid is not None:
            spec.update(uid=uid, gid=uid, kill_uid=uid)

        if plan.bwrap:
            file_fds = []
            for rel, content in [("main.py", code), *files.items()]:
                fd = _memfd(rel, _enc(content))
                fds.append(fd)
                file_fds.append((fd, posixpath.join(_WORK, rel)))
            pw_name = "sandbox"
            ident = uid if uid is not None else os.getuid()
            data = {
                "/etc/passwd": f"root:x:0:0::/:/usr/sbin/nologin\n{pw_name}:x:{ident}:{ident}::/tmp:/usr/sbin/nologin\n"
                               "nobody:x:65534:65534::/nonexistent:/usr/sbin/nologin\n",
                "/etc/group": f"root:x:0:\n{pw_name}:x:{ident}:\nnogroup:x:65534:\n",
                "/etc/hosts": "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost\n",
                "/etc/hostname": "sandbox\n",
            }
            data_fds = {}
            for dest, text in data.items():
                fd = _memfd(dest, text.encode())
                fds.append(fd)
                data_fds[dest] = fd
            seccomp_fd = None
            if plan.bpf is not None:
                seccomp_fd = _memfd("seccomp", plan.bpf)
                fds.append(seccomp_fd)
            cmd = _bwrap_args(plan, uid, limits, file_fds, data_fds, seccomp_fd, argv, binds or [], ro_binds or [])
            pass_fds += [fd for fd, _ in file_fds] + list(data_fds.values())
            if seccomp_fd is not None:
                pass_fds.append(seccomp_fd)
            spec.update(argv=cmd, env={}, cwd="/", bwrap_json_status="--json-status-fd" in plan.bwrap_opts)
        else:
            workdir = tempfile.mkdtemp(prefix=f"rlpipe-sbx-{run_name}-")  # 0700, ours
            wd, tmp = Path(workdir) / "work", Path(workdir) / "tmp"
            wd.mkdir()
            tmp.mkdir()
            (wd / "main.py").write_bytes(_enc(code))
            for rel, content in files.items():
                (wd / rel).parent.mkdir(parents=True, exist_ok=True)
                (wd / rel).write_bytes(_enc(content))
            if uid is not None:
                for root, dnames, fnames in os.walk(workdir):
                    for n in [*dnames, *fnames]:
                        os.chown(os.path.join(root, n), uid, uid)
                os.chown(workdir, uid, uid)
            env = dict(_SANDBOX_ENV, HOME=str(wd), TMPDIR=str(tmp))
            if plan.bpf is not None:
                seccomp_fd = _memfd("seccomp", plan.bpf)
                fds.append(seccomp_fd)
                pass_fds.append(seccomp_fd)
                spec["seccomp_fd"] = seccomp_fd
            spec.update(argv=_python_cmd(plan.python, argv), env=env, cwd=str(wd), umask=0o077)

        proc = subprocess.Popen(
            [plan.python, "-I", "-S", _LAUNCHER, marshal.dumps(spec, 2).hex()],
            stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=pass_fds,
            close_fds=True, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, cwd="/", start_new_session=True,
        )
        t_spawn = time.monotonic()
        if cg is not None:
            # Into the run's cgroups before the launcher forks anything (it waits for "go").
            for f in cg.procs_files:
                with open(f, "w") as fh:
                    fh.write(str(proc.pid))
            os.write(go_w, b"1")
        for fd in list(fds):
            if fd != status_r:
                os.close(fd)
                fds.remove(fd)
        out, err, status, timed_out, truncated = _collect(proc, status_r, limits, t_spawn)
        os.close(status_r)
        fds.remove(status_r)
        oom = cg.oom_killed() if cg is not None else False
        clean = True
        return _classify(plan, limits, out, err, status, timed_out, truncated, oom, time.monotonic() - t_spawn)
    finally:
        try:
            if proc is not None:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                proc.stdout.close()
                proc.stderr.close()
            left = True
            if cg is not None:
                left = not cg.kill_all()
            if uid is not None and (left or cg is None or not clean):
                if not _kill_uid(uid):
                    clean = False
                    log.error("rlpipe.sandbox: processes of uid %d survived SIGKILL", uid)
            elif cg is not None and left:
                clean = False
                log.error("rlpipe.sandbox: cgroup %s still has processes", cg.name)
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)
                if uid is not None:
                    _remove_files_of(uid)
        finally:
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            _slots.release(slot, lock_fd, clean)
            log.debug("rlpipe.sandbox: run %s took %.3f s", run_name, time.monotonic() - t_begin)


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
    deadline = t0 + limits.wall_s
    timed_out = False
    term_at = kill_at = gone_at = None
    try:
        while sel.get_map():
            now = time.monotonic()
            if not timed_out and now >= deadline:
                timed_out = True
                term_at = now
                _signal_launcher(proc, signal.SIGTERM)
            if term_at is not None and kill_at is None and now >= term_at + _TERM_GRACE_S:
                kill_at = now
                _signal_launcher(proc, signal.SIGKILL)
            if gone_at is None and proc.poll() is not None:
                gone_at = now
            if gone_at is not None and now >= gone_at + _DRAIN_GRACE_S:
                break  # something outside the launcher holds a pipe; the caller's sweep kills it
            waits = [t - now for t in (deadline if not timed_out else None,
                                       term_at + _TERM_GRACE_S if term_at and not kill_at else None,
                                       gone_at + _DRAIN_GRACE_S if gone_at else None) if t is not None]
            timeout = max(0.0, min(waits)) if waits else 0.05
            for key, _ in sel.select(min(timeout, 0.25)):
                fd = key.fd
                try:
                    chunk = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    continue
                if fd == status_r:
                    status += chunk[: 1 << 20]
                    continue
                buf = bufs[fd]
                room = cap - len(buf)
                if len(chunk) > room:
                    truncated = True
                if room > 0:
                    buf += chunk[:room]
    finally:
        sel.close()
    try:
        proc.wait(timeout=_TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        _signal_launcher(proc, signal.SIGKILL)
        proc.wait()
    try:
        st = marshal.loads(bytes(status)) if status else {}
    except (ValueError, EOFError, TypeError):
        st = {}
    if not isinstance(st, dict):
        st = {}
    return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), st, timed_out, truncated


def _signal_launcher(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except OSError:
        pass


_MEMORY_ERROR = re.compile(rb"(^|\n)(MemoryError\b|Fatal Python error: .*(memory|MemoryError))")


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

    setup_error = st.get("setup_error")
    bwrap_status = st.get("bwrap_status") or {}
    # bubblewrap writes "exit-code" once the command has run; without it bubblewrap itself failed
    # (a bad mount, no user namespace, ...) and the code never started.
    bwrap_failed = (plan.bwrap and "--json-status-fd" in plan.bwrap_opts and st.get("status") is not None
                    and not timed_out and not oom and "exit-code" not in bwrap_status and not st.get("terminated"))
    if setup_error or bwrap_failed:
        why = setup_error or "bubblewrap failed to set up the sandbox"
        log.error("rlpipe.sandbox: sandbox setup failed: %s | %s", why, stderr[-500:])
        res["stderr"] = note(f"rlpipe.sandbox: sandbox setup failed: {why}")
        failed = SandboxResult(status="error", exit_code=None, **res)
        failed._setup_failed = True  # not a field: run_python raises on it in strict mode
        return failed
    if not st:
        res["stderr"] = note("rlpipe.sandbox: the launcher died without a status report")
        return SandboxResult(status="timeout" if timed_out else "killed", exit_code=None, **res)

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
    exit_code = -sig if sig is not None else code

    if timed_out:
        status = "timeout"
        res["stderr"] = note(f"rlpipe.sandbox: wall-clock limit of {limits.wall_s:g} s exceeded")
    elif oom:
        status = "memory"
        res["stderr"] = note(f"rlpipe.sandbox: cgroup memory limit of {limits.memory_mb} MB exceeded (OOM kill)")
    elif sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= max(1, math.ceil(limits.cpu_s)) * 0.95):
        status = "timeout"
        res["stderr"] = note(f"rlpipe.sandbox: CPU limit of {limits.cpu_s:g} s exceeded")
    elif sig is not None:
        status = "killed"
        res["stderr"] = note(f"rlpipe.sandbox: killed by {_SIGNAL_NAMES.get(sig, sig)}")
    elif code == 0:
        status = "ok"
    elif _MEMORY_ERROR.search(err[-4096:]):
        status = "memory"
    else:
        status = "error"
    return SandboxResult(status=status, exit_code=exit_code, **res)


# --------------------------------------------------------------------------- public entry point


def run_python(code: str, stdin: str = "", limits: SandboxLimits | None = None,
               files: dict[str, str] | None = None, argv: list[str] | None = None,
               ro_binds: list[tuple[str, str]] | None = None) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh private work dir under the strongest isolation available.

    ``files`` are written next to main.py first (relative paths; importable), ``argv`` follows
    ``main.py`` on the command line, ``stdin`` is the program's standard input. ``ro_binds``
    ``(host_path, sandbox_path)`` show trusted host files or folders read-only inside bubblewrap (e.g. a
    library the code imports); without bubblewrap there is no private mount view and they are not made,
    so the code sees the host paths (as far as the worker uid may read them). Never raises
    because of what the code does; raises :class:`SandboxUnavailableError` only when
    ``RLPIPE_SANDBOX_STRICT=1`` and the full isolation level cannot be set up (without strict
    mode a setup failure is an ``error`` result whose stderr says so).
    """
    limits = limits or SandboxLimits()
    if not isinstance(code, str) or not isinstance(stdin, str):
        raise TypeError("code and stdin must be str")
    _check_files(files)
    _check_ro_binds(ro_binds)
    plan = _plan_for_run()
    if plan is None:
        return SandboxResult("error", None, "", "rlpipe.sandbox: no sandbox available on this machine "
                             "(see rlpipe.sandbox.isolation_report())", 0.0, 0.0, "none")
    try:
        result = _execute(code, stdin, limits, files, argv, plan, ro_binds=ro_binds)
    except (ValueError, TypeError):
        raise
    except Exception as e:
        if _strict():
            raise SandboxUnavailableError(f"rlpipe.sandbox: sandbox setup failed: {e}") from e
        log.error("rlpipe.sandbox: sandbox setup failed: %s", e, exc_info=True)
        return SandboxResult("error", None, "", f"rlpipe.sandbox: sandbox setup failed: {type(e).__name__}: {e}",
                             0.0, 0.0, plan.level)
    if getattr(result, "_setup_failed", False) and _strict():
        raise SandboxUnavailableError(result.stderr.strip().splitlines()[-1])
    return result
