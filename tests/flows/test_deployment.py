"""The `train` deployment of prefect.yaml, deployed to a real local Prefect server and run by a
process worker with `--run-once` — what a user does from the Prefect UI."""

import json
import subprocess
import sys
from pathlib import Path

from rlpipe.config import load_config, settings
from tests.flows.test_train_flow import even_task, rl_overrides  # noqa: F401 - fixture re-used
from tests.helpers.prefect_server import PREFECT, ROOT, prefect_server


def test_train_deployment_runs_on_a_process_worker(tiny_checkpoint, even_task, tmp_path):
    with prefect_server(tmp_path) as server:
        _deploy_and_run(server.env, tiny_checkpoint, even_task)


def _deploy_and_run(env: dict[str, str], tiny_checkpoint: Path, even_task: Path) -> None:
    def cli(*args, timeout=300):
        p = subprocess.run([PREFECT, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        assert p.returncode == 0, f"prefect {' '.join(args)}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        return p.stdout

    cli("work-pool", "create", "rlpipe-local", "--type", "process")
    cli("--no-prompt", "deploy", "--name", "train")
    cfg = load_config(None, rl_overrides(tiny_checkpoint, "rldeploy", "hf", even_task, iterations=1))
    params = {"config": cfg.model_dump(mode="json"), "run_id": "rl-deployed"}
    cli("deployment", "run", "rl-train/train", "--params", json.dumps(params))
    cli("worker", "start", "--pool", "rlpipe-local", "--run-once", timeout=900)
    state = subprocess.run(
        [sys.executable, "-c",
         "import asyncio\nfrom prefect.client.orchestration import get_client\n"
         "async def m():\n    async with get_client() as c:\n"
         "        runs = await c.read_flow_runs()\n"
         "        print(sorted((r.name, r.state.type.value) for r in runs))\n"
         "asyncio.run(m())"],
        env=env, capture_output=True, text=True, timeout=120,
    ).stdout
    assert "('rl-deployed', 'COMPLETED')" in state, state
    assert "('rl-deployed-iter-0', 'COMPLETED')" in state, state  # the iteration is its own flow run
    summary = json.loads((settings().run_dir("rl-deployed") / "summary.json").read_text())
    assert summary["iterations_done"] == 1
