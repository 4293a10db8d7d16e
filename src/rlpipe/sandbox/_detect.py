"""What this machine can do for the sandbox, and the plan a run follows.

Detection (once per process, on first use) finds the system interpreter, compiles the seccomp
filter, finds a cgroup hierarchy rlpipe may write to, checks bubblewrap's options and then probes
the whole thing with one real run. A plan is that minus what ``RLPIPE_SANDBOX_DISABLE`` switches
off; a plan weaker than the full level is warned about once per level, or refused in strict mode.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from rlpipe.sandbox import _cgroup, _run
from rlpipe.sandbox._once import Once
from rlpipe.sandbox._slots import _n_slots, _uid_base
from rlpipe.sandbox._types import COMPONENTS, FULL_LEVEL, SandboxLimits, SandboxUnavailableError, _Plan

log = logging.getLogger("rlpipe.sandbox")

STRICT_ENV = "RLPIPE_SANDBOX_STRICT"
DISABLE_ENV = "RLPIPE_SANDBOX_DISABLE"
PYTHON_ENV = "RLPIPE_SANDBOX_PYTHON"
BWRAP_ENV = "RLPIPE_SANDBOX_BWRAP"

DEFAULT_PYTHON = "/usr/bin/python3"
_DISABLEABLE = ("bwrap", "seccomp", "cgroup")
# The bubblewrap options the sandbox cannot do without (bubblewrap >= 0.5 has them all).
_BWRAP_NEEDS = frozenset({"--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--clearenv",
                          "--seccomp", "--file", "--ro-bind-data", "--perms", "--remount-ro"})


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


_warned_levels: set[str] = set()


def _strict() -> bool:
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _disabled() -> set[str]:
    raw = os.environ.get(DISABLE_ENV, "")
    out = {x.strip().lower() for x in raw.split(",") if x.strip()}
    bad = out - set(_DISABLEABLE)
    if bad:
        log.warning("%s: ignoring unknown component(s) %s (can disable: %s)", DISABLE_ENV, sorted(bad), _DISABLEABLE)
    return out & set(_DISABLEABLE)


def _find_bwrap() -> str | None:
    explicit = os.environ.get(BWRAP_ENV)
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return shutil.which("bwrap") or next(
        (p for p in ("/usr/bin/bwrap", "/bin/bwrap") if os.access(p, os.X_OK)), None
    )


def _detect_python() -> tuple[str | None, str]:
    python = os.environ.get(PYTHON_ENV, DEFAULT_PYTHON)
    if not os.access(python, os.X_OK):
        return None, f"{python} not found or not executable (set {PYTHON_ENV})"
    try:
        v = subprocess.run([python, "-I", "-S", "-c", "import sys; print(sys.version.split()[0])"],
                           capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{python}: {e}"
    if v.returncode != 0:
        return None, f"{python}: {v.stderr[-300:]}"
    return python, f"{python} (Python {v.stdout.strip()})"


def _detect_seccomp() -> tuple[bytes | None, str]:
    try:
        from rlpipe.sandbox import _seccomp  # imports pyseccomp only when it compiles the filter

        bpf = _seccomp.build_bpf()
        return bpf, f"{_seccomp.seccomp_version()}, {len(bpf) // 8} BPF instructions"
    except Exception as e:  # ImportError, RuntimeError (no libseccomp), OSError
        return None, f"unavailable: {type(e).__name__}: {e} (pip install pyseccomp; needs libseccomp2)"


def _detect_cgroup() -> tuple[_cgroup.CgroupManager | None, str]:
    try:
        return _cgroup.detect()
    except Exception as e:  # never let a strange /proc break the sandbox
        return None, f"{type(e).__name__}: {e}"


def _detect_bwrap() -> tuple[str | None, str, frozenset]:
    """(bubblewrap's path or None, what was found, the options its --help lists)."""
    bwrap = _find_bwrap()
    opts: frozenset = frozenset()
    if bwrap is None:
        return None, "bwrap not found (apt-get install bubblewrap)", opts
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=30)
        helptext = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30).stdout
        opts = frozenset(re.findall(r"--[a-z][a-z0-9-]*", helptext))
        bwrap_detail = f"{bwrap} ({out.stdout.strip() or 'unknown version'})"
        if not _BWRAP_NEEDS <= opts:
            return None, f"{bwrap_detail} lacks {sorted(_BWRAP_NEEDS - opts)} (need bubblewrap >= 0.5)", opts
        return bwrap, bwrap_detail, opts
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{bwrap}: {e}", opts


def _detect_caps() -> _Caps:
    python, python_detail = _detect_python()
    root = os.geteuid() == 0
    bpf, seccomp_detail = _detect_seccomp()
    cgroup, cgroup_detail = _detect_cgroup()
    bwrap, bwrap_detail, opts = _detect_bwrap()
    caps = _Caps(python, python_detail, root, bpf, seccomp_detail, cgroup, cgroup_detail, bwrap, bwrap_detail, opts)
    if bwrap is not None and python is not None:
        why = _probe_bwrap(_Plan(python, bwrap, bpf, root, None, opts, "probe"))
        if why:
            caps = _Caps(python, python_detail, root, bpf, seccomp_detail, cgroup, cgroup_detail, None,
                         f"{bwrap_detail}: {why} (are unprivileged user namespaces enabled?)", frozenset())
    return caps


def _probe_bwrap(probe_plan: _Plan) -> str:
    """Run a program through the real thing (launcher, uid switch, user namespace, mounts,
    seccomp) once; "" if it worked, else why not."""
    try:
        r = _run._execute("print('rlpipe-sandbox-probe')", "", SandboxLimits(wall_s=30.0), None, None, probe_plan)
    except Exception as e:
        return f"probe run failed: {type(e).__name__}: {e}"
    if r.status == "ok" and r.stdout == "rlpipe-sandbox-probe\n":
        return ""
    return f"probe run failed: status={r.status} exit={r.exit_code} stderr={r.stderr[-500:]!r}"


_caps: Once[_Caps] = Once(_detect_caps)


def _capabilities() -> _Caps:
    return _caps.get()


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
    """The plan for a run now; None (or, in strict mode, an error) if it cannot run as demanded."""
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
            _warn_degraded(plan, detail)
    return plan


def _warn_degraded(plan: _Plan, detail: str) -> None:
    extra = ""
    if plan.bwrap is None:
        extra = (" WITHOUT namespaces the code can read world-readable host files, see host processes, "
                 "write to world-writable host dirs (e.g. /tmp) and talk to host AF_UNIX sockets.")
    log.warning(
        "rlpipe.sandbox: DEGRADED ISOLATION: running untrusted code at level '%s' instead of '%s' (%s).%s "
        "Set %s=1 to make this an error.", plan.level, FULL_LEVEL, detail, extra, STRICT_ENV,
    )


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
