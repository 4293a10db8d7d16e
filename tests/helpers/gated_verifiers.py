"""A verifier that holds a run inside its second iteration, for a test that kills the run's process there.

``test_gated`` scores like ``test_even`` (1 for an even response length). While the file ``$RLPIPE_HOME/heal-gate``
exists and a run's save point 0 is recorded in the object store (``$RLPIPE_HOME/store/runs/<id>/progress.json`` at
iteration 0: its state uploaded, its model version registered) while its local progress is still at iteration 0,
each call touches ``heal-gate.held`` and waits for the gate to go (at most 10 minutes). With the default
``train.async_save`` the save point of iteration 0 is recorded after iteration 1's update, so the run is held in
iteration 1's evaluation: mid-iteration, with one model version registered. The test kills it there and removes
the gate."""

import json
import os
import time
from pathlib import Path

from rlpipe.rewards.base import VerifyResult, register_verifier


def _at(path: Path) -> int | None:
    try:
        return json.loads(path.read_text()).get("completed_iteration")
    except (OSError, ValueError):  # absent, or being rewritten: look again on the next call
        return None


def _held_here(home: Path) -> bool:
    return any(_at(p) == 0 and _at(home / "runs" / p.parent.name / "progress.json") == 0
               for p in home.glob("store/runs/*/progress.json"))


@register_verifier("test_gated", version="1", budget_s=900)
def gated(response: str, ground_truth: str | None) -> VerifyResult:
    home = Path(os.environ["RLPIPE_HOME"])
    gate = home / "heal-gate"
    if gate.exists() and _held_here(home):
        (home / "heal-gate.held").touch()
        deadline = time.monotonic() + 600
        while gate.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    return VerifyResult(float(len(response) % 2 == 0), "ok")
