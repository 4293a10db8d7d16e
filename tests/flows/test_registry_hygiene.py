"""Registry hygiene: a run can opt out of registration (and still resumes from its checkpoints); a run that
registers moves `last` only, never `best`; each version's lineage names the run, its flow run and its config."""

import json

from rlpipe.config import load_config, settings
from rlpipe.tracking.mlflow_utils import Tracker
from tests.flows.test_train_flow import even_task, rl_overrides  # noqa: F401 - fixture re-used


def test_opt_out_registers_nothing_and_lineage_names_run_and_config(prefect_harness, tiny_checkpoint, even_task):
    from flows.train import train
    from rlpipe.runtime import RunContext

    quiet = load_config(None, rl_overrides(tiny_checkpoint, "hygiene", "hf", even_task, iterations=1)
                        + ["tracking.register_models=false"])
    tracker = Tracker(settings(), quiet)
    name = quiet.registered_model

    summary = json.loads(open(train(config=quiet, run_id="rl-hygiene-quiet")).read())
    assert summary["iterations_done"] == 1 and summary["registered_model"]["version"] is None
    assert tracker.client.search_model_versions(f"name='{name}'") == []
    saved = RunContext.resolve(quiet, "rl-hygiene-quiet").state.read_saved()  # saved all the same: it resumes
    assert saved.completed_iteration == 0 and saved.resume_state.endswith("iter=0")

    loud = quiet.model_copy(deep=True)
    loud.tracking.register_models = True
    summary = json.loads(open(train(config=loud, run_id="rl-hygiene-loud")).read())
    mv = tracker.client.get_model_version(name, summary["registered_model"]["version"])
    assert set(mv.aliases) == {"last"}  # best moves only through the evaluate flow
    assert mv.tags["run_id"] == "rl-hygiene-loud" and mv.tags["kind"] == "policy"
    assert mv.tags["mlflow_run_id"] == mv.run_id == summary["mlflow_run_id"]
    flow_run = mv.tags["prefect_flow_run_id"]
    assert len(flow_run) == 36  # the rl-iteration flow run that registered it (a UUID)
    assert tracker.run_config(mv.run_id) == loud  # the whole config, loadable from the version's source run
