"""Reading a job's recorded log back: replay, timeline, export, status and report.

A job's log is read from a bus or an export file (:mod:`._job_log`, :mod:`._export_file`,
:mod:`._export_stream`) and folded through the same pure core the daemon runs
(:mod:`._replay`), which must reproduce the daemon's audit trail exactly; :mod:`._timeline`
prints what a replay found. ``trainguard status`` folds the bus the same way
(:mod:`._status`). The report (:mod:`._report`, with :mod:`._report_record`,
:mod:`._report_lanes`, :mod:`._report_tables`, :mod:`._report_html`) turns a job's record into
goodput, incidents and their causes; :mod:`._young_daly` holds the optimum checkpoint
interval and the goodput model the report and ``trainguard sim`` compare against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import lazy_loader

if TYPE_CHECKING:
    from trainguard.daemon.forensics._export_file import ExportHeader as ExportHeader
    from trainguard.daemon.forensics._export_file import ImportRefused as ImportRefused
    from trainguard.daemon.forensics._export_file import MalformedExport as MalformedExport
    from trainguard.daemon.forensics._export_file import dump as dump
    from trainguard.daemon.forensics._export_file import import_file as import_file
    from trainguard.daemon.forensics._job_log import JobLog as JobLog
    from trainguard.daemon.forensics._job_log import UnknownJob as UnknownJob
    from trainguard.daemon.forensics._job_log import Window as Window
    from trainguard.daemon.forensics._job_log import parse_time as parse_time
    from trainguard.daemon.forensics._job_log import read_bus as read_bus
    from trainguard.daemon.forensics._job_log import read_file as read_file
    from trainguard.daemon.forensics._job_log import replay_file as replay_file
    from trainguard.daemon.forensics._replay import Replay as Replay
    from trainguard.daemon.forensics._replay import replay as replay
    from trainguard.daemon.forensics._replay import verify as verify
    from trainguard.daemon.forensics._replay import what_if as what_if
    from trainguard.daemon.forensics._report import JobReport as JobReport
    from trainguard.daemon.forensics._report import build_report as build_report
    from trainguard.daemon.forensics._report_html import render_html as render_html
    from trainguard.daemon.forensics._report_record import AuditDigest as AuditDigest
    from trainguard.daemon.forensics._report_record import read_audit as read_audit
    from trainguard.daemon.forensics._report_tables import CAUSE_HEADER as CAUSE_HEADER
    from trainguard.daemon.forensics._report_tables import DEFINITIONS as DEFINITIONS
    from trainguard.daemon.forensics._report_tables import INCIDENT_HEADER as INCIDENT_HEADER
    from trainguard.daemon.forensics._report_tables import NUMERIC_COLUMNS as NUMERIC_COLUMNS
    from trainguard.daemon.forensics._report_tables import advice_rows as advice_rows
    from trainguard.daemon.forensics._report_tables import cause_rows as cause_rows
    from trainguard.daemon.forensics._report_tables import headline as headline
    from trainguard.daemon.forensics._report_tables import incident_notes as incident_notes
    from trainguard.daemon.forensics._report_tables import incident_rows as incident_rows
    from trainguard.daemon.forensics._report_tables import time_rows as time_rows
    from trainguard.daemon.forensics._status import job_summary as job_summary
    from trainguard.daemon.forensics._status import rank_summaries as rank_summaries
    from trainguard.daemon.forensics._status import read_status as read_status
    from trainguard.daemon.forensics._status import read_topic as read_topic
    from trainguard.daemon.forensics._timeline import change_json as change_json
    from trainguard.daemon.forensics._timeline import difference_json as difference_json
    from trainguard.daemon.forensics._timeline import iso as iso
    from trainguard.daemon.forensics._timeline import print_config_change as print_config_change
    from trainguard.daemon.forensics._timeline import print_difference as print_difference
    from trainguard.daemon.forensics._timeline import print_timeline as print_timeline
    from trainguard.daemon.forensics._timeline import print_what_if as print_what_if
    from trainguard.daemon.forensics._timeline import row_json as row_json
    from trainguard.daemon.forensics._young_daly import DALY_SOURCE as DALY_SOURCE
    from trainguard.daemon.forensics._young_daly import YOUNG_SOURCE as YOUNG_SOURCE
    from trainguard.daemon.forensics._young_daly import daly_interval_s as daly_interval_s
    from trainguard.daemon.forensics._young_daly import model_goodput as model_goodput
    from trainguard.daemon.forensics._young_daly import young_interval_s as young_interval_s

# Each name is imported on first use (PEP 562), so that one command (or the export reader
# process) imports only the modules it uses.
__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "_export_file": ["ExportHeader", "ImportRefused", "MalformedExport", "dump", "import_file"],
        "_job_log": [
            "JobLog",
            "UnknownJob",
            "Window",
            "parse_time",
            "read_bus",
            "read_file",
            "replay_file",
        ],
        "_replay": ["Replay", "replay", "verify", "what_if"],
        "_report": ["JobReport", "build_report"],
        "_report_html": ["render_html"],
        "_report_record": ["AuditDigest", "read_audit"],
        "_report_tables": [
            "CAUSE_HEADER",
            "DEFINITIONS",
            "INCIDENT_HEADER",
            "NUMERIC_COLUMNS",
            "advice_rows",
            "cause_rows",
            "headline",
            "incident_notes",
            "incident_rows",
            "time_rows",
        ],
        "_status": ["job_summary", "rank_summaries", "read_status", "read_topic"],
        "_timeline": [
            "change_json",
            "difference_json",
            "iso",
            "print_config_change",
            "print_difference",
            "print_timeline",
            "print_what_if",
            "row_json",
        ],
        "_young_daly": [
            "DALY_SOURCE",
            "YOUNG_SOURCE",
            "daly_interval_s",
            "model_goodput",
            "young_interval_s",
        ],
    },
)
