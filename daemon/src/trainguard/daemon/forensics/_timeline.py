"""How ``trainguard replay`` shows a replay: terminal text (rich) and JSON Lines for tools.

Text: one line per input (UTC time, seconds since the job's first record, offset, rank, what
the input said, and the phase change it caused), each decision on an indented line below it
with its reason. Runs of heartbeats and ticks that decided nothing fold into one dim line
unless every input is asked for. JSON Lines: one object per line, ``type`` first (``row``,
``verdict``, ``config``, ``change``, ``what_if``), times as ms since the Unix epoch and as ISO
8601 (UTC).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import orjson
from rich.console import Console
from rich.text import Text

from trainguard.daemon.core import (
    Anomaly,
    Committed,
    Decision,
    IncidentClosed,
    IncidentOpened,
    Issue,
    JobFailed,
    Rejected,
    Transition,
)
from trainguard.daemon.forensics._replay import Change, Difference, Row, WhatIf
from trainguard.schemas import JSONValue, Restore

__all__ = [
    "change_json",
    "describe",
    "difference_json",
    "iso",
    "print_config_change",
    "print_difference",
    "print_timeline",
    "print_what_if",
    "row_json",
]

_NS_PER_MS = 1_000_000
_QUIET = frozenset({"heartbeat", "heartbeat-batch", "tick", "synthetic-tick"})
"""Row kinds folded into one line when they decide nothing."""
_ROUTINE = frozenset({"stale_generation", "duplicate"})
"""Rejections folded with them."""


def iso(at_ms: int) -> str:
    """``at_ms`` (ms since the Unix epoch) as ISO 8601 UTC with milliseconds."""
    moment = datetime.fromtimestamp(at_ms / 1000, UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _clock(at_ns: int) -> str:
    return iso(at_ns // _NS_PER_MS)[11:23]


def _since(at_ns: int, origin_ns: int) -> str:
    return f"+{(at_ns - origin_ns) / 1e9:.3f}"


def describe(decision: Decision) -> str:
    """One line on a decision and its reason."""
    match decision:
        case Transition():
            return (
                f"{decision.old} → {decision.new}, generation {decision.generation}: "
                f"{decision.reason}"
            )
        case Committed():
            m = decision.manifest
            return f"committed step {m.step} ({m.snapshot_id}): {decision.reason}"
        case IncidentOpened():
            ranks = ",".join(map(str, decision.ranks)) or "-"
            return (
                f"incident {decision.incident_id} opened ({decision.cause}, ranks {ranks}): "
                f"{decision.reason}"
            )
        case IncidentClosed():
            return (
                f"incident {decision.incident_id} closed: {decision.outcome} after "
                f"{decision.attempts} attempt(s)"
            )
        case Issue(command=Restore() as c):
            target = (
                "from scratch"
                if c.target is None
                else f"to {c.target.snapshot_id} (step {c.target.step})"
            )
            at = f" at step {c.at_step}" if c.at_step is not None else ""
            skip = f", skip steps {c.skip.from_step}-{c.skip.to_step}" if c.skip else ""
            return (
                f"restore issued: generation {c.generation}, attempt {c.attempt}, {c.mode}{at}, "
                f"{target}{skip}"
            )
        case Issue(command=c):
            return (
                f"{type(c).__name__.lower()} issued: generation {c.generation}: {decision.reason}"
            )
        case Rejected():
            return f"rejected ({decision.code}): {decision.reason}"
        case Anomaly():
            ranks = f", ranks {','.join(map(str, decision.ranks))}" if decision.ranks else ""
            return f"anomaly {decision.kind}{ranks}: {decision.reason}"
        case JobFailed():
            return f"job failed: {decision.reason}"


def _style(decision: Decision) -> str:
    match decision:
        case IncidentOpened() | JobFailed():
            return "bold red"
        case Issue(command=Restore()):
            return "yellow"
        case Issue():
            return "green" if decision.command.SCHEMA.startswith("resume") else "bold red"
        case IncidentClosed():
            return "green"
        case Committed():
            return "cyan"
        case Anomaly():
            return "magenta"
        case Rejected():
            return "red"
        case Transition():
            return "bold"


def _who(row: Row) -> str:
    if row.rank is not None:
        return f"r{row.rank}"
    if row.ranks:
        return "sup " + ",".join(map(str, row.ranks))
    return "-"


def print_timeline(
    console: Console, rows: Sequence[Row], *, origin_ns: int, every: bool = False
) -> None:
    """Print ``rows`` as the timeline (module docstring); ``origin_ns`` is the time ``+0``.
    With ``every``, no line is folded."""
    quiet: list[Row] = []
    config: str | None = None
    for row in rows:
        if config is not None and row.config_id != config:
            console.print(
                Text(f"── decided from here on under configuration {row.config_id} ──", "blue")
            )
        config = row.config_id
        if not every and _quiet(row):
            quiet.append(row)
            continue
        _print_quiet(console, quiet, origin_ns)
        quiet = []
        offset = "-" if row.offset is None else str(row.offset)
        line = Text.assemble(
            (_clock(row.at_ns), "dim"),
            f" {_since(row.at_ns, origin_ns):>10} {offset:>7} {_who(row):>7}  ",
            (f"{row.kind:<11}", "red" if row.refused else ""),
            f" {row.summary}",
        )
        if row.transition is not None:
            line.append(f"  {row.transition[0]} → {row.transition[1]}", "bold")
        console.print(line)
        for decision in row.decisions:
            console.print(Text("      ▸ ") + Text(describe(decision), _style(decision)))
    _print_quiet(console, quiet, origin_ns)


def _quiet(row: Row) -> bool:
    """A heartbeat or tick that changed nothing, or that was only rejected as stale or as a
    duplicate (after a restore, until the old processes are gone)."""
    return (
        row.kind in _QUIET
        and row.transition is None
        and all(isinstance(d, Rejected) and d.code in _ROUTINE for d in row.decisions)
    )


def _print_quiet(console: Console, rows: Sequence[Row], origin_ns: int) -> None:
    if not rows:
        return
    beats = [r for r in rows if r.kind == "heartbeat"]
    ticks = len(rows) - len(beats)
    rejected = sum(1 for r in rows if r.decisions)
    parts = []
    if beats:
        ranks = sorted({r.rank for r in beats if r.rank is not None})
        steps = [_step(r.summary) for r in beats]
        known = [s for s in steps if s is not None]
        span = f", steps {min(known)}-{max(known)}" if known else ""
        parts.append(f"{_count(len(beats), 'heartbeat')} (ranks {_ranges(ranks)}{span})")
    if ticks:
        parts.append(_count(ticks, "tick"))
    if rejected:
        parts.append(f"{rejected} rejected as stale or duplicate")
    text = f"{_clock(rows[0].at_ns)} {_since(rows[0].at_ns, origin_ns):>10}   … " + ", ".join(parts)
    console.print(Text(text, "dim"))


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _step(summary: str) -> int | None:
    words = summary.split()
    if len(words) >= 2 and words[0] == "step" and words[1].isdigit():
        return int(words[1])
    return None


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    out: list[str] = []
    for rank in ranks:
        if out and rank == int(out[-1].rsplit("-", 1)[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{rank}"
        else:
            out.append(str(rank))
    return ",".join(out)


def row_json(row: Row) -> dict[str, Any]:
    """A timeline row as one JSON Lines object (``type`` ``row``)."""
    at_ms = row.at_ns // _NS_PER_MS
    return {
        "type": "row",
        "at_ms": at_ms,
        "at": iso(at_ms),
        "offset": row.offset,
        "kind": row.kind,
        "rank": row.rank,
        "ranks": list(row.ranks),
        "generation": row.generation,
        "summary": row.summary,
        "input": row.input_id,
        "transition": list(row.transition) if row.transition else None,
        "generation_after": row.generation_after,
        "config_id": row.config_id,
        "refused": row.refused,
        "decisions": [d.to_dict() for d in row.decisions],
    }


def difference_json(difference: Difference) -> dict[str, Any]:
    """A verification difference as a JSON object."""
    return {
        "input": difference.input_id,
        "at_ms": difference.at_ms,
        "at": iso(difference.at_ms),
        "offset": difference.offset,
        "expected": list(difference.expected),
        "got": list(difference.got),
        "expected_config": difference.expected_config,
        "got_config": difference.got_config,
        "pending": difference.pending,
    }


def print_difference(console: Console, difference: Difference) -> None:
    """Print where the replay and the audit trail first disagree, with a diff of the two
    decision groups (recorded ``-``, replayed ``+``)."""
    offset = "?" if difference.offset is None else difference.offset
    console.print(
        Text(
            f"✗ the replay differs from the audit trail at offset {offset} "
            f"({iso(difference.at_ms)}), input {_compact(difference.input_id)}",
            "bold red",
        )
    )
    if not difference.expected:
        console.print("  recorded: no decision; replayed:")
    elif not difference.got:
        console.print("  replayed: no decision; recorded:")
    elif difference.expected_config != difference.got_config:
        console.print(
            f"  recorded under configuration {difference.expected_config}, replayed under "
            f"{difference.got_config}"
        )
    for line in _json_diff(difference.expected, difference.got):
        style = "red" if line.startswith("-") else "green" if line.startswith("+") else "dim"
        console.print(Text("  " + line, style))
    if difference.pending:
        console.print(
            "  This input comes after the last one the audit trail records: the daemon may "
            "not have folded it yet (it lags behind, or it stopped). Replay again once it "
            "has caught up."
        )


def _compact(value: Mapping[str, JSONValue]) -> str:
    return orjson.dumps(value).decode()


def _json_diff(
    expected: Sequence[Mapping[str, JSONValue]], got: Sequence[Mapping[str, JSONValue]]
) -> Iterator[str]:
    def lines(value: Sequence[Mapping[str, JSONValue]]) -> list[str]:
        dumped = orjson.dumps(list(value), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
        return dumped.decode().splitlines()

    diff = difflib.unified_diff(lines(expected), lines(got), "recorded", "replayed", lineterm="")
    yield from diff


def print_config_change(
    console: Console, before: Mapping[str, JSONValue], after: Mapping[str, JSONValue]
) -> None:
    """Print the settings in which ``after`` differs from ``before``."""
    for key in sorted(before.keys() | after.keys()):
        if before.get(key) != after.get(key):
            console.print(f"  {key:<28} {before.get(key)!r} → {after.get(key)!r}")


def change_json(change: Change) -> dict[str, Any]:
    """A what-if change as one JSON Lines object (``type`` ``change``)."""
    at_ms = change.at_ns // _NS_PER_MS
    return {
        "type": "change",
        "change": change.change,
        "at_ms": at_ms,
        "at": iso(at_ms),
        "beyond_horizon": change.beyond_horizon,
        "before": None if change.before is None else change.before.to_dict(),
        "after": None if change.after is None else change.after.to_dict(),
        "before_at_ms": None if change.before_at_ns is None else change.before_at_ns // _NS_PER_MS,
        "after_at_ms": None if change.after_at_ns is None else change.after_at_ns // _NS_PER_MS,
    }


def print_what_if(console: Console, result: WhatIf, *, origin_ns: int) -> None:
    """Print the changes of a what-if run: findings up to the horizon, then the rest as
    consequences, then the rejected inputs."""
    if not result.changes:
        console.print(Text("no decision changes", "bold green"))
    findings = [c for c in result.changes if not c.beyond_horizon]
    later = [c for c in result.changes if c.beyond_horizon]
    for change in findings:
        _print_change(console, change, origin_ns)
    if later and result.horizon_ns is not None:
        console.print(
            Text(
                f"after {_clock(result.horizon_ns)} the recorded workers followed the recorded "
                f"commands, not the ones above: {len(later)} later changes are consequences, "
                "not findings; their incidents and commands:",
                "blue",
            )
        )
        major = [c for c in later if isinstance(c.before or c.after, _MAJOR)]
        for change in major:
            _print_change(console, change, origin_ns, dim=True)
        if len(major) < len(later):
            console.print(Text(f"  ... and {len(later) - len(major)} more (--format jsonl)", "dim"))
    if result.rejected_before != result.rejected_after:
        console.print(
            f"rejected inputs: recorded configuration {dict(result.rejected_before)}, "
            f"what-if {dict(result.rejected_after)}"
        )


_MAJOR = (IncidentOpened, Issue, JobFailed)
"""Decisions listed past a what-if's horizon (the others are only counted)."""

_MARKS = {"disappears": ("-", "red"), "appears": ("+", "green"), "differs": ("~", "yellow")}


def _print_change(console: Console, change: Change, origin_ns: int, *, dim: bool = False) -> None:
    mark, style = _MARKS[change.change]
    decision = change.after if change.before is None else change.before
    assert decision is not None  # a change has at least one side
    head = Text.assemble(
        (_clock(change.at_ns), "dim"),
        f" {_since(change.at_ns, origin_ns):>10}  ",
        (f"{mark} {change.change:<10}", "dim" if dim else style),
        " ",
        (describe(decision), "dim" if dim else _style(decision)),
    )
    console.print(head)
    if change.change == "differs" and change.after is not None:
        shift = ""
        if change.before_at_ns is not None and change.after_at_ns is not None:
            delta = (change.after_at_ns - change.before_at_ns) / 1e9
            if delta:
                shift = f"{abs(delta):.3f} s {'later' if delta > 0 else 'earlier'}; "
        console.print(Text(f"      what-if: {shift}{describe(change.after)}", "dim" if dim else ""))
