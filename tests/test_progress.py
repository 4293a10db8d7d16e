"""Where a run stands (rlpipe.progress.Progress), the run folder that keeps it, and the run's summary."""

import json

import pytest

from rlpipe.config import RunConfig
from rlpipe.progress import Progress
from rlpipe.runs import RunFolder
from rlpipe.summary import rl_summary, run_cost, stage_seconds


def test_progress_round_trips_and_an_unknown_key_is_an_error_naming_it(tmp_path):
    folder = RunFolder(tmp_path / "r")
    assert folder.read_progress() is None
    p = Progress(completed_iteration=3, weights_sha256="w", config={"train.lr": 1e-4}, final_accuracy=None)
    folder.write_progress(p)
    on_disk = json.loads(folder.progress_path.read_text())
    assert on_disk == {"completed_iteration": 3, "weights_sha256": "w", "config": {"train.lr": 1e-4}, "history_bytes": 0}
    assert folder.read_progress() == p and [f.name for f in (tmp_path / "r").iterdir()] == ["progress.json"]
    folder.progress_path.write_text(json.dumps(on_disk | {"policy_versoin": "x"}))
    with pytest.raises(ValueError, match=r"progress.json: unknown key\(s\) \['policy_versoin'\]"):
        folder.read_progress()


def test_progress_started_and_but():
    assert not Progress().started and Progress(base_accuracy=0.0).started and Progress(completed_iteration=0).started
    p = Progress(completed_iteration=1)
    assert p.but(completed_iteration=2).completed_iteration == 2 and p.completed_iteration == 1


def test_the_run_folder_owns_its_files(tmp_path):
    folder = RunFolder(tmp_path / "r")
    assert folder.state_dir(4) == tmp_path / "r" / "state" / "iter=4" and folder.spare_state_dir.name == "spare"
    folder.history.add(0, {"loss": 1.0})
    assert folder.history.read() == [{"iteration": 0, "loss": 1.0}]
    path = folder.write_summary("r", {"b": 1})
    assert path == folder.summary_path and json.loads(path.read_text()) == {"b": 1, "run_id": "r"}
    assert folder.report_path.name == "report.html"


HISTORY = [
    {"iteration": 0, "time/generate_s": 2.0, "time/verify_s": 1.0, "time/update_s": 3.0, "time/eval_s": 1.0,
     "time/iteration_total_s": 10.0, "resource/cpu_s": 20.0, "alerts/throughput": 1.0, "store/bytes_written": 100.0},
    {"iteration": 1, "time/generate_s": 2.0, "time/verify_s": 1.0, "time/update_s": 3.0, "time/iteration_s": 8.0,
     "resource/cpu_s": 20.0, "resource/rss_bytes": 5e8, "store/bytes_written": 50.0},
]


def test_the_summary_by_hand():
    breakdown, total = stage_seconds(HISTORY)
    assert total == 18.0 and breakdown["overhead_s"] == 18.0 - 4.0 - 2.0 - 6.0 - 1.0
    cost = run_cost(HISTORY, Progress(base_accuracy=0.25, final_accuracy=0.45))
    assert cost["cpu_s_total"] == 40.0 and cost["cpu_s_per_iteration"] == 20.0 and cost["cpu_s_per_heldout_point"] == 2.0
    assert cost["store_bytes_written"] == 150 and cost["peak_rss_bytes"] == 5e8 and "gpu_s_total" not in cost
    assert run_cost(HISTORY, Progress(base_accuracy=0.5, final_accuracy=0.4))["cpu_s_per_heldout_point"] is None
    s = rl_summary(RunConfig(), Progress(completed_iteration=1, base_accuracy=0.25, final_accuracy=0.45), HISTORY,
                   fingerprint="f", dataset_version="d")
    assert s["iterations_done"] == 2 and s["alerts_fired"] == {"throughput": 1} and s["config_fingerprint"] == "f"
    assert s["overhead_share"] == round(5.0 / 17.0, 4) and s["iteration_seconds_mean"] == 9.0
