"""Who removes a run cgroup (``rlpipe.sandbox._cgroup``): the process that made it when it exits,
the launcher when rlpipe dies mid-run (see ``test_attacks.test_crash_of_the_caller_leaves_nothing_behind``),
and otherwise the next rlpipe process to set the sandbox up. Each claim is checked on the host.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlpipe.sandbox import _cgroup, _detect, run_python
from tests.sandbox.conftest import cgroups_of, need

NEXT_START = "from rlpipe.sandbox import isolation_report; isolation_report()"


def _dead_pid() -> int:
    """A pid that was just used and is now free (our own reaped child)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _manager() -> _cgroup.CgroupManager:
    caps = _detect._caps.peek()
    assert caps is not None and caps.cgroup is not None
    return caps.cgroup


def _make(name: str) -> list[Path]:
    dirs = [b / name for b in _manager().bases]
    for d in dirs:
        d.mkdir()
    return dirs


def _run_next_start() -> None:
    r = subprocess.run([sys.executable, "-c", NEXT_START], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("make_name, alive", [
    (lambda: f"slot3-{_cgroup.owner_id()}", True),  # ours
    (lambda: f"slot3-{os.getpid()}-1", False),  # our pid, another start time: a reused pid's leftover
    (lambda: f"probe123-{_dead_pid()}-5", False),
    (lambda: f"slot3-{os.getpid()}", True),  # old-style name: only the pid to go by
    (lambda: f"slot3-{_dead_pid()}", False),
    (lambda: "process_api", None),  # not one of ours: never touched
    (lambda: "slot3", None),
    (lambda: f"probe-{os.getpid()}-99", None),  # an older rlpipe's probe: its ns is no start time
    (lambda: "slotx-12-34", None),
])
def test_a_group_names_its_owner_exactly(make_name, alive):
    assert _cgroup.owner_alive(make_name()) is alive


def test_the_owner_id_is_pid_and_start_time():
    me = _cgroup.owner_id()
    pid, start = me.split("-")
    assert int(pid) == os.getpid() and int(start) == _cgroup.process_start(os.getpid()) > 0
    assert _cgroup.owner_id(_dead_pid()) is None


def test_the_next_start_sweeps_groups_of_dead_owners_only(report):
    need(report, "cgroup")
    _detect._capabilities()
    sleeper = subprocess.Popen(["sleep", "60"])
    straggler = subprocess.Popen(["sleep", "60"])
    live = f"slot63-{_cgroup.owner_id(sleeper.pid)}"
    stale = [f"slot60-{_dead_pid()}-7", f"slot61-{os.getpid()}-1", f"slot62-{_dead_pid()}", f"probe9-{_dead_pid()}-3"]
    made = [d for name in [live, *stale] for d in _make(name)]
    try:
        for d in _make(stale[0].replace("slot60", "slot59")):  # a dead owner's group still holding a task
            (d / "cgroup.procs").write_text(str(straggler.pid))
        stale.append(stale[0].replace("slot60", "slot59"))
        _run_next_start()
        left = {p.name for b in _manager().bases for p in b.iterdir()}
        assert not left & set(stale), f"stale groups survived the next start: {sorted(left & set(stale))}"
        assert live in left, "the group of a live owner was swept"
        assert straggler.wait(timeout=10) == -9, "the task in a dead owner's group was not killed"
    finally:
        for p in (sleeper, straggler):
            p.kill()
            p.wait()
        for d in made:
            try:
                d.rmdir()
            except OSError:
                pass


def test_idle_groups_of_a_caller_killed_between_runs_are_swept_at_next_start(report, tmp_path):
    """No launcher is running between runs, so nothing outlives the caller to clean up after it."""
    need(report, "cgroup")
    _detect._capabilities()
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent("""
        import time
        from rlpipe.sandbox import _cgroup, run_python
        assert run_python("print(1)").status == "ok"
        print(_cgroup.owner_id(), flush=True)
        time.sleep(60)
    """))
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        owner = caller.stdout.readline().strip()
        assert owner == _cgroup.owner_id(caller.pid)
        assert cgroups_of(owner), "the caller kept no idle group between runs (nothing to test)"
    finally:
        caller.kill()
        caller.wait()
        caller.stdout.close()
    _run_next_start()
    assert cgroups_of(owner) == [], f"a killed caller's idle groups survived the next start: {cgroups_of(owner)}"


def _pool_worker(conn) -> None:
    r = run_python("print(1)")
    conn.send((r.status, _cgroup.owner_id(), [str(p) for p in cgroups_of(_cgroup.owner_id())]))
    conn.close()


def _worker_scenario(method: str) -> dict:
    """A parent with an idle sandbox group starts a multiprocessing worker that runs the sandbox and returns."""
    assert run_python("print(1)").status == "ok"  # the parent's own idle group, kept for reuse
    mine = cgroups_of(_cgroup.owner_id())
    ctx = mp.get_context(method)
    parent, child = ctx.Pipe()
    worker = ctx.Process(target=_pool_worker, args=(child,))
    worker.start()
    child.close()
    status, owner, groups = parent.recv()
    worker.join(30)
    return {"exitcode": worker.exitcode, "status": status, "groups": groups, "left": [g for g in groups if Path(g).exists()],
            "owner_left": [str(p) for p in cgroups_of(owner)], "mine": [str(p) for p in mine],
            "mine_after": [str(p) for p in cgroups_of(_cgroup.owner_id())]}


@pytest.mark.parametrize("method", ["forkserver", "fork"])
def test_a_multiprocessing_worker_removes_its_groups_when_it_returns(report, method):
    """multiprocessing children leave through os._exit (no atexit), like the verifier pool's workers.
    A forked one inherits its parent's groups and must leave them alone.

    The parent is a fresh interpreter: forking this pytest process, which by now holds torch, vLLM
    and gloo threads, gives a child whose exit is not ours to judge (the pool itself uses forkserver)."""
    import json

    need(report, "cgroup")
    code = f"import json; from tests.sandbox.test_cgroup import _worker_scenario; print(json.dumps(_worker_scenario({method!r})))"
    root = Path(__file__).resolve().parents[2]
    env = os.environ | {"PYTHONPATH": f"{root / 'src'}:{root}"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["mine"], "the parent made no group (nothing to test)"
    assert r["exitcode"] == 0 and r["status"] == "ok", proc.stderr[-3000:]
    assert r["groups"], "the worker made no group (nothing to test)"
    assert not r["left"], f"the worker's groups outlived it: {r['groups']}"
    assert r["owner_left"] == []
    assert r["mine_after"] == r["mine"], "the worker removed its parent's groups"
