"""The host processes and files of a worker uid: count them, kill them, remove them.

A run's cgroup and its launcher normally take everything down; these sweeps are the fallback for
a run without a cgroup, a slot whose last holder crashed, and (without a mount namespace) what the
code left in world-writable host directories.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import time
from pathlib import Path


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


def _tasks_of_uid(uid: int) -> int:
    """Threads of all processes whose real uid is uid (what RLIMIT_NPROC counts)."""
    n = 0
    for _, text in _proc_statuses():
        m = re.search(r"^Uid:\s+(\d+)", text, re.M)
        t = re.search(r"^Threads:\s+(\d+)", text, re.M)
        if m and int(m.group(1)) == uid:
            n += int(t.group(1)) if t else 1
    return n


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
