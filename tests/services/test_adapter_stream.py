"""LoRA runs move only the adapter to rollout replicas: a real vLLM replica started with `--lora-rank` takes a
trainer's adapter (kilobytes here, not the model) in one request, reads the adapter the trainer holds and then
computes the trainer's log-probs; a resume gives it the save point's adapter; a replica without LoRA support, a
bad body or a missing token are refused with the reason, and the next good adapter loads; a run's start checks
the replicas and names the fix where they cannot serve its adapter."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys

import httpx
import pytest
import torch
from safetensors.torch import load_file, save

from rlpipe.config import RunConfig, TrainConfig
from rlpipe.rollout.hf_engine import HFEngine
from rlpipe.rollout.probe import default_tolerance, max_gap
from rlpipe.rollout.remote import RemoteEngine, ReplicatedEngine, adapter_body
from rlpipe.runtime.assembly import _remote_engine, adapter_sync
from rlpipe.runtime.context import RunContext
from rlpipe.storage import open_store
from rlpipe.storage.weights import file_weights_digest
from tests.helpers.dist_update import fixed_batch
from tests.helpers.prom import scrape
from tests.helpers.s3server import free_port
from tests.helpers.waiting import wait_healthy
from tests.flows.test_train_flow import even_task, invoke, rl_overrides  # noqa: F401 - fixture re-used
from tests.services.test_rollout_service import _serve

RANK = 8
TOL = default_tolerance("float32")  # the probe's tolerance for a float32 engine (vLLM on CPU)
LORA = {"r": RANK, "alpha": 16.0, "target_modules": ["q_proj", "v_proj"]}
PROMPTS, CONTS = [[5, 6, 7, 8], [9, 10], [20, 21, 22]], [[11, 12, 13], [14, 15], [30, 31, 32, 33]]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return open_store(str(tmp_path_factory.mktemp("adapter-store")))


@pytest.fixture(scope="module")
def lora_replica(tiny_checkpoint, store, tmp_path_factory):
    """`rlpipe serve rollout --lora-rank 8` on vLLM, as its own process: (url, its log)."""
    home, port = tmp_path_factory.mktemp("adapter-home"), free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env |= {"RLPIPE_HOME": str(home), "RLPIPE_STORAGE_URI": store.uri, "OMP_NUM_THREADS": "1"}
    code = "import sys; from rlpipe.cli import main; sys.argv = ['rlpipe'] + sys.argv[1:]; main()"
    log = home / "serve.log"
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "rollout", str(tiny_checkpoint), "--port", str(port),
                             "--max-model-len", "64", "--lora-rank", str(RANK)],
                            env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 300, log.read_text)
        yield url, log
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


@pytest.fixture(scope="module")
def trainer(tiny_checkpoint):
    """A LoRA trainer one update past the start model (lr high enough that the policy visibly moves)."""
    from rlpipe.training.trainer import PolicyTrainer

    torch.set_num_threads(1)
    cfg = TrainConfig(algorithm="grpo", batch_size=16, micro_batch_size=8, lr=3e-2, lora=LORA)
    t = PolicyTrainer(model_dir=str(tiny_checkpoint), cfg=cfg, seed=3, max_new_tokens=5)
    t.update(fixed_batch(16), 0)
    return t


def test_a_lora_replica_takes_only_the_adapter_and_then_computes_the_trainers_policy(lora_replica, trainer, store,
                                                                                      tiny_checkpoint, tmp_path):
    url, _ = lora_replica
    assert httpx.get(f"{url}/health").json()["lora_rank"] == RANK
    engine = ReplicatedEngine([RemoteEngine(url, store, "rl-lora")], adapters=True)
    assert engine.lora_rank == RANK and engine.served_lora_rank == RANK
    merged_mode = ReplicatedEngine([RemoteEngine(url, store, "rl-lora")])
    assert merged_mode.lora_rank is None and merged_mode.served_lora_rank == RANK  # LoRA support alone is no mode
    base = engine.sequence_logprobs(PROMPTS, CONTS)
    want = trainer.sequence_logprobs(PROMPTS, CONTS)
    assert max_gap(base, want) > 20 * TOL  # the update moved the policy: the adapter must carry it

    version = trainer.policy_tensors()[0]
    adapter_sha = trainer.export_adapter(tmp_path / "handoff")
    loads = scrape(url)["rlpipe_rollout_weight_loads_total"]
    assert engine.load_adapter(tmp_path / "handoff", version) == adapter_sha == trainer.adapter_sha256()
    assert engine.weights_sha256() == version == httpx.get(f"{url}/health").json()["version"]
    assert scrape(url)["rlpipe_rollout_weight_loads_total"] == loads + 1
    got = engine.probe_each(PROMPTS, CONTS)
    assert set(got) == {url} and max_gap(got[url], want) <= TOL  # the probe's float32 tolerance
    # what travelled is the adapter: its own bytes, far below the merged weights a stream would send
    sent = engine.replicas[0].last_sent
    adapter_bytes = (tmp_path / "handoff" / "adapter_model.safetensors").stat().st_size
    merged_bytes = sum(t.numel() * t.element_size() for t in trainer.policy_tensors()[1].values())
    assert adapter_bytes <= sent <= adapter_bytes + 4096 and sent * 10 < merged_bytes, (sent, merged_bytes)

    # the start weights streamed (as a run's start does): the replica serves them without the adapter again
    assert engine.load_weights(tiny_checkpoint) == file_weights_digest(tiny_checkpoint)
    assert max_gap(engine.sequence_logprobs(PROMPTS, CONTS), base) <= TOL


def test_a_resume_gives_the_replicas_the_save_points_adapter(lora_replica, trainer, tiny_checkpoint, tmp_path, monkeypatch):
    url, _ = lora_replica
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    trainer.save(tmp_path / "state")
    ctx = RunContext.resolve(RunConfig.model_validate({"train": {"lora": LORA}, "services": {"rollout": [url]}}), "rl-res")
    assert adapter_sync(ctx)
    engine = _remote_engine(ctx, str(tiny_checkpoint), logging.getLogger("test"), adapters=True,
                            resume_dir=str(tmp_path / "state"))
    assert engine.lora_rank == RANK
    assert engine.weights_sha256() == file_weights_digest(tmp_path / "state")  # the save point's policy …
    assert max_gap(engine.sequence_logprobs(PROMPTS, CONTS), trainer.sequence_logprobs(PROMPTS, CONTS)) <= TOL


def _body(tensors: dict, config: dict | None) -> bytes:
    return save(tensors, metadata={"adapter_config": json.dumps(config)} if config is not None else None)


def test_bad_adapter_bodies_are_refused_and_the_next_good_one_loads(lora_replica, trainer, tmp_path):
    url, _ = lora_replica
    before = httpx.get(f"{url}/health").json()["version"]
    trainer.export_adapter(tmp_path / "good")
    good = load_file(tmp_path / "good" / "adapter_model.safetensors")
    config = json.loads((tmp_path / "good" / "adapter_config.json").read_text())
    a_name = next(n for n in good if ".lora_A." in n)
    version = "ab" * 32

    def refused(body: bytes, code: int, words: str, v: str = version) -> None:
        r = httpx.post(f"{url}/adapter", params={"version": v}, content=body)
        assert r.status_code == code and words in r.text, r.text
        assert httpx.get(f"{url}/health").json()["version"] == before  # nothing was loaded

    refused(b"not safetensors at all", 422, "not safetensors")
    refused(_body(good, None), 422, "no adapter_config.json")
    refused(_body(good, config), 422, "version=", v="abc")
    refused(_body(good, config | {"r": 16}), 422, "--lora-rank 16")
    wide = {**good, a_name: torch.zeros(RANK, good[a_name].shape[1] + 3)}  # an adapter of another model
    refused(_body(wide, config), 422, "does not fit")
    refused(_body({**good, "base_model.model.lm_head.weight": torch.zeros(4, 4)}, config), 422, "not the lora_A/lora_B")
    refused(b"x" * ((16 << 20) + 1), 413, "exceed")
    assert httpx.post(f"{url}/generate", json={"prompts": PROMPTS, "max_new_tokens": 2}).status_code == 200
    r = httpx.post(f"{url}/adapter", params={"version": version}, content=adapter_body(tmp_path / "good"))
    assert r.status_code == 200 and r.json()["version"] == version == httpx.get(f"{url}/health").json()["version"], r.text
    assert r.json()["adapter_sha256"] == trainer.adapter_sha256()


def test_a_replica_without_lora_refuses_and_a_run_is_told_the_fix(lora_replica, trainer, tiny_checkpoint, store,
                                                                  tmp_path, monkeypatch):
    lora_url, _ = lora_replica
    trainer.export_adapter(tmp_path / "adapter")
    server, service, url = _serve(HFEngine(tiny_checkpoint), tiny_checkpoint, store, token="s3cret")
    try:
        assert httpx.get(f"{url}/health").json()["lora_rank"] == 0
        r = httpx.post(f"{url}/adapter", params={"version": "ab" * 32}, content=adapter_body(tmp_path / "adapter"))
        assert r.status_code == 401 and "RLPIPE_ROLLOUT_TOKEN" in r.text  # the token, as for the weight endpoints
        monkeypatch.setenv("RLPIPE_ROLLOUT_TOKEN", "s3cret")
        with pytest.raises(ValueError, match=r"HTTP 409.*--lora-rank.*rollout.lora_sync: merged"):
            ReplicatedEngine([RemoteEngine(url, store, "rl-nolora")]).load_adapter(tmp_path / "adapter", "ab" * 32)
        assert service.stats.weight_loads == 0 and httpx.get(f"{url}/health").json()["version"] == HFEngine(tiny_checkpoint).weights_sha256()
        mixed = ReplicatedEngine([RemoteEngine(lora_url, store, "rl-mixed"), RemoteEngine(url, store, "rl-mixed")], adapters=True)
        assert mixed.served_lora_rank == 0 and mixed.lora_rank is None  # what every replica serves: none

        monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))

        def ctx(urls: list[str], lora: dict = LORA, **rest) -> RunContext:
            return RunContext.resolve(RunConfig.model_validate(
                {"train": {"lora": lora}, "services": {"rollout": urls}} | rest), "rl-sync")

        with pytest.raises(ValueError, match=rf"{url} \(LoRA rank none\).*--lora-rank {RANK}.*rollout.lora_sync: merged"):
            adapter_sync(ctx([lora_url, url]))
        with pytest.raises(ValueError, match=rf"{lora_url} \(LoRA rank {RANK}\).*--lora-rank 16"):
            adapter_sync(ctx([lora_url], LORA | {"r": 16}))
        assert adapter_sync(ctx([lora_url]))
        assert not adapter_sync(ctx([url], rollout={"lora_sync": "merged"}))  # asked for the merged weights
        assert not adapter_sync(ctx([url], services={"rollout": [url], "trainer": "http://127.0.0.1:9"}))
    finally:
        server.should_exit = True


@pytest.mark.parametrize("args,words", [(["--engine", "hf", "--lora-rank", "8"], "vllm engine only"),
                                        (["--lora-rank", "1024"], "up to 512")])
def test_serve_rollout_refuses_a_lora_rank_it_cannot_serve_before_starting(tiny_checkpoint, args, words):
    from typer.testing import CliRunner

    from rlpipe.cli import app

    r = CliRunner().invoke(app, ["serve", "rollout", str(tiny_checkpoint), *args])
    assert r.exit_code == 2 and words in r.output, r.output


def test_rlpipe_up_starts_replicas_with_lora_where_the_run_sends_adapters(tmp_path):
    from rlpipe.stack import _services

    def rollout_cmd(trainer_ranks: int = 0, **sections) -> list[str]:
        config = RunConfig.model_validate({"rollout": {"engine": "vllm"}} | sections)
        components, _ = _services(config, tmp_path, 1, trainer_ranks)
        return next(c.cmd for c in components if c.name == "rollout-0")

    assert rollout_cmd(train={"lora": LORA})[-4:-2] == ["--lora-rank", str(RANK)]
    assert "--lora-rank" not in rollout_cmd(train={"lora": LORA}, rollout={"engine": "vllm", "lora_sync": "merged"})
    assert "--lora-rank" not in rollout_cmd(trainer_ranks=2, train={"lora": LORA})  # a trainer service: merged weights
    assert "--lora-rank" not in rollout_cmd()


def test_a_lora_run_on_a_replica_sends_only_the_adapter_and_proves_every_sync(prefect_harness, lora_replica,
                                                                               tiny_checkpoint, even_task, monkeypatch):
    from rlpipe.config import settings
    from rlpipe.history import read_history

    url, _ = lora_replica
    loads = scrape(url)["rlpipe_rollout_weight_loads_total"]
    sets = rl_overrides(tiny_checkpoint, "rllora", "vllm", even_task, iterations=2) + [
        "train.lora={r: 8, alpha: 16, target_modules: [q_proj, v_proj]}", "train.lr=1e-2"]
    monkeypatch.setenv("RLPIPE_ROLLOUT_URL", url)
    summary = invoke(["run", "--run-id", "rl-lora-replica"] + [x for s in sets for x in ("--set", s)])
    assert summary["engine"] == "rollout×1" and summary["iterations_done"] == 2
    assert summary["final_policy_version"] == httpx.get(f"{url}/health").json()["version"] != file_weights_digest(tiny_checkpoint)
    history = read_history(settings().run_dir("rl-lora-replica"))
    assert [h["sync/adapter_only"] for h in history] == [1.0, 1.0]  # each sync moved the adapter alone …
    assert all(h["sync/probe_max_abs_diff"] <= TOL for h in history)  # … and was proven on the replica
    assert scrape(url)["rlpipe_rollout_weight_loads_total"] == loads + 3  # the start weights, then two adapters
