"""Attacks on the sandbox. Each test states a claim, attacks it from inside, and checks the outcome
*and* the host afterwards (the autouse ``host_guard`` also asserts that no process of a sandbox uid,
no launcher/bwrap process and no run cgroup is left after every test).

Tests that need a component this machine lacks skip with the component's own reason.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from rlpipe.sandbox import SandboxLimits, run_python
from rlpipe.sandbox import _cgroup, _detect, _program, _run, _slots
from tests.sandbox.conftest import (
    cgroups_of,
    last_json,
    need,
    process_tree,
    sandbox_processes,
    wait_for_exit,
    wait_until_clean,
)

FULL = ("bwrap", "seccomp", "uid", "rlimits", "cgroup")


# --------------------------------------------------------------------------- CPU and wall clock


def test_infinite_loop_is_stopped_by_the_cpu_limit(report):
    need(report, "rlimits")
    t = time.monotonic()
    r = run_python("while True:\n    pass\n", limits=SandboxLimits(wall_s=20, cpu_s=1))
    elapsed = time.monotonic() - t
    assert r.status == "timeout", r
    assert r.exit_code == -signal.SIGXCPU
    assert 0.8 <= r.cpu_s <= 2.5
    assert elapsed < 20, "the CPU limit, not the wall clock, must have stopped it"
    assert "CPU limit" in r.stderr


def test_loop_that_ignores_sigxcpu_is_killed_at_the_hard_cpu_limit(report):
    need(report, "rlimits")
    code = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n"
    r = run_python(code, limits=SandboxLimits(wall_s=20, cpu_s=1))
    assert r.status == "timeout", r
    assert r.exit_code == -signal.SIGKILL
    assert 1.8 <= r.cpu_s <= 3.5


def test_sleeping_forever_is_stopped_by_the_wall_clock_within_slack(report):
    wall = 1.5
    t = time.monotonic()
    r = run_python("import time\ntime.sleep(3600)\n", limits=SandboxLimits(wall_s=wall))
    elapsed = time.monotonic() - t
    assert r.status == "timeout", r
    assert r.exit_code == -signal.SIGKILL
    assert wall <= elapsed <= wall + 1.0, elapsed
    assert r.cpu_s < 0.5
    assert "wall-clock limit" in r.stderr


# --------------------------------------------------------------------------- processes


FORK_BOMB = textwrap.dedent("""
    import os
    while True:
        try:
            os.fork()
        except OSError:
            pass
""")


@pytest.mark.parametrize("disable", ["", "bwrap"], ids=["full", "no-bwrap"])
def test_fork_bomb_is_contained_and_leaves_no_survivor(report, monkeypatch, disable):
    need(report, "uid", "rlimits", "cgroup", *(["bwrap"] if not disable else []))
    monkeypatch.setenv("RLPIPE_SANDBOX_DISABLE", disable)
    limits = SandboxLimits(wall_s=2.0, max_processes=16)
    peak = [0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], len(sandbox_processes()))
            time.sleep(0.02)

    w = threading.Thread(target=watch)
    w.start()
    try:
        r = run_python(FORK_BOMB, limits=limits)
    finally:
        stop.set()
        w.join()
    assert r.status == "timeout", r
    # bubblewrap's monitor and pid-1 reaper run under the worker uid too (2 more tasks).
    assert 5 <= peak[0] <= limits.max_processes + 2, f"peak {peak[0]} sandbox processes"
    procs, desc, cgs = wait_until_clean()
    assert procs == [] and desc == [] and cgs == []
    # Nothing of the bomb is left in any state: each of its processes has a sandbox uid, which it cannot drop, so
    # the unreaped ones are counted too. Not the host's process count: other workloads (the suite's other xdist
    # worker, with sandbox uids of its own) start and stop processes meanwhile.
    assert sandbox_processes(zombies=True) == []


def test_process_limit_is_exact(report):
    need(report, "rlimits")
    code = textwrap.dedent("""
        import os, time, json
        n = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(3)
                    os._exit(0)
                n += 1
        except OSError as e:
            print(json.dumps({"children": n, "errno": e.errno}))
    """)
    r = run_python(code, limits=SandboxLimits(wall_s=10, max_processes=8))
    assert r.status == "ok", r
    out = last_json(r.stdout)
    assert out["children"] == 8 - 1  # the main process is one of max_processes
    assert out["errno"] == 11  # EAGAIN


def test_daemon_that_double_forks_and_setsids_does_not_outlive_the_run(report):
    need(report, "bwrap")
    _daemon_attempt(report, "exit")


def test_daemon_is_killed_on_timeout_too(report):
    need(report, "bwrap")
    _daemon_attempt(report, "timeout")


def test_without_bubblewrap_files_left_in_host_tmp_are_removed(report, monkeypatch):
    need(report, "uid")
    monkeypatch.setenv("RLPIPE_SANDBOX_DISABLE", "bwrap")
    tag = f"rlpipe-leftover-{uuid.uuid4().hex}"
    code = textwrap.dedent(f"""
        import os
        for d in ("/tmp", "/var/tmp", "/dev/shm"):
            open(os.path.join(d, "{tag}"), "w").write("carry me over")
            os.makedirs(os.path.join(d, "{tag}-dir", "sub"))
        print("written")
    """)
    r = run_python(code)
    assert r.status == "ok" and r.stdout == "written\n", r
    assert "bwrap" not in r.isolation
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not list(Path(d).glob(f"{tag}*")), f"{d}/{tag}* survived the run"


def test_daemon_is_killed_without_bubblewrap(report, monkeypatch):
    need(report, "uid", "rlimits")
    monkeypatch.setenv("RLPIPE_SANDBOX_DISABLE", "bwrap")
    _daemon_attempt(report, "exit", direct=True)


DAEMON = textwrap.dedent("""
    import os, signal, sys, time
    outbox, mode, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                signal.signal(s, signal.SIG_IGN)
            os.close(1); os.close(2)
            with open(os.path.join(outbox, "early"), "w") as fh:
                fh.write(str(os.getpid()))
            time.sleep(delay)
            with open(os.path.join(outbox, "late"), "w") as fh:
                fh.write("survived")
            os._exit(0)
        os._exit(0)
    for _ in range(500):
        if os.path.exists(os.path.join(outbox, "early")):
            break
        time.sleep(0.01)
    print("daemon started", flush=True)
    if mode == "timeout":
        time.sleep(3600)
""")


def _daemon_attempt(report, mode: str, direct: bool = False) -> None:
    # A host directory the daemon may write to (bind-mounted at /outbox for this test only) so
    # that a surviving daemon would be *visible* on the host.
    outbox = tempfile.mkdtemp(prefix="rlpipe-sbx-outbox-", dir="/tmp")
    os.chmod(outbox, 0o777)
    try:
        plan = _detect._plan_for_run()
        inside = outbox if direct else "/outbox"
        limits = SandboxLimits(wall_s=1.5 if mode == "timeout" else 10)
        delay = 2.5 if mode == "timeout" else 1.0  # the late write comes after the run has ended
        t0 = time.monotonic()
        r = _run._execute(DAEMON, "", limits, None, [inside, mode, str(delay)], plan,
                           binds=None if direct else [(outbox, "/outbox")])
        assert "daemon started" in r.stdout, r
        assert r.status == ("timeout" if mode == "timeout" else "ok"), r
        assert (Path(outbox) / "early").exists(), "control: the daemon ran and could write to the outbox"
        assert sandbox_processes() == [], "a sandbox process survived the run"
        assert not (Path(outbox) / "late").exists()
        time.sleep(max(0.0, t0 + delay + 0.5 - time.monotonic()))
        assert not (Path(outbox) / "late").exists(), "the daemon outlived the run"
    finally:
        for f in ("early", "late"):
            Path(outbox, f).unlink(missing_ok=True)
        os.rmdir(outbox)


# --------------------------------------------------------------------------- memory


def test_memory_bomb_hits_the_address_space_limit(report):
    need(report, "rlimits")
    r = run_python("x = bytearray(1 << 30)\n", limits=SandboxLimits(memory_mb=256))
    assert r.status == "memory", r
    assert "MemoryError" in r.stderr
    r = run_python("l = []\nwhile True:\n    l.append(' ' * 10**6)\n", limits=SandboxLimits(memory_mb=128))
    assert r.status == "memory", r


def test_memory_spread_over_processes_hits_the_cgroup_limit(report):
    need(report, "cgroup")
    code = textwrap.dedent("""
        import os, time
        kids = []
        for _ in range(4):
            pid = os.fork()
            if pid == 0:
                x = bytearray(100 << 20)          # under the per-process address-space limit
                for i in range(0, len(x), 4096):  # ...but actually touched
                    x[i] = 1
                time.sleep(0.5)
                os._exit(0)
            kids.append(pid)
        print([os.waitpid(p, 0)[1] for p in kids])
    """)
    r = run_python(code, limits=SandboxLimits(memory_mb=160, wall_s=20))
    assert r.status == "memory", r
    assert "cgroup memory limit" in r.stderr


def test_filling_tmpfs_counts_against_memory_and_never_touches_the_host(report):
    need(report, "bwrap", "cgroup")
    tag = f"rlpipe-fill-{uuid.uuid4().hex}"
    code = textwrap.dedent(f"""
        import os
        n = 0
        try:
            while True:
                with open('/dev/shm/{tag}-%d' % n, 'wb') as fh:
                    fh.write(b'x' * (8 << 20))
                n += 1
                print(n, flush=True)
        except OSError as e:
            print('full', e.errno, flush=True)
    """)
    limits = SandboxLimits(memory_mb=96, wall_s=20)
    r = run_python(code, limits=limits)
    written = max([int(x) for x in r.stdout.splitlines() if x.strip().isdigit()] or [0]) * 8
    assert written <= limits.memory_mb, f"wrote {written} MB to tmpfs with a {limits.memory_mb} MB limit"
    assert r.status == "memory" or (r.status == "ok" and "full" in r.stdout), r
    assert not list(Path("/dev/shm").glob(f"{tag}*"))


# --------------------------------------------------------------------------- output


def test_huge_output_is_capped_and_flagged(report):
    code = "import sys\nsys.stdout.write('o' * 10_000_000)\nsys.stderr.write('e' * 10_000_000)\n"
    r = run_python(code, limits=SandboxLimits(max_output_bytes=65536))
    assert r.status == "ok", r.status
    assert r.truncated
    assert r.stdout == "o" * 65536
    assert r.stderr == "e" * 65536


def test_endless_output_is_capped_until_the_wall_clock(report):
    t = time.monotonic()
    r = run_python("while True:\n    print('x' * 1000)\n", limits=SandboxLimits(wall_s=1.5, max_output_bytes=4096))
    assert r.status == "timeout"
    assert r.truncated and len(r.stdout) == 4096
    assert time.monotonic() - t < 1.5 + 1.0


# --------------------------------------------------------------------------- filesystem


def test_writes_outside_the_work_dir_fail_and_host_tmp_is_invisible(report):
    need(report, "bwrap")
    tag = f"rlpipe-escape-{uuid.uuid4().hex}"
    host_visible = [Path("/tmp") / f"{tag}-host", Path("/dev/shm") / f"{tag}-host"]
    for p in host_visible:
        p.write_text("host file")
    private = ["/work/ok.txt", f"/tmp/{tag}", f"/dev/shm/{tag}"]
    forbidden = [f"/{tag}", f"/usr/{tag}", f"/usr/local/{tag}", f"/etc/{tag}", "/etc/passwd", f"/root/{tag}",
                 f"/home/{tag}", f"/var/tmp/{tag}", f"/run/{tag}", f"/dev/{tag}", f"/bin/{tag}",
                 f"/work/../{tag}", f"/proc/{tag}", "/proc/sys/kernel/hostname", f"/sys/{tag}",
                 f"/sys/fs/cgroup/{tag}", "/usr/bin/python3"]
    code = textwrap.dedent("""
        import json, os, sys
        spec = json.load(sys.stdin)
        out = {"visible": {p: os.path.exists(p) for p in spec["visible"]}, "writes": {}}
        for p in spec["private"] + spec["forbidden"]:
            try:
                with open(p, "a") as fh:
                    fh.write("pwned\\n")
                out["writes"][p] = "ok"
            except OSError as e:
                out["writes"][p] = f"{type(e).__name__}: {e.strerror}"
        try:
            os.symlink("/etc", "/work/etc-link")
            open("/work/etc-link/" + spec["tag"], "w").write("x")
            out["symlink"] = "ok"
        except OSError as e:
            out["symlink"] = e.strerror
        print(json.dumps(out))
    """)
    spec = {"visible": [str(p) for p in host_visible], "private": private, "forbidden": forbidden, "tag": tag}
    try:
        r = run_python(code, stdin=json.dumps(spec))
        assert r.status == "ok", r
        out = last_json(r.stdout)
        assert not any(out["visible"].values()), f"host /tmp or /dev/shm visible: {out['visible']}"
        for p in private:
            assert out["writes"][p] == "ok", (p, out["writes"][p])
        for p in forbidden:
            assert out["writes"][p] != "ok", f"sandbox wrote to {p}"
        assert out["symlink"] != "ok"
        # ...and on the host nothing appeared or changed.
        for d in ("/", "/tmp", "/dev/shm", "/usr", "/usr/local", "/etc", "/root", "/home", "/var/tmp", "/run"):
            assert not (Path(d) / tag).exists(), f"{d}/{tag} appeared on the host"
        for p in host_visible:
            assert p.read_text() == "host file"
        assert "pwned" not in Path("/etc/passwd").read_text()
    finally:
        for p in host_visible:
            p.unlink(missing_ok=True)


def test_secrets_are_out_of_reach(report, monkeypatch):
    need(report, "bwrap")
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    monkeypatch.setenv("RLPIPE_TEST_SECRET", secret)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    code = textwrap.dedent("""
        import json, os, sys
        test_pid = int(sys.stdin.read())
        out = {"env": dict(os.environ), "reads": {}}
        for p in ["/etc/shadow", "/etc/gshadow", "/root/.bash_history", "/root/.cache",
                  f"/proc/{test_pid}/environ", "/proc/1/environ", "/proc/2/environ"]:
            try:
                if os.path.isdir(p):
                    out["reads"][p] = "listed: " + ",".join(os.listdir(p))
                else:
                    with open(p, "rb") as fh:
                        out["reads"][p] = "read: " + fh.read().decode("latin-1")
            except OSError as e:
                out["reads"][p] = f"denied: {type(e).__name__}"
        for p in ["/root", "/home"]:
            try:
                out["reads"][p] = "listed: " + ",".join(os.listdir(p))
            except OSError as e:
                out["reads"][p] = f"denied: {type(e).__name__}"
        blobs = []
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                for f in ("environ", "cmdline"):
                    try:
                        blobs.append(open(f"/proc/{pid}/{f}", "rb").read().decode("latin-1"))
                    except OSError:
                        pass
        out["proc_blobs"] = blobs
        print(json.dumps(out))
    """)
    r = run_python(code, stdin=str(os.getpid()))
    assert r.status == "ok", r
    assert secret not in r.stdout and secret not in r.stderr
    out = last_json(r.stdout)
    assert "RLPIPE_TEST_SECRET" not in out["env"] and "AWS_SECRET_ACCESS_KEY" not in out["env"]
    assert set(out["env"]) <= set(_program._SANDBOX_ENV) | {"HOME", "TMPDIR", "PWD"}, out["env"]
    for p in ["/etc/shadow", "/etc/gshadow", "/root/.bash_history", "/root/.cache", f"/proc/{os.getpid()}/environ",
              "/root", "/home"]:
        assert out["reads"][p].startswith("denied"), (p, out["reads"][p][:200])


# --------------------------------------------------------------------------- network


NET_ATTEMPTS = textwrap.dedent("""
    import json, socket, sys
    spec = json.load(sys.stdin)
    out = {}
    def attempt(name, fn):
        try:
            fn()
            out[name] = "ok"
        except OSError as e:
            out[name] = f"{type(e).__name__}: {e.errno}"
    def tcp(host, port, fam=socket.AF_INET):
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.settimeout(2)
        s.connect((host, port))
        s.sendall(b"pwned")
    def udp(host, port):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.sendto(b"pwned", (host, port))
    attempt("tcp_host_loopback", lambda: tcp("127.0.0.1", spec["tcp"]))
    attempt("tcp6_loopback", lambda: tcp("::1", spec["tcp"], socket.AF_INET6))
    attempt("udp_host_loopback", lambda: udp("127.0.0.1", spec["udp"]))
    if spec["remote"]:
        attempt("tcp_remote", lambda: tcp("10.255.255.1", 80))
        attempt("udp_remote", lambda: udp("10.255.255.1", 53))
        attempt("dns", lambda: socket.getaddrinfo("example.com", 80))
    attempt("netlink", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0))
    attempt("packet", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0))
    attempt("unix_pair", lambda: socket.socketpair())
    try:
        out["interfaces"] = [l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:]]
    except OSError as e:
        out["interfaces"] = str(e)
    print(json.dumps(out))
""")


@pytest.fixture
def host_servers():
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    tcp.setblocking(False)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.setblocking(False)
    yield {"tcp": tcp.getsockname()[1], "udp": udp.getsockname()[1], "_tcp": tcp, "_udp": udp}
    tcp.close()
    udp.close()


def _assert_servers_untouched(host_servers):
    with pytest.raises(BlockingIOError):
        host_servers["_tcp"].accept()
    with pytest.raises(BlockingIOError):
        host_servers["_udp"].recvfrom(100)


def test_no_network_at_all(report, host_servers):
    need(report, "bwrap", "seccomp")
    spec = {"tcp": host_servers["tcp"], "udp": host_servers["udp"], "remote": True}
    r = run_python(NET_ATTEMPTS, stdin=json.dumps(spec))
    assert r.status == "ok", r
    out = last_json(r.stdout)
    for name in ("tcp_host_loopback", "tcp6_loopback", "udp_host_loopback", "tcp_remote", "udp_remote", "dns",
                 "netlink", "packet"):
        assert out[name] != "ok", f"{name} succeeded"
    assert out["unix_pair"] == "ok", "AF_UNIX socketpairs (multiprocessing, asyncio) must keep working"
    _assert_servers_untouched(host_servers)


def test_network_namespace_alone_blocks_the_host(report, host_servers, monkeypatch):
    """Defence in depth: with seccomp switched off, sockets exist but only a private loopback does."""
    need(report, "bwrap")
    monkeypatch.setenv("RLPIPE_SANDBOX_DISABLE", "seccomp")
    spec = {"tcp": host_servers["tcp"], "udp": host_servers["udp"], "remote": True}
    r = run_python(NET_ATTEMPTS, stdin=json.dumps(spec))
    assert r.status == "ok", r
    assert "seccomp" not in r.isolation
    out = last_json(r.stdout)
    assert out["tcp_host_loopback"].startswith("ConnectionRefusedError"), out  # its own empty loopback
    assert out["tcp_remote"] != "ok" and out["udp_remote"] != "ok" and out["dns"] != "ok"
    assert out["interfaces"] == ["lo"], out["interfaces"]
    _assert_servers_untouched(host_servers)


def test_seccomp_alone_blocks_the_network_without_bubblewrap(report, host_servers, monkeypatch):
    need(report, "seccomp", "uid")
    monkeypatch.setenv("RLPIPE_SANDBOX_DISABLE", "bwrap")
    # Without a network namespace, never try non-loopback addresses.
    spec = {"tcp": host_servers["tcp"], "udp": host_servers["udp"], "remote": False}
    r = run_python(NET_ATTEMPTS, stdin=json.dumps(spec))
    assert r.status == "ok", r
    out = last_json(r.stdout)
    for name in ("tcp_host_loopback", "tcp6_loopback", "udp_host_loopback", "netlink", "packet"):
        assert out[name].startswith("PermissionError"), (name, out[name])
    _assert_servers_untouched(host_servers)


# --------------------------------------------------------------------------- signals


SIGNALS = textwrap.dedent("""
    import json, os, signal, sys
    spec = json.load(sys.stdin)
    out = {}
    for name, pid in [("test_process", spec["test"]), ("host_helper", spec["helper"]), ("pid1", 1),
                      ("everything", -1), ("helper_group", -spec["helper"])]:
        try:
            os.kill(pid, signal.SIGKILL)
            out[name] = "ok"
        except OSError as e:
            out[name] = f"{type(e).__name__}: {e.errno}"
    print(json.dumps(out))
""")


@pytest.mark.parametrize("disable", ["", "bwrap"], ids=["full", "no-bwrap"])
def test_signals_to_other_processes_fail(report, monkeypatch, disable):
    need(report, "seccomp", "uid", *(["bwrap"] if not disable else []))
    monkeypatch.setenv("RLPIPE_SANDBOX_DISABLE", disable)
    helper = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        r = run_python(SIGNALS, stdin=json.dumps({"test": os.getpid(), "helper": helper.pid}))
        assert r.status == "ok", r
        out = last_json(r.stdout)
        for name, res in out.items():
            assert res != "ok", f"kill({name}) succeeded"
        assert helper.poll() is None, "the host helper process was killed"
        os.kill(os.getpid(), 0)  # and we are alive
    finally:
        helper.kill()
        helper.wait()


def test_concurrent_runs_are_isolated_from_each_other(report):
    need(report, "bwrap", "uid")
    code = textwrap.dedent("""
        import json, os, time
        time.sleep(0.3)
        print(json.dumps({"uid": os.getuid(), "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}))
    """)
    results = [None, None]

    def go(i):
        results[i] = run_python(code)

    ts = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    outs = [last_json(r.stdout) for r in results]
    assert outs[0]["uid"] != outs[1]["uid"], "concurrent runs must get distinct worker uids"
    for o in outs:
        assert o["pids"] == [1, 2], f"a run sees foreign processes: {o['pids']}"


# --------------------------------------------------------------------------- privileges and syscalls


SYSCALLS = textwrap.dedent("""
    import ctypes, errno, json, os
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    NR = dict(ptrace=101, mount=165, umount2=166, unshare=272, setns=308, bpf=321, io_uring_setup=425,
              keyctl=250, add_key=248, perf_event_open=298, userfaultfd=323, clone3=435, chroot=161,
              pivot_root=155, init_module=175, kexec_load=246, process_vm_readv=310, pidfd_getfd=438,
              clone=56, open_tree=428, fsopen=430)
    CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWNS = 0x10000000, 0x40000000, 0x00020000
    params = {
        "ptrace": (0, 0, 0, 0),                                   # PTRACE_TRACEME
        "mount": (b"none", b"/tmp", b"tmpfs", 0, 0),
        "umount2": (b"/proc", 2),
        "unshare_user": ("unshare", CLONE_NEWUSER),
        "unshare_net": ("unshare", CLONE_NEWNET),
        "unshare_mnt": ("unshare", CLONE_NEWNS),
        "setns": (0, 0),
        "bpf": (0, 0, 0),                                         # BPF_MAP_CREATE, NULL attr
        "io_uring_setup": (8, ctypes.create_string_buffer(120)),
        "keyctl": (0, 0, 0),
        "add_key": (b"user", b"k", b"v", 1, -3),
        "perf_event_open": (ctypes.create_string_buffer(128), 0, -1, -1, 0),
        "userfaultfd": (0,),
        "clone3": (ctypes.create_string_buffer(88), 88),
        "clone_newuser": ("clone", CLONE_NEWUSER | 17, 0, 0, 0, 0),
        "chroot": (b"/tmp",),
        "pivot_root": (b"/tmp", b"/tmp"),
        "init_module": (0, 0, b""),
        "kexec_load": (0, 0, 0, 0),
        "process_vm_readv": (1, 0, 0, 0, 0, 0),
        "pidfd_getfd": (0, 0, 0),
        "open_tree": (-100, b"/", 1),
        "fsopen": (b"tmpfs", 0),
    }
    out = {}
    for name, args in params.items():
        call = name
        if args and isinstance(args[0], str):
            call, args = args[0], args[1:]
        ctypes.set_errno(0)
        rc = libc.syscall(NR[call], *args)
        if rc == 0 and call == "clone":
            os._exit(0)                                           # we are the clone; vanish
        out[name] = [rc, errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno())]
    status = open("/proc/self/status").read()
    out["_status"] = {l.split(":")[0]: l.split(":")[1].strip() for l in status.splitlines()
                      if l.split(":")[0] in ("Seccomp", "NoNewPrivs", "CapEff", "CapPrm", "Uid", "Groups")}
    try:
        os.setuid(0)
        out["_setuid0"] = "ok"
    except OSError as e:
        out["_setuid0"] = e.strerror
    print(json.dumps(out))
""")


def test_dangerous_syscalls_are_denied(report):
    need(report, "seccomp", "bwrap")
    r = run_python(SYSCALLS)
    assert r.status == "ok", r
    out = last_json(r.stdout)
    status = out.pop("_status")
    assert status["Seccomp"] == "2" and status["NoNewPrivs"] == "1"
    assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0
    assert out.pop("_setuid0") != "ok"
    for name, (rc, err) in out.items():
        assert rc == -1 and err in ("EPERM", "ENOSYS"), f"{name}: rc={rc} errno={err}"
    assert out["clone3"][1] == "ENOSYS" and out["ptrace"][1] == "EPERM" and out["unshare_user"][1] == "EPERM"


def test_runs_as_an_unprivileged_worker_uid_with_rlimits(report):
    need(report, "uid", "rlimits", "bwrap")
    code = textwrap.dedent("""
        import json, os, resource
        out = {"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": os.getgroups(),
               "core": resource.getrlimit(resource.RLIMIT_CORE)}
        try:
            with open("/work/big", "wb") as fh:
                fh.write(b"x" * (3 << 20))
            out["fsize"] = "ok"
        except OSError as e:
            out["fsize"] = e.errno
        fds = []
        try:
            while True:
                fds.append(os.open("/work/main.py", os.O_RDONLY))
        except OSError as e:
            out["nofile"] = [len(fds), e.errno]
        print(json.dumps(out))
    """)
    r = run_python(code, limits=SandboxLimits(max_file_mb=2, max_open_files=32))
    assert r.status == "ok", r
    out = last_json(r.stdout)
    base = _slots._uid_base()
    assert base <= out["uid"] < base + _slots._n_slots() and out["euid"] == out["uid"] == out["gid"]
    assert out["groups"] == []
    assert out["core"] == [0, 0]
    assert out["fsize"] == 27  # EFBIG
    assert out["nofile"][1] == 24 and out["nofile"][0] <= 32  # EMFILE


def _wait_for_sandboxed_code(caller: subprocess.Popen, timeout: float = 30) -> list[tuple[int, str]]:
    """The caller's run, once its code runs: [(pid, command line)] of launcher, bwrap, main.py."""
    deadline = time.monotonic() + timeout
    while True:
        tree = process_tree(caller.pid)
        if any("main.py" in cmd for _, cmd in tree):
            return tree
        assert time.monotonic() < deadline, f"the sandbox never started: {tree}"
        assert caller.poll() is None, "caller exited early"
        time.sleep(0.05)


def test_crash_of_the_caller_leaves_nothing_behind(report, tmp_path):
    """rlpipe itself is SIGKILLed mid-run: its launcher, which outlives it, kills the sandbox and
    removes the run's cgroups before it exits. The checks follow this caller's own run (pidfds on
    its processes, its owner id), so other sandbox users on the host cannot blur them, and wait
    for the launcher's exit rather than a guessed delay (the cleanup is asynchronous by design)."""
    need(report, "uid")
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent("""
        from rlpipe.sandbox import SandboxLimits, isolation_report, run_python
        isolation_report()  # the one-off probe run happens here
        print("probed", flush=True)
        run_python("import time\\ntime.sleep(60)", limits=SandboxLimits(wall_s=60))
    """))
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pidfds: list[int] = []
    try:
        assert caller.stdout.readline().strip() == "probed"
        run = _wait_for_sandboxed_code(caller)
        assert sum("_launcher.py" in cmd for _, cmd in run) == 1, run
        pidfds = [os.pidfd_open(pid) for pid, _ in run]
        owner = _cgroup.owner_id(caller.pid)
        if "cgroup" in report["level"].split("+"):
            assert cgroups_of(owner), f"the run's cgroups (owner {owner}) were never made"
        caller.kill()
        caller.wait()
        assert wait_for_exit(pidfds, timeout=30), f"the run outlived its caller by 30 s: {run}"
        assert cgroups_of(owner) == [], f"the crashed caller's cgroups were left: {cgroups_of(owner)}"
    finally:
        for fd in pidfds:
            os.close(fd)
        if caller.poll() is None:
            caller.kill()
            caller.wait()
        caller.stdout.close()
