"""A job report's numbers as rows of text, shared by the terminal (rich) and HTML renderers
so that both say exactly the same. Pure: no I/O.
"""

from __future__ import annotations

from datetime import UTC, datetime

from trainguard.daemon.forensics._report import CheckpointAdvice, JobReport

__all__ = [
    "CAUSE_HEADER",
    "DEFINITIONS",
    "INCIDENT_HEADER",
    "KIND_NOTES",
    "NUMERIC_COLUMNS",
    "advice_rows",
    "cause_rows",
    "clock",
    "headline",
    "incident_notes",
    "incident_rows",
    "seconds",
    "time_rows",
]

KIND_NOTES = {
    "productive": "advancing steps that survive in the final timeline",
    "recomputed": "advancing steps a later restore threw away",
    "detection": "failure onset -> incident",
    "restore": "incident -> resume (restart, load, barrier)",
    "startup": "first event -> first training step",
    "tail": "last step -> end (final save, shutdown)",
    "stopped": "stopped on request -> continued (or end)",
    "other": "not explained by the record",
}
"""What each kind of wall time is, in a few words."""

DEFINITIONS = (
    "Times are bus append times. Productive: time a generation spent advancing steps that "
    "survive in the final timeline. Recomputed: time spent on steps a restore threw away. "
    "Detection: estimated failure onset to the incident (per cause: exit report, last step "
    "advance, last event heard, first non-finite loss, or the last step known good). Restore: "
    "incident to the resume of the generation that took over. Goodput = productive / wall. "
    "See docs/forensics.md."
)

INCIDENT_HEADER = (
    "id",
    "cause",
    "gen",
    "ranks",
    "detect s",
    "restore s",
    "target",
    "redo steps",
    "redo s",
    "lost s",
)
"""Columns of :func:`incident_rows`: detection and restore time, the step restored to, the
steps recomputed and their time, the total lost (seconds)."""

CAUSE_HEADER = ("cause", "incidents", "lost s")
"""Columns of :func:`cause_rows`."""

NUMERIC_COLUMNS = frozenset(
    {"gen", "detect s", "restore s", "redo steps", "redo s", "lost s", "incidents", "s", "share"}
)
"""Columns aligned to the right."""


def seconds(value: float | None, digits: int = 2) -> str:
    """``"12.35"`` (seconds), ``"-"`` for ``None``."""
    return "-" if value is None else f"{value:.{digits}f}"


def clock(ms: int) -> str:
    """A time in ms since the epoch as ISO 8601 UTC with milliseconds."""
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


def headline(report: JobReport) -> list[tuple[str, str]]:
    """The job's identity and size: ``(label, value)`` pairs."""
    steps = f"{report.first_step} -> {report.final_step}"
    if report.steps_recomputed:
        steps += f" ({report.steps_recomputed} recomputed)"
    return [
        ("job", report.job_id),
        ("ended", report.ended),
        ("from", clock(report.start_ms)),
        ("to", clock(report.end_ms)),
        ("wall time", f"{seconds(report.wall_s)} s"),
        ("goodput", f"{report.goodput:.1%} (productive / wall)"),
        ("ranks", str(report.world_size)),
        ("steps", steps),
        ("median step time", f"{seconds(report.step_time_s, 3)} s"),
    ]


def time_rows(report: JobReport) -> list[tuple[str, str, str, str]]:
    """``(kind, seconds, share of the wall time, what it is)`` per kind of wall time (``other``
    only when non-zero), then the wall time."""
    wall = report.wall_s
    rows = [
        (kind, seconds(value), f"{value / wall:.1%}" if wall else "-", KIND_NOTES[kind])
        for kind, value in report.time_s.items()
        if kind != "other" or value > 0
    ]
    rows.append(("wall", seconds(wall), "100.0%" if wall else "-", "first event -> end"))
    return rows


def incident_rows(report: JobReport) -> list[tuple[str, ...]]:
    """One row per incident, columns as :data:`INCIDENT_HEADER`."""
    rows: list[tuple[str, ...]] = []
    for i in report.incidents:
        if i.target_step is None:
            target = "none"
        elif i.target_snapshot is None:
            target = "scratch"
        else:
            target = f"s{i.target_step}"
        if i.attempts > 1:
            target += f" ({i.attempts} tries)"
        if i.outcome not in ("resumed", None):
            target += f", {i.outcome}"
        rows.append(
            (
                _short(i.incident_id),
                i.cause,
                str(i.generation),
                ", ".join(map(str, i.ranks)) or "-",
                seconds(i.detection_s, 3),
                seconds(i.restore_s),
                target,
                str(i.recomputed_steps),
                seconds(i.recomputed_s),
                seconds(i.lost_s),
            )
        )
    return rows


def incident_notes(report: JobReport) -> list[str]:
    """Per incident: its hosts, how its detection time was estimated, and its reason."""
    notes = []
    for i in report.incidents:
        hosts = f"on {', '.join(i.hosts)}; " if i.hosts else ""
        notes.append(f"{_short(i.incident_id)}: {hosts}onset = {i.onset_evidence}. {i.reason}")
    return notes


def _short(incident_id: str) -> str:
    """``"i3"`` for ``"<job>/i3"``."""
    return incident_id.rsplit("/", 1)[-1]


def cause_rows(report: JobReport) -> list[tuple[str, str, str]]:
    """``(cause, incidents, seconds lost)`` per cause, most frequent first."""
    lost: dict[str, float] = {}
    for i in report.incidents:
        lost[i.cause] = lost.get(i.cause, 0.0) + i.lost_s
    ordered = sorted(report.causes.items(), key=lambda item: (-item[1], item[0]))
    return [(cause, str(count), seconds(lost[cause])) for cause, count in ordered]


def advice_rows(report: JobReport) -> list[tuple[str, str]]:
    """The checkpoint interval the job used next to Young's and Daly's, with the inputs
    ``C`` and ``M`` and the formulas' sources: ``(label, value)`` pairs."""
    a = report.checkpoint

    def interval(value_s: float | None, steps: float | None) -> str:
        if value_s is None:
            return "- (no checkpoint cost measured)"
        bound = ">= " if a.mtbf_is_lower_bound else ""
        in_steps = f" = {bound}{steps:.1f} steps" if steps is not None else ""
        return f"{bound}{value_s:.2f} s{in_steps}"

    used = "-"
    if a.interval_steps is not None:
        used = f"every {a.interval_steps:g} steps ({seconds(a.interval_s)} s)"
    if a.mtbf_is_lower_bound:
        mtbf = (
            f"unknown: no failure observed, so M > {seconds(a.exposure_s)} s "
            "(the time the job ran); the intervals below are lower bounds"
        )
    else:
        failures = f"{a.failures} failure{'s' if a.failures > 1 else ''}"
        mtbf = f"{seconds(a.mtbf_s)} s ({failures} in {seconds(a.exposure_s)} s running)"
    return [
        ("checkpoints taken", f"{a.checkpoints}, {used}"),
        ("checkpoint cost C", f"{seconds(a.cost_s, 3)} s from {a.cost_source}"),
        ("mean time between failures M", mtbf),
        ("Young's interval", f"{interval(a.young_s, a.young_steps)}; tau = sqrt(2 C M)"),
        (
            "Daly's interval",
            f"{interval(a.daly_s, a.daly_steps)}; tau = sqrt(2 C M) (1 + sqrt(C / 2M) / 3 "
            "+ C / 18M) - C",
        ),
        ("downtime per failure D + R", _downtime(a)),
        ("goodput: measured / model", _goodput_vs_model(report)),
        ("sources", "; ".join(a.sources)),
    ]


def _downtime(a: CheckpointAdvice) -> str:
    if a.downtime_s is None:
        return "- (no incident)"
    return f"{seconds(a.downtime_s)} s (mean detection + restore of the incidents)"


def _goodput_vs_model(report: JobReport) -> str:
    """The measured goodput next to the first-order model's, at the job's interval and at
    Young's (``1 - C / tau - tau / 2M - (D + R) / M``)."""
    a = report.checkpoint
    measured = f"{report.goodput:.1%}"
    if a.model_goodput_young is None:
        return f"{measured} / - (the model needs a failure and a checkpoint cost)"
    own = "-" if a.model_goodput is None else f"{a.model_goodput:.1%}"
    return (
        f"{measured} / {own} at the job's interval, {a.model_goodput_young:.1%} at Young's; "
        "model = 1 - C / tau - tau / 2M - (D + R) / M"
    )
