"""The report's page: one self-contained HTML document (header, curves, stage times, verdicts, alerts,
generations) rendered from :class:`RunData`, what the report reads from MLflow."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from rlpipe.tracking.report_charts import Series, esc, line_chart, stacked_bars, step_label

# Curve sections: id, heading, charts (title, metrics drawn together on one y axis).
CURVES: tuple[tuple[str, str, tuple[tuple[str, tuple[str, ...]], ...]], ...] = (
    ("reward", "Reward", (("training reward and accuracy", ("reward_mean", "accuracy")),)),
    ("heldout", "Held-out accuracy", (("held-out and validation accuracy (base policy at −1)",
                                       ("heldout_accuracy", "validation_accuracy")),)),
    ("kl", "KL", (("KL to the reference policy", ("kl",)), ("KL coefficient", ("kl_coef",)))),
    ("entropy", "Entropy", (("policy entropy (nats per token)", ("entropy",)),)),
    ("lengths", "Lengths", (("mean response length (tokens)", ("response_length_mean",)),
                            ("share of responses cut at max_new_tokens", ("truncated_share",)))),
)
WANTED = frozenset(m for _, _, charts in CURVES for _, metrics in charts for m in metrics)
_STAGES = ("generate", "verify", "update", "sync", "eval", "save")
METRIC_PREFIXES = ("status_", "alerts/", "time/")
_NO_DATA = '<p class="no-data">no data</p>'
_CELL_CHARS = 4000  # a generation longer than this is cut in the table (MLflow has the whole text)


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


def render(d: RunData) -> str:
    """The whole page: header, curves, stage times, verdicts, alerts, generations."""
    sections = [_header(d)]
    sections += [_curve_section(d, key, heading, charts) for key, heading, charts in CURVES]
    sections += [_stage_section(d), _verdict_section(d), _alert_section(d), _generation_section(d)]
    title = esc(f"rlpipe report — {d.rlpipe_run_id}")
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
    body = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows)
    notes = "".join(f'<p class="note">{esc(n)}</p>' for n in d.notes)
    return f'<section id="summary" data-section="summary">\n<table class="summary">{body}</table>{notes}\n</section>'


def _accuracy_change(base: float | None, final: float | None) -> str:
    if base is None and final is None:
        return "—"
    if base is None or final is None:
        return f"base {_pct(base)} → final {_pct(final)}"
    return f"base {_pct(base)} → final {_pct(final)} ({(final - base) * 100:+.1f} points)"


def _curve_section(d: RunData, key: str, heading: str, charts: tuple[tuple[str, tuple[str, ...]], ...]) -> str:
    """Metrics the run does not have are left out of their chart; a section with none says so."""
    figures = [line_chart(title, {m: d.metrics[m] for m in metrics if d.metrics.get(m)}) for title, metrics in charts]
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
    chart = stacked_bars("seconds per iteration, by stage", steps, stacks, lambda v: f"{v:.3g} s")
    return _section("stages", "Stage time", chart + _stage_table(stacks))


def _stage_table(stacks: dict[str, list[float]]) -> str:
    sums = {k: sum(v) for k, v in stacks.items()}
    whole = sum(sums.values()) or 1.0
    rows = "".join(f'<tr data-stage="{esc(k)}"><td>{esc(k)}</td><td class="num">{v:.2f}</td>'
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
    chart = stacked_bars("share of samples by verifier status", steps, {k: v for k, v in stacks.items() if any(v)},
                          lambda v: f"{v:.1%}")
    note = f'<p class="note">no sample was {esc(", ".join(never))} at any iteration</p>' if never else ""
    return _section("verdicts", "Verdict statuses", chart + note)


def _alert_section(d: RunData) -> str:
    rows = _alert_rows(d)
    checked = sorted(k.removeprefix("alerts/") for k in d.metrics if k.startswith("alerts/"))
    if not rows:
        if d.alerts is None and not checked:
            return _section("alerts", "Alerts", _NO_DATA)
        rules = f" (rules checked: {', '.join(checked)})" if checked else ""
        return _section("alerts", "Alerts", f'<p class="none">no alerts raised{esc(rules)}</p>')
    body = "".join(f"<tr><td class=\"num\">{step_label(it)}</td><td>{esc(rule)}</td><td>{esc(sev)}</td>"
                   f"<td>{esc(msg)}</td></tr>" for it, rule, sev, msg in rows)
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
        head = "".join(f"<th>{esc(c)}</th>" for c in columns)
        body = "".join("<tr>" + "".join(_cell(c, r.get(c)) for c in columns) + "</tr>" for r in groups[it])
        title = "base policy (before training)" if it == -1 else f"iteration {it}"
        parts.append(f'<h3>{esc(title)}</h3>\n<table class="generations" data-iteration="{it}">'
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
    return f'<td class="text" data-column="{esc(column)}">{esc(text)}</td>'


def _section(key: str, heading: str, body: str) -> str:
    return f'<section id="{key}" data-section="{key}">\n<h2>{esc(heading)}</h2>\n{body}\n</section>'


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


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v:.1%}"


def _when(ms: int | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ms / 1000)) if ms else "—"


def _duration(start_ms: int | None, end_ms: int | None) -> str:
    if not start_ms or not end_ms:
        return "—"
    minutes, seconds = divmod(round((end_ms - start_ms) / 1000), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


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
