"""The verifier service as a real HTTP server in its own process, loaded from a second process."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from rlpipe.rewards.pool import VerifyItem
from rlpipe.rewards.remote import RemoteVerifier
from tests.helpers.prom import histogram_ok, scrape
from tests.helpers.s3server import free_port

ROOT = Path(__file__).resolve().parents[2]


def start(tmp_path, *args):
    port = free_port()
    env = os.environ | {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}  # this checkout, whatever the shared venv points at
    code = "import sys; from rlpipe.cli import main; sys.argv = ['rlpipe'] + sys.argv[1:]; main()"
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "verifier", "--port", str(port),
                             "--plugin", "tests.helpers.slow_verifiers", *args],
                            env=env, stdout=subprocess.DEVNULL, stderr=(tmp_path / f"svc-{port}.log").open("w"),
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError((tmp_path / f"svc-{port}.log").read_text())


def stop(proc):
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    proc, url = start(tmp_path_factory.mktemp("svc"), "--workers", "2", "--grace", "1", "--max-queue", "8")
    yield url
    stop(proc)


def test_health_verify_and_metrics(service):
    h = httpx.get(f"{service}/health").json()
    assert h == {"status": "ok", "workers": 2, "alive": True, "queue": 0, "max_queue": 8}
    items = [{"verifier": "math", "response": "\\boxed{46}", "ground_truth": "46"},
             {"verifier": "math", "response": "45", "ground_truth": "46"},
             {"verifier": "test_sleepy", "response": "sleep 30", "ground_truth": None},
             {"verifier": "nope", "response": "x", "ground_truth": "1"}]
    r = httpx.post(f"{service}/verify", json={"items": items}, timeout=30)
    got = [(x["status"], x["reward"]) for x in r.json()["results"]]
    assert got == [("ok", 1.0), ("ok", 0.0), ("timeout", None), ("error", None)]
    assert all("isolation" in x for x in r.json()["results"])
    assert httpx.post(f"{service}/verify", json={"itemz": []}).status_code == 422  # bad input is named, not scored
    m = httpx.get(f"{service}/stats").json()
    assert m["requests"] >= 1 and m["items"] >= 4 and m["latency_p50_s"] > 0 and m["worker_restarts"] >= 1
    prom = scrape(service)  # the same numbers for Prometheus
    assert prom["rlpipe_verifier_up"] == 1.0
    m = httpx.get(f"{service}/stats").json()
    assert prom["rlpipe_verifier_requests_total"] == m["requests"] and prom["rlpipe_verifier_items_total"] == m["items"]
    assert prom["rlpipe_verifier_worker_restarts_total"] == m["worker_restarts"] >= 1
    assert prom["rlpipe_verifier_queue"] == 0 and "rlpipe_verifier_errors_total" in prom
    assert histogram_ok(prom, "rlpipe_verifier_request_seconds") == m["requests"]


def test_client_scores_through_the_service(service):
    res = RemoteVerifier(service).score([VerifyItem("exact", "7", "7"), VerifyItem("exact", "8", "7")])
    assert [(r.status, r.reward) for r in res] == [("ok", 1.0), ("ok", 0.0)]


def test_full_queue_answers_429_not_collapse(tmp_path):
    proc, url = start(tmp_path, "--workers", "1", "--grace", "5", "--max-queue", "1")
    try:
        slow = {"items": [{"verifier": "test_sleepy", "response": "sleep 1.5", "ground_truth": None}]}
        codes: list[int] = []

        def hit():
            codes.append(httpx.post(f"{url}/verify", json=slow, timeout=30).status_code)

        threads = [threading.Thread(target=hit) for _ in range(6)]  # bounded load from this process
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert codes.count(429) >= 3 and codes.count(200) >= 2, codes
        assert httpx.get(f"{url}/health").json()["status"] == "ok"  # still serving
        assert httpx.get(f"{url}/stats").json()["rejected"] == codes.count(429)
        # A request that cannot be answered in time gets 'timeout' per item, not an error.
        r = httpx.post(f"{url}/verify", json=slow | {"timeout_s": 0.3}, timeout=30).json()
        assert r["results"][0]["status"] == "timeout"
    finally:
        stop(proc)


def test_client_when_the_service_is_down_skips_and_says_why():
    client = RemoteVerifier(f"http://127.0.0.1:{free_port()}", retries=1)
    res = client.score([VerifyItem("math", "1", "1")] * 3)
    assert [r.status for r in res] == ["skipped"] * 3 and all(r.reward is None for r in res)
    assert "unreachable" in client.last_problem and not client.healthy()


def test_a_request_that_times_out_does_not_stop_the_service(tmp_path):
    proc, url = start(tmp_path, "--workers", "1", "--grace", "2", "--max-queue", "4")
    try:
        sleepy = {"items": [{"verifier": "test_sleepy", "response": "sleep 30", "ground_truth": None}], "timeout_s": 1}
        answers: list[dict] = []

        def hit():
            answers.append(httpx.post(f"{url}/verify", json=sleepy, timeout=30).json())

        # One batch times out while the pool works on it, one while it still waits in the queue.
        threads = [threading.Thread(target=hit) for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.2)
        for t in threads:
            t.join(30)
        for a in answers:
            [res] = a["results"]
            assert res["status"] == "timeout" and res["reward"] is None
            assert "no answer within 1 s" in res["reason"] and "raise timeout_s" in res["reason"], res["reason"]
        # The next request gets its verdict (after the pool kills the sleeper: budget 0.5 s + grace 2 s).
        ok = {"items": [{"verifier": "math", "response": "\\boxed{46}", "ground_truth": "46"},
                        {"verifier": "exact", "response": "45", "ground_truth": "46"}]}
        r = httpx.post(f"{url}/verify", json=ok, timeout=30).json()
        assert [(x["status"], x["reward"]) for x in r["results"]] == [("ok", 1.0), ("ok", 0.0)]
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
        m = httpx.get(f"{url}/stats").json()
        assert m["timeouts"] == 2 and m["dispatch_errors"] == 0 and m["abandoned"] >= 1, m
        # Without timeout_s a request is given what its batch declares: the sleeper is judged by the pool.
        r = httpx.post(f"{url}/verify", json={"items": sleepy["items"]}, timeout=30).json()
        assert r["results"][0]["status"] == "timeout" and "budget + grace" in r["results"][0]["reason"]
    finally:
        stop(proc)


def test_removed_timeout_option_says_what_replaces_it():
    from typer.testing import CliRunner

    from rlpipe.cli import app

    res = CliRunner().invoke(app, ["serve", "verifier", "--timeout", "5"])
    assert res.exit_code == 2 and "--grace" in res.output


def test_client_passes_isolation_through_and_checks_the_count(monkeypatch):
    results = [{"reward": 1.0, "status": "ok", "reason": "", "isolation": "namespaces+seccomp"},
               {"reward": 0.0, "status": "ok", "reason": "wrong"}]

    def post(url, json, timeout):
        return httpx.Response(200, json={"results": results[: len(json["items"])]})

    monkeypatch.setattr(httpx, "post", post)
    client = RemoteVerifier("http://verifier.invalid")
    res = client.score([VerifyItem("code", "x", "[]"), VerifyItem("math", "1", "2")])
    assert [(r.reward, r.isolation) for r in res] == [(1.0, "namespaces+seccomp"), (0.0, None)]
    results.pop()
    res = client.score([VerifyItem("code", "x", "[]"), VerifyItem("math", "1", "2")])
    assert [r.status for r in res] == ["skipped", "skipped"] and "1 verdicts for 2 items" in client.last_problem


def test_client_health_check_is_short_and_says_why(monkeypatch):
    client = RemoteVerifier(f"http://127.0.0.1:{free_port()}")
    start_t = time.monotonic()
    assert not client.healthy() and "unreachable" in client.health_problem
    assert time.monotonic() - start_t < 3

    def slow_get(url, timeout):
        assert timeout <= 2  # every iteration calls it: it must not hold the loop up
        raise httpx.ReadTimeout("slow")

    monkeypatch.setattr(httpx, "get", slow_get)
    assert not client.healthy() and "no answer within 2 s" in client.health_problem


def test_options_travel_with_the_request_and_unknown_ones_are_refused(service):
    half = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]}  # the second test is wrong: 1 of 2 pass
    items = [VerifyItem("code", "def add(a, b):\n    return a + b\n", __import__("json").dumps(half))]
    assert RemoteVerifier(service).score(items)[0].reward == 0.5  # the service's default: fraction
    res = RemoteVerifier(service, options={"code": {"scoring": "all"}}).score(items)[0]
    assert (res.status, res.reward) == ("ok", 0.0) and res.isolation
    r = httpx.post(f"{service}/verify", json={"items": [], "options": {"math": {"scoring": "all"}}})
    assert r.status_code == 422 and "verifier 'math' has no option" in r.text
    assert httpx.get(f"{service}/health").json()["status"] == "ok"
