"""Agentic RL end to end: SFT on expert tool-use traces registers a base; a 2-iteration GRPO run on
vLLM plays whole calculator episodes, stores each one's steps and loss mask, checks them before the
update, and logs the episode metrics to MLflow."""

import json
from pathlib import Path

import pytest

from rlpipe.config import load_config, settings
from rlpipe.storage import TRAJECTORY_SCHEMA, open_store
from rlpipe.storage.layout import stage_prefix
from rlpipe.tracking.mlflow_utils import Tracker
from tests.flows.test_train_flow import invoke

SETS = [
    "task.name=agentflow", "tracking.experiment=agentflow", "task.dataset=builtin:episodes",
    "agent.env={env: calculator, params: {digits: 3}, limits: {max_steps: 3}}", "agent.max_context=128", "agent.sft_traces=300",
    "data.test_size=16", "data.validation_size=8", "data.train_size=300",
    "sft.steps=40", "sft.stop_at_accuracy=null", "sft.eval_every=40", "rollout.max_new_tokens=20",
]


def _args(cmd: str, run_id: str, sets: list[str]) -> list[str]:
    return [cmd, "--run-id", run_id] + [x for s in sets for x in ("--set", s)]


@pytest.fixture(scope="module")
def agent_run(prefect_harness):
    sft = invoke(_args("sft", "agent-sft", SETS))
    rl_sets = SETS + ["task.policy_model=models:/rlpipe-agentflow@base", "rollout.engine=vllm", "rollout.batch_size=4",
                      "rollout.samples_per_prompt=4", "train.batch_size=16", "train.micro_batch_size=8",
                      "train.total_iterations=2", "train.save_interval=1", "train.eval_interval=1", "train.lr=1e-4"]
    return sft, invoke(_args("run", "agent-rl", rl_sets)), rl_sets


def test_sft_on_traces_registers_a_base_that_uses_the_tool(agent_run):
    sft, _, _ = agent_run
    assert sft["sft_steps"] == 40 and sft["heldout_n"] == 16
    assert sft["heldout_accuracy_before"] == 0.0  # an untrained model solves nothing
    assert sft["registered_model"]["aliases"][0] == "base"
    assert 0 <= sft["tool_calls_per_episode_after"] <= 3 and 1 <= sft["mean_steps_after"] <= 3


def test_two_iterations_of_episodes_on_vllm(agent_run):
    _, summary, sets = agent_run
    assert summary["iterations_done"] == 2 and summary["engine"] == "vllm" and summary["env"] == "calculator"
    for key in ("episode_success_base", "episode_success_final", "mean_steps", "tool_calls_per_episode"):
        assert summary[key] is not None and summary[key] >= 0, key
    store = open_store()
    for k in (0, 1):
        rows = store.read_stage(stage_prefix("agent-rl", k, "verify"), schema=TRAJECTORY_SCHEMA).to_pylist()
        assert len(rows) == 16 and {r["sample_index"] for r in rows} == {0, 1, 2, 3}
        assert all(r["verifier"] == "env:calculator" and r["steps"] for r in rows)
        for r in rows:
            assert len(r["loss_mask"]) == len(r["logprobs"]) == len(r["response_token_ids"])
            assert len(r["steps"]) <= 3 and all(s["env_s"] is not None and json.loads(s["info"]) is not None for s in r["steps"])
            if r["reward_status"] == "ok":
                assert r["reward"] == sum(s["reward"] for s in r["steps"])
            if len(r["steps"]) > 1:  # an observation between actions: masked, and a zero log-prob
                assert 0 in r["loss_mask"]
                assert all(lp == 0.0 for lp, m in zip(r["logprobs"], r["loss_mask"]) if m == 0)
    cfg = load_config(None, sets)
    run = Tracker(settings(), cfg).client.get_run(summary["mlflow_run_id"])
    for key in ("episode/success_share", "episode/error_share", "episode/truncated_share", "episode/tool_error_rate",
                "episode/env_step_p50_s", "episode/env_step_p99_s", "episode/steps_mean", "episode/incomplete",
                "heldout_accuracy", "heldout_mean_steps", "heldout_tool_calls_per_episode"):
        assert key in run.data.metrics, key
    assert any(k.startswith("episode/length/") for k in run.data.metrics)
    assert "episode/tool_use_share" in run.data.metrics
    gens = json.loads(Path(Tracker(settings(), cfg).client.download_artifacts(run.info.run_id, "generations.json")).read_text())
    turns = [r[gens["columns"].index("response")] for r in gens["data"]]
    assert len(turns) == 3 * 8 and all(" → " in t for t in turns)  # base, iterations 0 and 1: each episode's turns


def test_an_agent_run_killed_mid_iteration_resumes_to_the_same_weights(agent_run):
    """SIGKILL right after iteration 0's update: the resumed run samples iteration 1's episodes on a fresh
    engine and lands on the uninterrupted run's weights, bit for bit."""
    from prefect.settings import PREFECT_API_URL

    from tests.flows.test_train_flow import _cli

    _, _, sets = agent_run
    api = PREFECT_API_URL.value()
    ref = _cli(_args("run", "agent-ref", sets), {}, api)
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = _cli(_args("run", "agent-kill", sets), {"RLPIPE_FAULT": "0:update"}, api)
    assert killed.returncode == -9, killed.stderr[-3000:]
    done = _cli(_args("run", "agent-kill", sets), {}, api)
    assert done.returncode == 0, done.stderr[-3000:]
    want = json.loads((settings().run_dir("agent-ref") / "summary.json").read_text())
    got = json.loads((settings().run_dir("agent-kill") / "summary.json").read_text())
    assert got["iterations_done"] == 2 and got["final_policy_version"] == want["final_policy_version"]
    assert got["episode_success_final"] == want["episode_success_final"]
