"""Environments in the sandbox and the environment service: each call in its own sandboxed process,
stateless replay checked for determinism, and an environment that attacks its host contained — no
network, no host files, no host processes; a crash, a hang, a memory blow-up is the episode's error."""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid

import httpx
import pytest

from rlpipe.envs import EnvLimits, EnvSpec, Episode, load_env_spec
from rlpipe.envs.sandboxed import EnvFailure, SandboxOptions, remote_env, sandboxed_env
from rlpipe.sandbox import isolation_report
from tests.envs import hostile  # noqa: F401 - registers "hostile" on this side too
from tests.helpers.prom import histogram_ok, scrape
from tests.helpers.s3server import free_port
from tests.helpers.waiting import wait_healthy

FULL = "bwrap" in isolation_report()["level"]
needs_bwrap = pytest.mark.skipif(not FULL, reason="needs the sandbox's bubblewrap level")
OPTS = SandboxOptions(step_timeout_s=2.0, cpu_s=5.0, memory_mb=256, plugins=("tests.envs.hostile",))
HOSTILE = EnvSpec(env="hostile")


def _step(action: str) -> str:
    env = sandboxed_env(HOSTILE, OPTS)
    assert env.reset({}, 0) == "ready"
    return env.step(action).observation


def test_a_sandboxed_episode_equals_the_in_process_one():
    spec = load_env_spec("configs/envs/calculator.yaml")
    local, boxed = spec.make(), sandboxed_env(spec)
    assert boxed.reset({}, 7) == local.reset({}, 7)
    for action in ("calc(12*34)", "nonsense", "answer(408)"):
        assert boxed.step(action) == local.step(action)
    assert boxed.last_env_s >= 0


@pytest.fixture
def host_server():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.settimeout(0.2)
    hits = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                hits.append(srv.accept()[0])
            except OSError:
                pass

    threading.Thread(target=accept, daemon=True).start()
    yield srv.getsockname(), hits
    stop.set()
    srv.close()


@needs_bwrap
def test_no_network_to_the_host(host_server):
    (host, port), hits = host_server
    socket.create_connection((host, port), timeout=2).close()  # reachable from outside the sandbox
    time.sleep(0.3)
    assert len(hits) == 1
    assert _step(f"net:{host}:{port}").startswith("blocked")
    assert _step("net:1.1.1.1:53").startswith("blocked")
    time.sleep(0.3)
    assert len(hits) == 1


@needs_bwrap
def test_no_host_files_read_or_written(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the host's secret")
    os.chmod(tmp_path, 0o755)
    os.chmod(secret, 0o644)  # world-readable on the host, still invisible in the sandbox
    assert _step(f"read:{secret}").startswith("blocked")
    assert _step("read:/etc/shadow").startswith("blocked")
    assert _step("read:/root/.bashrc").startswith("blocked")
    marker = f"/tmp/rlpipe-env-attack-{uuid.uuid4().hex}"
    _step(f"write:{marker}")  # a private /tmp: whatever it wrote is gone with the sandbox
    assert not os.path.exists(marker)
    assert _step("write:/opt/rlpipe/lib/rlpipe/__init__.py").startswith("blocked")  # its own code is read-only


@needs_bwrap
def test_no_signals_to_host_processes():
    assert _step(f"kill:{os.getpid()}").startswith("blocked")


@pytest.mark.parametrize("attack, kind, words", [
    ("crash:", "error", "RuntimeError: the environment crashed"),
    ("exit:", "error", "sandbox"),
    ("hang:", "timeout", "step_timeout_s=2"),
    ("hang:stubborn", "timeout", "sandbox timeout"),
    ("memory:1024", "error", "MemoryError"),
    ("random:", "error", "not deterministic under replay"),
])
def test_a_failing_environment_raises_env_failure(attack, kind, words):
    env = sandboxed_env(HOSTILE, OPTS)
    env.reset({}, 0)
    if attack == "random:":
        env.step(attack)  # the first answer is taken; its replay in the next step differs
        attack = "echo:x"
    start = time.monotonic()
    with pytest.raises(EnvFailure) as e:
        env.step(attack)
    assert e.value.kind == kind and words in str(e.value), str(e.value)
    assert time.monotonic() - start < 2.0 + 10.0 + 2 * 2.0 + 5  # the deadline holds


def test_an_episode_on_a_failing_environment_is_error_not_zero():
    ep = Episode(sandboxed_env(HOSTILE, OPTS), {}, 0, EnvLimits(max_steps=5))
    assert ep.start() == "ready"
    assert ep.act("echo:fine") == "fine"
    assert ep.act("crash:") is None
    assert ep.status == "error" and ep.reward is None and "crashed" in ep.reason


def test_limits_hold_on_a_sandboxed_episode():
    ep = Episode(sandboxed_env(HOSTILE, OPTS), {}, 0, EnvLimits(max_steps=2))
    ep.start()
    ep.act("echo:a")
    assert ep.act("echo:b") is None
    assert ep.status == "ok" and ep.truncated and "max_steps=2" in ep.reason
    ep = Episode(sandboxed_env(HOSTILE, OPTS), {}, 0, EnvLimits(max_steps=9, episode_timeout_s=0.01))
    ep.start()
    assert ep.act("echo:a") is None
    assert ep.status == "ok" and ep.truncated and "episode_timeout_s" in ep.reason


# -- the service ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def service():
    import uvicorn

    from rlpipe.services.env import EnvService, create_app

    svc = EnvService(OPTS, workers=2, max_queue=1)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(svc), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 10)
    yield svc, url
    server.should_exit = True


def test_service_health_and_an_episode(service):
    svc, url = service
    h = httpx.get(f"{url}/health").json()
    assert h["status"] == "ok" and "calculator" in h["envs"] and h["workers"] == 2
    spec = load_env_spec("configs/envs/calculator.yaml")
    ep = Episode(remote_env(spec, url), {"expression": "1234*5678"}, 0, spec.limits)
    assert ep.start() == "1234*5678"
    assert ep.act("calc(1234*5678)") == "=7006652"
    assert ep.act("answer(7006652)") is None
    assert ep.status == "ok" and ep.reward == 1.0
    m = httpx.get(f"{url}/stats").json()
    assert m["resets"] >= 1 and m["steps"] >= 2 and m["latency_p50_s"] > 0 and m["env_step_p99_s"] is not None
    prom = scrape(url)
    assert prom["rlpipe_env_up"] == 1.0 and prom["rlpipe_env_steps_total"] == m["steps"] and prom["rlpipe_env_in_flight"] == 0
    assert histogram_ok(prom, "rlpipe_env_request_seconds") == m["requests"]
    assert histogram_ok(prom, "rlpipe_env_step_seconds") >= m["steps"]  # the environment's own time per call


def test_service_failure_is_the_episodes_error_and_the_service_goes_on(service):
    svc, url = service
    before = httpx.get(f"{url}/stats").json()["failures"]
    ep = Episode(remote_env(HOSTILE, url), {}, 0, EnvLimits())
    ep.start()
    assert ep.act("hang:") is None
    assert ep.status == "error" and "step_timeout_s" in ep.reason
    m = httpx.get(f"{url}/stats").json()
    assert m["failures"] == before + 1 and m["timeouts"] >= 1
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_service_refuses_a_bad_request_with_its_field(service):
    _, url = service
    r = httpx.post(f"{url}/reset", json={"spec": {"env": "calculator", "params": {"digits": 99}}})
    assert r.status_code == 422 and "params.digits" in r.text
    r = httpx.post(f"{url}/reset", json={"spec": {"env": "no-such-env"}})
    assert r.status_code == 422 and "unknown environment" in r.text
    r = httpx.post(f"{url}/step", json={"spec": {"env": "calculator"}, "actions": []})
    assert r.status_code == 422


def test_service_bounds_its_concurrency(service):
    """2 sandboxes run, 1 request waits; a fourth concurrent request gets 429 (the client retries it)."""
    svc, url = service
    body = {"spec": {"env": "hostile"}, "actions": ["hang:"], "seen": ["ready"]}
    codes = []

    def post():
        codes.append(httpx.post(f"{url}/step", json=body, timeout=30).status_code)

    threads = [threading.Thread(target=post) for _ in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert sorted(codes) == [200, 200, 200, 429]
    assert httpx.get(f"{url}/stats").json()["rejected"] >= 1


def test_service_down_is_an_error_episode():
    spec = load_env_spec("configs/envs/calculator.yaml")
    ep = Episode(remote_env(spec, f"http://127.0.0.1:{free_port()}", timeout_s=2), {}, 0, spec.limits)
    assert ep.start() is None
    assert ep.status == "error" and "environment service" in ep.reason


@pytest.fixture
def echo_server():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            c.sendall(c.recv(16))
            c.close()

    threading.Thread(target=serve, daemon=True).start()
    yield srv.getsockname()[1]
    srv.close()


@needs_bwrap
def test_the_allow_list_admits_exactly_its_hosts(echo_server):
    port = echo_server
    opts = SandboxOptions(step_timeout_s=5.0, plugins=("tests.envs.hostile",), allow_hosts=(f"127.0.0.1:{port}",))

    def step(action: str) -> str:
        env = sandboxed_env(HOSTILE, opts)
        env.reset({}, 0)
        return env.step(action).observation

    assert step(f"proxied:127.0.0.1:{port}") == "REACHED ping"
    assert "not on the allow-list" in step(f"proxied:127.0.0.1:{port + 1}")
    assert "not on the allow-list" in step(f"proxied:localhost:{port}")  # names are matched, never resolved inside
    assert step(f"net:127.0.0.1:{port}").startswith("blocked")  # a raw socket still has no network
    assert _step(f"proxied:127.0.0.1:{port}").startswith("blocked")  # without allow_hosts there is no proxy


def test_rlpipe_serve_env_as_its_own_process(tmp_path):
    """The CLI's service: up, healthy, an episode through it; stopped by its pid; then the episode is error."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    port = free_port()
    code = "import sys; from rlpipe.cli import main; sys.argv = ['rlpipe'] + sys.argv[1:]; main()"
    log = tmp_path / "env.log"
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "env", "--port", str(port), "--workers", "1"],
                            env=os.environ | {"PYTHONPATH": f"{root / 'src'}:{root}"}, stdout=subprocess.DEVNULL,
                            stderr=log.open("w"), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    spec = load_env_spec(root / "configs/envs/guess.yaml")
    try:
        wait_healthy(url, 60, log.read_text)
        ep = Episode(remote_env(spec, url), {"secret": 75}, 0, spec.limits)
        assert ep.start() == "1-100"
        assert [ep.act("guess(50)"), ep.act("guess(80)"), ep.act("guess(75)")] == ["higher", "lower", None]
        assert ep.status == "ok" and ep.reward == 1.0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    ep = Episode(remote_env(spec, url, timeout_s=2), {}, 0, spec.limits)
    assert ep.start() is None and ep.status == "error"


def test_agent_stages_step_sandboxed_environments_concurrently(tiny_checkpoint):
    """agent.executor: sandbox — episodes of the rollout with every environment call in a sandbox,
    a turn's calls run together; the same episodes as in-process (same engine, same seeds)."""
    from rlpipe.config import AgentConfig
    from rlpipe.rollout.agent import env_factory
    from rlpipe.rollout.base import SamplingConfig
    from rlpipe.rollout.hf_engine import HFEngine
    from rlpipe.rollout.multiturn import run_episodes

    engine = HFEngine(tiny_checkpoint)
    agent = AgentConfig(env={"env": "calculator", "params": {"digits": 2}, "limits": {"max_steps": 2}}, executor="sandbox",
                        step_workers=4)
    tasks = [({}, s) for s in range(4)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6, seed=3)
    boxed = run_episodes(engine, engine.tokenizer, agent.spec(), tasks, sampling, make_env=env_factory(agent), step_workers=4)
    local = run_episodes(engine, engine.tokenizer, agent.spec(), tasks, sampling)
    assert [r.episode.status for r in boxed] == ["ok"] * 4
    assert [r.response_ids for r in boxed] == [r.response_ids for r in local]
    assert [r.episode.record()[-1]["observation"] for r in boxed] == [r.episode.record()[-1]["observation"] for r in local]
