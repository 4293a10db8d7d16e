"""Retention (config section ``retention``): what ``rlpipe gc`` deletes from the object store and the
model registry, and what it must keep.

:func:`plan` reads the store's runs (``runs/<id>/checkpoints/<tag>/``, ``runs/<id>/iter=<k>/<stage>/``,
``runs/<id>/progress.json``) and the registry, and decides per checkpoint and per iteration's
trajectories; :func:`apply` carries a plan out, the registry first (a version never points at files
that are gone). Kept whatever the config says:

- a checkpoint a registry alias points to (``best``, ``latest``, ``base``, …),
- each run's resume point (its ``progress.json``'s ``resume_state``),
- a model version a run's config names (``models:/NAME/3`` or ``models:/NAME@alias``),
- the trajectories of an iteration its run has not finished (a resume reuses them).
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from rlpipe.config import RetentionConfig
from rlpipe.storage.store import MANIFEST, ObjectStore

__all__ = ["Item", "Plan", "apply", "plan"]

_ITER = re.compile(r"^iter=(\d+)$")
_MODEL_REF = re.compile(r"^models:/([^/@]+)(?:/(\d+)|@([A-Za-z0-9_-]+))$")
DAY = 86400.0


@dataclass(frozen=True)
class Item:
    kind: str  # "checkpoint" | "trajectories" | "model-version"
    target: str  # a store prefix, or "NAME/VERSION"
    reason: str
    bytes: int = 0


@dataclass
class Plan:
    delete: list[Item] = field(default_factory=list)
    keep: list[Item] = field(default_factory=list)

    def freed_bytes(self) -> int:
        return sum(i.bytes for i in self.delete)

    def lines(self, verb: str = "delete") -> list[str]:
        out = [f"keep   {i.kind:13s} {i.target}  ({i.reason})" for i in self.keep]
        out += [f"{verb:6s} {i.kind:13s} {i.target}  ({i.reason}{_mb(i.bytes)})" for i in self.delete]
        return out


def _mb(n: int) -> str:
    return f"; {n / 2**20:.1f} MiB" if n else ""


@dataclass
class _Run:
    progress: dict[str, Any] | None = None
    checkpoints: dict[str, int] = field(default_factory=dict)  # prefix -> bytes
    stages: dict[int, dict[str, int]] = field(default_factory=lambda: defaultdict(dict))  # iteration -> key -> bytes


def _scan(store: ObjectStore) -> dict[str, _Run]:
    runs: dict[str, _Run] = defaultdict(_Run)
    for key, size in store.sizes("runs").items():
        parts = key.split("/")
        if len(parts) < 3 or parts[0] != "runs":
            continue
        run = runs[parts[1]]
        if parts[2] == "progress.json" and len(parts) == 3:
            run.progress = store.get_json(key)
        elif parts[2] == "checkpoints" and len(parts) > 4:
            prefix = "/".join(parts[:4])
            run.checkpoints[prefix] = run.checkpoints.get(prefix, 0) + size
        elif _ITER.match(parts[2]):
            run.stages[int(_ITER.match(parts[2]).group(1))][key] = size
    return runs


@dataclass(frozen=True)
class _Version:
    name: str
    version: str
    key: str | None  # the checkpoint's store prefix; None outside this store
    aliases: tuple[str, ...]


def _registry(client: Any, store: ObjectStore) -> list[_Version]:
    out = []
    for rm in client.search_registered_models():
        by_version = defaultdict(list)
        for alias, v in (getattr(rm, "aliases", None) or {}).items():
            by_version[str(v)].append(alias)
        for mv in client.search_model_versions(f"name='{rm.name}'"):
            out.append(_Version(rm.name, str(mv.version), store.key_of(mv.source or ""), tuple(by_version[str(mv.version)])))
    return out


def _protected(runs: dict[str, _Run], versions: list[_Version]) -> dict[str, str]:
    """Checkpoint prefix -> every reason it must stay."""
    keep: dict[str, list[str]] = defaultdict(list)
    for v in versions:
        if v.key and v.aliases:
            keep[v.key].append(f"alias {', '.join('@' + a for a in v.aliases)} of {v.name} v{v.version}")
    by_ref = {(v.name, v.version): v for v in versions} | {(v.name, "@" + a): v for v in versions for a in v.aliases}
    for run_id, run in runs.items():
        p = run.progress or {}
        if p.get("resume_state"):
            keep[p["resume_state"].rstrip("/")].append(
                f"resume point of run {run_id} (after iteration {p.get('completed_iteration')})")
        for key, value in (p.get("config") or {}).items():
            m = _MODEL_REF.match(value) if isinstance(value, str) else None
            ref = m and by_ref.get((m.group(1), m.group(2) or "@" + (m.group(3) or "")))
            if ref and ref.key:
                keep[ref.key].append(f"{key} of run {run_id} names {value}")
    return {k: "; ".join(v) for k, v in keep.items()}


def _order(prefix: str) -> int:
    m = _ITER.match(prefix.rsplit("/", 1)[-1])
    return int(m.group(1)) if m else -1


def _checkpoints(cfg: RetentionConfig, runs: dict[str, _Run], versions: list[_Version], out: Plan) -> None:
    protected = _protected(runs, versions)
    for run_id, run in sorted(runs.items()):
        newest = sorted(run.checkpoints, key=_order, reverse=True)
        keep_n = set(newest[: cfg.keep_checkpoints]) if cfg.keep_checkpoints else set(newest)
        for prefix in newest:
            if prefix in protected:
                out.keep.append(Item("checkpoint", prefix, protected[prefix]))
            elif prefix in keep_n:
                out.keep.append(Item("checkpoint", prefix, f"among the newest {cfg.keep_checkpoints or 'all'} of run {run_id}"))
            else:
                why = f"not among the newest {cfg.keep_checkpoints} of run {run_id}, no alias, no run needs it"
                for v in versions:
                    if v.key == prefix:
                        out.delete.append(Item("model-version", f"{v.name}/{v.version}", f"its checkpoint {prefix} goes"))
                out.delete.append(Item("checkpoint", prefix, why, run.checkpoints[prefix]))


def _written_at(store: ObjectStore, keys: dict[str, int]) -> float:
    """When an iteration's stages were last written: their manifests' time, else the files' own."""
    stamps = [float(store.get_json(k).get("written_at", 0.0)) for k in keys if k.endswith("/" + MANIFEST)]
    if not stamps:
        stamps = [store.fs.modified(store.path(k)).timestamp() for k in keys]
    return max(stamps, default=0.0)


def _trajectories(cfg: RetentionConfig, store: ObjectStore, runs: dict[str, _Run], now: float, out: Plan) -> None:
    if cfg.trajectory_days is None:
        return
    for run_id, run in sorted(runs.items()):
        done = (run.progress or {}).get("completed_iteration", -1)
        for k, keys in sorted(run.stages.items()):
            prefix = f"runs/{run_id}/iter={k}"
            if k > done:
                out.keep.append(Item("trajectories", prefix, f"iteration {k} of run {run_id} is not finished: a resume reuses it"))
                continue
            age = (now - _written_at(store, keys)) / DAY
            if age < cfg.trajectory_days:
                out.keep.append(Item("trajectories", prefix, f"{age:.1f} days old, younger than {cfg.trajectory_days:g}"))
            else:
                out.delete.append(Item("trajectories", prefix, f"{age:.1f} days old (≥ {cfg.trajectory_days:g})",
                                       sum(keys.values())))


def plan(cfg: RetentionConfig, store: ObjectStore, client: Any, now: float | None = None) -> Plan:
    """What retention ``cfg`` deletes and keeps in ``store`` and the registry ``client`` (an MlflowClient)."""
    runs = _scan(store)
    out = Plan()
    if cfg.keep_checkpoints is not None:
        _checkpoints(cfg, runs, _registry(client, store), out)
    _trajectories(cfg, store, runs, time.time() if now is None else now, out)
    return out


def apply(p: Plan, store: ObjectStore, client: Any, audit: Any = None) -> None:
    """Carry the plan out: registry versions first, then the store's prefixes. ``audit`` (an
    :class:`rlpipe.audit.AuditLog`) records the deletions first, as one ``gc.delete`` record, and tags each
    registered model that lost a version; a plan whose record cannot be written deletes nothing."""
    if not p.delete:
        return
    versions = [i.target for i in p.delete if i.kind == "model-version"]
    prefixes = [i.target for i in p.delete if i.kind != "model-version"]
    if audit is None:
        return _delete(versions, prefixes, store, client)
    from rlpipe.audit import set_tag

    target = {"store": store.url(""), "model_versions": versions, "prefixes": prefixes}
    with audit.change("gc.delete", target, {"freed_bytes": p.freed_bytes(),
                                            "reasons": {i.target: i.reason for i in p.delete}}) as rec:
        _delete(versions, prefixes, store, client)
    for name in sorted({v.rsplit("/", 1)[0] for v in versions}):
        set_tag(lambda k, v, name=name: client.set_registered_model_tag(name, k, v), rec, name)


def _delete(versions: list[str], prefixes: list[str], store: ObjectStore, client: Any) -> None:
    for target in versions:
        name, version = target.rsplit("/", 1)
        client.delete_model_version(name, version)
    for prefix in prefixes:
        store.delete(prefix)
