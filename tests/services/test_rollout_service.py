"""The rollout service: generation and log-probs equal to the engine's own, bad requests refused with the
field named, weights only from a run's prefix of the service's store and only with the right hash, 429 and
504 when busy, a bearer token on every endpoint but /health, replicas that split a batch and reroute a dead
one's share — and `rlpipe serve rollout` on vLLM as its own process, sampling what the in-process engine
samples."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from rlpipe.rollout.base import SamplingConfig
from rlpipe.rollout.hf_engine import HFEngine
from rlpipe.rollout.probe import max_gap
from rlpipe.rollout.remote import RemoteEngine, ReplicatedEngine, upload_weights
from rlpipe.storage import open_store
from tests.helpers.prom import histogram_ok, scrape
from tests.helpers.s3server import free_port
from tests.helpers.waiting import wait_healthy

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16], [17, 18, 19]]
GREEDY = SamplingConfig(n=1, temperature=0.0, max_new_tokens=5)


class SlowHF(HFEngine):
    delay_s = 0.0

    def generate(self, prompts, sampling):
        time.sleep(self.delay_s)
        return super().generate(prompts, sampling)


def _serve(engine, model_dir, store, token=None, **kw):
    import uvicorn

    from rlpipe.services.rollout import RolloutService, create_app

    service = RolloutService(engine, model_dir, store, **kw)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(service, token), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 10)
    return server, service, url


@pytest.fixture
def store(tmp_path):
    return open_store(str(tmp_path / "store"))


@pytest.fixture
def served(tiny_checkpoint, store):
    server, service, url = _serve(SlowHF(tiny_checkpoint), tiny_checkpoint, store, max_queue=1, request_timeout_s=30)
    yield service, url
    server.should_exit = True


def perturbed(src: Path, dest: Path, scale: float = 0.05) -> Path:
    """A copy of the checkpoint with every weight moved a little: other weights, same shapes."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    for f in dest.glob("*.safetensors"):
        t = load_file(f)
        g = torch.Generator().manual_seed(0)
        save_file({k: v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in t.items()}, f)
    return dest


def test_generation_and_logprobs_are_the_engines_own(served, tiny_checkpoint, store):
    service, url = served
    h = httpx.get(f"{url}/health").json()
    local = HFEngine(tiny_checkpoint)
    assert h["status"] == "ok" and h["version"] == local.weights_sha256() and h["dtype"] and h["vocab_size"] > 19
    remote = RemoteEngine(url, store, "rl-svc")
    got = remote.generate(PROMPTS, GREEDY)
    want = local.generate(PROMPTS, GREEDY)
    assert [[c.token_ids for c in o] for o in got] == [[c.token_ids for c in o] for o in want]
    conts = [[20, 21], [22], [23, 24, 25], [26], [27], [28, 29]]
    assert max_gap(remote.sequence_logprobs(PROMPTS, conts), local.sequence_logprobs(PROMPTS, conts)) <= 1e-6
    m = scrape(url)
    assert m["rlpipe_rollout_requests_total"] == 2 and m["rlpipe_rollout_items_total"] == 6 and m["rlpipe_rollout_up"] == 1
    assert histogram_ok(m, "rlpipe_rollout_request_seconds") == 2


def test_bad_requests_name_the_problem_and_the_service_goes_on(served):
    _, url = served
    vocab = httpx.get(f"{url}/health").json()["vocab_size"]
    cases = [({"prompts": [[1, 2], [vocab + 5]]}, "prompts[1]: token ids must be a non-empty list"),
             ({"prompts": [[1] * 250], "max_new_tokens": 10}, "prompts[0]: 250 tokens + 10 more exceed"),
             ({"prompts": []}, "prompts"), ({"prompts": [[1]], "n": 1000}, "n"), ({"prompts": "12+34="}, "prompts")]
    for body, words in cases:
        r = httpx.post(f"{url}/generate", json=body)
        assert r.status_code == 422 and words in r.text, (body, r.text)
    r = httpx.post(f"{url}/logprobs", json={"prompts": [[1], [2]], "continuations": [[3]]})
    assert r.status_code == 422 and "one non-empty continuation per prompt" in r.text
    assert httpx.post(f"{url}/generate", json={"prompts": [[5, 6]]}).status_code == 200


def test_weights_come_only_from_a_runs_prefix_with_the_right_hash(served, tiny_checkpoint, store, tmp_path):
    service, url = served
    before = httpx.get(f"{url}/health").json()["version"]
    new = perturbed(tiny_checkpoint, tmp_path / "new")
    uri, sha = upload_weights(store, "rl-svc", new)
    assert uri == store.url(f"runs/rl-svc/weights/{sha[:16]}")
    refused = [({"uri": uri, "sha256": before}, 422, "the request expects"),
               ({"uri": store.url("datasets/x"), "sha256": sha}, 403, "only from a run's own prefix"),
               ({"uri": "s3://elsewhere/runs/rl-svc/weights/x", "sha256": sha}, 403, "not under runs/"),
               ({"uri": "runs/../datasets", "sha256": sha}, 403, "not under runs/"),
               ({"uri": store.url("runs/rl-svc/none"), "sha256": sha}, 404, "holds no *.safetensors"),
               ({"uri": uri, "sha256": "abc"}, 422, "sha256")]
    for body, code, words in refused:
        r = httpx.post(f"{url}/weights", json=body)
        assert r.status_code == code and words in r.text, (body, r.text)
        assert httpx.get(f"{url}/health").json()["version"] == before  # nothing was loaded
    r = httpx.post(f"{url}/weights", json={"uri": uri, "sha256": sha})
    assert r.status_code == 200 and r.json()["version"] == sha == httpx.get(f"{url}/health").json()["version"]
    local = HFEngine(new)  # the engine now samples the new policy: its log-probs are the new weights'
    remote = RemoteEngine(url, store, "rl-svc")
    assert max_gap(remote.sequence_logprobs(PROMPTS, PROMPTS), local.sequence_logprobs(PROMPTS, PROMPTS)) <= 1e-6


def test_a_busy_engine_answers_429_and_504(served):
    service, url = served
    service.engine.delay_s = 1.5
    results = {}

    def call(name, timeout_s):
        results[name] = httpx.post(f"{url}/generate", json={"prompts": [[5, 6]], "timeout_s": timeout_s}, timeout=30)

    first = threading.Thread(target=call, args=("first", 10))
    first.start()
    time.sleep(0.3)
    waiting = threading.Thread(target=call, args=("waiting", 0.5))  # waits for the turn, gives up after 0.5 s
    waiting.start()
    time.sleep(0.2)
    call("third", 10)  # the one place in the queue is taken
    first.join()
    waiting.join()
    assert results["first"].status_code == 200 and results["waiting"].status_code == 504
    assert results["third"].status_code == 429 and results["third"].headers["retry-after"] == "1"
    stats = httpx.get(f"{url}/stats").json()
    assert stats["rejected"] == 1 and stats["timeouts"] == 1
    service.engine.delay_s = 0.0
    assert httpx.post(f"{url}/generate", json={"prompts": [[5, 6]]}).status_code == 200


def test_a_token_guards_every_endpoint_but_health(tiny_checkpoint, store, monkeypatch):
    server, _, url = _serve(HFEngine(tiny_checkpoint), tiny_checkpoint, store, token="s3cret")
    try:
        assert httpx.get(f"{url}/health").status_code == 200
        for method, path, body in [("post", "/generate", {"prompts": [[5]]}), ("post", "/weights", {"uri": "runs/x", "sha256": "0" * 64}),
                                   ("post", "/logprobs", {"prompts": [[5]], "continuations": [[6]]}),
                                   ("get", "/metrics", None), ("get", "/stats", None)]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                r = httpx.request(method, f"{url}{path}", json=body, headers=headers)
                assert r.status_code == 401 and "RLPIPE_ROLLOUT_TOKEN" in r.text, (path, headers, r.text)
        assert httpx.get(f"{url}/stats", headers={"Authorization": "Bearer s3cret"}).json()["unauthorized"] == 15
        monkeypatch.setenv("RLPIPE_ROLLOUT_TOKEN", "s3cret")  # the client side reads the same variable
        assert RemoteEngine(url, store, "rl-svc").generate([[5, 6]], GREEDY)[0][0].token_ids
        monkeypatch.setenv("RLPIPE_ROLLOUT_TOKEN", "other")
        with pytest.raises(ValueError, match="HTTP 401"):
            RemoteEngine(url, store, "rl-svc").generate([[5, 6]], GREEDY)
    finally:
        server.should_exit = True


@pytest.mark.parametrize("service", ["rollout", "verifier", "reward-model", "env"])
def test_no_service_listens_beyond_loopback_without_a_credential(service, monkeypatch):
    from rlpipe.cli import app

    name = service.replace("-", "_").upper()
    monkeypatch.delenv(f"RLPIPE_{name}_TOKEN", raising=False)
    monkeypatch.delenv(f"RLPIPE_{name}_TOKEN_FILE", raising=False)
    args = ["serve", service, *(["/nonexistent-model"] if service in ("rollout", "reward-model") else []), "--host", "0.0.0.0"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and f"would listen on 0.0.0.0 with no credential: set RLPIPE_{name}_TOKEN" in res.output


def test_replicas_split_a_batch_and_a_dead_ones_share_goes_to_the_others(tiny_checkpoint, store, tmp_path):
    servers = [_serve(HFEngine(tiny_checkpoint), tiny_checkpoint, store) for _ in range(2)]
    try:
        engine = ReplicatedEngine([RemoteEngine(url, store, "rl-rep") for _, _, url in servers])
        sampled = SamplingConfig(n=2, temperature=1.0, max_new_tokens=6, seed=11)
        local = HFEngine(tiny_checkpoint)
        want = [[c.token_ids for c in o] for o in local.generate(PROMPTS, GREEDY)]
        want_sampled = [[c.token_ids for c in o] for o in local.generate(PROMPTS, sampled)]
        assert [[c.token_ids for c in o] for o in engine.generate(PROMPTS, GREEDY)] == want
        assert [s.stats.items for _, s, _ in servers] == [3, 3]  # split in two blocks
        # each prompt keeps its seed wherever it runs: the split samples what one engine samples
        assert [[c.token_ids for c in o] for o in engine.generate(PROMPTS, sampled)] == want_sampled
        servers[0][0].should_exit = True
        time.sleep(1.0)
        assert [[c.token_ids for c in o] for o in engine.generate(PROMPTS, GREEDY)] == want
        assert [[c.token_ids for c in o] for o in engine.generate(PROMPTS, sampled)] == want_sampled  # rerouted too
        assert engine.rerouted == 3 and engine.dead == {servers[0][2]} and servers[1][1].stats.items == 18
        new = perturbed(tiny_checkpoint, tmp_path / "new")
        assert engine.load_weights(new) == HFEngine(new).weights_sha256()  # the live replica took them
    finally:
        for server, _, _ in servers:
            server.should_exit = True


def test_serve_rollout_on_vllm_samples_what_the_in_process_engine_samples(tiny_checkpoint, tmp_path):
    """`rlpipe serve rollout` as its own process with its own RLPIPE_HOME: same seed, same samples and
    log-probs as vLLM in this process; a weight load through the store changes both alike."""
    from rlpipe.rollout.engines import get_engine

    port, store = free_port(), open_store(str(tmp_path / "store"))
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env |= {"RLPIPE_HOME": str(tmp_path / "home"), "RLPIPE_STORAGE_URI": store.uri, "OMP_NUM_THREADS": "1"}
    code = "import sys; from rlpipe.cli import main; sys.argv = ['rlpipe'] + sys.argv[1:]; main()"
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "rollout", str(tiny_checkpoint), "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"), start_new_session=True)
    # The process's shared engine, never closed: closing a vLLM engine tears down this process's torch.distributed
    # group, which the trainer tests after this one need.
    local = get_engine("vllm", tiny_checkpoint, max_model_len=64)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, 240, log.read_text)
        remote = RemoteEngine(url, store, "rl-vllm")
        sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=6, seed=7)
        got, want = remote.generate(PROMPTS, sampling), local.generate(PROMPTS, sampling)
        assert [[c.token_ids for c in o] for o in got] == [[c.token_ids for c in o] for o in want]
        assert max_gap([c.logprobs for o in got for c in o], [c.logprobs for o in want for c in o]) <= 1e-5
        new = perturbed(tiny_checkpoint, tmp_path / "new")
        assert remote.load_weights(new) == local.load_weights(new)
        assert max_gap(remote.sequence_logprobs(PROMPTS, PROMPTS), local.sequence_logprobs(PROMPTS, PROMPTS)) <= 1e-5
        assert scrape(url)["rlpipe_rollout_weight_loads_total"] == 1
    finally:
        local.load_weights(tiny_checkpoint)  # as the other tests expect to find it
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
