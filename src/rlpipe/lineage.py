"""Where a model version came from: version → run → iterations → trajectory objects → verifier and reward-model
versions → dataset version → base model.

The registry's tags (``run_id``, ``iteration``, ``parent_version``, ``dataset_version``, ``weights_sha256``,
``mlflow_run_id``) give the chain of versions, followed back through ``parent_version`` until a version has none;
the store gives each iteration's stage prefixes and, read from the stored Parquet, the distinct verifier versions
that scored them; the run's config (its MLflow ``config.json``, else its progress.json) gives the base model.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow.compute as pc

from rlpipe.storage.layout import run_prefix
from rlpipe.storage.schemas import TRAJECTORY_SCHEMA

__all__ = ["dataset_prefix_of", "format_lineage", "lineage", "lineage_json", "parse_model_version"]


def parse_model_version(spec: str) -> tuple[str, str | None, str | None]:
    """``NAME/VERSION``, ``models:/NAME/VERSION`` or ``models:/NAME@ALIAS`` → (name, version, alias)."""
    ref = spec[len("models:/"):] if spec.startswith("models:/") else spec
    if "@" in ref:
        name, alias = ref.split("@", 1)
        return name, None, alias
    name, sep, version = ref.rpartition("/")
    if not sep or not name or not version.isdigit():
        raise ValueError(f"model version {spec!r}: give NAME/VERSION, models:/NAME/VERSION or models:/NAME@ALIAS")
    return name, version, None


def _version(client: Any, name: str, version: str | None, alias: str | None) -> Any:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(name, version)
    except MlflowException:
        what = f"@{alias}" if alias else f"version {version}"
        raise LookupError(f"registered model {name!r} has no {what} (list them: the MLflow UI, or "
                          f"`mlflow models` / MlflowClient.search_model_versions(\"name='{name}'\"))") from None


def _iteration_objects(store: Any, run_id: str, iteration: int) -> dict[str, Any]:
    """The iteration's stage prefixes (with parts and rows) and the verifier versions its verify stages hold."""
    stages: dict[str, dict[str, Any]] = {}
    scored_by: set[tuple[str, str]] = set()
    base = f"{run_prefix(run_id)}/iter={iteration}"
    for key in store.list(base):
        if not key.endswith("/_manifest.json"):
            continue
        prefix = key.rsplit("/", 1)[0]
        manifest = store.read_manifest(prefix)
        stages[prefix] = {"parts": [p["name"] for p in manifest["parts"]], "rows": manifest["rows"]}
        if prefix.rsplit("/", 1)[1].split("-draw")[0] == "verify":
            table = store.read_stage(prefix, schema=TRAJECTORY_SCHEMA).select(["verifier", "verifier_version"])
            for row in pc.unique(pc.binary_join_element_wise(
                    pc.fill_null(table["verifier"], ""), pc.fill_null(table["verifier_version"], ""), "@")).to_pylist():
                name, _, version = row.partition("@")
                scored_by.add((name, version))
    return {"iteration": iteration, "stages": stages,
            "verifiers": [f"{n}@{v}" if v else n for n, v in sorted(scored_by)]}


def _base_model(tracker: Any, store: Any, run_id: str, mlflow_run_id: str | None) -> str | None:
    if mlflow_run_id:
        try:
            return tracker.run_config(mlflow_run_id).task.policy_model
        except LookupError:
            pass
    key = f"{run_prefix(run_id)}/progress.json"
    if store.exists(key):
        return (store.get_json(key).get("config") or {}).get("task.policy_model")
    return None


def dataset_prefix_of(store: Any, version: str) -> str | None:
    """The store prefix of the dataset stored under content version ``version`` (``datasets/<name>/<v[:16]>``)."""
    for key in store.list("datasets"):
        parts = key.split("/")
        if len(parts) == 4 and parts[2] == version[:16] and parts[3] == "_manifest.json":
            return "/".join(parts[:3])
    return None


def _node(mv: Any) -> dict[str, Any]:
    t = dict(mv.tags)
    return {"name": mv.name, "version": str(mv.version), "aliases": list(getattr(mv, "aliases", []) or []),
            "source": mv.source, "run_id": t.get("run_id"), "iteration": int(t["iteration"]) if "iteration" in t else None,
            "weights_sha256": t.get("weights_sha256"), "dataset_version": t.get("dataset_version"),
            "mlflow_run_id": t.get("mlflow_run_id") or mv.run_id, "parent_version": t.get("parent_version") or None}


def _chain(client: Any, first: Any, limit: int = 100_000) -> list[dict[str, Any]]:
    """The version and its ancestors through ``parent_version`` (``N`` in the same model, ``NAME/N`` another)."""
    chain = [_node(first)]
    while (parent := chain[-1]["parent_version"]) and len(chain) < limit:
        name, version = (parent.rsplit("/", 1) if "/" in parent else (chain[-1]["name"], parent))
        chain.append(_node(_version(client, name, version, None)))
    return chain


def lineage(tracker: Any, store: Any, spec: str) -> dict[str, Any]:
    """The chain of ``spec`` (see the module docstring) as one JSON-able mapping."""
    name, version, alias = parse_model_version(spec)
    chain = _chain(tracker.client, _version(tracker.client, name, version, alias))
    for i, node in enumerate(chain):
        parent = chain[i + 1] if i + 1 < len(chain) else None
        start = parent["iteration"] + 1 if parent and parent["run_id"] == node["run_id"] and parent["iteration"] is not None else 0
        node["iterations"] = [] if node["run_id"] is None or node["iteration"] is None else [
            _iteration_objects(store, node["run_id"], k) for k in range(start, node["iteration"] + 1)]
        if node["dataset_version"]:
            node["dataset_prefix"] = dataset_prefix_of(store, node["dataset_version"])
        progress_key = f"{run_prefix(node['run_id'])}/progress.json" if node["run_id"] else None
        saved = store.get_json(progress_key) if progress_key and store.exists(progress_key) else {}
        node["reward_model_version"] = saved.get("reward_model_version")
    last = chain[-1]
    base = _base_model(tracker, store, last["run_id"], last["mlflow_run_id"]) if last["run_id"] else None
    return {"model_version": f"{chain[0]['name']}/{chain[0]['version']}", "chain": chain, "base_model": base}


def format_lineage(info: dict[str, Any]) -> str:
    """The chain as an indented tree, newest version first, the base model last."""
    lines = []
    for depth, node in enumerate(info["chain"]):
        pad = "  " * depth
        aliases = f" ({', '.join('@' + a for a in node['aliases'])})" if node["aliases"] else ""
        lines.append(f"{pad}{node['name']}/{node['version']}{aliases}  weights {str(node['weights_sha256'])[:12]}")
        lines.append(f"{pad}  run {node['run_id']} iteration {node['iteration']}  (MLflow run {node['mlflow_run_id']})")
        for it in node["iterations"]:
            lines.append(f"{pad}    iter={it['iteration']}  scored by {', '.join(it['verifiers']) or 'n/a'}")
            lines += [f"{pad}      {p}  ({s['rows']} rows, {len(s['parts'])} part(s))" for p, s in it["stages"].items()]
        if node["reward_model_version"]:
            lines.append(f"{pad}  reward model {node['reward_model_version']}")
        lines.append(f"{pad}  dataset {node['dataset_version']}  at {node.get('dataset_prefix') or 'not in this store'}")
    lines.append("  " * len(info["chain"]) + f"base model: {info['base_model'] or 'unknown (no config found)'}")
    return "\n".join(lines)


def lineage_json(info: dict[str, Any]) -> str:
    return json.dumps(info, indent=1, ensure_ascii=False)
