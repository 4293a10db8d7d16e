"""`rlpipe report`: a real MLflow run with hand-written histories → the HTML page, read as text and in Chromium."""

import math
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlpipe.cli import app
from rlpipe.config import RunConfig, settings
from rlpipe.tracking.mlflow_utils import Tracker
from rlpipe.tracking.report import RunNotFound, build_report

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# Three iterations; the base policy's held-out accuracy at step -1. No validation_accuracy and no entropy:
# the one must be left out of its chart, the other's section must say "no data".
ITERATIONS = {
    0: {"reward_mean": 0.20, "accuracy": 0.25, "kl": 0.001, "kl_coef": 0.05, "response_length_mean": 5.0,
        "truncated_share": 0.50, "heldout_accuracy": 0.45, "status_ok": 0.75, "status_unparseable": 0.25,
        "time/generate_s": 2.0, "time/verify_s": 0.5, "time/update_s": 3.0, "time/sync_s": 0.25, "time/eval_s": 1.0,
        "time/save_s": 0.25, "time/iteration_s": 7.5, "time/iteration_total_s": 8.0,
        "alerts/memory_growth": 0.0, "alerts/kl_high": 0.0},
    1: {"reward_mean": 0.40, "accuracy": 0.50, "kl": float("nan"), "kl_coef": 0.05, "response_length_mean": 5.5,
        "truncated_share": 0.25, "heldout_accuracy": 0.50, "status_ok": 0.875, "status_unparseable": 0.125,
        "time/generate_s": 2.5, "time/verify_s": 0.5, "time/update_s": 3.0, "time/sync_s": 0.25, "time/eval_s": 1.0,
        "time/save_s": 0.25, "time/iteration_s": 8.0, "time/iteration_total_s": 8.5,
        "alerts/memory_growth": 0.0, "alerts/kl_high": 1.0},
    2: {"reward_mean": 0.70, "accuracy": 0.75, "kl": 0.004, "kl_coef": 0.05, "response_length_mean": 6.0,
        "truncated_share": 0.125, "heldout_accuracy": 0.60, "status_ok": 1.0, "status_unparseable": 0.0,
        "time/generate_s": 3.0, "time/verify_s": 0.5, "time/update_s": 3.0, "time/sync_s": 0.25, "time/eval_s": 1.0,
        "time/save_s": 0.25, "time/iteration_s": 8.5, "time/iteration_total_s": 9.0,
        "alerts/memory_growth": 1.0, "alerts/kl_high": 0.0},
}
# Points each polyline must have: kl's NaN at iteration 1 is not drawn; heldout_accuracy has the base too.
EXPECTED_POINTS = {"reward_mean": 3, "accuracy": 3, "heldout_accuracy": 4, "kl": 2, "kl_coef": 3,
                   "response_length_mean": 3, "truncated_share": 3}
HOSTILE = '<script>alert("x")</script> & <b>bold</b>'


@pytest.fixture(scope="module")
def run(rlpipe_home) -> dict:
    """A real MLflow run in the session's RLPIPE_HOME, made through Tracker like a training run's."""
    cfg = RunConfig.model_validate({"task": {"name": "report"}, "tracking": {"experiment": "report-test"},
                                    "train": {"total_iterations": 3}})
    tracker = Tracker(settings(), cfg)
    rid = tracker.start_run(cfg, "rl-report", "rl", dataset_version="d" * 64)
    tracker.log_metrics(rid, {"heldout_accuracy": 0.40}, -1)
    for k, metrics in ITERATIONS.items():
        tracker.log_metrics(rid, metrics, k)
    gens = [{"iteration": it, "prompt": f"{it + 2}+3=", "response": HOSTILE if it == 2 else str(it + 5),
             "ground_truth": str(it + 5), "status": "ok", "reward": 1.0} for it in (-1, 0, 1, 2)]
    tracker.log_table(rid, gens, "generations.json")
    alerts = [{"iteration": 1, "rule": "kl_high", "severity": "warning", "message": "kl 0.2 above max_kl 0.1 <x>"}]
    tracker.log_table(rid, alerts, "alerts.json")
    return {"mlflow_run_id": rid, "tracker": tracker}


@pytest.fixture(scope="module")
def report(run) -> Path:
    return build_report("rl-report", settings())


def section(page: str, key: str) -> str:
    found = re.search(rf'<section id="{key}" data-section="{key}">(.*?)</section>', page, re.S)
    assert found, f"section {key} missing"
    return found.group(1)


def test_report_has_every_section_from_mlflow(run, report):
    assert report == settings().run_dir("rl-report") / "report.html"
    page = report.read_text()
    for key in ("summary", "reward", "heldout", "kl", "entropy", "lengths", "stages", "verdicts", "alerts", "generations"):
        section(page, key)
    head = section(page, "summary")
    assert "rl-report" in head and run["mlflow_run_id"] in head and "grpo" in head
    assert "base 40.0% → final 60.0% (+20.0 points)" in head and "<td>3 of 3</td>" in head
    # A metric the run lacks is left out quietly; a section with nothing to show says so.
    assert 'data-series="validation_accuracy"' not in page and 'data-series="heldout_accuracy"' in page
    assert "no data" in section(page, "entropy") and "no data" not in section(page, "kl")
    assert "1 non-finite value(s) not drawn" in section(page, "kl")
    for series, n in EXPECTED_POINTS.items():
        points = re.search(rf'<polyline data-series="{re.escape(series)}" points="([^"]+)"', page).group(1)
        assert len(points.split()) == n, series
    # Stage times: 3 bars; overhead is the parent's total less every stage (8.0 - 7.0 at iteration 0).
    stages = section(page, "stages")
    assert stages.count('<rect data-series="generate"') == 3 and "overhead, 0: 1 s (12%)" in stages
    assert re.search(r'<td>generate</td><td class="num">7.50</td><td class="num">29.4%</td>', stages)
    assert re.search(r'<tr class="total"><td>total</td><td class="num">25.50</td>', stages)
    verdicts = section(page, "verdicts")
    assert verdicts.count('<rect data-series="status_ok"') == 3 and verdicts.count('<rect data-series="status_unparseable"') == 2


def test_report_alerts_generations_and_escaping(run, report):
    page = report.read_text()
    alerts = section(page, "alerts")
    # kl_high is in alerts.json and its metric: listed once, with the table's message; memory_growth only as a metric.
    assert alerts.count("<td>kl_high</td>") == 1 and "kl 0.2 above max_kl 0.1 &lt;x&gt;" in alerts
    assert "<td>memory_growth</td><td>alert</td><td>metric alerts/memory_growth = 1</td>" in alerts
    gens = section(page, "generations")
    assert [int(x) for x in re.findall(r'data-iteration="(-?\d+)"', gens)] == [-1, 0, 1, 2]
    assert "base policy (before training)" in gens
    assert html_escaped(HOSTILE) in gens and "<script" not in page and "<b>bold" not in page
    # Self-contained: nothing fetched from anywhere, no links.
    for word in ("http:", "https:", "src=", "href", "@import", "url(", "<link", "<img"):
        assert word not in page, word
    logged = {a.path for a in run["tracker"].client.list_artifacts(run["mlflow_run_id"])}
    assert {"report.html", "generations.json", "alerts.json"} <= logged


def html_escaped(text: str) -> str:
    import html

    return html.escape(text, quote=True)


def test_report_by_mlflow_id_newest_first_and_unknown_ids(run, tmp_path):
    client = run["tracker"].client
    out = build_report(run["mlflow_run_id"], settings(), tmp_path / "by-id.html", log=False)
    assert "base 40.0% → final 60.0%" in out.read_text()
    # The same rlpipe run id twice (a run redone in another experiment): the newest MLflow run is reported.
    exp = run["tracker"].experiment_id("report-test-other")
    old = client.create_run(exp, start_time=1_000, tags={"rlpipe.run_id": "rl-twice"}).info.run_id
    new = client.create_run(exp, start_time=2_000, tags={"rlpipe.run_id": "rl-twice"}).info.run_id
    page = build_report("rl-twice", settings(), tmp_path / "twice.html", log=False).read_text()
    assert new in page and old not in page and page.count("no data") == 9  # every section but the summary
    with pytest.raises(RunNotFound, match=r"'rl-nope'.*at sqlite:///.*mlflow\.db"):
        build_report("rl-nope", settings(), tmp_path / "nope.html")
    with pytest.raises(RunNotFound, match=r"no MLflow store at sqlite:///.*elsewhere"):
        build_report("rl-report", settings({"RLPIPE_HOME": str(tmp_path / "elsewhere")}))
    assert not (tmp_path / "elsewhere").exists()  # looking created nothing


def test_report_command(run, tmp_path):
    out = tmp_path / "cli" / "r.html"
    res = CliRunner().invoke(app, ["report", "rl-report", "--out", str(out), "--no-log"])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == str(out) and out.stat().st_size > 10_000
    res = CliRunner().invoke(app, ["report", "rl-missing"])
    assert res.exit_code == 2 and "rlpipe report: run 'rl-missing'" in res.output


def test_report_renders_in_headless_chromium(report, tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (`apt-get install chromium`; "
                    "scripts/install.sh does it when run as root)")
    from playwright.sync_api import sync_playwright

    errors, requests = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.route("**/*", lambda route: _only_files(route, requests))
            page.goto(report.as_uri(), wait_until="load")
            boxes = _check_curves(page)
            assert page.locator('rect[data-series="overhead"]').count() == 3
            tip = page.locator('circle[data-series="heldout_accuracy"] > title').first.text_content()
            assert tip == "heldout_accuracy, base: 0.4"
            shot = tmp_path / "report.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert not errors, errors
    assert requests == [report.as_uri()], requests
    _check_not_blank(shot, boxes["reward_mean"])


def _only_files(route, requests: list[str]) -> None:
    """Every request is recorded; anything but a file is refused (the machine may have a network)."""
    requests.append(route.request.url)
    if route.request.url.startswith("file://"):
        route.continue_()
    else:
        route.abort()


def _check_curves(page) -> dict:
    boxes = {}
    for series, n in EXPECTED_POINTS.items():
        line = page.locator(f'polyline[data-series="{series}"]')
        assert line.count() == 1, series
        assert len(line.get_attribute("points").split()) == n, series
        assert page.locator(f'circle[data-series="{series}"]').count() == n, series
        box = line.bounding_box()
        assert box and box["width"] > 0 and box["height"] > 0, (series, box)
        boxes[series] = box
    assert page.locator('polyline[data-series="validation_accuracy"]').count() == 0
    return boxes


def _check_not_blank(shot: Path, box: dict) -> None:
    """Not a white page: many colours overall, and reward_mean's blue where its line is."""
    from PIL import Image

    img = Image.open(shot).convert("RGB")
    assert img.width >= 1000 and img.height > 2000
    assert len(img.getcolors(maxcolors=1 << 20) or []) > 50
    crop = img.crop((int(box["x"]), int(box["y"]), math.ceil(box["x"] + box["width"]), math.ceil(box["y"] + box["height"])))
    assert any(abs(r - 0x1F) < 40 and abs(g - 0x77) < 40 and abs(b - 0xB4) < 40 for r, g, b in crop.getdata())
