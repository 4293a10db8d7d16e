"""How fast the shipped Prefect automation cancels a run after a critical alert (README, "Alerts and
automations"). Starts a real `prefect server` on 127.0.0.1, installs infra/prefect/automations.yaml, fires
the two default-critical rules from flow runs 3 times (tests/helpers/fire_alerts.py) and prints, per firing,
the seconds from the alert event to the flow run's Cancelling event. About 1 minute.

    .venv/bin/python benchmarks/automation_latency.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # this checkout's code, a worktree's too (not the installed one)

from tests.helpers.prefect_server import prefect_server  # noqa: E402


def _t(event: dict) -> float:
    return datetime.fromisoformat(event["occurred"].replace("Z", "+00:00")).timestamp()


def main(rounds: int = 3) -> None:
    code = "import sys; from rlpipe.cli import main; sys.argv = ['rlpipe'] + sys.argv[1:]; main()"
    lags = []
    with prefect_server(Path(tempfile.mkdtemp())) as s:
        env = s.env | {"OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-c", code, "automations", "install"], env=env, check=True, cwd=ROOT)
        for _ in range(rounds):
            out = subprocess.run([sys.executable, "-m", "tests.helpers.fire_alerts", "reward_flat", "nonfinite_loss"],
                                 env=env, cwd=ROOT, capture_output=True, text=True, check=True)
            time.sleep(3)  # the server persists events in batches
            events = s.events("rlpipe.alert.") + s.events("prefect.flow-run.Cancelling")
            for rule, run in json.loads(out.stdout.strip().splitlines()[-1]).items():
                alert = [e for e in events if e["event"] == f"rlpipe.alert.{rule}"
                         and any(r["prefect.resource.id"].endswith(run["flow_run_id"]) for r in e["related"])][-1]
                cancel = [e for e in events if e["event"] == "prefect.flow-run.Cancelling"
                          and e["resource"]["prefect.resource.id"].endswith(run["flow_run_id"])]
                lag = _t(cancel[0]) - _t(alert) if cancel else float("nan")
                lags.append(lag)
                print(f"{rule:16s} {run['state']:10s} cancel {lag:.2f} s after the alert event")
    print(f"{len(lags)} firings: {min(lags):.2f}–{max(lags):.2f} s")


if __name__ == "__main__":
    main()
