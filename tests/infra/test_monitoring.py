"""infra/prometheus and infra/grafana, checked offline: every metric name a rule or a dashboard queries is one the
services export (read from the code, so renaming a metric breaks this test), the rules pass ``promtool check
rules`` and their unit tests (each alert fires past its threshold and stays quiet just inside it), the
Prometheus config passes ``promtool check config``, and the compose file provisions both. promtool comes from
Debian's ``prometheus`` package (``make test`` installs it through scripts/install.sh); without it the promtool
tests skip, saying so. Nothing here starts Prometheus or Grafana (no Docker daemon on the machines that ran it)."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rlpipe.services._common import Counters, _ServiceCollector
from rlpipe.tracking import prom_push

ROOT = Path(__file__).resolve().parents[2]
PROM, GRAFANA = ROOT / "infra" / "prometheus", ROOT / "infra" / "grafana"
SERVICES = ROOT / "src" / "rlpipe" / "services"
RULES = sorted((PROM / "rules").glob("*.yml"))
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
PROMETHEUS_OWN = {"up"}  # series Prometheus makes itself for every target
RUN_PUSHED = set(prom_push.EXPORTED)  # a run's metrics, pushed to the Pushgateway (rlpipe.tracking.prom_push)
NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install "
                                    "prometheus; `make test` installs it through scripts/install.sh)")


# -- what the services export, read from their code --------------------------------------------------------
def _strings(node: ast.AST) -> list[str]:
    """The snapshot keys a ``metrics()`` or ``histograms()`` body builds: dict-literal keys, ``values(...)``'s
    string arguments, and ``percentiles(prefix)``'s two keys."""
    keys = []
    for n in ast.walk(node):
        if isinstance(n, ast.Dict):
            keys += [k.value for k in n.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            args = [a.value for a in n.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if n.func.attr == "values":
                keys += args
            elif n.func.attr == "percentiles":
                keys += [f"{args[0] if args else 'latency'}_{q}_s" for q in ("p50", "p99")]
    return keys


def _service_of(tree: ast.Module) -> tuple[str, list[str], list[str]]:
    """(name, snapshot keys, histogram names) of the service a module defines: the name its ``service_app``
    call gives, the keys of its class's ``metrics()``, the histograms of its ``histograms()`` (QueueWorker's
    ``request_seconds`` when it inherits that)."""
    app = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "service_app")
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef)
               and any(isinstance(f, ast.FunctionDef) and f.name == "metrics" for f in n.body))
    methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
    hists = _strings(methods["histograms"]) if "histograms" in methods else ["request_seconds"]
    return app.args[1].value, _strings(methods["metrics"]), hists


class _Numbers:
    """A service's snapshot shape (its keys, zeros) for the real exporter, ``_ServiceCollector``: the names
    come out as /metrics writes them (counters ``_total``, histograms ``_bucket``/``_sum``/``_count``)."""

    def __init__(self, keys: list[str], hists: list[str]):
        self.keys, self.hists = keys, hists

    def health(self) -> dict:
        return {"status": "ok"}

    def metrics(self) -> dict:
        return dict.fromkeys(self.keys, 0)

    def histograms(self) -> dict:
        return {h: Counters() for h in self.hists}


def sample_names(text: str) -> set[str]:
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def exported() -> dict[str, set[str]]:
    """service → the sample names its /metrics has, from the code of src/rlpipe/services/."""
    out = {}
    for path in sorted(SERVICES.glob("*.py")):
        tree = ast.parse(path.read_text())
        if "service_app" not in {getattr(n.func, "id", "") for n in ast.walk(tree) if isinstance(n, ast.Call)}:
            continue
        name, keys, hists = _service_of(tree)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_ServiceCollector(name, _Numbers(keys, hists)))
        out[name] = sample_names(generate_latest(registry).decode())
    return out


EXPORTED = exported()
ALL_EXPORTED = set().union(*EXPORTED.values())


def test_the_code_reading_sees_every_service():
    assert set(EXPORTED) == {"verifier", "reward_model", "rollout", "trainer", "env"}
    assert {"rlpipe_verifier_requests_total", "rlpipe_verifier_queue", "rlpipe_verifier_max_queue",
            "rlpipe_verifier_request_seconds_bucket", "rlpipe_env_failures_total", "rlpipe_env_step_seconds_count",
            "rlpipe_trainer_up", "rlpipe_rollout_in_flight"} <= ALL_EXPORTED
    assert "rlpipe_env_queue" not in ALL_EXPORTED and "rlpipe_verifier_latency_p99_s" not in ALL_EXPORTED


def test_the_code_reading_matches_what_real_services_export():
    """The two services cheap to build for real: their /metrics has exactly the names read from the code."""
    from fastapi.testclient import TestClient

    from rlpipe.envs.sandboxed import SandboxOptions
    from rlpipe.services.env import EnvService
    from rlpipe.services.env import create_app as env_app
    from rlpipe.services.verifier import VerifierService
    from rlpipe.services.verifier import create_app as verifier_app

    verifier = VerifierService(workers=1)
    try:
        assert sample_names(TestClient(verifier_app(verifier)).get("/metrics").text) == EXPORTED["verifier"]
    finally:
        verifier.close()
    env = EnvService(SandboxOptions(), workers=1, max_queue=1)
    assert sample_names(TestClient(env_app(env)).get("/metrics").text) == EXPORTED["env"]


# -- the names rules and dashboards query ------------------------------------------------------------------
def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers outside strings, label matchers, ranges and
    grouping clauses, that are not functions, aggregations or keywords."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in NAME.finditer(expr):
        tail = expr[m.end():].lstrip()
        word = m.group(0)
        if tail.startswith("(") or word in {"and", "or", "unless", "bool", "offset"} or re.fullmatch(r"\d.*", word):
            continue
        if expr[max(m.start() - 1, 0)].isdigit():  # the e of 1e3, a duration's unit
            continue
        names.add(word)
    return names


def rule_docs() -> list[tuple[Path, dict]]:
    return [(p, yaml.safe_load(p.read_text())) for p in RULES]


def recorded() -> set[str]:
    return {r["record"] for _, doc in rule_docs() for g in doc["groups"] for r in g["rules"] if "record" in r}


def dashboard_exprs(dash: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every Prometheus query of a dashboard, rows' nested panels included."""
    out = []
    for panel in dash["panels"] + [p for row in dash["panels"] for p in row.get("panels", [])]:
        out += [(panel["title"], t["expr"]) for t in panel.get("targets", [])]
    return out


def unknown_names(exprs: list[tuple[str, str]], known: set[str]) -> list[str]:
    return [f"{where}: {name}" for where, expr in exprs for name in sorted(metric_names(expr) - known)]


def test_metric_names_are_read_from_promql():
    assert metric_names('sum by (service) (rate(rlpipe_x_total{job=~"a.+"}[5m])) / on (job) rlpipe_y > 1e3') == \
        {"rlpipe_x_total", "rlpipe_y"}
    assert metric_names('histogram_quantile(0.99, sum by (le) (rate(rlpipe_z_bucket[5m])))') == {"rlpipe_z_bucket"}
    assert metric_names("rlpipe_service:queue_fill > 0.8 and up == 0") == {"rlpipe_service:queue_fill", "up"}


def test_rules_read_only_exported_metrics():
    exprs = [(f"{p.name}: {r.get('record') or r.get('alert')}", r["expr"])
             for p, doc in rule_docs() for g in doc["groups"] for r in g["rules"]]
    assert len(exprs) > 20 and unknown_names(exprs, ALL_EXPORTED | recorded() | PROMETHEUS_OWN) == []
    # Each alert's threshold applies to every service that has the signal: a service left out of a recording
    # rule would be a service no alert watches.
    record_rules = [r for _, doc in rule_docs() for g in doc["groups"] for r in g["rules"] if "record" in r]
    for signal in ("rlpipe_service:up", "rlpipe_service:errors:rate5m", "rlpipe_service:request_seconds:p99_5m"):
        assert {r["labels"]["service"] for r in record_rules if r["record"] == signal} == set(EXPORTED), signal
    with_queue = {s for s, names in EXPORTED.items() if f"rlpipe_{s}_queue" in names}
    assert {r["labels"]["service"] for r in record_rules if r["record"] == "rlpipe_service:queue_fill"} == with_queue


@pytest.mark.parametrize("path", DASHBOARDS, ids=[p.stem for p in DASHBOARDS])
def test_dashboards_query_only_exported_or_recorded_metrics(path):
    dash = json.loads(path.read_text())
    exprs = dashboard_exprs(dash)
    assert exprs and unknown_names(exprs, ALL_EXPORTED | RUN_PUSHED | recorded() | PROMETHEUS_OWN) == []
    datasources = {t["datasource"]["uid"] for p in dash["panels"] for t in p.get("targets", [])}
    provisioned = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert datasources == {d["uid"] for d in provisioned["datasources"]}
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"].startswith("rlpipe-")


def test_a_renamed_metric_is_caught():
    dash = json.loads((GRAFANA / "dashboards" / "rlpipe-run.json").read_text())
    exprs = [(w, e.replace("rlpipe_rollout_tokens_total", "rlpipe_rollout_generated_tokens_total"))
             for w, e in dashboard_exprs(dash)]
    assert unknown_names(exprs, ALL_EXPORTED | RUN_PUSHED | recorded()) == \
        ["Rollout: tokens generated per second: rlpipe_rollout_generated_tokens_total"]


def test_services_dashboard_covers_what_the_issue_asks():
    exprs = " ".join(e for _, e in dashboard_exprs(json.loads((GRAFANA / "dashboards" / "rlpipe-services.json").read_text())))
    for signal in ("requests:rate5m", "errors:rate5m", "p50_5m", "p99_5m", "rlpipe_service:queue", "in_flight",
                   "rlpipe_service:up", "up{"):
        assert signal in exprs, signal


# -- promtool ----------------------------------------------------------------------------------------------
def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120)


@needs_promtool
def test_promtool_checks_the_rules():
    got = _promtool("check", "rules", *map(str, RULES))
    assert got.returncode == 0 and "SUCCESS" in got.stdout, got.stdout + got.stderr


@needs_promtool
def test_promtool_unit_tests_pass():
    tests = sorted((PROM / "tests").glob("*.yml"))
    assert tests
    got = _promtool("test", "rules", *map(str, tests))
    assert got.returncode == 0 and "SUCCESS" in got.stdout, got.stdout + got.stderr


@needs_promtool
@pytest.mark.parametrize("old,new", [("> 0.05", "> 0.06"), ("> 0.8", "> 0.79"), ("> 30", "> 29.8")])
def test_promtool_unit_tests_fail_when_a_threshold_moves(tmp_path, old, new):
    """Each unit test pins its threshold from both sides: moved one way an alert goes quiet, the other way
    the case just inside fires."""
    (tmp_path / "rules").mkdir()
    text = (PROM / "rules" / "rlpipe-services.yml").read_text()
    assert text.count(old) == 1
    (tmp_path / "rules" / "rlpipe-services.yml").write_text(text.replace(old, new))
    (tmp_path / "tests").mkdir()
    shutil.copy(PROM / "tests" / "rlpipe-services.test.yml", tmp_path / "tests")
    got = _promtool("test", "rules", str(tmp_path / "tests" / "rlpipe-services.test.yml"))
    assert got.returncode != 0 and "FAILED" in got.stdout + got.stderr


def test_run_dashboard_charts_what_the_issue_asks():
    """The run's own metrics, not only the services' view: reward, accuracy, KL, loss and grad norm, entropy and
    response length, stage seconds, GPU memory and utilisation, the alert flags, for a chosen run."""
    dash = json.loads((GRAFANA / "dashboards" / "rlpipe-run.json").read_text())
    exprs = " ".join(e for _, e in dashboard_exprs(dash))
    for key in ('"reward_mean"', '"accuracy"', '"kl"', '"loss"', '"grad_norm"', '"entropy"', '"response_length_mean"',
                '"time/(generate|verify|update|eval|overhead)_s"', '_mem_bytes"', '_util"', '"alerts/.+"'):
        assert key in exprs, key
    assert all('run_id=~"$run_id"' in e for _, e in dashboard_exprs(dash) if "rlpipe_run_" in e)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert "label_values(rlpipe_run_metric" in variables["run_id"]["definition"]
    assert not [p for p in dash["panels"] if p["type"] == "text" and "not to Prometheus" in p["options"]["content"]]


@needs_promtool
def test_promtool_checks_the_config(tmp_path):
    """The config as compose mounts it, with its paths moved here: the token files (compose secrets) and the
    rules folder."""
    for name in ("verifier_token", "trainer_token", "rollout_token"):
        (tmp_path / name).write_text("t\n")
    text = (PROM / "prometheus.yml").read_text()
    text = text.replace("/run/secrets/", f"{tmp_path}/").replace("/etc/prometheus/rules/", f"{PROM / 'rules'}/")
    (tmp_path / "prometheus.yml").write_text(text)
    got = _promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert got.returncode == 0 and "SUCCESS" in got.stdout, got.stdout + got.stderr
    assert f"{len(RULES)} rule files found" in got.stdout or "rule files found" in got.stdout


# -- compose -----------------------------------------------------------------------------------------------
def test_compose_provisions_prometheus_and_grafana():
    doc = yaml.safe_load((ROOT / "infra" / "compose.yaml").read_text())
    prom, graf = doc["services"]["prometheus"], doc["services"]["grafana"]
    for svc in (prom, graf):
        image = svc["image"]
        assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", image), f"{image}: not pinned by a version tag"
        for vol in svc["volumes"]:
            src = vol.split(":")[0]
            if src.startswith("./"):
                assert (ROOT / "infra" / src).exists(), vol
    mounts = {v.split(":")[1]: v.split(":")[0] for v in prom["volumes"]}
    config = yaml.safe_load((ROOT / "infra" / mounts["/etc/prometheus/prometheus.yml"]).read_text())
    assert config["rule_files"] == ["/etc/prometheus/rules/*.yml"] and mounts["/etc/prometheus/rules"] == "./prometheus/rules"
    # Prometheus holds the token of every service it scrapes, and reaches them (same network).
    for job in config["scrape_configs"]:
        token = job.get("authorization", {}).get("credentials_file")
        if token:
            assert token.removeprefix("/run/secrets/") in prom["secrets"], job["job_name"]
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "rlpipe.yml").read_text())
    graf_mounts = {v.split(":")[1]: v.split(":")[0] for v in graf["volumes"]}
    assert graf_mounts[provider["providers"][0]["options"]["path"]] == "./grafana/dashboards"
    assert graf_mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"
    assert graf["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"
    datasource = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


def test_compose_runs_a_pushgateway_that_prometheus_scrapes_and_the_worker_pushes_to():
    doc = yaml.safe_load((ROOT / "infra" / "compose.yaml").read_text())
    services = doc["services"]
    gw, worker = services["pushgateway"], services["worker"]
    assert re.fullmatch(r"prom/pushgateway:v\d+\.\d+\.\d+", gw["image"]), gw["image"]
    assert gw["ports"] == ["127.0.0.1:9091:9091"] and "--web.listen-address=0.0.0.0:9091" in gw["command"]
    assert worker["environment"]["RLPIPE_PUSHGATEWAY_URL"] == "http://pushgateway:9091"
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "pushgateway")
    assert job["honor_labels"] is True and job["static_configs"] == [{"targets": ["pushgateway:9091"]}]
    # No authentication on the gateway: only the pusher and the scraper share its network, not the verifier
    # (which runs model-written code), nor any other service.
    on_it = {name for name, svc in services.items() if set(svc.get("networks", ["default"])) & set(gw["networks"])}
    assert on_it == {"pushgateway", "worker", "prometheus"}, on_it
    assert "pushgateway" in services["prometheus"]["depends_on"]
