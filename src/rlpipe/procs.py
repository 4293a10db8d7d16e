"""Stopping the process groups rlpipe starts (services, a stack's components, benchmark children)."""

from __future__ import annotations

import os
import signal
import subprocess

__all__ = ["stop_group"]


def stop_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the process group ``proc`` leads (it was started with ``start_new_session``), SIGKILL if it
    is still there after ``grace_s``; by its id, never by name."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
