"""Resource metrics of a run, per iteration and per stage: CPU-seconds and RSS of this process and its
children, peak memory per stage, GPU memory (and utilisation where NVML is installed), bytes written to
the object store; and the memory-growth alert over a run's history.

A daemon thread samples the process tree every ``interval_s`` and keeps each stage's peak; stages are
named by the caller (``with monitor.stage("update"): …``). CPU-seconds count the process, its live
children and the children it has reaped; a grandchild reaped by its own parent is not counted.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psutil

from rlpipe.storage.store import bytes_written

__all__ = ["ResourceMonitor", "monitor", "memory_growth"]


def _tree(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return [proc]


def tree_cpu_s(proc: psutil.Process, members: Sequence[psutil.Process] | None = None) -> float:
    """User + system CPU-seconds of ``proc``, its reaped children and its live descendants (``members``: a listing
    of them made earlier)."""
    total = 0.0
    for p in members if members is not None else _tree(proc):
        try:
            t = p.cpu_times()
        except psutil.Error:  # gone between listing and reading
            continue
        total += t.user + t.system + (t.children_user + t.children_system if p is proc else 0.0)
    return total


def tree_rss(proc: psutil.Process, members: Sequence[psutil.Process] | None = None) -> int:
    """RSS of ``proc`` and its live descendants (``members``: a listing of them made earlier)."""
    total = 0
    for p in members if members is not None else _tree(proc):
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total


class ResourceMonitor:
    """``interval_s``: between two samples of the tree's RSS; ``relist_s``: between two listings of the tree itself
    (it scans every process on the machine, milliseconds where there are thousands, and changes rarely: a verifier
    pool's or a server's start). A child started since the last listing is counted from the next one."""

    def __init__(self, interval_s: float = 0.2, pid: int | None = None, relist_s: float = 2.0):
        self.proc = psutil.Process(pid or os.getpid())
        self.interval_s, self.relist_s = interval_s, relist_s
        self._lock = threading.Lock()
        self._stage: str | None = None
        self._peaks: dict[str, int] = {}
        self._thread: threading.Thread | None = None
        # Listing the process tree scans every process on the machine (psutil reads each one's parent; 37 ms at
        # 1,071 processes here): the sampling thread lists it every relist_s, and everything else (a stage's start
        # and end, an iteration's mark and metrics, on the run's own thread) reuses its latest listing.
        self._members: list[psutil.Process] | None = None
        self._busy: _GpuBusy | None = None  # made by the sampling thread (it imports torch)

    def _listing(self) -> list[psutil.Process]:
        """The sampling thread's latest listing of the tree (at most ``relist_s`` old); one made now if none is."""
        if self._members is None:
            self._members = _tree(self.proc)
        return self._members

    def _sample(self, relist: bool = False) -> None:
        if relist:
            self._members = _tree(self.proc)
        rss = tree_rss(self.proc, self._listing())
        with self._lock:
            if self._stage is not None:
                self._peaks[self._stage] = max(self._peaks.get(self._stage, 0), rss)

    def _loop(self) -> None:
        self._busy = _GpuBusy()
        listed = -float("inf")
        while True:
            if time.monotonic() - listed >= self.relist_s:
                self._sample(relist=True)
                listed = time.monotonic()
            else:
                self._sample()
            self._busy.sample()
            time.sleep(self.interval_s)

    def start(self) -> "ResourceMonitor":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="rlpipe-resources", daemon=True)
            self._thread.start()
        return self

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Track the peak RSS (and, on CUDA, the peak allocated GPU memory) while the block runs."""
        cuda = _cuda()
        if cuda:
            cuda.reset_peak_memory_stats()
        with self._lock:
            self._stage = name
        self._sample()
        try:
            yield
        finally:
            self._sample()
            gpu = cuda.max_memory_allocated() if cuda else None
            with self._lock:
                self._stage = None
                if gpu is not None:
                    self._peaks[f"gpu:{name}"] = max(self._peaks.get(f"gpu:{name}", 0), gpu)

    def begin(self) -> dict[str, float]:
        """A mark to measure an iteration from; clears the stage peaks."""
        with self._lock:
            self._peaks.clear()
        if self._busy is not None:
            self._busy.reset()
        return {"t": time.perf_counter(), "cpu_s": tree_cpu_s(self.proc, self._listing()), "bytes": float(bytes_written())}

    def metrics(self, mark: dict[str, float]) -> dict[str, float]:
        """The iteration's resource metrics since ``mark``."""
        wall = max(time.perf_counter() - mark["t"], 1e-9)
        members = self._listing()
        cpu = tree_cpu_s(self.proc, members) - mark["cpu_s"]
        out = {"resource/cpu_s": cpu, "resource/cpu_util": cpu / wall / (os.cpu_count() or 1),
               "resource/rss_bytes": float(tree_rss(self.proc, members)), "store/bytes_written": bytes_written() - mark["bytes"]}
        with self._lock:
            for stage, peak in self._peaks.items():
                kind, _, name = stage.rpartition(":")
                out[f"resource/{'gpu_mem' if kind else 'rss'}_peak_bytes/{name}"] = float(peak)
        return out | _gpu_metrics(wall, self._busy.means() if self._busy is not None else None)


def _cuda() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda if torch.cuda.is_available() else None


def _nvml_handles() -> list[Any]:
    """NVML's handle of each GPU; none without CUDA or pynvml (nvidia-ml-py), or when NVML will not start."""
    if not _cuda():
        return []
    try:
        import pynvml

        pynvml.nvmlInit()
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # noqa: BLE001 - ImportError, or NVMLError (no driver library): no NVML metrics
        return []


class _GpuBusy:
    """Each GPU's utilisation averaged over the iteration, from the monitor's samples. NVML's utilisation is the
    share of its last sample period (1/6 s to 1 s) in which a kernel ran: one reading at the iteration's end says
    what the GPU did while the run logged and saved, not while it generated and trained (alerts.gpu_util_low)."""

    def __init__(self) -> None:
        self.handles = _nvml_handles()
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.sums, self.n = [0.0] * len(self.handles), 0

    def sample(self) -> None:
        if not self.handles:
            return
        import pynvml

        try:
            busy = [pynvml.nvmlDeviceGetUtilizationRates(h).gpu / 100 for h in self.handles]
        except pynvml.NVMLError:  # a GPU gone or NVML broken: stop sampling, the RSS samples must go on
            self.handles = []
            return
        with self._lock:
            self.sums, self.n = [a + b for a, b in zip(self.sums, busy)], self.n + 1

    def means(self) -> list[float] | None:
        with self._lock:
            return [x / self.n for x in self.sums] if self.n else None


def _gpu_metrics(wall: float, busy: list[float] | None = None) -> dict[str, float]:
    """GPU-seconds (wall × GPUs in use) and, with NVML, each GPU's memory in use and utilisation: ``busy``, the
    mean of the monitor's samples over the iteration, or one reading now when it has none."""
    cuda = _cuda()
    if not cuda:
        return {}
    out = {"resource/gpu_s": wall * cuda.device_count()}
    handles = _nvml_handles()
    if not handles:
        return out
    import pynvml

    for i, h in enumerate(handles):
        now = pynvml.nvmlDeviceGetUtilizationRates(h).gpu / 100
        out[f"resource/gpu{i}_util"] = float(busy[i] if busy and i < len(busy) else now)
        out[f"resource/gpu{i}_mem_bytes"] = float(pynvml.nvmlDeviceGetMemoryInfo(h).used)
    return out


_MONITOR: ResourceMonitor | None = None


def monitor() -> ResourceMonitor:
    """The process's monitor, started on first use."""
    global _MONITOR
    if _MONITOR is None:
        _MONITOR = ResourceMonitor().start()
    return _MONITOR


def memory_growth(rss: Sequence[float], iterations: int, min_growth_bytes: float, what: str = "memory",
                  see: str = "resource/rss_peak_bytes/*") -> str | None:
    """An alert when RSS (or ``what``) rose at every one of the last ``iterations`` iterations and by more than
    ``min_growth_bytes`` in all: a leak looks like this, a warm-up plateau does not."""
    last = list(rss)[-(iterations + 1):]
    if len(last) < iterations + 1 or any(b <= a for a, b in zip(last, last[1:])):
        return None
    grew = last[-1] - last[0]
    if grew <= min_growth_bytes:
        return None
    return (f"{what} grew at each of the last {iterations} iterations, by {grew / 2**20:.0f} MiB in all "
            f"(now {last[-1] / 2**30:.2f} GiB): a leak? see {see} for the stage")
