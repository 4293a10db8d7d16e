"""What the sandboxed program is given: its checked files, its command line, its environment,
its rlimits, and the memfds its inputs travel in. The same under bubblewrap and without it."""

from __future__ import annotations

import math
import os
import posixpath

from rlpipe.sandbox._sweep import _tasks_of_uid
from rlpipe.sandbox._types import SandboxLimits

_WORK = "/work"  # the work dir inside bubblewrap (main.py and the extra files)
_MAX_FILES = 256

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
