"""The `train` deployment of prefect.yaml, deployed to a real local Prefect server and run by a
process worker with `--run-once` — what a user does from the Prefect UI."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from rlpipe.config import load_config, settings
from tests.flows.test_train_flow import even_task, rl_overrides  # noqa: F401 - fixture re-used
from tests.helpers.s3server import free_port

ROOT = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).with_name("prefect"))


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"prefect server at {url} not healthy after {timeout} s")


def test_train_deployment_runs_on_a_process_worker(tiny_checkpoint, even_task, tmp_path):
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")
           and k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE")} | {
        "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "INFO", "PWD": str(ROOT), "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}",
    }
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def cli(*args, timeout=300):
        p = subprocess.run([PREFECT, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        assert p.returncode == 0, f"prefect {' '.join(args)}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        return p.stdout

    try:
        _wait_healthy(api, server)
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
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(tmp_path / "prefect", ignore_errors=True)
