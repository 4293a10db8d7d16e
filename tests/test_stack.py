"""`rlpipe up` / `status` / `down` for real: the stack's S3, MLflow, Prefect and verifier answer; status sees a
dead component; down stops exactly what up started; a component that cannot start stops the rest."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
from typer.testing import CliRunner

from rlpipe.cli import app


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def alive(pid: int) -> bool:
    from rlpipe.stack import _pid_alive

    return _pid_alive(pid)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    yield tmp_path / "home"
    if (tmp_path / "home" / "stack" / "stack.json").exists():  # whatever the test left running
        cli("down")


def test_up_status_down(home):
    res = cli("up", "--timeout-s", "240")
    assert res.exit_code == 0, res.output
    stack = json.loads((home / "stack" / "stack.json").read_text())
    names = [c["name"] for c in stack["components"]]
    assert names == ["s3", "mlflow", "prefect", "worker", "verifier"]
    env = stack["env"]
    assert f"source {home.resolve()}/stack/env.sh" in res.output
    assert "export RLPIPE_VERIFIER_URL=http://127.0.0.1:" in (home / "stack" / "env.sh").read_text()
    assert oct((home / "stack" / "env.sh").stat().st_mode & 0o777) == "0o600"  # it holds the S3 keys

    # Each component does its job, reached the way a run reaches it.
    from rlpipe.config import settings
    from rlpipe.storage import open_store

    s = settings(env | {"RLPIPE_HOME": str(home)})
    store = open_store(s.resolve_storage_uri(), s)
    store.put_bytes("probe/x", b"hello")
    assert store.get_bytes("probe/x") == b"hello" and store.uri == "s3://rlpipe/store"
    assert httpx.post(f"{env['RLPIPE_TRACKING_URI']}/api/2.0/mlflow/experiments/create", json={"name": "stack"}).status_code == 200
    pools = httpx.post(f"{env['PREFECT_API_URL']}/work_pools/filter", json={}).json()
    assert [p["name"] for p in pools if p["name"] == "rlpipe-local"] == ["rlpipe-local"]
    verdict = httpx.post(f"{env['RLPIPE_VERIFIER_URL']}/verify",
                         json={"items": [{"verifier": "exact", "response": "46", "ground_truth": "46"}]}).json()
    assert verdict["results"][0]["reward"] == 1.0

    res = cli("status")
    assert res.exit_code == 0 and res.output.count("ok  ") == 5, res.output
    assert cli("up").exit_code == 1  # one stack per RLPIPE_HOME

    verifier = next(c for c in stack["components"] if c["name"] == "verifier")
    os.killpg(verifier["pid"], signal.SIGKILL)
    time.sleep(0.5)
    res = cli("status")
    assert res.exit_code == 1 and "DOWN  verifier" in res.output, res.output

    pids = [c["pid"] for c in stack["components"]]
    res = cli("down")
    assert res.exit_code == 0 and "stopped 4: worker, prefect, mlflow, s3" in res.output, res.output
    assert not any(alive(p) for p in pids) and not (home / "stack" / "stack.json").exists()
    assert cli("status").exit_code == 2 and cli("down").exit_code == 2  # nothing recorded any more


def test_a_component_that_cannot_start_stops_the_rest(home):
    res = cli("up", "--set", "reward.type=model", "--set", "reward.model=/nonexistent/rm", "--timeout-s", "240")
    assert res.exit_code == 1 and "reward-model exited at start" in res.output, res.output
    assert "/nonexistent/rm" in res.output  # its log's tail says why
    assert not (home / "stack" / "stack.json").exists()
    pids = [int(p.read_text()) for p in (home / "stack").glob("*.pid")]
    assert pids and not any(alive(p) for p in pids)
