"""A job report as one self-contained HTML page: the same numbers as the terminal report and a
timeline chart drawn as inline SVG (no script, no network, no external file).

The chart (``<svg id="timeline">``): time on the x axis (seconds since the job's first
event), one lane per rank on the y axis with the rank's declared phases as bars (``train``,
``checkpoint``, ``eval``, ``data``, ``init``; shard announcements as ticks, deaths as crosses),
and above them a ``job`` lane with the wall time's split (productive, recomputed, detection,
restore, ...). Generations are shaded; incidents (red) and resumes (green) are vertical lines
with labels. Every element has a ``<title>``, shown by browsers on hover.

Pure: no I/O (:func:`render_html` returns the page as a string).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from html import escape

from trainguard.daemon.forensics._report import JobReport, RankSpan
from trainguard.daemon.forensics._report_tables import (
    CAUSE_HEADER,
    DEFINITIONS,
    INCIDENT_HEADER,
    NUMERIC_COLUMNS,
    advice_rows,
    cause_rows,
    headline,
    incident_notes,
    incident_rows,
    time_rows,
)

__all__ = ["MAX_RANK_LANES", "render_html"]

MAX_RANK_LANES = 64
"""Ranks drawn at most: those named by incidents first, then the lowest."""

KIND_COLORS = {
    "productive": "#2e7d32",
    "recomputed": "#f9a825",
    "detection": "#c62828",
    "restore": "#6a1b9a",
    "startup": "#90a4ae",
    "tail": "#b0bec5",
    "stopped": "#78909c",
    "other": "#e0e0e0",
}
PHASE_COLORS = {
    "train": "#1565c0",
    "checkpoint": "#ef6c00",
    "eval": "#00897b",
    "data": "#8e24aa",
    "init": "#9e9e9e",
}

_WIDTH = 1100
_LEFT = 110
_RIGHT = 20
_TOP = 52
_JOB_LANE = 24
_RANK_LANE = 16
_GAP = 4
_AXIS = 34

_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: 1150px; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
table { border-collapse: collapse; margin: 8px 0; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f0f0f0; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
.notes, .defs { color: #555; font-size: 13px; }
.legend span { display: inline-block; margin-right: 14px; }
.legend i { display: inline-block; width: 12px; height: 12px; margin-right: 4px;
  vertical-align: -1px; }
svg text { font: 11px system-ui, sans-serif; }
"""


def render_html(report: JobReport) -> str:
    """The report as a complete HTML document (UTF-8 text)."""
    title = f"trainguard job report: {report.job_id}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        _table(("", ""), headline(report)),
        "<h2>Timeline</h2>",
        _chart(report),
        _legend(),
        "<h2>Where the wall time went</h2>",
        _table(("kind", "s", "share", "what"), time_rows(report)),
        "<h2>Incidents</h2>",
    ]
    if report.incidents:
        parts.append(_table(INCIDENT_HEADER, incident_rows(report)))
        notes = "".join(f"<li>{escape(n)}</li>" for n in incident_notes(report))
        parts.append(f'<ul class="notes">{notes}</ul>')
        parts += ["<h2>Incidents by cause</h2>", _table(CAUSE_HEADER, cause_rows(report))]
    else:
        parts.append("<p>None.</p>")
    parts += [
        "<h2>Checkpoint interval (Young-Daly)</h2>",
        _table(("", ""), advice_rows(report)),
        f'<p class="defs">{escape(DEFINITIONS)}</p>',
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """An HTML table; no header row when ``header`` is all empty."""
    head = ""
    if any(header):
        head = "<tr>" + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr>"
    right = {i for i, h in enumerate(header) if h in NUMERIC_COLUMNS}
    body = "".join(
        "<tr>"
        + "".join(
            f"<td{' class=n' if i in right else ''}>{escape(cell)}</td>"
            for i, cell in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table>{head}{body}</table>"


def _legend() -> str:
    items = [*KIND_COLORS.items(), *(("rank " + k, v) for k, v in PHASE_COLORS.items())]
    spans = "".join(f'<span><i style="background:{c}"></i>{escape(k)}</span>' for k, c in items)
    marks = (
        "<span>| shard announced</span><span>&#x2715; rank died</span>"
        '<span style="color:#c62828">&#x2502; incident</span>'
        '<span style="color:#2e7d32">&#x2502; resume</span>'
    )
    return f'<p class="legend">{spans}{marks}</p>'


def _lanes(report: JobReport) -> tuple[list[int], int]:
    """The ranks drawn (incident ranks first, then the lowest, at most
    :data:`MAX_RANK_LANES`) in ascending order, and how many ranks there are."""
    ranks = sorted({s.rank for s in report.ranks})
    named = [r for i in report.incidents for r in i.ranks if r in ranks]
    chosen: list[int] = []
    for r in [*named, *ranks]:
        if r not in chosen and len(chosen) < MAX_RANK_LANES:
            chosen.append(r)
    return sorted(chosen), len(ranks)


def _ticks(span_s: float) -> list[float]:
    """Round tick positions (seconds) for an axis of ``span_s`` seconds, about 10 of them."""
    if span_s <= 0:
        return [0.0]
    raw = span_s / 10
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [i * step for i in range(int(span_s / step) + 1)]


def _chart(report: JobReport) -> str:
    ranks, total = _lanes(report)
    start, end = report.start_ms, max(report.end_ms, report.start_ms + 1)
    plot = _WIDTH - _LEFT - _RIGHT
    lane_y = {r: _TOP + _JOB_LANE + 10 + i * (_RANK_LANE + _GAP) for i, r in enumerate(ranks)}
    bottom = _TOP + _JOB_LANE + 10 + len(ranks) * (_RANK_LANE + _GAP)
    height = bottom + _AXIS

    def x(ms: float) -> float:
        return _LEFT + (min(max(ms, start), end) - start) / (end - start) * plot

    def rel(ms: float) -> str:
        return f"{(ms - start) / 1000:.2f} s"

    out = [
        f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" '
        f'height="{height}" viewBox="0 0 {_WIDTH} {height}" role="img" '
        f'aria-label="timeline of job {escape(report.job_id)}">'
    ]
    for i, g in enumerate(report.generations):
        x0, x1 = x(g.start_ms), x(g.end_ms)
        fill = "#eef3f8" if i % 2 else "#f9f9f9"
        out.append(
            f'<rect x="{x0:.1f}" y="{_TOP - 14}" width="{max(x1 - x0, 0.5):.1f}" '
            f'height="{bottom - _TOP + 14}" fill="{fill}"><title>generation {g.generation}: '
            f"{rel(g.start_ms)} - {rel(g.end_ms)}, from step {g.from_step}</title></rect>"
        )
        out.append(f'<text x="{x0 + 3:.1f}" y="{_TOP - 4}" fill="#555">g{g.generation}</text>')
    out.append(f'<text x="4" y="{_TOP + 16}">job</text>')
    for seg in report.segments:
        x0, x1 = x(seg.start_ms), x(seg.end_ms)
        about = f" ({seg.incident_id})" if seg.incident_id else ""
        out.append(
            f'<rect class="seg" x="{x0:.1f}" y="{_TOP}" width="{max(x1 - x0, 0.5):.1f}" '
            f'height="{_JOB_LANE}" fill="{KIND_COLORS[seg.kind]}"><title>{seg.kind}{escape(about)}'
            f": {rel(seg.start_ms)} - {rel(seg.end_ms)} "
            f"({(seg.end_ms - seg.start_ms) / 1000:.2f} s)</title></rect>"
        )
    for rank, y in lane_y.items():
        out.append(f'<text x="4" y="{y + 12}">rank {rank}</text>')
    for span in report.ranks:
        if span.rank in lane_y:
            out.append(_span(span, x(span.start_ms), x(span.end_ms), lane_y[span.rank], rel))
    for m in report.marks:
        if m.kind == "committed" or m.rank not in lane_y:
            continue
        y, at = lane_y[m.rank], x(m.at_ms)
        tip = f"<title>rank {m.rank}: {escape(m.label)} at {rel(m.at_ms)}</title>"
        if m.kind == "checkpoint":
            out.append(
                f'<line x1="{at:.1f}" x2="{at:.1f}" y1="{y - 2}" y2="{y + _RANK_LANE + 2}" '
                f'stroke="#222" stroke-width="1">{tip}</line>'
            )
        else:
            color = "#c62828" if m.kind == "exited" else "#ef6c00"
            out.append(
                f'<text x="{at - 4:.1f}" y="{y + 12}" fill="{color}" font-weight="bold">'
                f"&#x2715;{tip}</text>"
            )
    for i, inc in enumerate(report.incidents):
        at = x(inc.opened_ms)
        label = f"{inc.incident_id.rsplit('/', 1)[-1]} {inc.cause}"
        out.append(_vline(at, bottom, "#c62828", f"{label}: {inc.reason}", label, 2 * i))
        resumed = inc.opened_ms + inc.restore_s * 1000
        if inc.outcome == "resumed":
            text = f"resume from step {inc.target_step}"
            out.append(_vline(x(resumed), bottom, "#2e7d32", text, text, 2 * i + 1))
    for t in _ticks((end - start) / 1000):
        at = x(start + t * 1000)
        out.append(
            f'<line x1="{at:.1f}" x2="{at:.1f}" y1="{bottom}" y2="{bottom + 5}" stroke="#555"/>'
            f'<text x="{at:.1f}" y="{bottom + 17}" text-anchor="middle">{t:g}</text>'
        )
    out.append(
        f'<text x="{_LEFT + plot / 2:.1f}" y="{bottom + 31}" text-anchor="middle">'
        "seconds since the job's first event</text>"
    )
    if total > len(ranks):
        out.append(
            f'<text x="{_LEFT}" y="{height - 2}" fill="#555">showing {len(ranks)} of {total} '
            "ranks</text>"
        )
    out.append("</svg>")
    return "\n".join(out)


def _span(span: RankSpan, x0: float, x1: float, y: int, rel: Callable[[float], str]) -> str:
    steps = (
        f"step {span.first_step}"
        if span.first_step == span.last_step
        else f"steps {span.first_step}-{span.last_step}"
    )
    tip = (
        f"rank {span.rank}, generation {span.generation}, {span.phase}, {steps}: "
        f"{rel(span.start_ms)} - {rel(span.end_ms)}"
    )
    width = max(x1 - x0, 0.5)
    rect = (
        f'<rect class="span" x="{x0:.1f}" y="{y}" width="{width:.1f}" height="{_RANK_LANE}" '
        f'fill="{PHASE_COLORS.get(span.phase, "#607d8b")}"><title>{escape(tip)}</title></rect>'
    )
    if span.phase == "train" and width > 60:
        rect += (
            f'<text x="{x0 + 3:.1f}" y="{y + 12}" fill="#fff">'
            f"{span.first_step}-{span.last_step}</text>"
        )
    return rect


def _vline(at: float, bottom: int, color: str, tip: str, label: str, index: int) -> str:
    """A vertical line over every lane with a label above the chart (staggered by
    ``index`` so that close incidents stay readable)."""
    y = 12 + (index % 2) * 13
    return (
        f'<line x1="{at:.1f}" x2="{at:.1f}" y1="{y + 3}" y2="{bottom}" stroke="{color}" '
        f'stroke-width="1.5" stroke-dasharray="4 2"><title>{escape(tip)}</title></line>'
        f'<text x="{at + 3:.1f}" y="{y}" fill="{color}">{escape(label)}</text>'
    )
