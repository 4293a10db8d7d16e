"""The sandbox's values: the limits a caller asks for, the result it gets back, the error of
strict mode, and the plan (isolation components chosen on this machine) a run follows."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlpipe.sandbox._cgroup import CgroupManager

COMPONENTS = ("bwrap", "seccomp", "uid", "rlimits", "cgroup")
FULL_LEVEL = "+".join(COMPONENTS)


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


@dataclass(frozen=True)
class _Plan:
    """What one run uses: the interpreter and each isolation component present (None/False if not)."""

    python: str
    bwrap: str | None
    bpf: bytes | None
    uid_switch: bool
    cgroup: CgroupManager | None
    bwrap_opts: frozenset
    level: str
    missing: dict = field(default_factory=dict)

    @property
    def full(self) -> bool:
        return self.level == FULL_LEVEL
