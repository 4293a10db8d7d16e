"""`rlpipe doctor`: passes on the local defaults (the engine started for real), names the component and its
fix when one is down, and never hangs or crashes on a component that does; runs start with its preflight."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlpipe.config import load_config, settings
from rlpipe.doctor import PreflightError, _mlflow_registry, _one, preflight
from tests.helpers.s3server import free_port

ROOT = Path(__file__).resolve().parents[1]


def _doctor(args: list[str], env_extra: dict[str, str], home: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLPIPE_", "PREFECT_API_URL"))}
    env |= {"RLPIPE_HOME": str(home), "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"} | env_extra
    code = "import sys; from rlpipe.cli import main; sys.argv = ['rlpipe'] + sys.argv[1:]; main()"
    return subprocess.run([sys.executable, "-c", code, "doctor", *args], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)


def test_doctor_passes_on_the_local_defaults(tmp_path):
    p = _doctor(["--json"], {}, tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    checks = {c["component"]: c for c in json.loads(p.stdout[p.stdout.index("[\n"):])}
    assert list(checks) == ["object-store", "mlflow-tracking", "mlflow-registry", "prefect-api", "rollout-engine",
                            "verifier", "sandbox", "deepspeed", "gpu", "alert-inputs"]
    for name in ("object-store", "mlflow-tracking", "mlflow-registry", "rollout-engine", "verifier", "sandbox", "deepspeed"):
        assert checks[name]["status"] == "ok", checks[name]
    assert "vllm: started" in checks["rollout-engine"]["detail"]
    assert checks["prefect-api"]["status"] == "skip"  # no PREFECT_API_URL: runs start their own server
    assert not list((tmp_path / "store").rglob("_doctor/*"))  # the probe object is gone


def test_doctor_names_what_is_down_and_its_fix(tmp_path):
    s3, api = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}/api"
    env = {"RLPIPE_STORAGE_URI": "s3://rlpipe-doctor/runs", "RLPIPE_S3_ENDPOINT_URL": s3, "RLPIPE_S3_ACCESS_KEY_ID": "k",
           "RLPIPE_S3_SECRET_ACCESS_KEY": "s", "PREFECT_API_URL": api}
    start = time.monotonic()
    p = _doctor(["--no-engine", "--timeout-s", "60"], env, tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr[-2000:]
    lines = p.stdout.splitlines()
    store = next(i for i, line in enumerate(lines) if line.startswith("FAIL  object-store"))
    assert "s3://rlpipe-doctor/runs" in lines[store] and f"start the S3 server behind {s3}" in lines[store + 1]
    prefect = next(line for line in lines if line.startswith("FAIL  prefect-api"))
    assert api in prefect
    assert any(line.startswith("ok    mlflow-tracking") for line in lines)
    assert lines[-1] == "2 of 9 failed: object-store, prefect-api"
    assert time.monotonic() - start < 120


def test_a_hung_or_crashing_check_is_that_components_failure():
    cfg, s = load_config(None, []), settings()
    hung = _one("slow", lambda c, st: time.sleep(30), cfg, s, timeout_s=0.5)  # a daemon thread: it holds no exit
    assert (hung.status, hung.detail) == ("fail", "no answer in 0.5 s") and hung.seconds < 5
    crash = _one("bad", lambda c, st: 1 / 0, cfg, s, timeout_s=5)
    assert crash.status == "fail" and "ZeroDivisionError" in crash.detail
    fine = _one("fine", lambda c, st: "all good", cfg, s, 5)
    assert (fine.component, fine.status, fine.detail, fine.fix) == ("fine", "ok", "all good", "")


def test_an_mlflow_server_with_a_local_store_fails_before_any_run(tmp_path, monkeypatch):
    """An MLflow *server* refuses a model version whose source is a local folder: say so at preflight, not at the
    first save point."""
    monkeypatch.setenv("RLPIPE_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    # Nothing listens there: MLflow's client would retry the second check's request with back-off for the whole
    # 30 s the check is given (28 s of the suite); one try says the same.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("RLPIPE_STORAGE_URI", str(tmp_path / "store"))
    cfg = load_config(None, [])
    bad = _one("mlflow-registry", _mlflow_registry, cfg, settings(), 30)
    assert bad.status == "fail" and "local folder" in bad.detail and "RLPIPE_STORAGE_URI=s3://" in bad.fix
    cfg = load_config(None, ["tracking.register_models=false"])  # nothing registered: the check moves on
    assert "local folder" not in _one("mlflow-registry", _mlflow_registry, cfg, settings(), 30).detail


def test_preflight_fails_fast_naming_the_component(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the store should be")
    monkeypatch.setenv("RLPIPE_STORAGE_URI", str(blocker / "store"))
    with pytest.raises(PreflightError, match=r"object-store: .*not-a-folder.*fix: make .* a writable folder"):
        preflight(load_config(None, []), settings())


def test_a_run_whose_store_is_down_stops_at_preflight(prefect_harness, tmp_path):
    """`rlpipe run` with an unreachable S3 endpoint: exit 3 at once, naming the store and the fix; nothing ran."""
    from prefect.settings import PREFECT_API_URL

    from tests.flows.test_train_flow import _cli

    s3 = f"http://127.0.0.1:{free_port()}"
    env = {"RLPIPE_HOME": str(tmp_path), "RLPIPE_STORAGE_URI": "s3://rlpipe-doctor/runs", "RLPIPE_S3_ENDPOINT_URL": s3,
           "RLPIPE_S3_ACCESS_KEY_ID": "k", "RLPIPE_S3_SECRET_ACCESS_KEY": "s"}
    p = _cli(["run", "--run-id", "preflight-down", "--set", "rollout.engine=hf"], env, PREFECT_API_URL.value())
    assert p.returncode == 3, p.stdout[-2000:] + p.stderr[-3000:]
    assert "rlpipe run stopped: preflight failed — object-store: s3://rlpipe-doctor/runs" in p.stderr
    assert f"fix: start the S3 server behind {s3}" in p.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # no summary: nothing ran


def test_doctor_checks_the_services_the_config_names(tmp_path):
    """A dead rollout replica is named but not a failure while another answers (a run leaves it out); a
    trainer service that does not answer is a failure with its fix."""
    import threading

    import uvicorn
    from fastapi import FastAPI

    app = FastAPI()
    app.get("/health")(lambda: {"status": "ok"})
    port, dead = free_port(), f"http://127.0.0.1:{free_port()}"
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    live = f"http://127.0.0.1:{port}"
    try:
        from tests.helpers.waiting import wait_healthy

        wait_healthy(live, 10)
        cfg = tmp_path / "run.yaml"
        cfg.write_text(json.dumps({"services": {"rollout": [live, dead], "trainer": dead}}))
        p = _doctor([str(cfg), "--timeout-s", "30"], {}, tmp_path)
    finally:
        server.should_exit = True
    assert p.returncode == 1, p.stdout + p.stderr[-2000:]
    lines = p.stdout.splitlines()
    rollout = next(line for line in lines if "rollout-service" in line)
    assert rollout.startswith("ok") and "1 of 2 replica(s) answer" in rollout and f"DOWN (their prompts go to the others): rollout replica at {dead}" in rollout
    trainer = next(i for i, line in enumerate(lines) if line.startswith("FAIL  trainer"))
    assert dead in lines[trainer] and "rlpipe serve trainer" in lines[trainer + 1]
    assert not any("rollout-engine" in line for line in lines)  # no engine started here: the replicas are the engine
