"""`rlpipe report RUN_ID`: one self-contained HTML page about a run, read back from MLflow.

Everything comes from the tracking server — metric histories, params, tags and the run's
``generations.json`` and ``alerts.json`` tables — so a report can be made for any run the server has,
on any machine, after the run's own folder is gone.

The page loads nothing: no script, stylesheet, font or image from elsewhere (it is read on machines
without a network, and a report must not call home). Its charts are inline SVG rather than images, so
that a browser test can inspect them like any element (:mod:`~rlpipe.tracking.report_charts`).

This module reads the run; :mod:`~rlpipe.tracking.report_page` renders the page.

mlflow is imported inside the functions, like the rest of :mod:`rlpipe.tracking`.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from rlpipe.config import RunConfig, Settings
from rlpipe.tracking.report_charts import Series
from rlpipe.tracking.report_page import METRIC_PREFIXES, WANTED, RunData, render

__all__ = ["RunData", "RunNotFound", "build_report", "load_run", "render"]

_SAFE_ID = re.compile(r"^[A-Za-z0-9._-]+$")  # what may go into an MLflow filter string unquoted


class RunNotFound(LookupError):
    """No MLflow run answers to the id; the message names the id and where it looked."""


# -- reading the run ---------------------------------------------------------------------------


def build_report(run: str, settings: Settings, out: Path | None = None, *, log: bool = True,
                 config: RunConfig | None = None) -> Path:
    """Write the report of ``run`` (an rlpipe run id, newest MLflow run first, or an MLflow run id) to
    ``out`` (default ``$RLPIPE_HOME/runs/<run>/report.html``); with ``log``, also as the MLflow run's
    artifact ``report.html``. ``config``: its tracking URI, when it sets one. Raises :class:`RunNotFound`
    naming the id and the tracking URI."""
    from rlpipe.tracking.mlflow_utils import Tracker

    _check_store(run, settings, config)
    tracker = Tracker(settings, config)
    data = load_run(tracker.client, run, tracker.uri)
    folder = data.rlpipe_run_id if _SAFE_ID.match(data.rlpipe_run_id) else data.mlflow_run_id  # a tag is no path
    path = Path(out) if out is not None else settings.run_dir(folder) / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(data), encoding="utf-8")
    if log:
        _log_artifact(tracker.client, data.mlflow_run_id, path)
    return path


def _check_store(run: str, s: Settings, config: RunConfig | None = None) -> None:
    """An embedded store that does not exist holds no run: say so instead of creating an empty one."""
    uri = s.resolve_tracking_uri(config)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        raise RunNotFound(f"run {run!r}: there is no MLflow store at {uri} (RLPIPE_HOME={s.home}); set RLPIPE_HOME "
                          "to the folder the run used, or RLPIPE_TRACKING_URI to its tracking server")


def load_run(client: Any, run: str, uri: str) -> RunData:
    """The run's params, the histories of the metrics the report draws, and its tables."""
    found = _find_run(client, run, uri)
    rid = found.info.run_id
    keys = [k for k in found.data.metrics if k in WANTED or k.startswith(METRIC_PREFIXES)]
    data = RunData(
        mlflow_run_id=rid, rlpipe_run_id=found.data.tags.get("rlpipe.run_id") or rid,
        experiment=_experiment_name(client, found.info.experiment_id), status=found.info.status,
        start_ms=found.info.start_time, end_ms=found.info.end_time, params=dict(found.data.params),
        metrics={k: _history(client, rid, k) for k in sorted(keys)},
    )
    present = {a.path for a in client.list_artifacts(rid)}
    with tempfile.TemporaryDirectory(prefix="rlpipe-report-") as tmp:
        data.generations = _table(client, rid, "generations.json", present, Path(tmp), data.notes)
        data.alerts = _table(client, rid, "alerts.json", present, Path(tmp), data.notes)
    return data


def _find_run(client: Any, run: str, uri: str) -> Any:
    """The newest run tagged ``rlpipe.run_id=run`` in any experiment, else the MLflow run with that id."""
    from mlflow.exceptions import MlflowException

    experiments = [e.experiment_id for e in client.search_experiments()]
    if experiments and _SAFE_ID.match(run):
        found = client.search_runs(experiments, filter_string=f"tags.`rlpipe.run_id` = '{run}'",
                                   order_by=["attributes.start_time DESC"], max_results=1)
        if found:
            return found[0]
    try:
        return client.get_run(run)
    except MlflowException:
        raise RunNotFound(
            f"run {run!r}: no MLflow run is tagged rlpipe.run_id={run!r} and none has that MLflow run id, in "
            f"{len(experiments)} experiment(s) at {uri}; check the id (`mlflow ui` lists the runs) and "
            "RLPIPE_HOME / RLPIPE_TRACKING_URI") from None


def _experiment_name(client: Any, experiment_id: str) -> str:
    exp = client.get_experiment(experiment_id)
    return exp.name if exp is not None else experiment_id


def _history(client: Any, run_id: str, key: str) -> Series:
    """One value per step: an iteration redone after a resume logged it again; the last one counts."""
    latest: dict[int, float] = {}
    for m in sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp)):
        latest[int(m.step)] = float(m.value)
    return sorted(latest.items())


def _table(client: Any, run_id: str, name: str, present: set[str], tmp: Path, notes: list[str]) -> dict[str, Any] | None:
    """An MLflow table artifact ({"columns": [...], "data": [[...]]}), or None when the run has none."""
    if name not in present:
        return None
    try:
        table = json.loads(Path(client.download_artifacts(run_id, name, str(tmp))).read_text())
    except (OSError, ValueError) as e:
        notes.append(f"{name}: could not be read ({type(e).__name__}: {e}); not shown")
        return None
    if not (isinstance(table, dict) and isinstance(table.get("columns"), list) and isinstance(table.get("data"), list)):
        notes.append(f'{name}: not an MLflow table ({{"columns": [...], "data": [[...]]}}); not shown')
        return None
    return table


def _log_artifact(client: Any, run_id: str, path: Path) -> None:
    """Logged as ``report.html`` whatever the file is called here (MLflow names an artifact by its file)."""
    if path.name == "report.html":
        client.log_artifact(run_id, str(path))
        return
    with tempfile.TemporaryDirectory(prefix="rlpipe-report-") as tmp:
        copy = Path(tmp) / "report.html"
        shutil.copyfile(path, copy)
        client.log_artifact(run_id, str(copy))


# -- the page ----------------------------------------------------------------------------------
