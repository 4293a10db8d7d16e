"""Resume you can trust: killed at every stage boundary on the vLLM engine (once with the local state
deleted, so only the object store is left), it lands on the same weights as an uninterrupted run,
registers each iteration once, and refuses a resume that would change the experiment."""

import json
import shutil

import pytest

from rlpipe.config import load_config, settings
from rlpipe.resume import ResumeRefused, check_resume, config_changes, resume_fingerprint
from rlpipe.progress import Progress
from rlpipe.storage import open_store
from rlpipe.storage.layout import stage_prefix
from rlpipe.tracking.mlflow_utils import Tracker
from tests.flows.test_train_flow import _cli, even_task, rl_overrides  # noqa: F401 - fixture re-used

# (iteration, stage): SIGKILL right after that stage. Iteration 2's kills happen after the local run
# folder was deleted: those resumes come from the store's save points.
# (1, "save"): half-way through iteration 1's save point, written on a thread (train.async_save).
# (0, "upload") and (0, "register"): iteration 0's save point is uploaded behind the run (train.async_save) and
# recorded by iteration 1 after its update; the kills come on the upload's thread, then between its model version's
# registration and its record. Iteration 2 is the last: its save point is uploaded and recorded at once.
BOUNDARIES = [(0, "rollout"), (0, "verify"), (0, "upload"), (0, "register"), (1, "save"), (1, "update"), (1, "sync"),
              (2, "upload"), (2, "register")]


def _args(run_id, sets, *extra):
    return ["run", "--run-id", run_id, *[x for s in sets for x in ("--set", s)], *extra]


@pytest.fixture(scope="module")
def api(prefect_harness):
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


@pytest.fixture(scope="module")
def reference(api, tiny_checkpoint, even_task):
    # The HF engine: these drills are about the run's state, and each of their nine processes would pay
    # vLLM's start (~20 s). A resume onto a fresh vLLM engine is drilled in tests/flows/test_agent_flow.py.
    sets = rl_overrides(tiny_checkpoint, "rlkill", "hf", even_task, iterations=3)
    ref = _cli(_args("rl-kill-ref", sets), {}, api)
    assert ref.returncode == 0, ref.stderr[-3000:]
    return sets, json.loads((settings().run_dir("rl-kill-ref") / "summary.json").read_text())


def test_kill_at_every_stage_boundary_resumes_to_the_same_weights(api, reference):
    sets, ref = reference
    store = open_store()
    for iteration, stage in BOUNDARIES:
        if (iteration, stage) == (2, "upload"):
            shutil.rmtree(settings().run_dir("rl-kill"))  # another machine: only the store and MLflow remain
        killed = _cli(_args("rl-kill", sets), {"RLPIPE_FAULT": f"{iteration}:{stage}"}, api)
        assert killed.returncode == -9, (iteration, stage, killed.stderr[-3000:])
        if (iteration, stage) == (0, "register"):  # registered, not recorded: a resume starts before it
            assert json.loads((settings().run_dir("rl-kill") / "resume.json").read_text())["completed_iteration"] == -1
        if (iteration, stage) == (0, "rollout"):
            written = store.read_manifest(stage_prefix("rl-kill", 0, "rollout"))["written_at"]
    done = _cli(_args("rl-kill", sets), {}, api)
    assert done.returncode == 0, done.stderr[-3000:]
    assert store.read_manifest(stage_prefix("rl-kill", 0, "rollout"))["written_at"] == written  # reused, not redone

    got = json.loads((settings().run_dir("rl-kill") / "summary.json").read_text())
    assert got["iterations_done"] == ref["iterations_done"] == 3
    assert got["final_policy_version"] == ref["final_policy_version"]  # the same weights, bit for bit
    cfg = load_config(None, sets)
    tracker = Tracker(settings(), cfg)
    mine = [mv for mv in tracker.client.search_model_versions(f"name='{cfg.registered_model}'") if mv.tags["run_id"] == "rl-kill"]
    assert sorted(int(mv.tags["iteration"]) for mv in mine) == [0, 1, 2]  # never a second version of a redone iteration
    assert [mv.tags["weights_sha256"] for mv in sorted(mine, key=lambda m: int(m.tags["iteration"]))][-1] == ref["final_policy_version"]
    assert [_flow_run_name(mv.tags["prefect_flow_run_id"]) for mv in sorted(mine, key=lambda m: int(m.tags["iteration"]))] == [
        f"rl-kill-iter-{k}" for k in (0, 1, 2)]  # recorded behind the run, each version still names its own flow run
    for key in ("time/iteration_s", "time/iteration_total_s"):  # each iteration's metrics in MLflow, once
        assert sorted(m.step for m in tracker.client.get_metric_history(got["mlflow_run_id"], key)) == [0, 1, 2], key

    again = _cli(_args("rl-kill", sets), {}, api)  # a finished run run again changes nothing
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((settings().run_dir("rl-kill") / "summary.json").read_text())["final_policy_version"] == ref["final_policy_version"]


def _flow_run_name(flow_run_id: str) -> str:
    from uuid import UUID

    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(UUID(flow_run_id)).name


def test_between_save_points_nothing_is_written_and_a_kill_redoes_from_the_last(api, reference):
    """train.save_interval 2 over 3 iterations: save points after iterations 1 and 2 only. Killed after
    iteration 0 (no state written: the weights went to the engine in memory), then half-way through the
    asynchronous save of iteration 1, the run resumes each time from its last complete save point (the start),
    redoes the iterations after it, and lands on the weights of the uninterrupted run saved every iteration."""
    sets, ref = reference
    sets = sets + ["train.save_interval=2"]
    run_dir = settings().run_dir("rl-sparse")
    killed = _cli(_args("rl-sparse", sets), {"RLPIPE_FAULT": "1:verify"}, api)  # iteration 0 done, then killed
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert not list((run_dir / "state").glob("iter=*"))  # nothing on disk between save points
    assert json.loads((run_dir / "progress.json").read_text())["completed_iteration"] == 0
    killed = _cli(_args("rl-sparse", sets), {"RLPIPE_FAULT": "1:save"}, api)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert "after iteration -1 from the start policy" in killed.stderr
    assert "iterations 0..0 (done after that save point) are redone" in killed.stderr
    assert json.loads((run_dir / "resume.json").read_text())["completed_iteration"] == -1  # the save was not whole
    assert not (run_dir / "state" / "iter=1" / "trainer_state.json").exists()
    done = _cli(_args("rl-sparse", sets), {}, api)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "iterations 0..0 (done after that save point) are redone" in done.stderr
    got = json.loads((run_dir / "summary.json").read_text())
    assert got["final_policy_version"] == ref["final_policy_version"]  # the same weights, bit for bit
    assert json.loads((run_dir / "resume.json").read_text())["completed_iteration"] == 2
    cfg = load_config(None, sets)
    tracker = Tracker(settings(), cfg)
    mine = [mv for mv in tracker.client.search_model_versions(f"name='{cfg.registered_model}'") if mv.tags["run_id"] == "rl-sparse"]
    assert sorted(int(mv.tags["iteration"]) for mv in mine) == [1, 2]  # a model version per save point
    steps = sorted(m.step for m in tracker.client.get_metric_history(got["mlflow_run_id"], "time/iteration_s"))
    assert steps == [0, 1, 2]  # a redone iteration's metrics are not logged twice


def test_a_changed_config_is_refused_and_an_allowed_one_recorded(api, reference):
    sets, ref = reference
    refused = _cli(_args("rl-kill-ref", sets + ["train.lr=2e-4"]), {}, api)
    assert refused.returncode == 4, refused.stderr[-3000:]
    assert "train.lr: 0.0001 → 0.0002" in refused.stderr and "--allow-config-change" in refused.stderr

    longer = _cli(_args("rl-kill-ref", sets + ["train.total_iterations=4"]), {}, api)  # extending is no change
    assert longer.returncode == 0, longer.stderr[-3000:]
    changed = _cli(_args("rl-kill-ref", sets + ["train.total_iterations=5", "train.lr=2e-4"], "--allow-config-change"), {}, api)
    assert changed.returncode == 0, changed.stderr[-3000:]
    summary = json.loads((settings().run_dir("rl-kill-ref") / "summary.json").read_text())
    assert summary["iterations_done"] == 5
    run = Tracker(settings(), load_config(None, sets)).client.get_run(summary["mlflow_run_id"])
    assert "train.lr: 0.0001 → 0.0002" in run.data.tags["rlpipe.config_change.iter4"]


def test_resume_rules_by_hand():
    a = load_config(None, ["train.lr=1e-4"])
    b = load_config(None, ["train.lr=2e-4", "train.total_iterations=99"])
    assert config_changes(a.flat(), b.flat()) == ["train.lr: 0.0001 → 0.0002"]
    assert resume_fingerprint(a) != resume_fingerprint(b)
    assert resume_fingerprint(a) == resume_fingerprint(load_config(None, ["train.lr=1e-4", "train.total_iterations=3"]))
    progress = Progress(config=a.flat(), dataset_version="d1")
    assert check_resume(progress, load_config(None, ["train.lr=1e-4", "train.total_iterations=7"]), "d1", False) == []
    with pytest.raises(ResumeRefused, match="dataset_version: d1 → d2"):
        check_resume(progress, a, "d2", False)
    with pytest.raises(ResumeRefused, match="train.lr"):
        check_resume(progress, b, "d1", False)
    assert check_resume(progress, b, "d1", True) == ["train.lr: 0.0001 → 0.0002"]


def test_progress_without_its_state_and_no_save_point_is_refused_not_restarted():
    """A run that finished iterations here, whose state folder was cleaned and which never reached a
    save point in the store, cannot continue: it is refused (exit 4), never silently begun again."""
    from flows.train import _resume_point
    from rlpipe.runtime import RunContext

    config = load_config(None, ["train.save_interval=100"])
    state = RunContext.resolve(config, "rl-gone").state
    assert state.read_saved() is None
    state.write_local(Progress(completed_iteration=1, config=config.flat(), dataset_version="d1",
                               resume_dir=str(settings().run_dir("rl-gone") / "state" / "iter=1"), weights_sha256="ab" * 32))
    with pytest.raises(ResumeRefused, match="completed iteration 1, but its state is gone .* start a new --run-id"):
        _resume_point(RunContext.resolve(config, "rl-gone"), "d1", allow_change=True)
    assert state.read_local().completed_iteration == 1  # nothing lost: the record stays for a person to read

    fresh = RunContext.resolve(config, "rl-new").state  # never finished an iteration: starts at 0, as asked
    fresh.write_local(Progress(completed_iteration=-1, config=config.flat(), dataset_version="d1"))
    assert _resume_point(RunContext.resolve(config, "rl-new"), "d1", allow_change=False)[0].completed_iteration == -1


def test_a_resume_continues_from_the_last_save_point_and_cuts_the_history_back_to_it(tmp_path):
    """resume.json (the last save point) wins over progress.json (further along): the history is cut back to the
    save point's length, progress.json becomes the save point's record, and the iterations after it count as
    logged to MLflow already."""
    import torch
    from safetensors.torch import save_file

    from flows.train import _resume_point
    from rlpipe.runtime import RunContext
    from rlpipe.storage.weights import file_weights_digest

    config = load_config(None, ["train.save_interval=2"])
    ctx = RunContext.resolve(config, "rl-cut")
    folder = ctx.folder.state_dir(1)
    folder.mkdir(parents=True)
    save_file({"w": torch.ones(3)}, folder / "model.safetensors")
    for k in range(4):
        ctx.folder.history.add(k, {"loss": float(k)})
        if k == 1:
            at_save = ctx.folder.history.size()
    saved = Progress(completed_iteration=1, config=config.flat(), dataset_version="d1", resume_dir=str(folder),
                     weights_sha256=file_weights_digest(folder), history_bytes=at_save)
    ctx.folder.write_resume(saved)
    ctx.state.write_local(saved.but(completed_iteration=3, weights_sha256="ab" * 32))
    progress, changes = _resume_point(ctx, "d1", allow_change=False)
    assert (progress.completed_iteration, progress.resume_dir, changes) == (1, str(folder), [])
    assert [h["iteration"] for h in ctx.folder.history.read()] == [0, 1]
    assert ctx.state.read_local().completed_iteration == 1 and ctx.logged_through == 3
    folder.joinpath("model.safetensors").unlink()  # the save point's state gone, no store: refused, not restarted
    ctx.state.write_local(saved.but(completed_iteration=3))
    with pytest.raises(ResumeRefused, match="completed iteration 3"):
        _resume_point(RunContext.resolve(config, "rl-cut"), "d1", allow_change=False)


def test_a_run_with_models_uri_reference_and_critic_resumes(api, reference):
    """task.ref_model and train.critic.model given as models:/ URIs are fetched to local folders for the
    services, but the run records them as given: extending the run is a resume, not a changed config
    (it was refused with `task.ref_model: '/…/cache/…' → 'models:/…'`, exit 4)."""
    sets, _ = reference
    name = load_config(None, sets).registered_model  # the reference run registered its iterations, @last the newest
    uri = f"models:/{name}@last"
    extra = [f"task.ref_model={uri}", f"train.critic.model={uri}", "train.algorithm=ppo", "train.kl_coef=0.01"]
    one = [s for s in sets if not s.startswith("train.total_iterations=")] + extra
    first = _cli(_args("rl-uri", one + ["train.total_iterations=1"]), {}, api)
    assert first.returncode == 0, first.stderr[-3000:]
    progress = json.loads((settings().run_dir("rl-uri") / "progress.json").read_text())
    assert progress["config"]["task.ref_model"] == progress["config"]["train.critic.model"] == uri
    longer = _cli(_args("rl-uri", one + ["train.total_iterations=2"]), {}, api)
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert json.loads((settings().run_dir("rl-uri") / "summary.json").read_text())["iterations_done"] == 2
