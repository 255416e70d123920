"""The agent's outbox (``trainguard.agent._outbox``): seq order across its queues, and its
bound policy: heartbeats keep a ring of the newest, a full outbox drops its oldest data cursor
first and then refuses, and the event being sent is never evicted."""

from __future__ import annotations

import pytest

from trainguard.agent._outbox import Kind, Outbox, Queued


def item(seq: int, kind: Kind = "event") -> Queued:
    return Queued(seq, b"%d" % seq, kind)


def drain(box: Outbox) -> list[int]:
    """Seqs in the order a sender takes them (heartbeat runs included)."""
    out: list[int] = []
    while True:
        beats = box.take_heartbeats()
        if beats:
            out += [b.seq for b in beats]
            continue
        taken = box.take()
        if taken is None:
            return out
        out.append(box.done().seq)


def test_events_leave_in_seq_order_across_the_queues() -> None:
    box = Outbox(max_events=10, ring=10)
    kinds: list[Kind] = ["event", "heartbeat", "cursor", "heartbeat", "heartbeat", "event"]
    for seq, kind in enumerate(kinds):
        assert box.add(item(seq, kind)).accepted
    assert box.oldest == 0
    assert drain(box) == [0, 1, 2, 3, 4, 5]
    assert len(box) == 0
    assert box.oldest is None


def test_a_run_of_heartbeats_stops_at_the_next_other_event() -> None:
    box = Outbox(max_events=10, ring=10)
    for seq, kind in enumerate(["heartbeat", "heartbeat", "event", "heartbeat"]):
        box.add(item(seq, kind))  # type: ignore[arg-type]
    assert [b.seq for b in box.take_heartbeats()] == [0, 1]
    assert box.take_heartbeats() == []  # the event comes first now
    assert box.take() == item(2)
    assert box.take_heartbeats() == []  # nothing overtakes the event being sent
    box.done()
    assert [b.seq for b in box.take_heartbeats()] == [3]


def test_the_heartbeat_ring_keeps_the_newest() -> None:
    box = Outbox(max_events=10, ring=2)
    evicted = [box.add(item(seq, "heartbeat")).evicted for seq in range(4)]
    assert [e.seq if e else None for e in evicted] == [None, None, 0, 1]
    assert box.events == 0  # heartbeats do not count towards the bound
    assert drain(box) == [2, 3]


def test_a_full_outbox_drops_the_oldest_data_cursor_first() -> None:
    box = Outbox(max_events=3, ring=1)
    box.add(item(1, "cursor"))
    box.add(item(2, "event"))
    box.add(item(3, "cursor"))
    added = box.add(item(4, "event"))
    assert (added.accepted, added.evicted) == (True, item(1, "cursor"))
    added = box.add(item(5, "cursor"))  # a newer cursor evicts an older one too
    assert (added.accepted, added.evicted) == (True, item(3, "cursor"))
    assert box.events == 3
    assert drain(box) == [2, 4, 5]


def test_a_full_outbox_without_data_cursors_refuses_the_new_event() -> None:
    box = Outbox(max_events=2, ring=1)
    box.add(item(1))
    box.add(item(2))
    for seq, kind in ((3, "event"), (4, "cursor")):
        added = box.add(item(seq, kind))  # type: ignore[arg-type]
        assert (added.accepted, added.evicted) == (False, None)
    assert box.add(item(5, "heartbeat")).accepted  # heartbeats have their own ring
    assert drain(box) == [1, 2, 5]


def test_the_event_being_sent_is_kept_until_done_and_never_evicted() -> None:
    box = Outbox(max_events=2, ring=1)
    box.add(item(1, "cursor"))
    taken = box.take()
    assert taken == item(1, "cursor")
    assert box.take() is taken  # a failed delivery: the same event goes again
    box.add(item(2, "cursor"))
    added = box.add(item(3, "cursor"))
    assert added.evicted == item(2, "cursor")  # not the one being sent
    assert (box.events, box.oldest) == (2, 1)
    assert box.done() == taken
    with pytest.raises(LookupError):
        box.done()
    assert drain(box) == [3]


@pytest.mark.parametrize(("max_events", "ring"), [(0, 1), (1, 0)])
def test_bounds_below_one_are_refused(max_events: int, ring: int) -> None:
    with pytest.raises(ValueError, match="outbox bounds"):
        Outbox(max_events, ring)
