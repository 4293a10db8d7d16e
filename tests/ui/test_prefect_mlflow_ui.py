"""What a person does in the two UIs, in Debian's Chromium driven by Playwright: start the `train`
deployment from the Prefect UI's form with one parameter changed, watch the run and its `rl-iteration`
flow runs complete, then find the registered version (aliases, lineage tags) and two runs side by side
in the MLflow UI. Real servers on 127.0.0.1: Prefect, MLflow (sqlite + proxied artifacts), SeaweedFS S3
(the store: an MLflow server registers checkpoints from s3://, as `rlpipe stack up` sets it up), and a
process worker (`--run-once`). Its screenshots go to the test's own folder; with
RLPIPE_UPDATE_SCREENSHOTS=1 to docs/images/ for the README (so a test run leaves the checkout as it was)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from rlpipe.config import load_config
from rlpipe.net import free_port
from tests.flows.test_train_flow import even_task, rl_overrides  # noqa: F401 - fixture re-used
from tests.helpers.prefect_server import PREFECT, ROOT, PrefectServer, prefect_server, wait_healthy

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
MLFLOW = str(Path(sys.executable).with_name("mlflow"))
DOCS_IMAGES = ROOT / "docs" / "images"
TASK = "uidemo"                     # registered model rlpipe-uidemo, MLflow experiment uidemo
UI_RUN, CLI_RUN = "rl-from-the-ui", "rl-from-the-cli"
WORKER_TIMEOUT_S = 600


_T0 = [time.monotonic()]
_IMAGES = [DOCS_IMAGES]  # where this run's screenshots go (set by the test)


def _shot(page: Any, name: str) -> None:
    page.screenshot(path=_IMAGES[0] / name)


def _step(what: str) -> None:
    print(f"[{time.monotonic() - _T0[0]:6.1f} s] {what}", flush=True)


def test_start_train_from_the_prefect_ui_and_find_it_in_mlflow(tiny_checkpoint, even_task, s3_server, tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (`apt-get install chromium`)")
    from playwright.sync_api import sync_playwright

    _T0[0] = time.monotonic()
    _IMAGES[0] = DOCS_IMAGES if os.environ.get("RLPIPE_UPDATE_SCREENSHOTS") == "1" else tmp_path / "images"
    _IMAGES[0].mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, rl_overrides(tiny_checkpoint, TASK, "hf", even_task, iterations=2))
    recipe = cfg.model_dump(mode="json")
    procs: list[subprocess.Popen] = []
    try:
        _step("fixtures ready (tiny checkpoint, S3)")
        mlflow_url = _start_mlflow(tmp_path / "mlflow", procs)  # starts while the Prefect server starts
        with prefect_server(tmp_path) as server, sync_playwright() as p:
            wait_healthy(f"{mlflow_url}/health", procs[0], "mlflow server", log=tmp_path / "mlflow" / "mlflow.log")
            _step("Prefect and MLflow servers up")
            env = server.env | s3_server.env() | {
                "RLPIPE_TRACKING_URI": mlflow_url, "RLPIPE_HOME": str(tmp_path / "rlpipe-home"),
                "RLPIPE_STORAGE_URI": f"s3://{s3_server.bucket}/ui-{uuid.uuid4().hex[:8]}",
                "OMP_NUM_THREADS": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true",
            }
            # The deployment of prefect.yaml, its default parameters the tiny recipe: what the form shows.
            _cli(env, "work-pool", "create", "rlpipe-local", "--type", "process")
            _cli(env, "--no-prompt", "deploy", "--name", "train", "--params", json.dumps({"config": recipe}))
            deployment = server.get("/deployments/name/rl-train/train")
            assert deployment["parameters"]["config"] == recipe

            _step("deployed")
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            prefect_ui = server.api.removesuffix("/api")
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            flow_run_id = _run_from_the_form(page, prefect_ui, str(tiny_checkpoint))

            # The run the form created: the changed parameter, the rest the deployment's recipe, not started.
            created = server.flow_run(flow_run_id)
            all_runs = server.post("/flow_runs/filter", {})
            assert [r["id"] for r in all_runs] == [flow_run_id], all_runs  # one submit, one run
            assert created["deployment_id"] == deployment["id"] and created["state_type"] == "SCHEDULED"
            assert created["parameters"]["run_id"] == UI_RUN
            assert created["parameters"]["config"] == recipe

            _step("flow run created from the form")
            worker = _worker(env, tmp_path / "worker-ui.log", procs)
            iter_ids = _watch_the_run(page, server, flow_run_id, worker, tmp_path / "worker-ui.log")
            assert worker.wait(60) == 0, _tail(tmp_path / "worker-ui.log")
            _step("run and iterations Completed in the UI")
            summary = json.loads((tmp_path / "rlpipe-home" / "runs" / UI_RUN / "summary.json").read_text())
            assert summary["iterations_done"] == 2 and summary["registered_model"]["version"] == "2"

            # A second, shorter run of the same deployment from the CLI, registering nothing: the second
            # run of the compare view. It runs while the browser reads the registry.
            second = recipe | {"train": recipe["train"] | {"total_iterations": 1},
                               "tracking": recipe["tracking"] | {"register_models": False}}
            _cli(env, "deployment", "run", "rl-train/train", "--params", json.dumps({"config": second, "run_id": CLI_RUN}))
            worker2 = _worker(env, tmp_path / "worker-cli.log", procs)

            ml_ctx = browser.new_context(viewport={"width": 1400, "height": 1100})
            # MLflow 3's assistant panel opens itself on a first visit and covers a third of the page.
            ml_ctx.add_init_script("window.localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false');"
                                   "window.localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');")
            ml_page = ml_ctx.new_page()
            _registered_version(ml_page, mlflow_url, summary, iter_ids[1])

            _step("registered version checked in the MLflow UI")
            assert worker2.wait(WORKER_TIMEOUT_S) == 0, _tail(tmp_path / "worker-cli.log")
            runs = server.post("/flow_runs/filter", {"flow_runs": {"name": {"any_": [CLI_RUN]}}})
            assert [r["state_type"] for r in runs] == ["COMPLETED"], runs
            summary2 = json.loads((tmp_path / "rlpipe-home" / "runs" / CLI_RUN / "summary.json").read_text())
            assert summary2["iterations_done"] == 1 and summary2["registered_model"]["version"] is None
            _compare_runs(ml_page, {UI_RUN: summary["mlflow_run_id"], CLI_RUN: summary2["mlflow_run_id"]})
            _step("compare view checked")
            browser.close()
    finally:
        for proc in reversed(procs):
            _stop(proc)


# -- Prefect -----------------------------------------------------------------------------------------

def _run_from_the_form(page: Any, ui: str, checkpoint: str) -> str:
    """Deployments → train → Run → Custom run; run_id changed, submitted; the new flow run's id."""
    from playwright.sync_api import expect

    page.goto(f"{ui}/deployments")
    page.get_by_role("link", name="train", exact=True).click()
    expect(page.get_by_text("flows/train.py:train")).to_be_visible(timeout=30_000)
    page.get_by_role("button", name="Run", exact=True).click()
    page.get_by_text("Custom run", exact=True).click()
    expect(page).to_have_url(re.compile(r"/deployments/deployment/[0-9a-f-]+/run"), timeout=30_000)
    # The form shows the deployment's defaults: the tiny recipe, not the class defaults.
    expect(_form_field(page, "Policy Model (Optional)")).to_have_value(checkpoint, timeout=30_000)
    run_id = _form_field(page, "run_id (Optional)")
    expect(run_id).to_have_value("")
    run_id.fill(UI_RUN)
    run_id.scroll_into_view_if_needed()
    expect(run_id).to_have_value(UI_RUN)
    _shot(page, "prefect-ui-train-form.png")
    page.get_by_role("button", name="Submit", exact=True).click()
    # The toast "<run> scheduled to start now [View run]". The UI renders it more than once, one copy over
    # the other: the last one in #prefect-design-toast-app takes the click.
    toast = page.locator("#prefect-design-toast-app .toast-flow-run-create").last
    expect(toast).to_contain_text(re.compile(r"scheduled\s+to start\s+now"), timeout=30_000)
    view_run = toast.get_by_role("button", name="View run")
    view_run.click()
    expect(page).to_have_url(re.compile(r"/runs/flow-run/[0-9a-f-]{36}"), timeout=30_000)
    return page.url.split("/runs/flow-run/")[1].split("?")[0]


def _form_field(page: Any, label: str) -> Any:
    """The input of the schema form's property whose label reads ``label`` (the form's <label for> names
    no input, so Playwright's get_by_label finds nothing)."""
    title = page.locator("span.schema-form-property__label", has_text=re.compile(f"^{re.escape(label)}$"))
    prop = title.locator("xpath=ancestor::div[contains(concat(' ', normalize-space(@class), ' '), ' schema-form-property ')][1]")
    return prop.locator(".p-label__body").first.locator("textarea, input").first


def _reload(page: Any) -> None:
    """Reload the page without waiting for its "load" event: under the suite's load the Prefect UI's
    assets can take longer than any fixed wait, and the badge read that follows waits for the page itself.
    A reload that times out or is aborted (the UI's own navigation can detach the frame) is retried on the next
    turn of the caller's loop, up to its deadline."""
    from playwright.sync_api import Error as PlaywrightError

    try:
        page.reload(wait_until="commit", timeout=60_000)
    except PlaywrightError:  # TimeoutError included
        pass


def _watch_the_run(page: Any, server: PrefectServer, flow_run_id: str, worker: subprocess.Popen, log: Path) -> list[str]:
    """On the flow run's page while the worker runs it: reload until its badge says Completed; then the
    Subflow Runs tab lists both rl-iteration runs, Completed. Their flow run ids, iteration order."""
    from playwright.sync_api import expect

    heading = page.locator("header.page-heading-flow-run")
    badge = heading.locator(".state-badge")
    seen: list[str] = []
    deadline, worker_gone = time.monotonic() + WORKER_TIMEOUT_S, None
    while True:
        try:
            text = badge.inner_text(timeout=10_000).strip()
        except Exception:  # noqa: BLE001 - the page is (re)loading
            text = ""
        if text and (not seen or seen[-1] != text):
            seen.append(text)
        if text == "Completed":
            break
        if worker_gone is None and worker.poll() is not None:
            worker_gone = time.monotonic()
        late = time.monotonic() > deadline or (worker_gone is not None and time.monotonic() - worker_gone > 30)
        if text in ("Failed", "Crashed", "Cancelled") or late:
            pytest.fail(f"flow run {flow_run_id} is {text or 'not shown'} in the UI (states seen: {seen}); "
                        f"worker exit code {worker.poll()}:\n{_tail(log)}")
        time.sleep(3)
        _reload(page)
    print(f"states the flow run page showed: {seen}")
    # The flow renamed its run to its run_id parameter (flow_run_name="{run_id}").
    expect(heading.locator(".p-bread-crumbs")).to_contain_text(UI_RUN)
    page.locator(".p-tab", has_text="Subflow Runs").click()
    expect(page).to_have_url(re.compile(r"tab=Subflow"))
    expect(page.get_by_text("2 Flow runs", exact=True)).to_be_visible(timeout=30_000)
    for k in (0, 1):
        card = page.locator(".flow-run-list-item").filter(has=page.get_by_role("link", name=f"{UI_RUN}-iter-{k}", exact=True))
        expect(card).to_contain_text("rl-iteration", timeout=30_000)
        expect(card.locator(".state-badge")).to_have_text("Completed")
    _shot(page, "prefect-ui-train-run.png")

    done = server.flow_run(flow_run_id)
    assert done["name"] == UI_RUN and done["state_type"] == "COMPLETED", done
    iters = server.post("/flow_runs/filter", {"flow_runs": {"name": {"any_": [f"{UI_RUN}-iter-0", f"{UI_RUN}-iter-1"]}}})
    by_name = {r["name"]: r for r in iters}
    assert sorted(by_name) == [f"{UI_RUN}-iter-0", f"{UI_RUN}-iter-1"], sorted(by_name)
    for r in iters:
        assert r["state_type"] == "COMPLETED" and r["parent_task_run_id"], r
    return [by_name[f"{UI_RUN}-iter-{k}"]["id"] for k in (0, 1)]


# -- MLflow ------------------------------------------------------------------------------------------

def _registered_version(page: Any, mlflow_url: str, summary: dict[str, Any], iter1_flow_run_id: str) -> None:
    """The model's page: versions 1 and 2, @last on 2; version 2's page: alias, source run, lineage tags."""
    from playwright.sync_api import expect

    name = f"rlpipe-{TASK}"
    page.goto(f"{mlflow_url}/#/models/{name}")
    expect(page.get_by_role("heading", name=name)).to_be_visible(timeout=60_000)
    v1 = page.get_by_role("row").filter(has=page.get_by_role("link", name="Version 1", exact=True))
    v2 = page.get_by_role("row").filter(has=page.get_by_role("link", name="Version 2", exact=True))
    expect(v2.locator('[title="last"]')).to_be_visible(timeout=30_000)
    expect(v1).to_contain_text(f"run_id: {UI_RUN}")
    expect(v1.locator('[title="last"]')).to_have_count(0)

    page.get_by_role("link", name="Version 2", exact=True).click()
    expect(page.get_by_role("heading", name="Version 2")).to_be_visible(timeout=30_000)
    expect(page.get_by_role("link", name=UI_RUN, exact=True)).to_be_visible()  # Source Run: the MLflow run's name
    expect(page.locator('[data-testid="descriptions-item"]', has_text="Aliases").locator('[title="last"]')).to_be_visible()
    tags = {"run_id": UI_RUN, "iteration": "1", "parent_version": "1", "kind": "policy",
            "config_fingerprint": summary["config_fingerprint"], "dataset_version": summary["dataset_version"],
            "weights_sha256": summary["final_policy_version"], "mlflow_run_id": summary["mlflow_run_id"],
            "prefect_flow_run_id": iter1_flow_run_id}
    for key, value in tags.items():
        row = page.get_by_role("row").filter(has=page.get_by_role("cell", name=key, exact=True))
        expect(row.get_by_role("cell").nth(1)).to_have_text(value)
    # The tag table scrolls inside 280 px: show the lineage rows (mlflow_run_id … run_id) in the screenshot.
    page.get_by_role("row").filter(has=page.get_by_role("cell", name="mlflow_run_id", exact=True)).evaluate(
        "row => row.closest('.du-bois-light-table-body').scrollTop = row.offsetTop")
    _shot(page, "mlflow-model-version.png")


def _compare_runs(page: Any, runs: dict[str, str]) -> None:
    """Experiments → Model training → the experiment's runs; tick both, Compare."""
    from playwright.sync_api import expect

    page.get_by_role("link", name="Experiments", exact=True).first.click()
    page.get_by_text("Model training", exact=True).click()  # MLflow 3 opens on the GenAI view
    page.get_by_role("link", name=TASK, exact=True).click()
    for run_name in runs:
        row = page.get_by_role("row").filter(has=page.get_by_role("link", name=run_name, exact=True))
        row.locator("input.ag-checkbox-input").check(timeout=60_000)
    page.get_by_role("button", name="Compare", exact=True).click()
    expect(page.get_by_text("Comparing 2 Runs from 1 Experiment")).to_be_visible(timeout=60_000)
    assert all(run_uuid in page.url for run_uuid in runs.values()), page.url
    names = page.get_by_role("row").filter(has=page.get_by_role("rowheader", name="Run Name:", exact=True))
    for run_name in runs:
        expect(names).to_contain_text(run_name)
    # The parameters in which they differ, the plots folded away: the view for the README.
    page.get_by_text("Visualizations", exact=True).click()
    page.get_by_role("switch", name="Parameters - Show diff only").click()
    iterations = page.get_by_role("row").filter(has=page.get_by_role("rowheader", name="train.total_iterations", exact=True))
    expect(iterations.get_by_role("cell")).to_have_count(2)
    columns = dict(zip(names.get_by_role("cell").all_inner_texts(), iterations.get_by_role("cell").all_inner_texts()))
    assert {k.strip(): v.strip() for k, v in columns.items()} == {UI_RUN: "2", CLI_RUN: "1"}, columns
    _shot(page, "mlflow-compare-runs.png")


# -- processes ---------------------------------------------------------------------------------------

def _start_mlflow(folder: Path, procs: list[subprocess.Popen]) -> str:
    """Start `mlflow server` as `rlpipe stack up` does (stopped by its process group); its URL."""
    folder.mkdir(parents=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (folder / "mlflow.log").open("w")
    procs.append(subprocess.Popen(
        [MLFLOW, "server", "--host", "127.0.0.1", "--port", str(port), "--backend-store-uri",
         f"sqlite:///{folder / 'mlflow.db'}", "--artifacts-destination", str(folder / "mlartifacts"), "--workers", "1"],
        env=os.environ | {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}, cwd=folder,
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return url


def _cli(env: dict[str, str], *args: str, timeout: float = 300) -> str:
    p = subprocess.run([PREFECT, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"prefect {' '.join(args)[:200]}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def _worker(env: dict[str, str], log: Path, procs: list[subprocess.Popen]) -> subprocess.Popen:
    """`prefect worker start --pool rlpipe-local --run-once`: runs what is scheduled now, then exits."""
    proc = subprocess.Popen([PREFECT, "worker", "start", "--pool", "rlpipe-local", "--run-once"], env=env, cwd=ROOT,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    procs.append(proc)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else f"({path} missing)"
