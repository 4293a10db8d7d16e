"""The one way rlpipe writes a file that a reader or a kill may catch half-written.

The bytes go to a temporary name beside the target, are flushed to disk, and replace the target in one
``rename``: a reader sees the old file or the new one, never a part, and a kill leaves at most a stray
``*.tmp-*`` file that the next write replaces.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["copy_atomic", "link_atomic", "write_atomic", "write_json_atomic"]


def write_atomic(path: str | os.PathLike[str], data: bytes | str, *, fsync: bool = True) -> Path:
    """Write ``data`` (text is UTF-8) to ``path`` through a temporary name; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def copy_atomic(src: str | os.PathLike[str], path: str | os.PathLike[str], *, fsync: bool = True) -> Path:
    """The file ``src`` copied to ``path`` as :func:`write_atomic` writes, copied by the kernel (``sendfile``): no
    copy of it in this process's memory, which for a save point's gigabyte of optimizer state is most of the cost."""
    path, tmp = _temporary(path)
    _into_place(lambda: shutil.copyfile(src, tmp), tmp, path, fsync)
    return path


def link_atomic(src: str | os.PathLike[str], path: str | os.PathLike[str]) -> bool:
    """``src`` named ``path`` too (a hard link), its data flushed to disk, as :func:`copy_atomic` leaves a copy: no
    byte copied or written twice. False where the file system cannot link it there (another device, no hard
    links): the caller copies instead. Only for files that nothing writes in place afterwards (both names are
    one file); a save point's files are such (``Spare.take`` never writes over a file with another name)."""
    path, tmp = _temporary(path)
    try:
        os.link(src, tmp)
    except OSError:
        return False
    _into_place(lambda: None, tmp, path, fsync=True)
    return True


def _temporary(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """``path`` (its folder made) and a temporary name beside it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path, path.with_name(f"{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")


def _into_place(make: Callable[[], object], tmp: Path, path: Path, fsync: bool) -> None:
    """``make()`` the file ``tmp``, flush it to disk (``fsync``), and rename it to ``path``; on any failure the
    temporary name is removed and ``path`` is left as it was."""
    try:
        make()
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | os.PathLike[str], obj: Any, *, fsync: bool = True) -> Path:
    """``obj`` as indented, key-sorted JSON (a trailing newline), written with :func:`write_atomic`."""
    return write_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n", fsync=fsync)
