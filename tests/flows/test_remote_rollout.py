"""A run whose rollout is a separate service (RLPIPE_ROLLOUT_URL): weights reach it streamed over HTTP, never
through the object store, every sync is proven on it, and with one replica on the same engine it trains to exactly the weights
the in-process run reaches with the same seed."""

from __future__ import annotations


from rlpipe.config import settings
from rlpipe.history import read_history
from rlpipe.rollout.hf_engine import HFEngine
from rlpipe.storage import open_store
from rlpipe.storage.weights import file_weights_digest
from tests.flows.test_train_flow import even_task, invoke, rl_overrides  # noqa: F401 - fixture re-used
from tests.services.test_rollout_service import _serve


def test_a_run_on_a_rollout_service_matches_the_in_process_run(prefect_harness, tiny_checkpoint, even_task, monkeypatch):
    sets = rl_overrides(tiny_checkpoint, "rlremote", "hf", even_task, iterations=2)
    local = invoke(["run", "--run-id", "rl-local-ref"] + [x for s in sets for x in ("--set", s)])
    server, service, url = _serve(HFEngine(tiny_checkpoint), tiny_checkpoint, open_store())
    try:
        monkeypatch.setenv("RLPIPE_ROLLOUT_URL", url)
        remote = invoke(["run", "--run-id", "rl-remote"] + [x for s in sets for x in ("--set", s)])
    finally:
        server.should_exit = True
    assert remote["engine"] == "rollout×1" and remote["iterations_done"] == 2
    assert remote["final_policy_version"] == local["final_policy_version"] != file_weights_digest(tiny_checkpoint)
    assert remote["heldout_accuracy_final"] == local["heldout_accuracy_final"]
    # The start weights and one set per iteration were streamed to the service, each loaded once; none went
    # through the store.
    assert open_store().list("runs/rl-remote/weights") == [] and service.stats.weight_loads == 3
    history = read_history(settings().run_dir("rl-remote"))
    assert all(h["sync/probe_max_abs_diff"] <= 1e-5 for h in history)  # proven on the service's engine
    assert all(h["service/rollout/calls"] >= 1 and h["service/rollout/error_rate"] == 0 for h in history)
