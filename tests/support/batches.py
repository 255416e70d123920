"""Heartbeat batches as a node's supervisor sends them, built from the inputs of a trace, and
the reference they must fold like: their heartbeats one by one at the batch's append time."""

from __future__ import annotations

from collections.abc import Sequence

from msgspec import structs

from tests.support.machine_scenarios import config
from trainguard.daemon.core._decisions import Decision, Rejected
from trainguard.daemon.core._inputs import Input, Observed
from trainguard.daemon.core._machine import decide
from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.core._state import JobState
from trainguard.schemas import Heartbeat, HeartbeatBatch, batched_beat

SUPERVISOR_PID = 7


def batch(beats: Sequence[Heartbeat], at: int, seq: int) -> Observed:
    """One node's ``beats`` (one host) as a batch appended at ``at`` (ns), sent at ``at`` by
    its supervisor with ``seq``."""
    head = beats[0]
    return Observed(
        at,
        None,
        HeartbeatBatch(
            job_id=head.job_id,
            ts=at,
            seq=seq,
            host=head.host,
            pid=SUPERVISOR_PID,
            beats=tuple(batched_beat(b) for b in beats),
        ),
    )


def batched(inputs: Sequence[Input], window_ns: int) -> list[Input]:
    """``inputs`` with each run of consecutive heartbeats of one host, of distinct ranks and
    within ``window_ns`` of the run's first append time, replaced by one batch appended at the
    run's last append time (what a supervisor flushing every ``window_ns`` sends); every other
    input unchanged, in order."""
    out: list[Input] = []
    run: list[Observed] = []
    seq = 0

    def flush() -> None:
        nonlocal seq
        if run:
            seq += 1
            beats = [item.event for item in run if isinstance(item.event, Heartbeat)]
            out.append(batch(beats, run[-1].at_ns, seq))
            run.clear()

    for item in inputs:
        event = item.event if isinstance(item, Observed) else None
        if not isinstance(item, Observed) or not isinstance(event, Heartbeat):
            flush()
            out.append(item)
            continue
        if run and (
            run[0].event.host != event.host
            or item.at_ns - run[0].at_ns > window_ns
            or any(r.event.rank == event.rank for r in run)
        ):
            flush()
        run.append(item)
    flush()
    return out


def one_by_one(
    state: JobState, item: Observed, cfg: MachineConfig | None = None
) -> tuple[JobState, list[Decision], list[Rejected]]:
    """Fold ``item``'s batch as its heartbeats, each alone at the batch's append time: the
    state after them (with the batch's ``seq`` as its supervisor's latest, ``relays``, when
    one of them was folded), the decisions other than rejections, and the rejections. A
    stale entry (behind its rank's newer event) is rejected here, where the batch skips it:
    the traces batched by :func:`batched` have none."""
    batch = item.event
    assert isinstance(batch, HeartbeatBatch)
    decisions: list[Decision] = []
    refused: list[Rejected] = []
    folded = False
    for beat in batch.heartbeats():
        state, decided = decide(state, item._replace(event=beat), cfg or config())
        rejected = [d for d in decided if isinstance(d, Rejected)]
        folded = folded or not rejected
        refused += rejected
        decisions += [d for d in decided if not isinstance(d, Rejected)]
    if folded:
        state = structs.replace(
            state, relays=state.relays.insert((batch.host, batch.pid), batch.seq)
        )
    return state, decisions, refused
