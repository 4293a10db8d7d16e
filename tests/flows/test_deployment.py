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


def _deployments() -> dict[str, dict]:
    import yaml

    return {d["name"]: d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]}


def test_every_deployment_default_is_a_valid_parameter_set():
    """Each deployment's parameters are what its flow accepts (the UI's form starts from them), and every flow
    the issue names is deployed."""
    from prefect.flows import load_flow_from_entrypoint

    deps = _deployments()
    assert {"train", "sft", "prepare-data", "evaluate", "rm-train", "evaluate-nightly", "evaluate-on-registration"} <= set(deps)
    for name, d in deps.items():
        fl = load_flow_from_entrypoint(str(ROOT / d["entrypoint"]))
        params = fl.validate_parameters(d.get("parameters") or {})
        undocumented = [k for k, v in fl.parameters.model_dump()["properties"].items() if not v.get("description")]
        assert not undocumented, f"{name}: the UI form would show {undocumented} without a description"
        assert d["work_pool"]["name"] == "rlpipe-local", name
        if name == "train":  # the RL run starts from the SFT base, never from an untrained model
            assert params["config"].task.policy_model == "models:/rlpipe-arithmetic@base"
    nightly = deps["evaluate-nightly"]
    assert nightly["schedules"][0]["cron"] == "0 3 * * *" and nightly["entrypoint"] == "flows/evaluate.py:evaluate_suite"
    assert nightly["parameters"]["suite"] == ["gsm8k", "math500", "humaneval", "mbpp"]
    from rlpipe.eval_suite import load_suite

    assert [b.name for b in load_suite(nightly["parameters"]["suite"], nightly["parameters"]["overrides"])] == nightly["parameters"]["suite"]
    trigger = deps["evaluate-on-registration"]["triggers"][0]
    assert trigger["expect"] == ["rlpipe.checkpoint.registered"] and trigger["parameters"]["model"] == "{{ event.payload.model_uri }}"


def test_train_defaults_before_sft_fail_at_once_saying_what_to_run(prefect_harness, tmp_path, monkeypatch):
    """Pressing Run on `train` before `sft` has registered @base: the preflight fails in seconds and names the fix.
    (A home of its own: another test's registry must not hold rlpipe-arithmetic@base.)"""
    import time

    import pytest

    from flows.train import train
    from rlpipe.config import RunConfig
    from rlpipe.doctor import PreflightError

    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "fresh-home"))
    monkeypatch.delenv("RLPIPE_TRACKING_URI", raising=False)
    cfg = RunConfig.model_validate(_deployments()["train"]["parameters"]["config"])
    start = time.perf_counter()
    with pytest.raises(PreflightError, match=r"models:/rlpipe-arithmetic@base.*register it first \(rlpipe sft CONFIG, or the sft deployment"):
        train(config=cfg, run_id="rl-before-sft")
    assert time.perf_counter() - start < 60
