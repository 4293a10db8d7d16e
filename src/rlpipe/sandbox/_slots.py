"""Worker slots: each concurrent run holds one slot, and with it its own host uid (base + slot).

A slot is exclusive across the threads of a process (a lock) and across processes (an ``flock``
on a file in a private lock directory). The lock file remembers whether its last holder ended
cleanly, so the next holder knows to sweep what a crashed run left behind.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import pwd
import stat
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger("rlpipe.sandbox")

UID_BASE_ENV = "RLPIPE_SANDBOX_UID_BASE"
SLOTS_ENV = "RLPIPE_SANDBOX_SLOTS"
DEFAULT_UID_BASE = 61000  # below systemd's DynamicUser range (61184-65519)
DEFAULT_SLOTS = 64


def _uid_base() -> int:
    return int(os.environ.get(UID_BASE_ENV, DEFAULT_UID_BASE))


def _n_slots() -> int:
    return max(1, min(int(os.environ.get(SLOTS_ENV, DEFAULT_SLOTS)), 1024))


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


_pool = _SlotPool()
