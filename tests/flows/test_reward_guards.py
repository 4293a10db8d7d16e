"""Run-level reward guards end to end: the circuit breaker stops a run resumably; the sandbox floor
refuses to score model code below the configured isolation level and records the level used."""

import json
import os
from pathlib import Path

from typer.testing import CliRunner

from rlpipe.cli import app
from rlpipe.config import settings
from rlpipe.history import read_history
from rlpipe.storage import TRAJECTORY_SCHEMA, open_store
from rlpipe.storage.layout import stage_prefix
from tests.flows.test_train_flow import _cli, even_task, rl_overrides  # noqa: F401 - even_task is a fixture
from tests.helpers.slow_verifiers import broken_flag


def _task_file(even_task: Path, tmp_path: Path, task: str) -> Path:
    rows = [json.loads(line) for line in even_task.read_text().splitlines()]
    out = tmp_path / f"{task}.jsonl"
    out.write_text("\n".join(json.dumps(r | {"task": task}) for r in rows))
    return out


def _sets(items: list[str]) -> list[str]:
    return [x for s in items for x in ("--set", s)]


def test_circuit_breaker_stops_the_run_and_it_resumes_once_fixed(prefect_harness, tiny_checkpoint, even_task, tmp_path):
    data = _task_file(even_task, tmp_path, "test_flaky")
    sets = _sets(rl_overrides(tiny_checkpoint, "rlbreaker", "hf", data, iterations=3)
                 + ["reward.max_invalid_iterations=2", "train.save_interval=10", "train.eval_interval=10"])
    Path(broken_flag()).write_text("broken")
    try:
        res = CliRunner().invoke(app, ["run", "--run-id", "rl-breaker", *sets])
    finally:
        os.unlink(broken_flag())
    assert res.exit_code == 3, res.output[-3000:]
    assert "iteration 1: 100% of samples not scored 'ok'" in res.output
    assert "2 iterations in a row" in res.output and "verifier 'test_flaky'" in res.output
    assert "reference store unreachable" in res.output
    progress = json.loads((settings().run_dir("rl-breaker") / "progress.json").read_text())
    assert progress["completed_iteration"] == 0 and read_history(settings().run_dir("rl-breaker"))[0]["invalid_share"] == 1.0
    store = open_store()
    assert not store.stage_done(stage_prefix("rl-breaker", 1, "verify"))  # the tripping iteration is rescored

    res = CliRunner().invoke(app, ["run", "--run-id", "rl-breaker", *sets])  # the cause is fixed
    assert res.exit_code == 0, res.output[-3000:]
    summary = json.loads(Path(res.stdout.strip().splitlines()[-1]).read_text())
    assert summary["iterations_done"] == 3
    rows = store.read_stage(stage_prefix("rl-breaker", 1, "verify"), schema=TRAJECTORY_SCHEMA).to_pylist()
    assert {r["reward_status"] for r in rows} == {"ok"}


def test_sandbox_floor_refuses_a_weaker_sandbox_unless_lowered_and_records_the_level(prefect_harness, tiny_checkpoint,
                                                                                     even_task, tmp_path):
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    data = _task_file(even_task, tmp_path, "python_expr")
    base = rl_overrides(tiny_checkpoint, "rlfloor", "hf", data, iterations=1) + ["train.save_interval=10"]
    weak = {"RLPIPE_SANDBOX_DISABLE": "cgroup"}
    refused = _cli(["run", "--run-id", "rl-floor-refused", *_sets(base)], weak, api)
    assert refused.returncode == 3, refused.stderr[-3000:]
    assert "lacks cgroup required by reward.sandbox_min_level" in refused.stderr
    assert "--set reward.sandbox_min_level=bwrap+seccomp+uid+rlimits" in refused.stderr
    assert not (settings().run_dir("rl-floor-refused") / "progress.json").exists()  # refused before any work

    lowered = _cli(["run", "--run-id", "rl-floor-lowered",
                    *_sets(base + ["reward.sandbox_min_level=bwrap+seccomp+uid+rlimits"])], weak, api)
    assert lowered.returncode == 0, lowered.stderr[-3000:]
    summary = json.loads(Path(lowered.stdout.strip().splitlines()[-1]).read_text())
    assert summary["sandbox_level"] == "bwrap+seccomp+uid+rlimits"
    rows = open_store().read_stage(stage_prefix("rl-floor-lowered", 0, "verify"), schema=TRAJECTORY_SCHEMA).to_pylist()
    ran = [r for r in rows if r["isolation"] is not None]  # an empty expression is judged without running
    assert ran and {r["isolation"] for r in ran} == {"bwrap+seccomp+uid+rlimits"}
    assert all(r["reward_reason"] == "empty expression" for r in rows if r["isolation"] is None)
    history = read_history(settings().run_dir("rl-floor-lowered"))
    assert history[0]["sandbox/level/bwrap-seccomp-uid-rlimits"] == len(ran) / len(rows)  # share of all samples
