"""The bubblewrap command line of a run: namespaces, the read-only host view, synthetic ``/etc``
files, size-capped tmpfs mounts, the program's files, seccomp, and the interpreter to start.

Inputs reach bubblewrap as memfds (``--file``, ``--ro-bind-data``, ``--seccomp``), so nothing of a
run is written to the host's disk.
"""

from __future__ import annotations

import os
import posixpath
from typing import Callable

from rlpipe.sandbox._program import _SANDBOX_ENV, _WORK, _enc, _python_cmd
from rlpipe.sandbox._types import SandboxLimits, _Plan

# Read-only files of /etc the interpreter may want; nothing else of /etc is visible.
_ETC_RO = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives")


def _etc_data(uid: int | None) -> dict[str, str]:
    """The synthetic /etc files: only root, the sandbox user (the run's uid) and nobody exist."""
    pw_name = "sandbox"
    ident = uid if uid is not None else os.getuid()
    return {
        "/etc/passwd": f"root:x:0:0::/:/usr/sbin/nologin\n{pw_name}:x:{ident}:{ident}::/tmp:/usr/sbin/nologin\n"
                       "nobody:x:65534:65534::/nonexistent:/usr/sbin/nologin\n",
        "/etc/group": f"root:x:0:\n{pw_name}:x:{ident}:\nnogroup:x:65534:\n",
        "/etc/hosts": "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost\n",
        "/etc/hostname": "sandbox\n",
    }


def _bwrap_spec(plan: _Plan, uid: int | None, limits: SandboxLimits, code: str, files: dict[str, str],
                argv: list[str], binds: list[tuple[str, str]] | None, ro_binds: list[tuple[str, str]] | None,
                memfd: Callable[[str, bytes], int]) -> tuple[dict, list[int]]:
    """The launcher's spec entries and the fds it must pass on for a run inside bubblewrap.

    main.py, the extra files, the /etc data and the seccomp filter go into memfds made by
    ``memfd(name, data)``; the caller owns them and closes them once the launcher has started."""
    file_fds = []
    for rel, content in [("main.py", code), *files.items()]:
        file_fds.append((memfd(rel, _enc(content)), posixpath.join(_WORK, rel)))
    data_fds = {dest: memfd(dest, text.encode()) for dest, text in _etc_data(uid).items()}
    seccomp_fd = memfd("seccomp", plan.bpf) if plan.bpf is not None else None
    cmd = _bwrap_args(plan, uid, limits, file_fds, data_fds, seccomp_fd, argv, binds or [], ro_binds or [])
    pass_fds = [fd for fd, _ in file_fds] + list(data_fds.values())
    if seccomp_fd is not None:
        pass_fds.append(seccomp_fd)
    spec = dict(argv=cmd, env={}, cwd="/", bwrap_json_status="--json-status-fd" in plan.bwrap_opts)
    return spec, pass_fds


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
    a += _host_view(data_fds)
    a += ["--proc", "/proc", "--dev", "/dev"]
    size = ["--size", str(limits.memory_mb << 20)] if "--size" in plan.bwrap_opts else []
    for m in ("/dev/shm", "/tmp", _WORK):
        a += [*size, "--perms", "0700", "--tmpfs", m]
    a += _work_files(file_fds)
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


def _host_view(data_fds: dict[str, int]) -> list[str]:
    """/usr and the /lib* links read-only, the loader's files of /etc, and the synthetic /etc files."""
    a = ["--ro-bind", "/usr", "/usr"]
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
    return a


def _work_files(file_fds: list[tuple[int, str]]) -> list[str]:
    """main.py and the extra files in /work, with the directories they need."""
    a = []
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
    return a
