"""The spool (``trainguard.agent.supervisor._spool``): what a worker's agent writes, and what its supervisor
reads back after the worker ended: the unsettled events, in ``seq`` order; torn or damaged
lines skipped with a warning, never a crash. And the supervisor's journal, read back in the
order its events were put."""

from __future__ import annotations

import os
from pathlib import Path

from structlog.testing import capture_logs

from trainguard.agent.supervisor._spool import Spool, read_journal, read_spool
from trainguard.schemas import JobRequest, Lifecycle, encode


def event(seq: int, kind: str = "started") -> bytes:
    return encode(
        Lifecycle(
            job_id="j", generation=0, ts=1, seq=seq, rank=0, host="h", pid=os.getpid(),
            kind=kind,  # type: ignore[arg-type]
        )
    )  # fmt: skip


def test_unsettled_events_are_read_back_in_seq_order(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    for seq in (10, 11, 12):
        spool.add(seq, event(seq))
    spool.settled(10)
    other = Spool(tmp_path)  # a second agent of the process: its own file
    other.add(5, event(5, "finished"))
    assert [(s.seq, s.data) for s in read_spool(tmp_path)] == [
        (5, event(5, "finished")),
        (11, event(11)),
        (12, event(12)),
    ]
    assert {s.path for s in read_spool(tmp_path)} == {spool.path, other.path}


def test_a_fully_settled_spool_is_emptied_and_removed_on_close(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.add(1, event(1))
    spool.add(2, event(2))
    spool.settled(2)
    assert spool.path.read_bytes() == b""  # only grows while the bus is away
    spool.add(3, event(3))
    assert read_spool(tmp_path)[0].seq == 3
    spool.settled(3)
    spool.close()
    assert not spool.path.exists()


def test_a_spool_with_unsettled_events_stays_after_close(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.add(1, event(1))
    spool.close()
    spool.close()
    assert [s.seq for s in read_spool(tmp_path)] == [1]


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.add(1, event(1))
    spool.add(2, event(2, "finished"))
    whole = spool.path.read_bytes()
    spool.path.write_bytes(whole[:-9])  # the writer died in the middle of its last line
    with capture_logs() as logs:
        found = read_spool(tmp_path)
    assert [s.seq for s in found] == [1]
    assert [(e["event"], e["line"]) for e in logs] == [
        ("spool file ends in a torn line: skipped", 2)
    ]


def test_damaged_lines_are_skipped_and_the_rest_is_read(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.add(1, event(1))
    with spool.path.open("ab") as f:
        f.write(b"garbage\n")
        f.write(b"e 7 " + event(8) + b"\n")  # seq does not match the event's
        f.write(b"e 9 {not json}\n")
        f.write(b"d x\n")
    spool.add(3, event(3))
    with capture_logs() as logs:
        found = read_spool(tmp_path)
    assert [s.seq for s in found] == [1, 3]
    assert [e["line"] for e in logs if e["event"] == "spool line not understood: skipped"] == [
        2,
        3,
        4,
        5,
    ]


def test_a_missing_or_unreadable_spool_reads_as_empty(tmp_path: Path) -> None:
    assert read_spool(tmp_path / "absent") == []
    (tmp_path / "x.spool").mkdir()  # not a file
    with capture_logs() as logs:
        assert read_spool(tmp_path) == []
    assert [e["event"] for e in logs] == ["spool file not readable: its events are lost"]


def test_a_journal_is_read_back_in_the_order_its_events_were_put(tmp_path: Path) -> None:
    """A supervisor's journal holds events of several senders (its own request and reports,
    its workers' events it forwards): it keeps the order they were put in, not ``seq``'s."""
    request = encode(
        JobRequest(job_id="j", generation=0, ts=1, seq=0, host="h", pid=1, kind="stop")
    )
    worker = event(41, "finished")
    report = encode(
        Lifecycle(
            job_id="j", generation=0, ts=1, seq=1, rank=None, host="h", pid=1, kind="exited",
            ranks=(0,), signal=15,
        )
    )  # fmt: skip
    journal = Spool(tmp_path, "supervisor-1-1.outbox")
    for number, data in enumerate([event(40), request, worker, report]):
        journal.add(number, data)
    journal.settled(0)
    with journal.path.open("ab") as f:
        f.write(b"e 9 {not json}\n")
    with capture_logs() as logs:
        assert read_journal(journal.path) == [request, worker, report]
    assert [e["line"] for e in logs] == [6]
    assert read_spool(tmp_path) == []  # no agent's spool file
    journal.settled(3)
    journal.close()
    assert read_journal(journal.path) == []  # removed: everything was delivered
