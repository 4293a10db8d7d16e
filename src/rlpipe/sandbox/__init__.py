"""Run untrusted, model-written Python in a sandbox.

    from rlpipe.sandbox import run_python, SandboxLimits
    r = run_python("print(input()[::-1])", stdin="abc", limits=SandboxLimits(wall_s=5))
    r.status, r.stdout        # ("ok", "cba\\n")

**What the full level ("bwrap+seccomp+uid+rlimits+cgroup") does.** The code runs as ``main.py``
under the *system* interpreter (``/usr/bin/python3``) inside bubblewrap with every namespace
unshared (user, pid, net, ipc, uts, cgroup, mount; nested user namespaces disabled): no network
at all (a private, empty loopback), its own pid 1, a read-only view of ``/usr`` (plus the
``/lib*`` links and the dynamic-loader files of ``/etc``), synthetic ``/etc/passwd``/``group``/
``hosts``, a private ``/proc``, a minimal ``/dev``, and private size-capped tmpfs mounts for
``/work`` (the work dir, holding ``main.py`` and ``files``), ``/tmp`` and ``/dev/shm``; everything
else is read-only or absent (``/root``, ``/home``, ``/etc/shadow``, host ``/tmp``…). The
environment is a fixed minimal one; nothing of the caller's (secrets) is passed. A seccomp
filter denies non-AF_UNIX sockets, ptrace, mount, unshare/setns/namespace clones, bpf,
perf_event_open, userfaultfd, io_uring, keyctl, signals to process groups/everything/pid 1, and
more (see ``_seccomp.py``). Each concurrent run gets its own unprivileged host uid (``61000 +
slot``, slots locked across threads and processes), rlimits (CPU, address space, processes, file
size, open files, no core dumps) and its own cgroup (memory incl. tmpfs, pids). A trusted
launcher process (still root, so the sandbox cannot signal it) is the child subreaper of the run;
when the program ends or the wall clock runs out it SIGKILLs everything left — by pid namespace,
by descendant tree, by uid, and finally by cgroup — so daemons that ``setsid``/double-fork die
too. A run therefore ends when ``main.py`` exits: whatever it left running is killed. stdout and
stderr are each capped at ``max_output_bytes`` (the rest is read and discarded; ``truncated`` is
set). ``max_processes`` counts tasks, so threads count; ``cpu_s`` is per process and rounded up to
whole seconds; the cgroup allows ``memory_mb`` plus 16 MB for the launcher and bubblewrap.

**Fallbacks.** Without root there is no uid switch (and usually no cgroup); without bubblewrap or
user namespaces there are no namespaces: the code runs in a private host temp dir under the
worker uid with seccomp and rlimits, and can read world-readable host files (and other
processes' command lines), write to world-writable host dirs (what the worker uid leaves in
``/tmp``, ``/var/tmp`` and ``/dev/shm`` is deleted after the run; SysV IPC objects are not) and
reach host AF_UNIX sockets. Without root the sandbox shares the caller's uid (no kill-by-uid;
``RLIMIT_NPROC`` counts the caller's processes too, so it is raised by their number). Whatever
is missing is logged as a warning once per level and named in every result's ``isolation``
field; it never runs without the launcher, rlimits and timeouts. ``RLPIPE_SANDBOX_STRICT=1`` turns a missing component into
:class:`SandboxUnavailableError`. ``isolation_report()`` says what this machine offers.
``RLPIPE_SANDBOX_DISABLE=bwrap,seccomp,cgroup`` switches components off (testing/operations;
warned like any fallback).

**What it does NOT protect against.**

* Kernel and hardware vulnerabilities: the sandbox shares the host kernel (a kernel exploit
  through an allowed syscall, or through user namespaces, escapes it), and speculative-execution
  or other side channels (cache timing, Rowhammer) are not mitigated.
* Information about the host the kernel shows anyone: ``/proc/cpuinfo``, ``/proc/meminfo``,
  kernel version, uptime, load, the mounted /usr contents and installed packages.
* CPU time stolen within the limits: each process may burn ``cpu_s`` of CPU (``RLIMIT_CPU`` is per
  process) until ``wall_s``; there is no CPU share/quota, so concurrent runs slow the host down.
* Resource use below the limits: up to ``memory_mb`` of RAM (plus a little for bubblewrap), up to
  ``max_processes`` tasks (threads count), tmpfs writes up to the memory limit, disk I/O on reads.
* Lies in the output: stdout/stderr are capped, but what the program prints is untrusted text.
  A harness that runs the code in the same process and reads its verdict from stdout can be
  fooled by code that prints a fake verdict and then exits (``os._exit``) before the harness
  reports.
* Exhaustion of shared kernel resources that are not namespaced or not limited per uid (e.g.
  inotify watches, pipe buffer pages, entropy): bounded only by the process, file and time limits.
* Exit status ambiguity: through bubblewrap a program that exits with ``128+N`` looks like one
  killed by signal N.
* Anything at the degraded levels beyond what they name (see Fallbacks), and a host where an
  attacker already controls root, the system Python, or ``/usr``.
"""

from __future__ import annotations

import logging

from rlpipe.sandbox import _detect, _run
from rlpipe.sandbox._detect import isolation_report
from rlpipe.sandbox._program import _check_files, _check_ro_binds
from rlpipe.sandbox._types import SandboxLimits, SandboxResult, SandboxUnavailableError

log = logging.getLogger("rlpipe.sandbox")

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailableError", "isolation_report", "run_python"]


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
    plan = _detect._plan_for_run()
    if plan is None:
        return SandboxResult("error", None, "", "rlpipe.sandbox: no sandbox available on this machine "
                             "(see rlpipe.sandbox.isolation_report())", 0.0, 0.0, "none")
    try:
        result = _run._execute(code, stdin, limits, files, argv, plan, ro_binds=ro_binds)
    except (ValueError, TypeError):
        raise
    except Exception as e:
        if _detect._strict():
            raise SandboxUnavailableError(f"rlpipe.sandbox: sandbox setup failed: {e}") from e
        log.error("rlpipe.sandbox: sandbox setup failed: %s", e, exc_info=True)
        return SandboxResult("error", None, "", f"rlpipe.sandbox: sandbox setup failed: {type(e).__name__}: {e}",
                             0.0, 0.0, plan.level)
    if getattr(result, "_setup_failed", False) and _detect._strict():
        raise SandboxUnavailableError(result.stderr.strip().splitlines()[-1])
    return result
