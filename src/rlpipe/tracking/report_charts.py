"""The report's charts: inline SVG drawn by hand, so the page loads nothing and a browser test can inspect
each chart like any element (a metric is a ``<polyline data-series="<metric>">`` with one ``<circle>`` a
point carrying a ``<title>`` tooltip; a stacked-bar segment is a ``<rect data-series="<metric>">``)."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Any

Series = list[tuple[int, float]]  # (step, value) by step; step -1 is the base policy

_PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf")
# The chart's size and its margins, in px.
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


def line_chart(title: str, series: dict[str, Series]) -> str:
    """One polyline per metric (non-finite values left out, and counted under the chart)."""
    points = {m: [(x, y) for x, y in s if math.isfinite(y)] for m, s in series.items()}
    points = {m: p for m, p in points.items() if p}
    if not points:
        return ""
    xs = [x for p in points.values() for x, _ in p]
    ys = [y for p in points.values() for _, y in p]
    sx = _step_axis(min(xs), max(xs), (_LEFT, _W - _RIGHT))
    sy = _value_axis(min(ys), max(ys), (_H - _BOTTOM, _TOP))
    x_labels = [(sx(t), step_label(int(t))) for t in sx.ticks]
    parts = [_y_axis(sy, _num), _x_axis(x_labels, "iteration")]
    for i, (metric, p) in enumerate(points.items()):
        color, name = _PALETTE[i % len(_PALETTE)], esc(metric)
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in p)
        dash = ' stroke-dasharray="6 4"' if i % 2 else ""  # a series drawn over another stays visible
        parts.append(f'<polyline data-series="{name}" points="{coords}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        parts += [f'<circle data-series="{name}" cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}">'
                  f"<title>{name}, {step_label(x)}: {_num(y)}</title></circle>" for x, y in p]
    dropped = sum(len(s) for s in series.values()) - len(xs)
    note = f'<p class="note">{dropped} non-finite value(s) not drawn</p>' if dropped else ""
    return _figure(title, parts, list(points), note)


def stacked_bars(title: str, steps: list[int], stacks: dict[str, list[float]], fmt: Any) -> str:
    """One bar per step, one ``rect`` per (step, series) stacked bottom-up in the order of ``stacks``."""
    totals = [sum(v[j] for v in stacks.values()) for j in range(len(steps))]
    sy = _value_axis(0.0, max(totals) or 1.0, (_H - _BOTTOM, _TOP))
    band = (_W - _LEFT - _RIGHT) / len(steps)
    every = max(1, math.ceil(len(steps) / 12))  # at most ~12 labels under the bars
    labels = [(_LEFT + (j + 0.5) * band, step_label(s)) for j, s in enumerate(steps) if j % every == 0]
    parts = [_y_axis(sy, _num), _x_axis(labels, "iteration")]
    for j, step in enumerate(steps):
        below = 0.0
        for i, (name, values) in enumerate(stacks.items()):
            v = values[j]
            if v <= 0:
                continue
            top, bottom = sy(below + v), sy(below)
            share = f" ({v / totals[j]:.0%})" if totals[j] else ""
            parts.append(f'<rect data-series="{esc(name)}" x="{_LEFT + j * band + band * 0.15:.1f}" y="{top:.1f}" '
                         f'width="{band * 0.7:.1f}" height="{bottom - top:.1f}" fill="{_PALETTE[i % len(_PALETTE)]}">'
                         f"<title>{esc(name)}, {step_label(step)}: {esc(fmt(v))}{share}</title></rect>")
            below += v
    return _figure(title, parts, list(stacks), "")


def _y_axis(sy: _Axis, fmt: Any) -> str:
    grid = "".join(f'<line class="grid" x1="{_LEFT}" x2="{_W - _RIGHT}" y1="{sy(t):.1f}" y2="{sy(t):.1f}"/>'
                   f'<text class="tick" x="{_LEFT - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">{esc(fmt(t))}</text>'
                   for t in sy.ticks)
    return f'<g class="y-axis">{grid}<line class="axis" x1="{_LEFT}" x2="{_LEFT}" y1="{_TOP}" y2="{_H - _BOTTOM}"/></g>'


def _x_axis(labels: list[tuple[float, str]], name: str) -> str:
    y = _H - _BOTTOM
    ticks = "".join(f'<line class="axis" x1="{x:.1f}" x2="{x:.1f}" y1="{y}" y2="{y + 4}"/>'
                    f'<text class="tick" x="{x:.1f}" y="{y + 16}" text-anchor="middle">{esc(label)}</text>'
                    for x, label in labels)
    title = f'<text class="axis-name" x="{(_LEFT + _W - _RIGHT) / 2:.1f}" y="{_H - 6}" text-anchor="middle">{esc(name)}</text>'
    return f'<g class="x-axis"><line class="axis" x1="{_LEFT}" x2="{_W - _RIGHT}" y1="{y}" y2="{y}"/>{ticks}{title}</g>'


def _figure(title: str, parts: list[str], names: list[str], note: str) -> str:
    legend = "".join(f'<span class="key" data-series="{esc(n)}"><i style="background:{_PALETTE[i % len(_PALETTE)]}">'
                     f"</i>{esc(n)}</span>" for i, n in enumerate(names))
    return (f'<figure class="chart"><figcaption>{esc(title)}</figcaption>'
            f'<svg viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" role="img" aria-label="{esc(title)}">'
            + "".join(parts) + f'</svg><div class="legend">{legend}</div>{note}</figure>')


def step_label(step: int) -> str:
    return "base" if step == -1 else str(step)


def _num(v: float) -> str:
    return f"{v:.4g}"


def esc(text: Any) -> str:
    return html.escape(str(text), quote=True)
