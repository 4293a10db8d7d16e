"""rollout.prefetch (on by default): iteration k+1's first batch is generated right after iteration k's weight
sync, while k's flow run ends and k+1's starts. The same batches as without it (on-policy, same seeds); a kill
with the batch in flight resumes to the weights of a run without prefetch; its error is the rollout task's."""

import json
import threading
import time

import pytest

from rlpipe.config import RunConfig, load_config, settings
from rlpipe.history import read_history
from rlpipe.runtime import RunServices, register_services, stop_services
from rlpipe.storage import TRAJECTORY_SCHEMA, open_store
from rlpipe.storage.layout import stage_prefix
from rlpipe.tracking.mlflow_utils import Tracker
import tasks.rl
from tasks.rl import prefetch_rollout
from tests.flows.test_resume import _args
from tests.flows.test_train_flow import _cli, even_task, rl_overrides  # noqa: F401 - fixture re-used

# SIGKILLs inside the prefetch thread: batch 1 generated ahead during iteration 0's end (iteration 0 not yet
# recorded), then batch 2 during iteration 1's end.
KILLS = [(1, "rollout"), (2, "rollout")]


@pytest.fixture(scope="module")
def api(prefect_harness):
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def _rows(run_id, k):
    return [(r["policy_version"], r["policy_iteration"], r["staleness"], r["response_token_ids"]) for r in
            open_store().read_stage(stage_prefix(run_id, k, "verify"), schema=TRAJECTORY_SCHEMA).to_pylist()]


@pytest.fixture(scope="module")
def without_prefetch(api, tiny_checkpoint, even_task):
    sets = rl_overrides(tiny_checkpoint, "rlprefetch", "hf", even_task, iterations=3)
    off = _cli(_args("rl-pf-off", sets + ["rollout.prefetch=false"]), {}, api)
    assert off.returncode == 0, off.stderr[-3000:]
    return sets, json.loads((settings().run_dir("rl-pf-off") / "summary.json").read_text())


def test_prefetched_batches_are_the_batches_without_prefetch(api, without_prefetch):
    sets, ref = without_prefetch
    on = _cli(_args("rl-pf-on", sets), {}, api)
    assert on.returncode == 0, on.stderr[-3000:]
    got = json.loads((settings().run_dir("rl-pf-on") / "summary.json").read_text())
    assert got["final_policy_version"] == ref["final_policy_version"]
    for k in range(3):  # on-policy (staleness 0), the same tokens by the same policies
        assert _rows("rl-pf-on", k) == _rows("rl-pf-off", k) and {r[2] for r in _rows("rl-pf-on", k)} == {0}
    history = read_history(settings().run_dir("rl-pf-on"))
    assert "rollout/prefetch_generate_s" not in history[0]  # nothing before the first iteration to overlap
    for h in history[1:]:  # generated ahead; the iteration waited only for what was left of it
        assert h["rollout/prefetch_generate_s"] > 0 and h["time/generate_s"] < h["rollout/prefetch_generate_s"]
    # A sanity check of the parent's accounting: an iteration's total holds its flow run's body and more.
    assert all(h["time/iteration_total_s"] > h["time/iteration_s"] for h in history)
    assert all("rollout/prefetch_generate_s" not in h for h in read_history(settings().run_dir("rl-pf-off")))


def test_a_kill_with_the_batch_ahead_in_flight_resumes_to_the_same_weights(api, without_prefetch):
    sets, ref = without_prefetch
    store = open_store()
    for iteration, stage in KILLS:
        killed = _cli(_args("rl-pf", sets), {"RLPIPE_FAULT": f"{iteration}:{stage}"}, api)
        assert killed.returncode == -9, (iteration, stage, killed.stderr[-3000:])
        # The batch ahead is generated while iteration k-1 records itself: the kill lands before or after
        # that record, and either must resume to the same course.
        progress = json.loads((settings().run_dir("rl-pf") / "progress.json").read_text())
        assert progress.get("completed_iteration", -1) in (iteration - 2, iteration - 1)
        if iteration == 1:
            written = store.read_manifest(stage_prefix("rl-pf", 1, "rollout"))["written_at"]
    done = _cli(_args("rl-pf", sets), {}, api)
    assert done.returncode == 0, done.stderr[-3000:]
    assert store.read_manifest(stage_prefix("rl-pf", 1, "rollout"))["written_at"] == written  # reused, not redone
    got = json.loads((settings().run_dir("rl-pf") / "summary.json").read_text())
    assert got["iterations_done"] == 3 and got["final_policy_version"] == ref["final_policy_version"]
    for k in range(3):
        assert _rows("rl-pf", k) == _rows("rl-pf-off", k)
    assert [h["iteration"] for h in read_history(settings().run_dir("rl-pf"))] == [0, 1, 2]
    cfg = load_config(None, sets)
    mine = [mv for mv in Tracker(settings(), cfg).client.search_model_versions(f"name='{cfg.registered_model}'")
            if mv.tags["run_id"] == "rl-pf"]
    assert sorted(int(mv.tags["iteration"]) for mv in mine) == [0, 1, 2]  # each iteration registered once


def _fake_services(run_id):
    svc = RunServices(run_id, None, None, None, None, [], [], {})
    register_services(svc)
    return svc


def test_a_failed_prefetch_is_the_rollout_tasks_error(monkeypatch):
    svc = _fake_services("pf-fails")

    def broken(config, run_id, iteration, draw):
        raise ConnectionError("engine replica gone")

    monkeypatch.setattr(tasks.rl, "generate_rollout", broken)
    prefetch_rollout(RunConfig(), "pf-fails", 4)
    assert svc.join_ahead(3, 0) is None and svc.join_ahead(4, 1) is None  # not theirs
    with pytest.raises(RuntimeError, match="iteration 4: generating its batch ahead .* engine replica gone"):
        svc.join_ahead(4, 0)
    assert svc.background is None and svc.join_ahead(4, 0) is None  # the task's retry generates it itself
    stop_services("pf-fails")


def test_stopping_the_run_waits_for_the_batch_in_flight(monkeypatch):
    """The process keeps its engine for its next run: a run that stops must not leave it generating."""
    _fake_services("pf-stop")
    finished = threading.Event()

    def slow(config, run_id, iteration, draw):
        time.sleep(0.5)
        finished.set()
        return {}

    monkeypatch.setattr(tasks.rl, "generate_rollout", slow)
    prefetch_rollout(RunConfig(), "pf-stop", 1)
    with pytest.raises(RuntimeError, match="still being generated ahead"):
        prefetch_rollout(RunConfig(), "pf-stop", 2)
    stop_services("pf-stop")
    assert finished.is_set()


def test_prefetch_and_async_steps_do_not_stack():
    assert RunConfig().rollout.prefetch is True
    assert RunConfig.model_validate({"rollout": {"async_steps": 1}}).rollout.prefetch is False
    with pytest.raises(ValueError, match="drop rollout.prefetch"):
        RunConfig.model_validate({"rollout": {"async_steps": 1, "prefetch": True}})
