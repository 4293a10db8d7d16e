"""Shared helpers for the sandbox tests: capability gates and a host guard run around every test."""

from __future__ import annotations

import json
import os
import select
import time
from pathlib import Path

import pytest

from rlpipe.sandbox import isolation_report
from rlpipe.sandbox import _cgroup, _detect, _slots


@pytest.fixture(scope="session")
def report() -> dict:
    return isolation_report()


def need(report: dict, *components: str) -> None:
    """Skip (loudly, with the reason) unless every component is available on this machine."""
    for c in components:
        comp = report["components"][c]
        if not comp["available"]:
            pytest.skip(f"sandbox component '{c}' unavailable here: {comp['detail']}")
        if c in report["disabled_by_env"]:
            pytest.skip(f"sandbox component '{c}' disabled by RLPIPE_SANDBOX_DISABLE")


def sandbox_uid_range() -> range:
    base = _slots._uid_base()
    return range(base, base + _slots._n_slots())


def _status(pid: str) -> str | None:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None


def sandbox_processes(zombies: bool = False) -> list[tuple[int, int, str]]:
    """(pid, uid, name) of every live process with a sandbox uid (any of real/effective/saved/fs); with
    ``zombies``, those not yet reaped too."""
    uids = sandbox_uid_range()
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        text = _status(p)
        if text is None:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        ids = [int(x) for x in fields.get("Uid", "").split()]
        if fields.get("State", "").strip().startswith("Z") and not zombies:
            continue
        hit = [u for u in ids if u in uids]
        if hit:
            out.append((int(p), hit[0], fields.get("Name", "").strip()))
    return out


def process_tree(root: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live (non-zombie) descendant of `root`."""
    children: dict[int, list[int]] = {}
    names = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        text = _status(p)
        if text is None:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        if fields.get("State", "").strip().startswith("Z"):
            continue
        children.setdefault(int(fields.get("PPid", "0")), []).append(int(p))
        try:
            names[int(p)] = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            names[int(p)] = "?"
    out, stack = [], list(children.get(root, []))
    while stack:
        pid = stack.pop()
        out.append((pid, names.get(pid, "")[:120]))
        stack.extend(children.get(pid, []))
    return out


def launcher_descendants() -> list[tuple[int, str]]:
    """Descendants of this test process that belong to the sandbox machinery."""
    return [(pid, cmd) for pid, cmd in process_tree(os.getpid())
            if "_launcher.py" in cmd or "bwrap" in cmd or "main.py" in cmd]


def cgroups_of(owner: str | None) -> list[Path]:
    """The run cgroups (in every base) whose name says `owner` (``<pid>-<start>``) made them."""
    caps = _detect._caps.peek()
    if owner is None or caps is None or caps.cgroup is None:
        return []
    out = []
    for base in caps.cgroup.bases:
        try:
            out += [p for p in base.iterdir() if p.is_dir() and _cgroup.owner_of(p.name) == owner]
        except OSError:
            pass
    return out


def leftover_cgroups() -> list[str]:
    """This process's run cgroups that still hold a process (they are kept, empty, for reuse)."""
    left = []
    for p in cgroups_of(_cgroup.owner_id()):
        try:
            if (p / "cgroup.procs").read_text().strip():
                left.append(str(p))
        except OSError:
            pass
    return left


def wait_for_exit(pidfds: list[int], timeout: float) -> bool:
    """Wait until every process behind these pidfds has exited (a pidfd polls readable then)."""
    poller = select.poll()
    for fd in pidfds:
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout
    pending = set(pidfds)
    while pending:
        left_ms = (deadline - time.monotonic()) * 1000
        if left_ms <= 0:
            return False
        for fd, _ in poller.poll(left_ms):
            pending.discard(fd)
            poller.unregister(fd)
    return True


def wait_until_clean(timeout: float = 3.0) -> tuple[list, list, list]:
    deadline = time.monotonic() + timeout
    while True:
        state = (sandbox_processes(), launcher_descendants(), leftover_cgroups())
        if not any(state) or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def host_guard():
    """After every test: no process of a sandbox uid, no launcher/bwrap child, no run cgroup left."""
    yield
    procs, desc, cgs = wait_until_clean()
    assert not procs, f"sandbox-uid processes survived: {procs}"
    assert not desc, f"sandbox processes survived under the test process: {desc}"
    assert not cgs, f"run cgroups left behind: {cgs}"


def last_json(stdout: str) -> dict:
    """The child reports its findings as JSON on its last stdout line."""
    lines = [line for line in stdout.strip().splitlines() if line.strip()]
    assert lines, "child printed nothing"
    return json.loads(lines[-1])
