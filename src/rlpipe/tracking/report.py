"""`rlpipe report RUN_ID`: one self-contained HTML page about a run, read back from MLflow.

Everything comes from the tracking server — metric histories, params, tags and the run's
``generations.json`` and ``alerts.json`` tables — so a report can be made for any run the server has,
on any machine, after the run's own folder is gone.

The page loads nothing: no script, stylesheet, font or image from elsewhere (it is read on machines
without a network, and a report must not call home). Its charts are inline SVG drawn here rather than
images, so that a browser test can inspect them like any element: each metric is a
``<polyline data-series="<metric>">`` with one ``<circle>`` per point carrying a ``<title>`` tooltip;
each stacked-bar segment is a ``<rect data-series="<metric>">``.

mlflow is imported inside the functions, like the rest of :mod:`rlpipe.tracking`.
"""

from __future__ import annotations

import html
import json
import math
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlpipe.config import RunConfig, Settings

__all__ = ["RunData", "RunNotFound", "build_report", "load_run", "render"]

Series = list[tuple[int, float]]  # (step, value) by step; step -1 is the base policy

# Curve sections: id, heading, charts (title, metrics drawn together on one y axis).
_CURVES: tuple[tuple[str, str, tuple[tuple[str, tuple[str, ...]], ...]], ...] = (
    ("reward", "Reward", (("training reward and accuracy", ("reward_mean", "accuracy")),)),
    ("heldout", "Held-out accuracy", (("held-out and validation accuracy (base policy at −1)",
                                       ("heldout_accuracy", "validation_accuracy")),)),
    ("kl", "KL", (("KL to the reference policy", ("kl",)), ("KL coefficient", ("kl_coef",)))),
    ("entropy", "Entropy", (("policy entropy (nats per token)", ("entropy",)),)),
    ("lengths", "Lengths", (("mean response length (tokens)", ("response_length_mean",)),
                            ("share of responses cut at max_new_tokens", ("truncated_share",)))),
)
_WANTED = frozenset(m for _, _, charts in _CURVES for _, metrics in charts for m in metrics)
_STAGES = ("generate", "verify", "update", "sync", "eval", "save")
_METRIC_PREFIXES = ("status_", "alerts/", "time/")
_PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf")
_NO_DATA = '<p class="no-data">no data</p>'
_SAFE_ID = re.compile(r"^[A-Za-z0-9._-]+$")  # what may go into an MLflow filter string unquoted
_CELL_CHARS = 4000  # a generation longer than this is cut in the table (MLflow has the whole text)


class RunNotFound(LookupError):
    """No MLflow run answers to the id; the message names the id and where it looked."""


@dataclass
class RunData:
    """What the report shows, as read from MLflow."""

    mlflow_run_id: str
    rlpipe_run_id: str
    experiment: str
    status: str
    start_ms: int | None
    end_ms: int | None
    params: dict[str, str]
    metrics: dict[str, Series]
    generations: dict[str, Any] | None = None
    alerts: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


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
    keys = [k for k in found.data.metrics if k in _WANTED or k.startswith(_METRIC_PREFIXES)]
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


def render(d: RunData) -> str:
    """The whole page: header, curves, stage times, verdicts, alerts, generations."""
    sections = [_header(d)]
    sections += [_curve_section(d, key, heading, charts) for key, heading, charts in _CURVES]
    sections += [_stage_section(d), _verdict_section(d), _alert_section(d), _generation_section(d)]
    title = _esc(f"rlpipe report — {d.rlpipe_run_id}")
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{title}</title>\n'
            f'<meta name="generator" content="rlpipe report">\n<style>{_CSS}</style>\n</head>\n<body>\n'
            f'<h1>{title}</h1>\n' + "\n".join(sections) + "\n</body>\n</html>\n")


def _header(d: RunData) -> str:
    acc = dict(d.metrics.get("heldout_accuracy", []))
    base = acc.get(-1)
    final = acc[max(acc)] if acc and max(acc) >= 0 else None
    steps = {s for k in ("reward_mean", "time/iteration_s") for s, _ in d.metrics.get(k, []) if s >= 0}
    planned = d.params.get("train.total_iterations")
    rows = [
        ("run", d.rlpipe_run_id),
        ("MLflow run", f"{d.mlflow_run_id} (experiment {d.experiment}, {d.status.lower()})"),
        ("algorithm", d.params.get("train.algorithm", "—")),
        ("task", d.params.get("task.name", "—")),
        ("reward", d.params.get("reward.type", "—")),
        ("held-out accuracy", _accuracy_change(base, final)),
        ("iterations", f"{len(steps)}" + (f" of {planned}" if planned else "")),
        ("started", _when(d.start_ms) + (f", ran {_duration(d.start_ms, d.end_ms)}" if d.end_ms else "")),
    ]
    body = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in rows)
    notes = "".join(f'<p class="note">{_esc(n)}</p>' for n in d.notes)
    return f'<section id="summary" data-section="summary">\n<table class="summary">{body}</table>{notes}\n</section>'


def _accuracy_change(base: float | None, final: float | None) -> str:
    if base is None and final is None:
        return "—"
    if base is None or final is None:
        return f"base {_pct(base)} → final {_pct(final)}"
    return f"base {_pct(base)} → final {_pct(final)} ({(final - base) * 100:+.1f} points)"


def _curve_section(d: RunData, key: str, heading: str, charts: tuple[tuple[str, tuple[str, ...]], ...]) -> str:
    """Metrics the run does not have are left out of their chart; a section with none says so."""
    figures = [_line_chart(title, {m: d.metrics[m] for m in metrics if d.metrics.get(m)}) for title, metrics in charts]
    return _section(key, heading, "".join(f for f in figures if f) or _NO_DATA)


def _stage_section(d: RunData) -> str:
    """Seconds per iteration by stage, stacked; what no stage accounts for is overhead (orchestration,
    storage, logging). The total is the parent flow's view when logged (the iteration flow run's own start
    and finish included), else the iteration's own wall time."""
    total = dict(d.metrics.get("time/iteration_s", [])) | dict(d.metrics.get("time/iteration_total_s", []))
    steps = sorted(s for s in total if s >= 0)
    if not steps:
        return _section("stages", "Stage time", _NO_DATA)
    stacks = {st: _at(d.metrics.get(f"time/{st}_s", []), steps) for st in _STAGES}
    stacks = {k: v for k, v in stacks.items() if any(v)}
    known = [sum(v[j] for v in stacks.values()) for j in range(len(steps))]
    stacks["overhead"] = [max(_finite(total[s]) - known[j], 0.0) for j, s in enumerate(steps)]
    chart = _stacked_bars("seconds per iteration, by stage", steps, stacks, lambda v: f"{v:.3g} s")
    return _section("stages", "Stage time", chart + _stage_table(stacks))


def _stage_table(stacks: dict[str, list[float]]) -> str:
    sums = {k: sum(v) for k, v in stacks.items()}
    whole = sum(sums.values()) or 1.0
    rows = "".join(f'<tr data-stage="{_esc(k)}"><td>{_esc(k)}</td><td class="num">{v:.2f}</td>'
                   f'<td class="num">{v / whole:.1%}</td></tr>' for k, v in sums.items())
    return ('<table class="stages"><thead><tr><th>stage</th><th>seconds, all iterations</th><th>share</th></tr></thead>'
            f'<tbody>{rows}<tr class="total"><td>total</td><td class="num">{sum(sums.values()):.2f}</td>'
            '<td class="num">100%</td></tr></tbody></table>')


def _verdict_section(d: RunData) -> str:
    """Verifier statuses (ok — right or wrong —, unparseable, timeout, error, skipped) as shares of each batch."""
    keys = [k for k in d.metrics if k.startswith("status_") and d.metrics[k]]
    if not keys:
        return _section("verdicts", "Verdict statuses", _NO_DATA)
    keys.sort(key=lambda k: (k != "status_ok", k))  # ok at the bottom of each bar
    steps = sorted({s for k in keys for s, _ in d.metrics[k]})
    stacks = {k: _at(d.metrics[k], steps) for k in keys}
    never = [k.removeprefix("status_") for k, v in stacks.items() if not any(v)]
    chart = _stacked_bars("share of samples by verifier status", steps, {k: v for k, v in stacks.items() if any(v)},
                          lambda v: f"{v:.1%}")
    note = f'<p class="note">no sample was {_esc(", ".join(never))} at any iteration</p>' if never else ""
    return _section("verdicts", "Verdict statuses", chart + note)


def _alert_section(d: RunData) -> str:
    rows = _alert_rows(d)
    checked = sorted(k.removeprefix("alerts/") for k in d.metrics if k.startswith("alerts/"))
    if not rows:
        if d.alerts is None and not checked:
            return _section("alerts", "Alerts", _NO_DATA)
        rules = f" (rules checked: {', '.join(checked)})" if checked else ""
        return _section("alerts", "Alerts", f'<p class="none">no alerts raised{_esc(rules)}</p>')
    body = "".join(f"<tr><td class=\"num\">{_step_label(it)}</td><td>{_esc(rule)}</td><td>{_esc(sev)}</td>"
                   f"<td>{_esc(msg)}</td></tr>" for it, rule, sev, msg in rows)
    table = ('<table class="alerts"><thead><tr><th>iteration</th><th>rule</th><th>severity</th><th>message</th>'
             f"</tr></thead><tbody>{body}</tbody></table>")
    return _section("alerts", "Alerts", table)


def _alert_rows(d: RunData) -> list[tuple[int, str, str, str]]:
    """alerts.json's rows, and every ``alerts/<rule>`` metric above 0 that the table does not already list."""
    rows = [(_int(r.get("iteration")), str(r.get("rule", "")), str(r.get("severity", "")), str(r.get("message", "")))
            for r in _records(d.alerts)]
    listed = {(it, rule) for it, rule, _, _ in rows}
    for key, series in d.metrics.items():
        if key.startswith("alerts/"):
            rule = key.removeprefix("alerts/")
            rows += [(s, rule, "alert", f"metric {key} = {v:g}") for s, v in series
                     if v > 0 and (s, rule) not in listed]
    return sorted(rows, key=lambda r: (r[0], r[1]))


def _generation_section(d: RunData) -> str:
    """The held-out generations logged at each evaluation, the base policy's (iteration −1) first."""
    rows = _records(d.generations)
    if not rows:
        return _section("generations", "Sampled generations", _NO_DATA)
    columns = [c for c in d.generations["columns"] if c != "iteration"]
    groups: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(_int(r.get("iteration")), []).append(r)
    parts = []
    for it in sorted(groups):
        head = "".join(f"<th>{_esc(c)}</th>" for c in columns)
        body = "".join("<tr>" + "".join(_cell(c, r.get(c)) for c in columns) + "</tr>" for r in groups[it])
        title = "base policy (before training)" if it == -1 else f"iteration {it}"
        parts.append(f'<h3>{_esc(title)}</h3>\n<table class="generations" data-iteration="{it}">'
                     f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
    return _section("generations", "Sampled generations", "\n".join(parts))


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "<td></td>"
    if isinstance(value, float):
        return f'<td class="num">{value:.4g}</td>'
    if isinstance(value, (int, bool)):
        return f'<td class="num">{value}</td>'
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    if len(text) > _CELL_CHARS:
        text = text[:_CELL_CHARS] + f"… ({len(text) - _CELL_CHARS} more characters in MLflow)"
    return f'<td class="text" data-column="{_esc(column)}">{_esc(text)}</td>'


# -- SVG charts --------------------------------------------------------------------------------

_W, _H = 560, 250
_LEFT, _RIGHT, _TOP, _BOTTOM = 56, 14, 12, 40


@dataclass(frozen=True)
class _Axis:
    """A linear map from data values in [lo, hi] to pixels, with the ticks to label."""

    lo: float
    hi: float
    ticks: tuple[float, ...]
    px: tuple[float, float]

    def __call__(self, v: float) -> float:
        return self.px[0] + (v - self.lo) / (self.hi - self.lo) * (self.px[1] - self.px[0])


def _value_axis(lo: float, hi: float, px: tuple[float, float]) -> _Axis:
    ticks = _ticks(lo, hi)
    return _Axis(ticks[0], ticks[-1], ticks, px)


def _step_axis(lo: int, hi: int, px: tuple[float, float]) -> _Axis:
    """Iterations: the axis spans the data (half a step either side of a single one); the base policy's
    step −1, when there, gets its own tick, and a round tick too close to it gives way."""
    a, b = (lo - 0.5, hi + 0.5) if lo == hi else (lo, hi)
    ticks = [t for t in _ticks(a, b, integer=True) if a <= t <= b]
    if lo == -1:
        room = 30 * (b - a) / abs(px[1] - px[0])  # 30 px, in steps
        ticks = [-1.0] + [t for t in ticks if t - -1 >= room]
    return _Axis(a, b, tuple(ticks), px)


def _ticks(lo: float, hi: float, integer: bool = False, n: int = 5) -> tuple[float, ...]:
    """Round tick values covering [lo, hi]: steps of 1, 2, 2.5 or 5 times a power of ten (whole numbers
    when ``integer``)."""
    if hi - lo < 1e-12:  # a flat line: in the middle of the chart; a flat 0 (no reward yet) on a 0..1 axis
        pad = 1.0 if integer else abs(lo) * 0.1
        lo, hi = (lo - pad, hi + pad) if pad else (0.0, 1.0)
    raw = (hi - lo) / (n - 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    if integer:
        step = float(max(1, math.ceil(step)))
    start = math.floor(lo / step + 1e-9) * step
    count = max(1, math.ceil((hi - start) / step - 1e-9))
    return tuple(round(start + i * step, 12) for i in range(count + 1))


def _line_chart(title: str, series: dict[str, Series]) -> str:
    """One polyline per metric (non-finite values left out, and counted under the chart)."""
    points = {m: [(x, y) for x, y in s if math.isfinite(y)] for m, s in series.items()}
    points = {m: p for m, p in points.items() if p}
    if not points:
        return ""
    xs = [x for p in points.values() for x, _ in p]
    ys = [y for p in points.values() for _, y in p]
    sx = _step_axis(min(xs), max(xs), (_LEFT, _W - _RIGHT))
    sy = _value_axis(min(ys), max(ys), (_H - _BOTTOM, _TOP))
    x_labels = [(sx(t), _step_label(int(t))) for t in sx.ticks]
    parts = [_y_axis(sy, _num), _x_axis(x_labels, "iteration")]
    for i, (metric, p) in enumerate(points.items()):
        color, name = _PALETTE[i % len(_PALETTE)], _esc(metric)
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in p)
        dash = ' stroke-dasharray="6 4"' if i % 2 else ""  # a series drawn over another stays visible
        parts.append(f'<polyline data-series="{name}" points="{coords}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        parts += [f'<circle data-series="{name}" cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}">'
                  f"<title>{name}, {_step_label(x)}: {_num(y)}</title></circle>" for x, y in p]
    dropped = sum(len(s) for s in series.values()) - len(xs)
    note = f'<p class="note">{dropped} non-finite value(s) not drawn</p>' if dropped else ""
    return _figure(title, parts, list(points), note)


def _stacked_bars(title: str, steps: list[int], stacks: dict[str, list[float]], fmt: Any) -> str:
    """One bar per step, one ``rect`` per (step, series) stacked bottom-up in the order of ``stacks``."""
    totals = [sum(v[j] for v in stacks.values()) for j in range(len(steps))]
    sy = _value_axis(0.0, max(totals) or 1.0, (_H - _BOTTOM, _TOP))
    band = (_W - _LEFT - _RIGHT) / len(steps)
    every = max(1, math.ceil(len(steps) / 12))  # at most ~12 labels under the bars
    labels = [(_LEFT + (j + 0.5) * band, _step_label(s)) for j, s in enumerate(steps) if j % every == 0]
    parts = [_y_axis(sy, _num), _x_axis(labels, "iteration")]
    for j, step in enumerate(steps):
        below = 0.0
        for i, (name, values) in enumerate(stacks.items()):
            v = values[j]
            if v <= 0:
                continue
            top, bottom = sy(below + v), sy(below)
            share = f" ({v / totals[j]:.0%})" if totals[j] else ""
            parts.append(f'<rect data-series="{_esc(name)}" x="{_LEFT + j * band + band * 0.15:.1f}" y="{top:.1f}" '
                         f'width="{band * 0.7:.1f}" height="{bottom - top:.1f}" fill="{_PALETTE[i % len(_PALETTE)]}">'
                         f"<title>{_esc(name)}, {_step_label(step)}: {_esc(fmt(v))}{share}</title></rect>")
            below += v
    return _figure(title, parts, list(stacks), "")


def _y_axis(sy: _Axis, fmt: Any) -> str:
    grid = "".join(f'<line class="grid" x1="{_LEFT}" x2="{_W - _RIGHT}" y1="{sy(t):.1f}" y2="{sy(t):.1f}"/>'
                   f'<text class="tick" x="{_LEFT - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">{_esc(fmt(t))}</text>'
                   for t in sy.ticks)
    return f'<g class="y-axis">{grid}<line class="axis" x1="{_LEFT}" x2="{_LEFT}" y1="{_TOP}" y2="{_H - _BOTTOM}"/></g>'


def _x_axis(labels: list[tuple[float, str]], name: str) -> str:
    y = _H - _BOTTOM
    ticks = "".join(f'<line class="axis" x1="{x:.1f}" x2="{x:.1f}" y1="{y}" y2="{y + 4}"/>'
                    f'<text class="tick" x="{x:.1f}" y="{y + 16}" text-anchor="middle">{_esc(label)}</text>'
                    for x, label in labels)
    title = f'<text class="axis-name" x="{(_LEFT + _W - _RIGHT) / 2:.1f}" y="{_H - 6}" text-anchor="middle">{_esc(name)}</text>'
    return f'<g class="x-axis"><line class="axis" x1="{_LEFT}" x2="{_W - _RIGHT}" y1="{y}" y2="{y}"/>{ticks}{title}</g>'


def _figure(title: str, parts: list[str], names: list[str], note: str) -> str:
    legend = "".join(f'<span class="key" data-series="{_esc(n)}"><i style="background:{_PALETTE[i % len(_PALETTE)]}">'
                     f"</i>{_esc(n)}</span>" for i, n in enumerate(names))
    return (f'<figure class="chart"><figcaption>{_esc(title)}</figcaption>'
            f'<svg viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" role="img" aria-label="{_esc(title)}">'
            + "".join(parts) + f'</svg><div class="legend">{legend}</div>{note}</figure>')


# -- small helpers -----------------------------------------------------------------------------


def _section(key: str, heading: str, body: str) -> str:
    return f'<section id="{key}" data-section="{key}">\n<h2>{_esc(heading)}</h2>\n{body}\n</section>'


def _records(table: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not table:
        return []
    return [dict(zip(table["columns"], row)) for row in table["data"] if isinstance(row, list)]


def _at(series: Series, steps: list[int]) -> list[float]:
    values = dict(series)
    return [_finite(values.get(s, 0.0)) for s in steps]


def _finite(v: float) -> float:
    return v if math.isfinite(v) else 0.0


def _int(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1


def _step_label(step: int) -> str:
    return "base" if step == -1 else str(step)


def _num(v: float) -> str:
    return f"{v:.4g}"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v:.1%}"


def _when(ms: int | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ms / 1000)) if ms else "—"


def _duration(start_ms: int | None, end_ms: int | None) -> str:
    if not start_ms or not end_ms:
        return "—"
    minutes, seconds = divmod(round((end_ms - start_ms) / 1000), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def _esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


_CSS = """
body { font: 14px/1.45 "DejaVu Sans", "Liberation Sans", Arial, sans-serif; color: #1b1b1b; margin: 24px auto;
       max-width: 1180px; padding: 0 16px; }
h1 { font-size: 22px; margin: 0 0 12px; }
h2 { font-size: 17px; border-bottom: 1px solid #ddd; padding-bottom: 4px; margin: 28px 0 10px; }
h3 { font-size: 14px; margin: 16px 0 6px; }
section { clear: both; }
table { border-collapse: collapse; margin: 6px 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
thead th { background: #f4f4f4; }
table.summary th { background: #f4f4f4; width: 160px; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.text { white-space: pre-wrap; font-family: "DejaVu Sans Mono", monospace; font-size: 12px; max-width: 460px;
          overflow-wrap: anywhere; }
tr.total td { font-weight: bold; }
figure.chart { display: inline-block; margin: 0 18px 12px 0; vertical-align: top; }
figure.chart figcaption { font-weight: bold; margin-bottom: 2px; }
svg { background: #fff; overflow: visible; }
svg .grid { stroke: #eee; }
svg .axis { stroke: #888; }
svg .tick, svg .axis-name { font-size: 11px; fill: #555; }
.legend { font-size: 12px; }
.legend .key { margin-right: 14px; white-space: nowrap; }
.legend i { display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: -1px; }
.no-data, .none, .note { color: #777; font-style: italic; margin: 4px 0; }
"""
