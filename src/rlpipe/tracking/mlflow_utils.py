"""MLflow: one run per training run, metrics by step, checkpoints as registered model versions.

mlflow is imported inside the functions, so the core stays importable without it. The embedded
default is a sqlite file and a local artifact folder under ``$RLPIPE_HOME``; set
``RLPIPE_TRACKING_URI`` for a server.

Lineage tags on every model version: run id, iteration, config fingerprint, dataset version,
parent version, weight sha256, and the Prefect flow run that registered it; the MLflow run (the
version's source run) holds the whole config as ``config.json``. Aliases: ``base`` (the SFT start) and
``latest`` move on registration; ``best`` and ``champion`` (PROMOTION_ALIASES) move only through the
``evaluate`` flow, on the validation split, so a smoke run never moves what people compare.

MLflow reserves the alias name ``latest`` (``models:/NAME/latest`` means the highest version
number, whatever run made it), so rlpipe's ``latest`` is stored as the alias ``last``: code says
``latest``, and :func:`mlflow_alias` maps it. Users write ``models:/NAME@last``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlpipe.config import RunConfig, Settings

CONFIG_ARTIFACT = "config.json"
PROMOTION_ALIASES = frozenset({"best", "champion"})
LINEAGE_TAGS = ("run_id", "iteration", "config_fingerprint", "dataset_version", "parent_version", "weights_sha256")

__all__ = ["CONFIG_ARTIFACT", "LINEAGE_TAGS", "PROMOTION_ALIASES", "Tracker", "ModelVersionInfo", "mlflow_alias", "mlflow_ui_command"]


def mlflow_alias(alias: str) -> str:
    return "last" if alias.lower() == "latest" else alias


@dataclass(frozen=True)
class ModelVersionInfo:
    name: str
    version: str
    source: str
    tags: dict[str, str]
    aliases: tuple[str, ...]


def mlflow_ui_command(s: Settings) -> str:
    uri = s.resolve_tracking_uri()
    if uri.startswith("sqlite:") or uri.startswith("file:"):
        return f"mlflow ui --backend-store-uri {uri} --default-artifact-root {s.artifact_root} --port 5000"
    return f"open {uri}"


_METRIC_NAME = re.compile(r"[^A-Za-z0-9_\-. :/]")  # what MLflow refuses in a metric name


def metric_key(name: str) -> str:
    """``name`` as MLflow stores it: a name built from user-given parts (a verifier "rm+exact") keeps only the
    characters MLflow takes. The Pushgateway exporter labels its gauges with the same key."""
    return _METRIC_NAME.sub("_", name)


class Tracker:
    """Thin wrapper that pins the tracking URI per call (never set globally at import time)."""

    def __init__(self, s: Settings, cfg: RunConfig | None = None):
        import mlflow
        from mlflow.tracking import MlflowClient

        self.settings = s
        self.uri = s.resolve_tracking_uri(cfg)
        if self.uri.startswith("sqlite:///"):
            s.home.mkdir(parents=True, exist_ok=True)
        self._mlflow = mlflow
        self.client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)

    # -- runs ---------------------------------------------------------------------------------
    def experiment_id(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        artifact_location = None
        if self.uri.startswith("sqlite:"):
            self.settings.artifact_root.mkdir(parents=True, exist_ok=True)
            artifact_location = self.settings.artifact_root.as_uri() + f"/{name}"
        try:
            return self.client.create_experiment(name, artifact_location=artifact_location)
        except Exception:  # noqa: BLE001 - created concurrently by another process
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    def find_run(self, experiment: str, rlpipe_run_id: str) -> str | None:
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            return None
        runs = self.client.search_runs(
            [exp.experiment_id], filter_string=f"tags.`rlpipe.run_id` = '{rlpipe_run_id}'", max_results=1
        )
        return runs[0].info.run_id if runs else None

    def start_run(
        self, cfg: RunConfig, rlpipe_run_id: str, kind: str, dataset_version: str | None = None
    ) -> str:
        """Create (or find, when resuming) the MLflow run of an rlpipe run; logs config params once."""
        existing = self.find_run(cfg.tracking.experiment, rlpipe_run_id)
        if existing:
            return existing
        run = self.client.create_run(
            self.experiment_id(cfg.tracking.experiment),
            run_name=rlpipe_run_id,
            tags={"rlpipe.run_id": rlpipe_run_id, "rlpipe.kind": kind, "rlpipe.config_fingerprint": cfg.fingerprint()},
        )
        rid = run.info.run_id
        params = {k: ("" if v is None else str(v))[:6000] for k, v in cfg.flat().items()}
        params["config_fingerprint"] = cfg.fingerprint()
        if dataset_version:
            params["dataset_version"] = dataset_version
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):
            self.client.log_batch(rid, params=items[i : i + 100])
        # The whole config, as the run was given it: params are flat strings, this one loads back (run_config).
        self.client.log_dict(rid, cfg.model_dump(mode="json"), CONFIG_ARTIFACT)
        return rid

    def run_config(self, mlflow_run_id: str) -> RunConfig:
        """The config an rlpipe run was started with (its ``config.json`` artifact)."""
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            try:
                path = self.client.download_artifacts(mlflow_run_id, CONFIG_ARTIFACT, d)
            except Exception as e:  # noqa: BLE001 - MLflow raises several types for a missing artifact
                raise LookupError(f"MLflow run {mlflow_run_id} in {self.uri} has no {CONFIG_ARTIFACT} (a run "
                                  "older than the artifact?); pass the config explicitly") from e
            return RunConfig.model_validate(json.loads(Path(path).read_text()))

    def log_params(self, mlflow_run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        self.client.log_batch(mlflow_run_id, params=[Param(k, str(v)) for k, v in params.items()])

    def log_metrics(self, mlflow_run_id: str, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        # NaN and ±inf are logged as they are (MLflow stores them): a non-finite loss must be seen.
        items = [
            Metric(metric_key(k), float(v), now, step)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        ]
        if items:
            self.client.log_batch(mlflow_run_id, metrics=items)

    def system_metrics(self, mlflow_run_id: str, interval_s: float) -> Any:
        """MLflow's own system-metrics monitor on this run (a thread); ``.finish()`` stops it and logs the
        samples of the last, partial interval too, so a run shorter than one interval still has its figures."""
        monitor = _FlushingMonitor(mlflow_run_id, sampling_interval=interval_s, tracking_uri=self.uri)
        monitor.start()
        return monitor

    def log_table(self, mlflow_run_id: str, rows: list[dict[str, Any]], artifact_file: str) -> None:
        """Append ``rows`` (same keys each) to the run's table ``artifact_file`` (MLflow's Evaluation view)."""
        if rows:
            self.client.log_table(mlflow_run_id, {k: [r[k] for r in rows] for k in rows[0]}, artifact_file)

    def log_artifact(self, mlflow_run_id: str, path: str) -> None:
        self.client.log_artifact(mlflow_run_id, path)

    def end_run(self, mlflow_run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(mlflow_run_id, status=status)

    # -- registry -----------------------------------------------------------------------------
    def register_checkpoint(
        self,
        name: str,
        source: str,
        mlflow_run_id: str,
        *,
        rlpipe_run_id: str,
        iteration: int,
        config_fingerprint: str,
        dataset_version: str,
        weights_sha256: str,
        parent_version: str | None = None,
        aliases: tuple[str, ...] = ("latest",),
        extra_tags: dict[str, str] | None = None,
    ) -> ModelVersionInfo:
        """A model version for a checkpoint folder/URI, with lineage tags and aliases.

        ``mlflow.register_model('runs:/…')`` refuses a plain folder, so the version is created
        from its source URI directly.
        """
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(name)
        except MlflowException:
            try:
                self.client.create_registered_model(name, tags={"rlpipe": "reward_model" if name.endswith("-rm") else "policy"})
            except MlflowException:
                pass  # created concurrently
        tags = {
            "run_id": rlpipe_run_id,
            "iteration": str(iteration),
            "config_fingerprint": config_fingerprint,
            "dataset_version": dataset_version,
            "parent_version": parent_version or "",
            "weights_sha256": weights_sha256,
        } | (extra_tags or {})
        mv = self.client.create_model_version(name, source=source, run_id=mlflow_run_id, tags=tags)
        for alias in aliases:
            self.client.set_registered_model_alias(name, mlflow_alias(alias), mv.version)
        return ModelVersionInfo(name, str(mv.version), source, tags, tuple(mlflow_alias(a) for a in aliases))

    def version_by_alias(self, name: str, alias: str) -> ModelVersionInfo | None:
        from mlflow.exceptions import MlflowException

        try:
            mv = self.client.get_model_version_by_alias(name, mlflow_alias(alias))
        except MlflowException:
            return None
        return ModelVersionInfo(name, str(mv.version), mv.source, dict(mv.tags), tuple(mv.aliases))

    def set_alias(self, name: str, alias: str, version: str) -> None:
        self.client.set_registered_model_alias(name, mlflow_alias(alias), version)


def _FlushingMonitor(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 - builds a class deriving from a lazy import
    """MLflow's ``SystemMetricsMonitor`` whose ``finish`` publishes what was sampled since the last publish
    (MLflow's own drops it: a run that ends within one interval would log no system metrics at all)."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    class Monitor(SystemMetricsMonitor):
        def finish(self) -> None:
            running = self._process is not None
            super().finish()
            pending = running and any(m.metrics for m in self.monitors)
            if pending:
                self.publish_metrics(self.aggregate_metrics())
                self.mlflow_logger.flush()

    return Monitor(*args, **kwargs)
