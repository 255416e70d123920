"""What a job report's timeline chart draws per rank: each rank's declared phases over time,
and the instants that matter (shards announced, snapshots committed, exits, errors).

Pure: no I/O. Built from an :class:`~trainguard.daemon.forensics._report_record.EventDigest` and
:class:`~trainguard.daemon.forensics._report_record.AuditDigest`; times are bus append times (ms).
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from dataclasses import dataclass

from trainguard.daemon.forensics._report_record import AuditDigest, EventDigest
from trainguard.schemas import Heartbeat

__all__ = ["Mark", "RankSpan", "marks", "rank_spans"]

_DEFAULT_INTERVAL_MS = 1000
"""Heartbeat interval assumed for a rank that sent a single heartbeat (the agent's default)."""


@dataclass(frozen=True, slots=True)
class RankSpan:
    """One rank in one declared phase (``train``, ``checkpoint``, ``eval``, ``data``,
    ``init``) of one generation from ``start_ms`` to ``end_ms``, as its heartbeats showed it;
    ``first_step`` to ``last_step`` are the steps they reported."""

    rank: int
    generation: int
    phase: str
    start_ms: int
    end_ms: int
    first_step: int
    last_step: int


@dataclass(frozen=True, slots=True)
class Mark:
    """An instant of a rank's life (``rank`` ``None``: the job's): ``checkpoint`` (a shard
    announced), ``committed`` (a snapshot every rank wrote), ``exited`` (died: a signal or a
    non-zero exit code), ``error`` (a rank's error report); ``label`` says it in words."""

    at_ms: int
    kind: str
    rank: int | None
    generation: int
    step: int | None
    label: str


def rank_spans(ev: EventDigest) -> tuple[RankSpan, ...]:
    """Each rank's phases, merged from its heartbeats: a heartbeat's phase lasts until the
    rank's next heartbeat of the same generation, at most two of its median heartbeat
    intervals, and not past its next exit, error or finished report. Ordered by rank, then
    time."""
    beats: dict[int, list[tuple[int, Heartbeat]]] = {}
    for at, b in ev.beats:
        beats.setdefault(b.rank, []).append((at, b))
    stops: dict[tuple[int, int], list[int]] = {}
    for at, lc in ev.lifecycles:
        if lc.kind in ("exited", "error", "finished"):
            for rank in (lc.rank,) if lc.rank is not None else lc.ranks:
                stops.setdefault((rank, lc.generation), []).append(at)
    out: list[RankSpan] = []
    for rank, items in sorted(beats.items()):
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(items) if b[0] > a[0]]
        cap = 2 * (statistics.median(gaps) if gaps else _DEFAULT_INTERVAL_MS)
        # The span being built (plain locals: this loop runs once per heartbeat).
        generation, phase, start, end, first, last = -1, "", 0, 0, 0, 0
        count = len(items)
        for i, (at, b) in enumerate(items):
            until = at + cap
            if i + 1 < count and items[i + 1][1].generation == b.generation:
                until = min(until, items[i + 1][0])
            ends = stops.get((rank, b.generation))
            if ends:
                j = bisect.bisect_left(ends, at)
                if j < len(ends):
                    until = min(until, ends[j])
            until = int(max(until, at))
            if b.generation == generation and b.phase == phase and end >= at:
                end, last = until, b.step
                continue
            if generation >= 0:
                out.append(RankSpan(rank, generation, phase, start, end, first, last))
            generation, phase, start, end, first, last = (
                b.generation,
                b.phase,
                at,
                until,
                b.step,
                b.step,
            )
        if generation >= 0:
            out.append(RankSpan(rank, generation, phase, start, end, first, last))
    return tuple(out)


def marks(ev: EventDigest, au: AuditDigest) -> tuple[Mark, ...]:
    """Shards announced, snapshots committed, deaths and error reports, in time order."""
    out = [
        Mark(at, "checkpoint", c.rank, c.generation, c.step, f"shard of step {c.step}")
        for at, c in ev.shards
    ]
    out += [
        Mark(at, "committed", None, gen, step, f"committed {sid}")
        for sid, (gen, step, at) in au.commits.items()
    ]
    for at, lc in ev.lifecycles:
        if lc.kind == "exited" and (lc.signal is not None or lc.exit_code):
            how = f"signal {lc.signal}" if lc.signal is not None else f"exit code {lc.exit_code}"
            for rank in (lc.rank,) if lc.rank is not None else lc.ranks:
                out.append(Mark(at, "exited", rank, lc.generation, lc.step, f"exited ({how})"))
        elif lc.kind == "error" and lc.rank is not None:
            out.append(Mark(at, "error", lc.rank, lc.generation, lc.step, lc.message[:200]))
    return tuple(sorted(out, key=lambda m: m.at_ms))
