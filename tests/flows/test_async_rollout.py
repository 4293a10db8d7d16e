"""rollout.async_steps: 1 — iteration k+1's batch is generated while iteration k trains, one update behind.

Every row says which policy sampled it and how stale it is, the update takes its ratio against the
sampling policy, a staler batch is refused or redone, and a kill with a batch in flight resumes to the
weights of an uninterrupted run (the batch ahead belongs to the iteration that generated it)."""

import json
import time

import pytest

from rlpipe.config import RunConfig, load_config, settings
from rlpipe.history import read_history
from rlpipe.storage import TRAJECTORY_SCHEMA, open_store
from rlpipe.storage.layout import stage_prefix
from rlpipe.tracking.mlflow_utils import Tracker
from rlpipe.storage.weights import file_weights_digest
from rlpipe.guards import StaleBatchError, check_staleness
from rlpipe.rollout.batch import reuse_expectation
from tests.flows.test_resume import _args
from tests.flows.test_train_flow import _cli, even_task, rl_overrides  # noqa: F401 - fixture re-used

# SIGKILLs with iteration k's update done or running and batch k+1 in flight or just written: the first
# while iteration 0's update runs beside batch 1's generation, the second right after batch 2 is written
# (iteration 1 not yet recorded), the third after iteration 1's redone update (batch 2 reused).
KILLS = [(0, "update"), (2, "rollout"), (1, "update")]


@pytest.fixture(scope="module")
def api(prefect_harness):
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


@pytest.fixture(scope="module")
def uninterrupted(api, tiny_checkpoint, even_task):
    # With a task run per stage: the batch ahead is a task run of the iteration that started it, on another thread.
    sets = rl_overrides(tiny_checkpoint, "rlasync", "hf", even_task, iterations=3) + [
        "rollout.async_steps=1", "tracking.stage_task_runs=true"]
    ref = _cli(_args("rl-async-ref", sets), {}, api)
    assert ref.returncode == 0, ref.stderr[-3000:]
    return sets, json.loads((settings().run_dir("rl-async-ref") / "summary.json").read_text())


def _rows(run_id, k):
    return open_store().read_stage(stage_prefix(run_id, k, "verify"), schema=TRAJECTORY_SCHEMA).to_pylist()


def test_each_batch_is_sampled_one_update_behind_and_says_so(uninterrupted, tiny_checkpoint):
    sets, summary = uninterrupted
    cfg = load_config(None, sets)
    versions = {int(mv.tags["iteration"]): mv.tags["weights_sha256"] for mv in Tracker(settings(), cfg).client.search_model_versions(
        f"name='{cfg.registered_model}'") if mv.tags["run_id"] == "rl-async-ref"}
    base = file_weights_digest(tiny_checkpoint)
    # (policy that sampled, the update it came after, staleness) for batches 0, 1, 2.
    expected = [(base, -1, 0), (base, -1, 1), (versions[0], 0, 1)]
    for k, (sha, after, stale) in enumerate(expected):
        rows = _rows("rl-async-ref", k)
        assert len(rows) == 16
        assert {(r["policy_version"], r["policy_iteration"], r["staleness"]) for r in rows} == {(sha, after, stale)}, k
    assert summary["final_policy_version"] == versions[2] != versions[1] != versions[0] != base
    history = read_history(settings().run_dir("rl-async-ref"))
    assert [h["rollout/staleness"] for h in history] == [0.0, 1.0, 1.0]
    assert all(h["rollout/ahead_generate_s"] > 0 for h in history[:2]) and "rollout/ahead_generate_s" not in history[2]
    # The ratio's denominator is the sampling policy: iteration 0 trains on its own samples (gap: numerics
    # only), iteration 1 on the start policy's after update 0 moved the trainer.
    gap = [h["mismatch/abs_max"] for h in history]
    assert gap[1] > 1e-4 and gap[1] > 10 * gap[0], gap


def test_each_stage_is_a_task_run_of_its_iteration_where_asked(uninterrupted):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        # A save point every iteration, uploaded behind the run (train.async_save) and registered by the next
        # iteration; the last's uploaded and registered in its own.
        saving = {0: [], 1: ["register-checkpoint"], 2: ["register-checkpoint", "upload-checkpoint", "register-checkpoint"]}
        for k, ahead in ((0, ["rollout"]), (1, ["rollout"]), (2, [])):
            # its own rollout (from k ≥ 1 it takes the batch generated ahead) and the one ahead, but at the last
            want = sorted(["rollout", "verify"] + ahead + ["update", "sync-weights"] + saving[k])
            flt = FlowRunFilter(name=FlowRunFilterName(any_=[f"rl-async-ref-iter-{k}"]))
            deadline = time.time() + 30  # task runs reach the server as events
            while len(runs := client.read_task_runs(flow_run_filter=flt)) < len(want) and time.time() < deadline:
                time.sleep(0.5)
            assert sorted(r.name.rsplit("-", 1)[0] for r in runs) == want, (k, runs)
            assert {r.state_type.value for r in runs} == {"COMPLETED"}


def test_a_kill_with_a_batch_in_flight_resumes_to_the_same_weights(api, uninterrupted):
    sets, ref = uninterrupted
    store = open_store()
    for iteration, stage in KILLS:
        killed = _cli(_args("rl-async", sets), {"RLPIPE_FAULT": f"{iteration}:{stage}"}, api)
        assert killed.returncode == -9, (iteration, stage, killed.stderr[-3000:])
        if (iteration, stage) == (2, "rollout"):
            written = store.read_manifest(stage_prefix("rl-async", 2, "rollout"))["written_at"]
            progress = json.loads((settings().run_dir("rl-async") / "progress.json").read_text())
            assert progress["completed_iteration"] == 0  # batch 2 is written, iteration 1 is not recorded
    done = _cli(_args("rl-async", sets), {}, api)
    assert done.returncode == 0, done.stderr[-3000:]
    assert store.read_manifest(stage_prefix("rl-async", 2, "rollout"))["written_at"] == written  # reused, not redone
    got = json.loads((settings().run_dir("rl-async") / "summary.json").read_text())
    assert got["iterations_done"] == 3 and got["final_policy_version"] == ref["final_policy_version"]
    for k in range(3):
        mine, theirs = _rows("rl-async", k), _rows("rl-async-ref", k)
        assert [(r["policy_version"], r["staleness"], r["response_token_ids"]) for r in mine] == \
               [(r["policy_version"], r["staleness"], r["response_token_ids"]) for r in theirs]


def test_the_staleness_bound_redoes_or_refuses_a_staler_batch():
    # A batch generated ahead (after update 3, for iteration 5): reused only where one step is allowed.
    meta = {"policy_iteration": 3, "policy_version": "old"}
    assert reuse_expectation(1, "new", meta, 5) == {"staleness": 1}
    assert reuse_expectation(0, "new", meta, 5) == {"policy_version": "new"}  # ≠ "old": redone on-policy
    # Two updates behind: beyond the bound, never matched, so redone.
    assert reuse_expectation(1, "new", {"policy_iteration": 2}, 5) == {"staleness": "at most 1"}
    # An on-policy batch (staleness 0, or a table from before staleness was recorded) must match the engine.
    assert reuse_expectation(1, "new", {"policy_iteration": 4}, 5) == {"policy_version": "new"}
    assert reuse_expectation(1, "new", {}, 5) == {"policy_version": "new"}
    check_staleness(1, 5, 1, "batch")
    with pytest.raises(StaleBatchError, match="2 update\\(s\\) behind.*rollout.async_steps=1 allows at most 1"):
        check_staleness(1, 5, 2, "batch")
    with pytest.raises(StaleBatchError, match="async_steps=0"):
        check_staleness(0, 5, 1, "batch")
    with pytest.raises(StaleBatchError):  # an engine ahead of the iteration: never trained on
        check_staleness(1, 5, -1, "batch")
    with pytest.raises(ValueError, match="async_steps"):
        RunConfig.model_validate({"rollout": {"async_steps": 2}})
