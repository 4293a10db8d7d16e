"""Resource metrics measure what happened: a child that burns CPU and holds memory inside a stage shows up in
that stage's peak and the iteration's CPU-seconds; store writes are counted; memory growth alerts by hand."""

import subprocess
import sys
import time

import psutil
import pytest

from rlpipe.storage.store import open_store
from rlpipe.tracking.resources import ResourceMonitor, memory_growth

HOG = "import time\nx = bytearray(300 * 2**20)\nx[::4096] = b'1' * len(x[::4096])\nt = time.process_time()\n" \
      "while time.process_time() - t < 1.0: pass\nprint('ready', flush=True)\ntime.sleep(30)\n"


def test_a_child_s_cpu_and_memory_are_the_stage_s(tmp_path):
    mon = ResourceMonitor(interval_s=0.05, relist_s=0.05).start()
    mark = mon.begin()
    with mon.stage("hog"):
        child = subprocess.Popen([sys.executable, "-c", HOG], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.3)  # a few samples while it holds its 300 MiB
        child.kill()
        child.wait()
    with mon.stage("quiet"):
        time.sleep(0.2)
    open_store(str(tmp_path / "store")).put_bytes("a/b.bin", b"x" * 5000)
    m = mon.metrics(mark)
    assert m["resource/cpu_s"] >= 1.0  # the child's busy second, reaped
    assert m["resource/rss_peak_bytes/hog"] >= m["resource/rss_peak_bytes/quiet"] + 250 * 2**20
    assert m["store/bytes_written"] == 5000
    assert 0 < m["resource/rss_bytes"] < m["resource/rss_peak_bytes/hog"]


def test_the_tree_is_listed_every_relist_s_and_sampled_between():
    """The listing of the process tree (a scan of every process on the machine) is renewed every ``relist_s``; the
    RSS of what it lists is read every ``interval_s``: a child started after a listing counts from the next one."""
    mon = ResourceMonitor(interval_s=0.02, relist_s=0.6).start()
    time.sleep(0.1)  # the first listing is made: without a child
    before = psutil.Process().memory_info().rss
    with mon.stage("hog"):
        child = subprocess.Popen([sys.executable, "-c", HOG.replace("1.0", "0.0")], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            time.sleep(0.8)  # past relist_s: listed, then sampled with its 300 MiB
        finally:
            child.kill()
            child.wait()
    assert mon._peaks["hog"] >= before + 250 * 2**20


@pytest.mark.parametrize("rss,fires", [
    ([100, 200, 300, 400], True),              # 3 rises in a row, +300 in all
    ([100, 200, 300, 350], False),             # +250: not more than the floor
    ([100, 200, 150, 400, 500], False),        # a fall inside the window
    ([100, 200, 300], False),                  # too short to say
    ([500, 100, 200, 300, 400], True),         # only the last window counts
])
def test_memory_growth_by_hand(rss, fires):
    alert = memory_growth([x * 2**20 for x in rss], iterations=3, min_growth_bytes=250 * 2**20)
    assert (alert is not None) == fires
    if fires:
        assert "each of the last 3 iterations" in alert and "300 MiB" in alert
