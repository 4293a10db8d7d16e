"""The local cluster: `rlpipe up` with two rollout replicas and a 2-rank trainer service (S3, MLflow server,
Prefect server and worker, a verifier service, each its own process with its own RLPIPE_HOME), a run in yet
another RLPIPE_HOME that reaches everything over HTTP and the object store. After iteration 0 a rollout
replica and the trainer service are killed: the run stops at the next update; with the trainer restarted,
the same --run-id resumes from the store and completes on the one replica left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from rlpipe.history import read_history
from tests.test_stack import cli
from tests.helpers.prefect_server import ROOT
from tests.helpers.waiting import wait_healthy


def _env_sh(path: Path) -> dict[str, str]:
    return dict(line.removeprefix("export ").split("=", 1) for line in path.read_text().splitlines())


def _closeness_task(path: Path) -> Path:
    from rlpipe.config import DataConfig
    from rlpipe.data import build_arithmetic

    rows = build_arithmetic(DataConfig(test_size=40, validation_size=0)).to_pylist()
    keep = [r for r in rows if r["split"] == "train"][:200] + [r for r in rows if r["split"] == "test"]
    path.write_text("\n".join(json.dumps(r | {"task": "closeness"}) for r in keep))
    return path


def _rlpipe(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    code = "import sys; from rlpipe.cli import main; sys.argv = ['rlpipe'] + sys.argv[1:]; main()"
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdout=log.open("a"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_for_iteration(run: subprocess.Popen, progress: Path, k: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while run.poll() is None and time.monotonic() < deadline:
        if progress.exists() and json.loads(progress.read_text()).get("completed_iteration", -1) >= k:
            return
        time.sleep(0.05)
    raise AssertionError(f"iteration {k} did not complete (run exit {run.poll()})")


def test_a_run_on_the_local_cluster_survives_dead_services(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "stack-home"))
    monkeypatch.setenv("RLPIPE_TRAINER_FAULT", "2")  # the stack's trainer dies in iteration 2's update, before saving
    data = _closeness_task(tmp_path / "closeness.jsonl")  # partial credit: the barely trained policy gets a signal
    base = ["--set", f"task.policy_model={tiny_checkpoint}", "--set", "rollout.engine=hf", "--set", f"task.dataset={data}"]
    res = cli("up", "--rollout-replicas", "2", "--trainer-ranks", "2", *base, "--timeout-s", "240")
    assert res.exit_code == 0, res.output
    try:
        stack = json.loads((tmp_path / "stack-home" / "stack" / "stack.json").read_text())
        env = _env_sh(tmp_path / "stack-home" / "stack" / "env.sh")
        assert len(env["RLPIPE_ROLLOUT_URL"].split(",")) == 2 and env["RLPIPE_TRAINER_URL"]
        run_home = tmp_path / "run-home"  # the run's own: nothing is shared with the services but S3 and HTTP
        sets = [*base, "--set", "rollout.batch_size=4", "--set", "rollout.samples_per_prompt=4",
                "--set", "rollout.max_new_tokens=6", "--set", "train.batch_size=8", "--set", "train.micro_batch_size=4",
                "--set", "train.total_iterations=3", "--set", "train.save_interval=1", "--set", "train.eval_interval=3",
                "--set", "train.eval_size=40", "--set", "tracking.experiment=cluster"]
        run_env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK",
                                                                    "WORLD_SIZE") and not k.startswith("PREFECT_")}
        run_env |= env | {"RLPIPE_HOME": str(run_home), "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
        log, progress = tmp_path / "run.log", run_home / "runs" / "rl-cluster" / "progress.json"
        # Prefetch off in this attempt: a batch generated ahead before the kill would find the dead replica at
        # the weight sync, not in generation, and nothing would be rerouted. The resume turns it on again
        # (an operational key), with the same batches.
        run = _rlpipe(["run", "--run-id", "rl-cluster", *sets, "--set", "rollout.prefetch=false"], run_env, log)
        _wait_for_iteration(run, progress, 0)
        pids = {c["name"]: c["pid"] for c in stack["components"]}
        os.killpg(pids["rollout-0"], signal.SIGKILL)
        assert run.wait(600) != 0  # iteration 2's update lost its trainer
        first = json.loads(progress.read_text())
        assert first["completed_iteration"] == 1 and read_history(progress.parent)[1]["rollout/rerouted_prompts"] > 0
        assert "restart it and resume the run" in log.read_text()
        port = env["RLPIPE_TRAINER_URL"].rsplit(":", 1)[1]
        again_env = {k: v for k, v in run_env.items() if k != "RLPIPE_TRAINER_FAULT"} | {"RLPIPE_HOME": str(tmp_path / "trainer-again")}
        trainer = _rlpipe(["serve", "trainer", "--nproc", "2", "--port", port], again_env, tmp_path / "trainer-again.log")
        try:
            wait_healthy(env["RLPIPE_TRAINER_URL"], 180, why=lambda: (tmp_path / "trainer-again.log").read_text()[-3000:])
            assert _rlpipe(["run", "--run-id", "rl-cluster", *sets], run_env, log).wait(600) == 0, log.read_text()[-4000:]
        finally:
            os.killpg(trainer.pid, signal.SIGTERM)
            trainer.wait(60)
        # The same config and seed with everything in one process: every prompt keeps its seed wherever it is
        # sampled, so the run learns alike, its weights within the 2-rank trainer's float32 rounding.
        ref_home = tmp_path / "ref-home"
        ref_env = {k: v for k, v in run_env.items() if not k.startswith(("RLPIPE_S3_", "RLPIPE_STORAGE", "RLPIPE_TRACKING", "RLPIPE_ROLLOUT",
                                                                           "RLPIPE_TRAINER", "RLPIPE_VERIFIER"))}
        assert _rlpipe(["run", "--run-id", "rl-ref", *sets], ref_env | {"RLPIPE_HOME": str(ref_home)},
                       tmp_path / "ref.log").wait(600) == 0, (tmp_path / "ref.log").read_text()[-4000:]
        ours, ref = (load_file(h / "runs" / r / "state" / "iter=2" / "model.safetensors")
                     for h, r in ((run_home, "rl-cluster"), (ref_home, "rl-ref")))
        start = load_file(Path(tiny_checkpoint) / "model.safetensors")
        assert max(float((ref[k] - start[k]).abs().max()) for k in ref) > 1e-4  # it learned
        assert all(torch.allclose(ours[k], ref[k], atol=1e-5, rtol=1e-4) for k in ref)
        ref_history = read_history(ref_home / "runs" / "rl-ref")
        ours_history = read_history(progress.parent)
        assert [h["reward_mean"] for h in ours_history] == pytest.approx([h["reward_mean"] for h in ref_history], abs=1e-6)
        assert max(h["reward_mean"] for h in ref_history) > 0
        summary = json.loads((run_home / "runs" / "rl-cluster" / "summary.json").read_text())
        assert summary["iterations_done"] == 3 and summary["engine"] == "rollout×1"
        history = read_history(progress.parent)
        assert [h["iteration"] for h in history] == [0, 1, 2]  # nothing lost, nothing done twice
        assert history[0]["rollout/replicas_live"] == 2 and history[-1]["rollout/replicas_live"] == 1
        assert all(h["trainer/world"] == 2 for h in history)  # every update on the 2-rank trainer service
        assert all(h["service/verifier/calls"] >= 1 for h in history)  # scored by the stack's verifier service
        runs = httpx.post(f"{env['PREFECT_API_URL']}/flow_runs/filter", json={}).json()
        states = lambda name: sorted(r["state"]["type"] for r in runs if r["name"] == name)  # noqa: E731
        assert states("rl-cluster") == states("rl-cluster-iter-2") == ["COMPLETED", "FAILED"]  # the attempt, the resume
        assert states("rl-cluster-iter-1") == ["COMPLETED"]  # done once
        mlrun = httpx.get(f"{env['RLPIPE_TRACKING_URI']}/api/2.0/mlflow/runs/get",
                          params={"run_id": summary["mlflow_run_id"]}).json()["run"]
        assert mlrun["info"]["status"] == "FINISHED"
        assert not (run_home / "store").exists()  # the run's data went to the stack's S3, not a local folder
    finally:
        assert cli("down").exit_code == 0
