"""A run's history: append-only, merged per iteration, redo-safe, torn-line-safe, bounded reads, and carried
to another machine through the store's save-point segments. `progress.json` no longer grows with the run."""

from __future__ import annotations

import json

from rlpipe.history import RunHistory, read_history
from rlpipe.resume import STATE_DONE, RunState
from rlpipe.progress import Progress
from rlpipe.storage import open_store


def test_records_merge_per_iteration_and_a_redo_replaces_what_followed(tmp_path):
    h = RunHistory(tmp_path / "history.jsonl")
    for k in range(4):
        h.add(k, {"reward_mean": k / 10})
        h.extend(k, {"time/iteration_total_s": 1.0 + k})
    assert [r["iteration"] for r in h.read()] == [0, 1, 2, 3]
    assert h.read()[2] == {"iteration": 2, "reward_mean": 0.2, "time/iteration_total_s": 3.0}
    h.add(2, {"reward_mean": 0.9})  # iteration 2 redone after a kill: 2 and 3 are gone, then 2 again
    assert [(r["iteration"], r["reward_mean"]) for r in h.read()] == [(0, 0.0), (1, 0.1), (2, 0.9)]
    assert "time/iteration_total_s" not in h.read()[2] and h.last_iteration() == 2
    assert read_history(tmp_path) == h.read()


def test_a_line_torn_by_a_kill_is_dropped_before_the_next_append(tmp_path):
    h = RunHistory(tmp_path / "history.jsonl")
    h.add(0, {"loss": 1.0})
    with h.path.open("a") as f:
        f.write('{"iteration": 1, "loss": 0.')  # the kill came mid-line
    assert [r["iteration"] for r in h.read()] == [0]  # a torn line is never read as data
    h.add(1, {"loss": 0.5})
    assert h.read() == [{"iteration": 0, "loss": 1.0}, {"iteration": 1, "loss": 0.5}]
    assert h.path.read_text().count("\n") == 2


def test_tail_reads_only_the_end_and_equals_the_whole_files_end(tmp_path):
    h = RunHistory(tmp_path / "history.jsonl")
    pad = "x" * 900  # ~1 KB lines: the tail spans several 64 KiB chunks
    for k in range(300):
        h.add(k, {"reward_mean": k, "note": pad})
        h.extend(k, {"extra": -k})
    whole = h.read()
    for n in (1, 2, 70, 150, 299, 300, 500):
        assert h.tail(n) == whole[-n:], n
    assert h.tail(0) == [] and RunHistory(tmp_path / "none.jsonl").tail(5) == []


def _save(state: RunState, progress: Progress, k: int) -> Progress:
    state.store.put_json(f"{state.checkpoint_prefix(k)}/{STATE_DONE}", {"weights_sha256": f"w{k}"})
    return state.save_point(progress.but(completed_iteration=k, weights_sha256=f"w{k}"))


def test_save_points_carry_the_history_to_another_machine_and_progress_stays_small(tmp_path):
    store = open_store(str(tmp_path / "store"))
    state, progress, sizes = RunState(store, tmp_path / "here", "r1"), Progress(), []
    for k in range(12):
        state.history.add(k, {"reward_mean": k / 12, "iteration_seconds": 1.5})
        if k % 3 == 2:  # save_interval 3
            progress = _save(state, progress, k)
            sizes.append(len(store.get_bytes(state.progress_key)))
        state.history.extend(k, {"time/iteration_total_s": 2.0})  # the parent's outer timing, after the save
    assert max(sizes) - min(sizes) < 8  # the progress does not grow with the run (only its offsets gain digits)
    segments = store.list(state.history_prefix)
    assert [s.rsplit("/", 1)[1] for s in segments] == [f"iter={k:08d}.jsonl" for k in (2, 5, 8, 11)]
    saved = store.get_json(state.progress_key)
    assert "history" not in saved and saved["completed_iteration"] == 11

    there = RunState(store, tmp_path / "there", "r1")  # another machine: only the store
    back = there.fetch_history(Progress.from_dict(saved))
    got = there.history.read()
    assert [r["iteration"] for r in got] == list(range(12)) and back.history_bytes == there.history.size()
    assert got[:11] == state.history.read()[:11]  # iteration 11's outer timing comes with the next save point
    # A resume at an earlier save point takes only the segments up to it.
    earlier = RunState(store, tmp_path / "earlier", "r1")
    earlier.fetch_history(Progress.from_dict(saved).but(completed_iteration=5))
    assert [r["iteration"] for r in earlier.history.read()] == list(range(6))
    json.dumps(back.to_dict())  # the progress stays JSON


def test_a_run_from_before_moves_its_history_out_of_progress_once(tmp_path):
    store = open_store(str(tmp_path / "store"))
    state = RunState(store, tmp_path / "here", "old")
    old = [{"iteration": k, "reward_mean": k / 4, "time/iteration_total_s": 1.0} for k in range(4)]
    progress = state.history_out_of_progress(Progress(completed_iteration=3, history=old, weights_sha256="ab"))
    assert progress.history is None and progress.history_bytes == 0  # the next save point uploads it all
    assert state.history.read() == old
    assert json.loads((tmp_path / "here" / "progress.json").read_text()) == progress.to_dict()
    state.history.add(4, {"reward_mean": 1.0})  # the run goes on appending
    assert [r["iteration"] for r in state.history.read()] == [0, 1, 2, 3, 4]
    assert state.history_out_of_progress(progress) is progress  # nothing left to move
