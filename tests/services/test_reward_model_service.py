"""The reward-model service: health and version, text and token-id scoring, bad items, micro-batching,
429 when the queue is full, per-request timeouts — and `rlpipe serve reward-model` as its own process."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from rlpipe.rewards.model import RemoteRewardModel, RMItem
from rlpipe.training.reward_model import RewardScorer, encode_response
from tests.helpers.prom import histogram_ok, scrape
from tests.helpers.s3server import free_port
from tests.helpers.waiting import wait_healthy

ROOT = Path(__file__).resolve().parents[2]


class SlowScorer(RewardScorer):
    """The real scorer with added latency per batch, to fill the queue on purpose."""

    delay_s = 0.0

    def score_ids(self, seqs):
        time.sleep(self.delay_s)
        return super().score_ids(seqs)


def _serve_in_thread(service):
    import uvicorn

    from rlpipe.services.reward_model import create_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 10)
    return server, url


@pytest.fixture
def served(tiny_reward_model):
    from rlpipe.services.reward_model import RewardModelService

    scorer = SlowScorer(tiny_reward_model[0], version="rlpipe-test-rm/v3@abc")
    service = RewardModelService(scorer, max_queue=2, max_batch_items=512, request_timeout_s=10)
    server, url = _serve_in_thread(service)
    yield scorer, service, url
    server.should_exit = True
    service.close()


def test_health_scores_and_version(served):
    scorer, _, url = served
    h = httpx.get(f"{url}/health").json()
    assert h["status"] == "ok" and h["version"] == "rlpipe-test-rm/v3@abc" and h["reward_stats"]["count"] == 1000
    ids = encode_response(scorer.tokenizer, "12+34=", False, "46")
    r = httpx.post(f"{url}/score", json={"items": [{"prompt": "12+34=", "response": "46"}, {"input_ids": ids},
                                                   {"prompt": "12+34=", "response": "xq"}]}).json()["results"]
    assert [x["status"] for x in r] == ["ok"] * 3 and {x["rm_version"] for x in r} == {"rlpipe-test-rm/v3@abc"}
    assert r[0]["score"] == pytest.approx(r[1]["score"], abs=1e-5)  # text and token ids read the same
    assert r[0]["score"] == pytest.approx(scorer.score_texts([("12+34=", "46", False)])[0], abs=1e-5)
    assert r[0]["score"] > r[2]["score"]


def test_a_bad_item_fails_alone_and_a_bad_request_is_refused(served):
    scorer, _, url = served
    r = httpx.post(f"{url}/score", json={"items": [{"input_ids": [10**6]}, {"prompt": "1+1=", "response": "2"},
                                                   {"input_ids": [5] * 5000}, {"input_ids": []}]}).json()["results"]
    assert [x["status"] for x in r] == ["error", "ok", "error", "error"]
    assert "token ids in [0," in r[0]["reason"] and "more than the reward model's" in r[2]["reason"]
    assert all(x["score"] is None for x in (r[0], r[2], r[3]))
    bad_chat = httpx.post(f"{url}/score", json={"items": [{"prompt": "not json", "response": "2", "chat": True}]}).json()
    assert bad_chat["results"][0]["status"] == "error" and "JSON message list" in bad_chat["results"][0]["reason"]
    assert httpx.post(f"{url}/score", json={"items": [{"prompt": "q"}]}).status_code == 422  # nothing to score
    assert httpx.post(f"{url}/score", content=b"{not json").status_code == 422
    assert httpx.get(f"{url}/health").json()["status"] == "ok"  # it survived


def test_concurrent_requests_are_micro_batched(served):
    scorer, service, url = served
    scorer.delay_s = 0.3
    results = []

    def call():
        results.append(httpx.post(f"{url}/score", json={"items": [{"prompt": "1+1=", "response": "2"}] * 4},
                                  timeout=30).status_code)

    ts = [threading.Thread(target=call) for _ in range(3)]
    for t in ts:
        t.start()
        time.sleep(0.05)
    for t in ts:
        t.join()
    m = httpx.get(f"{url}/stats").json()
    assert results == [200, 200, 200]
    assert m["batches"] < 3 and m["mean_batch_items"] > 4  # the second and third request shared a batch
    assert m["latency_p50_s"] > 0 and m["items"] == 12
    prom = scrape(url)
    assert prom["rlpipe_reward_model_up"] == 1.0 and prom["rlpipe_reward_model_items_total"] == 12
    assert prom["rlpipe_reward_model_batches_total"] == m["batches"] and prom["rlpipe_reward_model_mean_batch_items"] > 4
    assert histogram_ok(prom, "rlpipe_reward_model_request_seconds") == m["requests"] == 3


def test_a_full_queue_answers_429_and_a_slow_answer_times_out(served):
    scorer, service, url = served
    scorer.delay_s = 1.5
    codes, bodies = [], []

    def call(timeout_s=None):
        r = httpx.post(f"{url}/score", json={"items": [{"prompt": "1+1=", "response": "2"}], "timeout_s": timeout_s}, timeout=30)
        codes.append(r.status_code)
        bodies.append(r.json())

    ts = [threading.Thread(target=call) for _ in range(6)]  # 1 being scored + 2 queued; the rest refused
    for t in ts:
        t.start()
        time.sleep(0.05)
    for t in ts:
        t.join()
    assert codes.count(429) >= 2 and codes.count(200) >= 2
    assert any("queue full" in str(b) for b in bodies)
    call(timeout_s=0.2)  # waits behind nothing but the slow scorer: runs out
    assert codes[-1] == 200 and bodies[-1]["results"][0]["status"] == "timeout"
    assert "no answer within 0.2 s" in bodies[-1]["results"][0]["reason"]
    m = httpx.get(f"{url}/stats").json()
    assert m["rejected"] >= 2 and m["timeouts"] == 1


def test_serve_reward_model_cli_process_and_the_client(tiny_reward_model, tmp_path):
    port = free_port()
    env = os.environ | {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    code = "import sys; from rlpipe.cli import main; sys.argv = ['rlpipe'] + sys.argv[1:]; main()"
    log = tmp_path / "rm.log"
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "reward-model", str(tiny_reward_model[0]), "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 60, log.read_text)
        client = RemoteRewardModel(url)
        assert client.healthy() and client.version.endswith(RewardScorer(tiny_reward_model[0], "x").weights_sha256[:12])
        out = client.score([RMItem("12+34=", "46"), RMItem("12+34=", "xq")])
        assert [r.status for r in out] == ["ok", "ok"] and out[0].reward > out[1].reward
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    down = client.score([RMItem("12+34=", "46")])  # the service is gone: skipped, never 0
    assert down[0].status == "skipped" and down[0].reward is None
