"""The pure replay (``trainguard.daemon.forensics._replay``): a job's log folded again reproduces the
decisions its daemons recorded, across daemon restarts with another configuration and
re-derived duplicates; a tampered trail is caught at the first difference; a what-if run
under another configuration shows the decisions that change (architecture invariant 1).

Logs here are simulated (``tests.support.traces``) and audited the way the daemon's service
audits (``_audit.config_entry``/``decision_entry`` per input that decided something); the
real service on real buses is ``test_replay_bus.py``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import orjson
import pytest

from tests.support.machine_scenarios import AWAY, JOB, T0, S, Sim, config, killed_in_an_outage
from tests.support.traces import Faults, Job, Pace, drive, simulate
from trainguard.agent.bus import Record
from trainguard.daemon.core._audit_entry import (
    AuditTrail,
    Group,
    MalformedAudit,
    config_entry,
    decision_entry,
    read_trail,
)
from trainguard.daemon.core._decisions import IncidentOpened, Issue
from trainguard.daemon.core._inputs import Input, Observed, Tick
from trainguard.daemon.core._intake import Taken, take
from trainguard.daemon.core._machine import decide
from trainguard.daemon.core._machine_config import RULES_VERSION, MachineConfig
from trainguard.daemon.core._state import new_job
from trainguard.daemon.forensics._replay import Replay, _replay_runs, replay, verify, what_if
from trainguard.schemas import ClockTick, Restore, encode

HANG = Job(
    world_size=2,
    steps=60,
    pace=Pace(base_s=1.0),
    faults=Faults(hang_after=30),
    tail_s=40.0,
    checkpoint_every=10,
    seed=1,
)
"""Both ranks stop after step 30 and heartbeat on for 40 s: the default adaptive progress
timeout (5 s floor) calls it a hang a few seconds in."""

A = MachineConfig(daemon_id="daemon-a")
B = MachineConfig(daemon_id="daemon-b")


def log_of(job: Job, cfg: MachineConfig, daemon_id: str = "daemon-a") -> list[Record]:
    """The job's ``events`` records as a daemon under ``cfg`` leaves them: the simulated
    events, and a ``ClockTick`` at every deadline that passed and every pulse (bus times in
    whole ms, a tick stamped at the first ms at or after its deadline)."""
    trace = simulate(job)
    _, folded = drive(trace.inputs, cfg=cfg, until=trace.end_ns)
    return records_of((item for item, _ in folded), daemon_id)


def records_of(folded: Iterable[Input], daemon_id: str = "daemon-a") -> list[Record]:
    """``folded`` (a driver's inputs, ticks included) as the ``events`` records holding them."""
    records: list[Record] = []
    seq = 0
    for item in folded:
        if isinstance(item, Tick):
            seq += 1
            message: Any = ClockTick(
                job_id=JOB, generation=0, ts=item.at_ns, seq=seq, daemon_id=daemon_id
            )
            at_ms = math.ceil(item.at_ns / 1_000_000)
        else:
            assert isinstance(item, Observed)
            message, at_ms = item.event, item.at_ns // 1_000_000
        records.append(Record("events", 0, len(records), JOB, encode(message), at_ms))
    return records


def audit_of(
    records: Sequence[Record], runs: Sequence[tuple[MachineConfig, int, int]]
) -> list[dict[str, Any]]:
    """The audit entries daemons running one after the other would write: each run folds the
    log from its start under its configuration and records the inputs ``first..last``
    (indices) that decided something, after a config entry."""
    entries: list[dict[str, Any]] = []
    for cfg, first, last in runs:
        entries.append(config_entry(JOB, cfg))
        state = new_job(JOB)
        for i, record in enumerate(records[: last + 1]):
            item = take(record)
            assert isinstance(item, Taken)
            state, decisions = decide(state, item.input, cfg)
            if i >= first and decisions:
                entries.append(
                    decision_entry(
                        JOB,
                        partition=0,
                        offset=record.offset,
                        at_ms=record.timestamp_ms,
                        identity=item.input_id,
                        config=config_entry(JOB, cfg)["config_id"],  # type: ignore[arg-type]
                        decisions=decisions,
                    )
                )
    # As written to the bus and read back.
    return [orjson.loads(orjson.dumps(e)) for e in entries]


def replayed(records: Sequence[Record], entries: Sequence[dict[str, Any]]) -> Replay:
    return replay(JOB, records, read_trail(entries), config())


def restore_index(records: Sequence[Record], cfg: MachineConfig) -> int:
    """Index of the input at which ``cfg`` issues the first restore."""
    state = new_job(JOB)
    for i, record in enumerate(records):
        item = take(record)
        assert isinstance(item, Taken)
        state, decisions = decide(state, item.input, cfg)
        if any(isinstance(d, Issue) and isinstance(d.command, Restore) for d in decisions):
            return i
    raise AssertionError("no restore")


@pytest.fixture(scope="module")
def hang_log() -> list[Record]:
    return log_of(HANG, A)


def test_a_log_replays_to_the_decisions_its_daemon_recorded(hang_log: list[Record]) -> None:
    result = replayed(hang_log, audit_of(hang_log, [(A, 0, len(hang_log) - 1)]))
    assert verify(result.replayed, result.recorded) is None
    kinds = [d["decision"] for g in result.replayed for d in g.decisions]
    assert "incident_opened" in kinds
    assert any(row.kind == "tick" and row.decisions for row in result.rows), "ticks decide"
    assert len(result.rows) == len(hang_log)


def test_a_verification_without_timeline_derives_the_same_groups(hang_log: list[Record]) -> None:
    trail = read_trail(audit_of(hang_log, [(A, 0, len(hang_log) - 1)]))
    full = replay(JOB, hang_log, trail, config())
    bare = replay(JOB, hang_log, trail, config(), timeline=False)
    assert bare.rows == ()
    assert bare.replayed == full.replayed
    assert bare.state == full.state


def test_verify_names_the_first_injected_difference(hang_log: list[Record]) -> None:
    entries = audit_of(hang_log, [(A, 0, len(hang_log) - 1)])
    decided = [i for i, e in enumerate(entries) if e["decisions"]]
    victim = entries[decided[2]]
    victim["decisions"][0]["reason"] = "forged"
    difference = verify(*_pair(replayed(hang_log, entries)))
    assert difference is not None
    assert difference.input_id == victim["input"]
    assert difference.at_ms == victim["at_ms"]
    assert difference.expected[0]["reason"] == "forged"
    assert difference.got[0]["reason"] != "forged"
    assert not difference.pending


def test_a_recorded_group_the_replay_does_not_derive_is_a_difference(
    hang_log: list[Record],
) -> None:
    entries = audit_of(hang_log, [(A, 0, len(hang_log) - 1)])
    quiet = next(i for i, r in enumerate(hang_log) if i > 5 and not _decides(hang_log, i))
    forged = decision_entry(
        JOB,
        partition=0,
        offset=hang_log[quiet].offset,
        at_ms=hang_log[quiet].timestamp_ms,
        identity=_identity(hang_log[quiet]),
        config=entries[0]["config_id"],
        decisions=(),
    )
    forged["decisions"] = [{"decision": "job_failed", "reason": "forged"}]
    position = next(
        n for n, e in enumerate(entries) if e.get("at_ms", 0) > hang_log[quiet].timestamp_ms
    )
    entries.insert(position, orjson.loads(orjson.dumps(forged)))
    difference = verify(*_pair(replayed(hang_log, entries)))
    assert difference is not None
    assert difference.got == ()
    assert difference.expected == ({"decision": "job_failed", "reason": "forged"},)


def test_a_decision_missing_at_the_end_of_the_trail_is_pending(hang_log: list[Record]) -> None:
    entries = audit_of(hang_log, [(A, 0, len(hang_log) - 1)])
    last = max(i for i, e in enumerate(entries) if e["decisions"])
    del entries[last]
    difference = verify(*_pair(replayed(hang_log, entries)))
    assert difference is not None
    assert difference.expected == ()
    assert difference.pending


def test_exact_duplicates_of_re_derived_entries_are_tolerated(hang_log: list[Record]) -> None:
    """A daemon that crashed between acting and committing: its successor, under the same
    configuration, re-derives and records the inputs after the last committed position."""
    k = restore_index(hang_log, A)
    entries = audit_of(hang_log, [(A, 0, k), (A, k - 20, len(hang_log) - 1)])
    result = replayed(hang_log, entries)
    assert len(result.recorded) > len(result.replayed), "the trail holds duplicates"
    assert verify(result.replayed, result.recorded) is None
    assert len(result.runs) == 1


def test_a_duplicate_that_differs_is_not_tolerated(hang_log: list[Record]) -> None:
    k = restore_index(hang_log, A)
    entries = audit_of(hang_log, [(A, 0, k), (A, k - 20, len(hang_log) - 1)])
    again = [n for n, e in enumerate(entries) if e.get("offset") == k][1]
    entries[again]["decisions"] = entries[again]["decisions"][:-1]
    assert verify(*_pair(replayed(hang_log, entries))) is not None


def test_a_restart_under_another_daemon_id_replays_as_two_runs(hang_log: list[Record]) -> None:
    """Daemon a issued the restore and crashed before committing; daemon b (another
    ``daemon_id``) re-derived the restore with its own id, and went on."""
    k = restore_index(hang_log, A)
    entries = audit_of(hang_log, [(A, 0, k), (B, k - 20, len(hang_log) - 1)])
    result = replayed(hang_log, entries)
    assert [config_id for config_id, _ in result.runs] == [
        config_entry(JOB, cfg)["config_id"] for cfg in (A, B)
    ]
    assert verify(result.replayed, result.recorded) is None
    restores = [
        command["daemon_id"]
        for g in result.replayed
        for d in g.decisions
        if isinstance(command := d.get("command"), dict)
        and str(command["schema"]).startswith("restore")
    ]
    assert restores == ["daemon-a", "daemon-b"]
    # Which daemon decided is data: a trail claiming daemon a re-derived it is caught.
    for entry in entries[::-1]:
        for d in entry["decisions"]:
            if d["decision"] == "issue" and d["command"]["daemon_id"] == "daemon-b":
                d["command"]["daemon_id"] = "daemon-a"
                break
        else:
            continue
        break
    assert verify(*_pair(replayed(hang_log, entries))) is not None


def test_a_window_shows_and_verifies_only_its_part(hang_log: list[Record]) -> None:
    entries = audit_of(hang_log, [(A, 0, len(hang_log) - 1)])
    start = len(hang_log) // 2
    result = replay(JOB, hang_log, read_trail(entries), config(), start=start)
    assert result.rows[0].offset == hang_log[start].offset
    assert len(result.rows) == len(hang_log) - start
    assert all(g.at_ms >= hang_log[start].timestamp_ms for g in result.recorded)
    assert verify(result.replayed, result.recorded) is None


def test_records_that_are_no_input_are_shown_and_decide_nothing(hang_log: list[Record]) -> None:
    entries = audit_of(hang_log, [(A, 0, len(hang_log) - 1)])
    junk = Record("events", 0, 3, JOB, b"\xff not json", hang_log[3].timestamp_ms)
    log = [
        *hang_log[:3],
        junk,
        *(r._replace(offset=r.offset + 1) for r in hang_log[3:]),
    ]
    result = replayed(log, entries)
    [refused] = [row for row in result.rows if row.refused]
    assert refused.offset == 3
    assert not refused.decisions
    assert verify(result.replayed, result.recorded) is None


def test_a_one_configuration_replay_streams_to_what_the_general_path_derives(
    hang_log: list[Record],
) -> None:
    """A trail of one configuration is replayed record by record, keeping only what the
    result holds; it derives what the general path (every input taken and keyed first, as
    for several runs) derives: rows, groups, recorded groups, runs and state. Also from a
    generator, from a window's start, and with a decided input missing from the log (its
    recorded group then falls in a gap)."""
    trail = read_trail(audit_of(hang_log, [(A, 0, len(hang_log) - 1)]))
    missing = [i for i in range(len(hang_log)) if _decides(hang_log, i)][1]
    gapped = hang_log[:missing] + hang_log[missing + 1 :]
    for log in (hang_log, gapped):
        for start in (0, missing, len(log) - 1, len(log)):
            for timeline in (True, False):
                streamed = replay(JOB, iter(log), trail, config(), start=start, timeline=timeline)
                general = _replay_runs(JOB, log, trail, config(), start, timeline)
                assert streamed == general, (len(log), start, timeline)
    gap = replay(JOB, gapped, trail, config())
    assert len(gap.recorded) == len(gap.replayed) + 1, "the missing input's group is compared"
    assert verify(gap.replayed, gap.recorded) is not None


def test_a_trail_without_configuration_folds_under_the_default() -> None:
    log = log_of(dataclasses.replace(HANG, faults=Faults()), A)
    result = replay(JOB, log, AuditTrail(configs={}, groups=()), A)
    assert result.replayed, "the default configuration decides"
    difference = verify(result.replayed, result.recorded)
    assert difference is not None
    assert difference.pending


# -- what-if ----------------------------------------------------------------------------------


def test_what_if_under_the_same_configuration_changes_nothing(hang_log: list[Record]) -> None:
    result = what_if(JOB, hang_log, A, A, tick_interval_s=0.25, poll_s=0.05)
    assert result.changes == ()
    assert result.horizon_ns is None
    assert any(row.kind == "synthetic-tick" for row in result.baseline)
    assert not any(row.kind == "tick" for row in result.baseline), "recorded ticks are left out"


def test_a_hang_incident_disappears_with_a_progress_floor_above_the_hang(
    hang_log: list[Record],
) -> None:
    result = what_if(
        JOB,
        hang_log,
        A,
        dataclasses.replace(A, progress_floor_s=60.0),
        tick_interval_s=0.25,
        poll_s=0.05,
    )
    gone = [c for c in result.changes if c.change == "disappears" and not c.beyond_horizon]
    opened = [c.before for c in gone if isinstance(c.before, IncidentOpened)]
    assert [o.cause for o in opened] == ["progress_timeout"]
    restores = [(c.at_ns, c.before) for c in gone if isinstance(c.before, Issue)]
    assert [type(issue.command) for _, issue in restores] == [Restore]
    assert result.horizon_ns == restores[0][0]
    assert not [c for c in result.changes if c.change == "appears" and not c.beyond_horizon]
    variant = [d for row in result.variant for d in row.decisions]
    assert not [d for d in variant if isinstance(d, IncidentOpened)]


def test_a_hang_caught_later_under_a_longer_floor_is_a_changed_decision(
    hang_log: list[Record],
) -> None:
    result = what_if(
        JOB,
        hang_log,
        A,
        dataclasses.replace(A, progress_floor_s=15.0),
        tick_interval_s=0.25,
        poll_s=0.05,
    )
    [restore] = [c for c in result.changes if isinstance(c.before, Issue) and not c.beyond_horizon]
    assert restore.change == "differs"
    assert restore.before_at_ns is not None
    assert restore.after_at_ns is not None
    assert 9 * S < restore.after_at_ns - restore.before_at_ns < 12 * S


def test_what_if_refuses_a_tick_interval_that_is_not_positive(hang_log: list[Record]) -> None:
    with pytest.raises(ValueError, match="tick_interval_s"):
        what_if(JOB, hang_log, A, A, tick_interval_s=0, poll_s=0.05)


# -- helpers ----------------------------------------------------------------------------------


def _pair(result: Replay) -> tuple[Sequence[Group], Sequence[Group]]:
    return result.replayed, result.recorded


def _identity(record: Record) -> dict[str, Any]:
    item = take(record)
    assert isinstance(item, Taken)
    return item.input_id


def _decides(records: Sequence[Record], index: int) -> bool:
    state = new_job(JOB)
    decisions: tuple[Any, ...] = ()
    for record in records[: index + 1]:
        item = take(record)
        assert isinstance(item, Taken)
        state, decisions = decide(state, item.input, A)
    return bool(decisions)


def outage_log() -> list[Record]:
    """A 2-rank job whose rank 1 is killed while the bus is away for 60 s
    (:func:`killed_in_an_outage`), as its daemon's log holds it: its ticks stop during the
    outage too."""
    inputs = killed_in_an_outage(Sim(world_size=2))
    _, folded = drive(inputs, cfg=A, outages=[AWAY], until=T0 + 130 * S)
    return records_of(item for item, _ in folded)


def test_a_log_with_a_bus_outage_replays_to_the_held_restore_its_daemon_decided() -> None:
    """The gap is in the job's own log, so a replay sees it as the daemon did: the same
    ``bus_gap``, the restore held while the bus settled and issued to the checkpoint made
    during the outage."""
    records = outage_log()
    result = replayed(records, audit_of(records, [(A, 0, len(records) - 1)]))
    assert verify(result.replayed, result.recorded) is None
    decided = [d for g in result.replayed for d in g.decisions]
    anomalies = [d["kind"] for d in decided if d["decision"] == "anomaly"]
    assert anomalies == ["bus_gap", "restore_held"]
    [restore] = [d["command"] for d in decided if d["decision"] == "issue"]
    assert isinstance(restore, dict)
    target = restore["target"]
    assert isinstance(target, dict)
    assert target["step"] == 70


def test_a_what_if_models_no_tick_inside_an_outage_of_the_log() -> None:
    """The what-if model writes no tick where the recorded log shows the bus away, and pulses
    where it was up: its baseline holds the same restore as the recorded run (a model ticking
    through the outage would time rank 1 out during it and restore step 30)."""
    records = outage_log()
    result = what_if(JOB, records, A, A, tick_interval_s=0.25, poll_s=0.05)
    restores = [
        d.command
        for row in result.baseline
        for d in row.decisions
        if isinstance(d, Issue) and isinstance(d.command, Restore)
    ]
    [restore] = restores
    assert restore.target is not None
    assert restore.target.step == 70
    assert result.changes == ()


@pytest.mark.parametrize("rules", ["1", 0, -3, 1.5, True])
def test_a_rules_version_that_is_no_positive_integer_is_a_malformed_trail(rules: Any) -> None:
    entry = config_entry(JOB, config()) | {"rules": rules}
    with pytest.raises(MalformedAudit, match=r"audit entry 0: rules must be a positive integer"):
        read_trail([entry])


def test_the_rules_version_of_each_configuration_is_read() -> None:
    ours = config_entry(JOB, config())
    older = config_entry(JOB, config(heartbeat_timeout_s=30.0))
    del older["rules"]
    trail = read_trail([ours, older])
    assert trail.rules == {ours["config_id"]: RULES_VERSION, older["config_id"]: None}
