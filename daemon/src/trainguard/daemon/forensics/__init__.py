"""Reading a job's recorded log back: replay, timeline, export, status and report.

A job's log is read from a bus or an export file (:mod:`._job_log`, :mod:`._export_file`,
:mod:`._export_stream`) and folded through the same pure core the daemon runs
(:mod:`._replay`), which must reproduce the daemon's audit trail exactly; :mod:`._timeline`
prints what a replay found. ``trainguard status`` folds the bus the same way
(:mod:`._status`). The report (:mod:`._report`, with :mod:`._report_record`,
:mod:`._report_lanes`, :mod:`._report_tables`, :mod:`._report_html`) turns a job's record into
goodput, incidents and their causes.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainguard.daemon.forensics._export_file import (
        ExportHeader,
        ImportRefused,
        MalformedExport,
        dump,
        import_file,
    )
    from trainguard.daemon.forensics._job_log import (
        JobLog,
        UnknownJob,
        Window,
        parse_time,
        read_bus,
        read_file,
        replay_file,
    )
    from trainguard.daemon.forensics._replay import (
        Replay,
        replay,
        verify,
        what_if,
    )
    from trainguard.daemon.forensics._report import (
        JobReport,
        build_report,
    )
    from trainguard.daemon.forensics._report_html import (
        render_html,
    )
    from trainguard.daemon.forensics._report_record import (
        AuditDigest,
        read_audit,
    )
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
    from trainguard.daemon.forensics._status import (
        job_summary,
        rank_summaries,
        read_status,
        read_topic,
    )
    from trainguard.daemon.forensics._timeline import (
        change_json,
        difference_json,
        iso,
        print_config_change,
        print_difference,
        print_timeline,
        print_what_if,
        row_json,
    )

_LAZY: dict[str, str] = {
    "ExportHeader": "trainguard.daemon.forensics._export_file",
    "ImportRefused": "trainguard.daemon.forensics._export_file",
    "MalformedExport": "trainguard.daemon.forensics._export_file",
    "dump": "trainguard.daemon.forensics._export_file",
    "import_file": "trainguard.daemon.forensics._export_file",
    "JobLog": "trainguard.daemon.forensics._job_log",
    "UnknownJob": "trainguard.daemon.forensics._job_log",
    "Window": "trainguard.daemon.forensics._job_log",
    "parse_time": "trainguard.daemon.forensics._job_log",
    "read_bus": "trainguard.daemon.forensics._job_log",
    "read_file": "trainguard.daemon.forensics._job_log",
    "replay_file": "trainguard.daemon.forensics._job_log",
    "Replay": "trainguard.daemon.forensics._replay",
    "replay": "trainguard.daemon.forensics._replay",
    "verify": "trainguard.daemon.forensics._replay",
    "what_if": "trainguard.daemon.forensics._replay",
    "JobReport": "trainguard.daemon.forensics._report",
    "build_report": "trainguard.daemon.forensics._report",
    "render_html": "trainguard.daemon.forensics._report_html",
    "AuditDigest": "trainguard.daemon.forensics._report_record",
    "read_audit": "trainguard.daemon.forensics._report_record",
    "CAUSE_HEADER": "trainguard.daemon.forensics._report_tables",
    "DEFINITIONS": "trainguard.daemon.forensics._report_tables",
    "INCIDENT_HEADER": "trainguard.daemon.forensics._report_tables",
    "NUMERIC_COLUMNS": "trainguard.daemon.forensics._report_tables",
    "advice_rows": "trainguard.daemon.forensics._report_tables",
    "cause_rows": "trainguard.daemon.forensics._report_tables",
    "headline": "trainguard.daemon.forensics._report_tables",
    "incident_notes": "trainguard.daemon.forensics._report_tables",
    "incident_rows": "trainguard.daemon.forensics._report_tables",
    "time_rows": "trainguard.daemon.forensics._report_tables",
    "job_summary": "trainguard.daemon.forensics._status",
    "rank_summaries": "trainguard.daemon.forensics._status",
    "read_status": "trainguard.daemon.forensics._status",
    "read_topic": "trainguard.daemon.forensics._status",
    "change_json": "trainguard.daemon.forensics._timeline",
    "difference_json": "trainguard.daemon.forensics._timeline",
    "iso": "trainguard.daemon.forensics._timeline",
    "print_config_change": "trainguard.daemon.forensics._timeline",
    "print_difference": "trainguard.daemon.forensics._timeline",
    "print_timeline": "trainguard.daemon.forensics._timeline",
    "print_what_if": "trainguard.daemon.forensics._timeline",
    "row_json": "trainguard.daemon.forensics._timeline",
}
"""Each public name -> the module that defines it; imported on first use, so that one command (or the export reader process) imports only
the modules it uses."""


def __getattr__(name: str) -> Any:
    """The names of :data:`_LAZY`, imported when first asked for (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "CAUSE_HEADER",
    "DEFINITIONS",
    "INCIDENT_HEADER",
    "NUMERIC_COLUMNS",
    "AuditDigest",
    "ExportHeader",
    "ImportRefused",
    "JobLog",
    "JobReport",
    "MalformedExport",
    "Replay",
    "UnknownJob",
    "Window",
    "advice_rows",
    "build_report",
    "cause_rows",
    "change_json",
    "difference_json",
    "dump",
    "headline",
    "import_file",
    "incident_notes",
    "incident_rows",
    "iso",
    "job_summary",
    "parse_time",
    "print_config_change",
    "print_difference",
    "print_timeline",
    "print_what_if",
    "rank_summaries",
    "read_audit",
    "read_bus",
    "read_file",
    "read_status",
    "read_topic",
    "render_html",
    "replay",
    "replay_file",
    "row_json",
    "time_rows",
    "verify",
    "what_if",
]
