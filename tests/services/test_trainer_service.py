"""The trainer service (`rlpipe serve trainer --nproc 2`): two DeepSpeed ranks under torchrun in their own
RLPIPE_HOME, reached only over HTTP and the object store. It refuses what it must (no token, a folder outside
the run's prefix, an update before /init, a bad train section), and a run trained through it reaches the
in-process run's weights within the tolerance of a 2-rank reduction."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from rlpipe.config import settings
from rlpipe.history import read_history
from rlpipe.storage import open_store
from rlpipe.storage.layout import stage_prefix
from rlpipe.storage.schemas import TRAJECTORY_SCHEMA
from rlpipe.storage.weights import file_weights_digest
from tests.flows.test_train_flow import even_task, invoke, rl_overrides  # noqa: F401 - fixture re-used
from tests.helpers.prefect_server import ROOT
from tests.helpers.s3server import free_port
from tests.helpers.waiting import wait_healthy

TOKEN = "trainer-test-token"


def start_trainer(home: Path, nproc: int = 2, port: int | None = None, extra_env: dict | None = None):
    """``rlpipe serve trainer`` as its own process group on the test's object store; (process, url, log path)."""
    port = port or free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env |= {"RLPIPE_HOME": str(home), "RLPIPE_STORAGE_URI": settings().resolve_storage_uri(), "RLPIPE_TRAINER_TOKEN": TOKEN,
            "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"} | (extra_env or {})
    home.mkdir(parents=True, exist_ok=True)
    log = home / f"trainer-{port}.log"
    code = "import sys; from rlpipe.cli import main; sys.argv = ['rlpipe'] + sys.argv[1:]; main()"
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "trainer", "--nproc", str(nproc), "--port", str(port)],
                            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 180, why=lambda: log.read_text()[-3000:])
    return proc, url, log


def stop(proc: subprocess.Popen) -> None:
    from rlpipe.procs import stop_group

    stop_group(proc)


@pytest.fixture(scope="module")
def trainer2(tmp_path_factory):
    proc, url, log = start_trainer(tmp_path_factory.mktemp("trainer-home"))
    yield url, log
    stop(proc)


def _post(url: str, path: str, body: dict, token: str | None = TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=120)


def test_the_trainer_service_refuses_what_it_must(trainer2, tiny_checkpoint):
    url, _ = trainer2
    health = httpx.get(f"{url}/health").json()  # /health needs no token
    assert health["status"] == "ok" and health["world"] == 2
    assert _post(url, "/update", {"run_id": "r1", "iteration": 0, "stages": ["runs/r1/x"]}, token=None).status_code == 401
    assert _post(url, "/update", {"run_id": "r1", "iteration": 0, "stages": ["runs/r1/x"]}, token="wrong").status_code == 401
    sha = file_weights_digest(tiny_checkpoint)
    store = open_store()
    store.upload_dir(tiny_checkpoint, "elsewhere/model")
    body = {"run_id": "r1", "policy": {"uri": "elsewhere/model", "sha256": sha}, "train": {}}
    got = _post(url, "/init", body)
    assert got.status_code == 403 and "runs/r1/" in got.json()["detail"]
    # another run's prefix is not this run's either
    store.upload_dir(tiny_checkpoint, "runs/other/trainer/policy/x")
    got = _post(url, "/init", body | {"policy": {"uri": store.url("runs/other/trainer/policy/x"), "sha256": sha}})
    assert got.status_code == 403
    got = _post(url, "/init", body | {"policy": {"uri": "runs/r1/trainer/policy/missing", "sha256": sha}})
    assert got.status_code == 404 and "holds no files" in got.json()["detail"]
    store.upload_dir(tiny_checkpoint, "runs/r1/trainer/policy/a")
    got = _post(url, "/init", body | {"policy": {"uri": "runs/r1/trainer/policy/a", "sha256": sha}, "train": {"lr": "fast"}})
    assert got.status_code == 422 and "lr" in got.json()["detail"]
    got = _post(url, "/init", body | {"policy": {"uri": "runs/r1/trainer/policy/a", "sha256": "0" * 64}})
    assert got.status_code == 422 and "expects 000000000000" in got.json()["detail"]
    assert _post(url, "/update", {"run_id": "r1", "iteration": 0, "stages": ["runs/r1/x"]}).status_code == 409
    assert _post(url, "/logprobs", {"run_id": "r1", "prompts": [[1]], "continuations": [[2]]}).status_code == 409
    assert _post(url, "/update", {"run_id": "r1", "iteration": -1, "stages": []}).status_code == 422
    assert httpx.get(f"{url}/health").json()["status"] == "ok"  # none of it hurt the service
    metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    assert "rlpipe_trainer_unauthorized_total 2.0" in metrics and "rlpipe_trainer_world 2.0" in metrics


def test_a_run_through_two_trainer_ranks_matches_the_in_process_run(prefect_harness, trainer2, tiny_checkpoint, even_task,
                                                                     monkeypatch):
    url, log = trainer2
    # Iteration 0 is no save point: its weights are streamed from the service, nothing goes to the store.
    sets = rl_overrides(tiny_checkpoint, "rltrainer", "hf", even_task, iterations=2) + ["train.save_interval=2"]
    local = invoke(["run", "--run-id", "rl-trainer-local"] + [x for s in sets for x in ("--set", s)])
    assert local["iterations_done"] == 2
    monkeypatch.setenv("RLPIPE_TRAINER_TOKEN", TOKEN)
    remote = invoke(["run", "--run-id", "rl-trainer-svc", "--set", f"services.trainer={url}"] + [x for s in sets for x in ("--set", s)])
    assert remote["iterations_done"] == 2
    history = read_history(settings().run_dir("rl-trainer-svc"))
    assert all(h["trainer/world"] == 2 and h["service/trainer/error_rate"] == 0 for h in history)
    assert all(h["sync/probe_max_abs_diff"] <= 1e-5 for h in history)  # the engine holds what the ranks trained
    # Two ranks reduce gradients in another order than one: the same weights within float32 rounding.
    ours = load_file(settings().run_dir("rl-trainer-svc") / "state" / "iter=1" / "model.safetensors")
    ref = load_file(settings().run_dir("rl-trainer-local") / "state" / "iter=1" / "model.safetensors")
    before = load_file(Path(tiny_checkpoint) / "model.safetensors")
    assert max(float((ref[k] - before[k]).abs().max()) for k in ref) > 1e-5  # training moved the weights
    for k in ref:
        assert torch.allclose(ours[k], ref[k], atol=1e-5, rtol=1e-4), k
    # The whole resumable state is in the store, written by both ranks and marked whole last.
    store = open_store()
    done = store.get_json("runs/rl-trainer-svc/checkpoints/iter=1/_state_complete.json")
    assert done["weights_sha256"] == remote["final_policy_version"] == httpx.get(f"{url}/health").json()["version"]
    assert "model.safetensors" in done["files"] and any(f.startswith("deepspeed/") for f in done["files"])
    assert not store.list("runs/rl-trainer-svc/checkpoints/iter=0")  # uploaded at save points only
    assert history[0]["trainer/hash_s"] > 0 and history[0]["trainer/upload_s"] == 0
    version, auth = remote["final_policy_version"], {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.get(f"{url}/weights/{version}/0").status_code == 401  # the weights need the token
    assert httpx.get(f"{url}/weights/{'0' * 64}/0", headers=auth).status_code == 409  # not the weights held
    assert httpx.get(f"{url}/weights/{version}/99", headers=auth).status_code == 422
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_bf16_weights_start_weights_are_streamed_to_the_engine(prefect_harness, trainer2, tiny_checkpoint, even_task,
                                                               monkeypatch):
    """train.precision bf16_weights on two ranks of the service, from a float32 checkpoint: the service rounds the
    start weights, reports their hash at /init and streams them; the engine takes them before the start probe,
    and iteration 0 samples from them."""
    url, _ = trainer2
    sets = rl_overrides(tiny_checkpoint, "rlbf16w", "hf", even_task, iterations=1) + [
        "train.precision=bf16_weights", "train.zero_stage=1"]
    monkeypatch.setenv("RLPIPE_TRAINER_TOKEN", TOKEN)
    out = invoke(["run", "--run-id", "rl-trainer-bf16w", "--set", f"services.trainer={url}"] + [x for s in sets for x in ("--set", s)])
    assert out["iterations_done"] == 1
    start = file_weights_digest(tiny_checkpoint)
    rows = open_store().read_stage(stage_prefix("rl-trainer-bf16w", 0, "verify"), schema=TRAJECTORY_SCHEMA).to_pylist()
    sampled = {r["policy_version"] for r in rows}
    assert len(sampled) == 1 and start not in sampled  # the rounded weights, not the checkpoint's
    history = read_history(settings().run_dir("rl-trainer-bf16w"))
    assert history[0]["sync/probe_max_abs_diff"] <= 1e-5
    saved = load_file(settings().run_dir("rl-trainer-bf16w") / "state" / "iter=0" / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}


def _two_rank_reference(url: str, sets: list[str]) -> str:
    """The final weights of the uninterrupted 2-rank run (made here when this test runs alone)."""
    if not (settings().run_dir("rl-trainer-svc") / "summary.json").exists():
        os.environ["RLPIPE_TRAINER_TOKEN"] = TOKEN
        try:
            invoke(["run", "--run-id", "rl-trainer-svc", "--set", f"services.trainer={url}"] + sets)
        finally:
            del os.environ["RLPIPE_TRAINER_TOKEN"]
    return json.loads((settings().run_dir("rl-trainer-svc") / "summary.json").read_text())["final_policy_version"]


def test_a_trainer_killed_mid_update_resumes_from_the_store_with_nothing_lost(prefect_harness, trainer2, tiny_checkpoint,
                                                                               even_task, monkeypatch, tmp_path):
    """The service dies after iteration 1's optimizer steps, before its state is saved: the run fails; a new
    service and the same --run-id resume after iteration 0 from the store and reach the uninterrupted run's weights."""
    from typer.testing import CliRunner

    from rlpipe.cli import app

    url, _ = trainer2
    sets = [x for s in rl_overrides(tiny_checkpoint, "rltrainer", "hf", even_task, iterations=2) for x in ("--set", s)]
    monkeypatch.setenv("RLPIPE_TRAINER_TOKEN", TOKEN)
    want = _two_rank_reference(url, sets)
    port = free_port()
    doomed, doomed_url, log = start_trainer(tmp_path / "doomed", port=port, extra_env={"RLPIPE_TRAINER_FAULT": "1"})
    res = CliRunner().invoke(app, ["run", "--run-id", "rl-trainer-kill", "--set", f"services.trainer={doomed_url}"] + sets)
    assert res.exit_code != 0 and doomed.wait(60) != 0, res.output[-3000:]
    progress = json.loads((settings().run_dir("rl-trainer-kill") / "progress.json").read_text())
    assert progress["completed_iteration"] == 0  # iteration 1 was lost with the service, nothing after it
    again, again_url, _ = start_trainer(tmp_path / "again", port=port)
    try:
        resumed = invoke(["run", "--run-id", "rl-trainer-kill", "--set", f"services.trainer={again_url}"] + sets)
    finally:
        stop(again)
    assert resumed["iterations_done"] == 2 and resumed["final_policy_version"] == want
    history = read_history(settings().run_dir("rl-trainer-kill"))
    assert [h["iteration"] for h in history] == [0, 1]


def test_run_nproc_starts_the_same_two_rank_trainer_for_the_run(prefect_harness, trainer2, tiny_checkpoint, even_task):
    """`rlpipe run --nproc 2`: the trainer service on loopback with a fresh token for the run's length; the
    same maths as the 2-rank service, so the same final weights."""
    url, _ = trainer2
    sets = [x for s in rl_overrides(tiny_checkpoint, "rltrainer", "hf", even_task, iterations=2) for x in ("--set", s)]
    want = _two_rank_reference(url, sets)
    got = invoke(["run", "--run-id", "rl-nproc", "--nproc", "2"] + sets)
    assert got["final_policy_version"] == want
    history = read_history(settings().run_dir("rl-nproc"))
    assert all(h["trainer/world"] == 2 for h in history)
    assert "RLPIPE_TRAINER_URL" not in os.environ and "RLPIPE_TRAINER_TOKEN" not in os.environ
    log = (settings().home / "trainer-service" / "trainer.log").read_text()
    port = log.split("trainer service: 2 rank(s), http://127.0.0.1:")[1].split()[0]
    with pytest.raises(httpx.HTTPError):  # the service is gone with the run
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_a_sigkill_to_the_launcher_takes_every_rank_with_it(tmp_path):
    """torchrun starts each rank in its own session: without the parent-death signal a killed service would
    leave its ranks serving as orphans (found by the local cluster test)."""
    import time

    proc, url, _ = start_trainer(tmp_path / "home")
    ranks = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()]
    assert len(ranks) == 2
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{r}").exists() and Path(f"/proc/{r}/stat").read_text().split()[2] != "Z" for r in ranks):
        assert time.monotonic() < deadline, f"ranks {ranks} outlived their launcher"
        time.sleep(0.1)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=2)


def test_the_trainer_service_times_out_and_bounds_its_queue(trainer2, tiny_checkpoint):
    """A request whose result does not come within its timeout_s gets 504; past max_queue waiting requests
    (4), 429; the service goes on serving after both."""
    import threading
    import time

    url, _ = trainer2
    store = open_store()
    store.upload_dir(tiny_checkpoint, "runs/rq/trainer/policy/a")
    body = {"run_id": "rq", "policy": {"uri": "runs/rq/trainer/policy/a", "sha256": file_weights_digest(tiny_checkpoint)},
            "train": {"batch_size": 8, "micro_batch_size": 4}}
    got = _post(url, "/init", body | {"timeout_s": 0.001})
    assert got.status_code == 504 and "timeout_s" in got.json()["detail"]
    lp = {"run_id": "rq", "prompts": [[5, 6]], "continuations": [[7, 8]]}
    deadline = time.monotonic() + 120
    while _post(url, "/logprobs", lp).status_code != 200:  # the ranks finish the init nobody waits for
        assert time.monotonic() < deadline
        time.sleep(0.2)
    codes: list[int] = []
    start = threading.Barrier(12)

    def one() -> None:
        start.wait()
        codes.append(_post(url, "/init", body).status_code)

    threads = [threading.Thread(target=one) for _ in range(12)]  # 12 at once: one runs, four wait, the rest are refused
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)
    assert sorted(set(codes)) == [200, 429] and codes.count(200) >= 5, codes
    got = _post(url, "/logprobs", lp)
    assert got.status_code == 200 and len(got.json()["logprobs"][0]) == 2
    stats = httpx.get(f"{url}/stats", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert stats["timeouts"] >= 1 and stats["rejected"] >= 1
