"""The local cluster: `rlpipe up` with two rollout replicas (S3, MLflow server, Prefect server and worker, a
verifier service, each its own process with its own RLPIPE_HOME), a run in yet another RLPIPE_HOME that
reaches everything over HTTP and the object store, and a rollout replica killed mid-run: its prompts go to
the other and the run completes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.test_stack import cli
from tests.helpers.prefect_server import ROOT


def _env_sh(path: Path) -> dict[str, str]:
    return dict(line.removeprefix("export ").split("=", 1) for line in path.read_text().splitlines())


def test_a_run_on_the_local_cluster_survives_a_dead_rollout_replica(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "stack-home"))
    base = ["--set", f"task.policy_model={tiny_checkpoint}", "--set", "rollout.engine=hf"]
    res = cli("up", "--rollout-replicas", "2", *base, "--timeout-s", "240")
    assert res.exit_code == 0, res.output
    try:
        stack = json.loads((tmp_path / "stack-home" / "stack" / "stack.json").read_text())
        env = _env_sh(tmp_path / "stack-home" / "stack" / "env.sh")
        assert len(env["RLPIPE_ROLLOUT_URL"].split(",")) == 2
        run_home = tmp_path / "run-home"  # the run's own: nothing is shared with the services but S3 and HTTP
        sets = [*base, "--set", "rollout.batch_size=4", "--set", "rollout.samples_per_prompt=4",
                "--set", "rollout.max_new_tokens=6", "--set", "train.batch_size=8", "--set", "train.micro_batch_size=4",
                "--set", "train.total_iterations=3", "--set", "train.save_interval=1", "--set", "train.eval_interval=3",
                "--set", "train.eval_size=40", "--set", "tracking.experiment=cluster"]
        run_env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK",
                                                                    "WORLD_SIZE") and not k.startswith("PREFECT_")}
        run_env |= env | {"RLPIPE_HOME": str(run_home), "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
        code = "import sys; from rlpipe.cli import main; sys.argv = ['rlpipe'] + sys.argv[1:]; main()"
        log = (tmp_path / "run.log").open("w")
        run = subprocess.Popen([sys.executable, "-c", code, "run", "--run-id", "rl-cluster", *sets], env=run_env,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        progress = run_home / "runs" / "rl-cluster" / "progress.json"
        deadline = time.monotonic() + 600
        while run.poll() is None and time.monotonic() < deadline:  # kill replica 0 once iteration 0 is done
            if progress.exists() and json.loads(progress.read_text()).get("completed_iteration", -1) >= 0:
                break
            time.sleep(0.5)
        replica = next(c for c in stack["components"] if c["name"] == "rollout-0")
        os.killpg(replica["pid"], signal.SIGKILL)
        assert run.wait(600) == 0, (tmp_path / "run.log").read_text()[-4000:]
        summary = json.loads((run_home / "runs" / "rl-cluster" / "summary.json").read_text())
        assert summary["iterations_done"] == 3 and summary["engine"] == "rollout×2"
        history = json.loads(progress.read_text())["history"]
        assert history[0]["rollout/replicas_live"] == 2 and history[-1]["rollout/replicas_live"] == 1
        assert history[-1]["rollout/rerouted_prompts"] > 0
        assert all(h["service/verifier/calls"] >= 1 for h in history)  # scored by the stack's verifier service
        runs = {r["name"]: r["state"]["type"] for r in httpx.post(f"{env['PREFECT_API_URL']}/flow_runs/filter", json={}).json()}
        assert runs["rl-cluster"] == "COMPLETED" and runs["rl-cluster-iter-2"] == "COMPLETED"
        mlrun = httpx.get(f"{env['RLPIPE_TRACKING_URI']}/api/2.0/mlflow/runs/get",
                          params={"run_id": summary["mlflow_run_id"]}).json()["run"]
        assert mlrun["info"]["status"] == "FINISHED"
        assert not (run_home / "store").exists()  # the run's data went to the stack's S3, not a local folder
    finally:
        assert cli("down").exit_code == 0
