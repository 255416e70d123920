"""The agent's outbox: the bounded FIFO of encoded events waiting for the bus.

Events leave in ``seq`` order, because the daemon drops an event whose ``seq`` is not above the
last one it took from the same sender: an event that overtook a lower one would make the daemon
drop that one. Three queues, merged by ``seq`` when the sender takes the next event, keep each
policy O(1):

* **heartbeats**: at most ``ring`` wait; a newer one evicts the oldest (only the newest
  progress matters, and a backlog would grow with the outage);
* **data cursors** (``data-cursor`` events): kept, but the first to go when the outbox is full;
* **checkpoint and lifecycle events**: kept until the bus takes them.

The bound, ``max_events``, counts data-cursor, checkpoint and lifecycle events together (the one
the sender has taken included). When an event arrives at a full outbox, the oldest waiting
data cursor is dropped to make room; without one, the new event is refused. The caller counts
and logs both (:class:`~trainguard.agent._link.Link`).

Not thread-safe: the link calls it under its own lock.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Literal

__all__ = ["Added", "Outbox", "Queued"]

Kind = Literal["heartbeat", "cursor", "event"]
"""How an event is kept: see the module docstring."""


@dataclass(frozen=True, slots=True)
class Queued:
    """One encoded event waiting in the outbox.

    Attributes:
        seq: the event's ``seq``.
        data: its encoded bytes, sent unchanged (also on a re-send).
        kind: its queue.
    """

    seq: int
    data: bytes
    kind: Kind


@dataclass(frozen=True, slots=True)
class Added:
    """What :meth:`Outbox.add` did.

    Attributes:
        accepted: whether the event was queued (false: refused, the outbox is full).
        evicted: the event dropped to make room (the oldest heartbeat or data cursor), if any.
    """

    accepted: bool
    evicted: Queued | None = None


class Outbox:
    """The FIFO of one sender (module docstring).

    Args:
        max_events: most data-cursor, checkpoint and lifecycle events kept (>= 1).
        ring: most heartbeats kept (>= 1).

    Raises:
        ValueError: a bound below 1.
    """

    def __init__(self, max_events: int, ring: int) -> None:
        if max_events < 1 or ring < 1:
            raise ValueError(f"outbox bounds must be >= 1, got {max_events=}, {ring=}")
        self._max_events = max_events
        self._ring = ring
        self._queues: dict[Kind, collections.deque[Queued]] = {
            "heartbeat": collections.deque(),
            "cursor": collections.deque(),
            "event": collections.deque(),
        }
        self._taken: Queued | None = None

    @property
    def events(self) -> int:
        """Data-cursor, checkpoint and lifecycle events waiting, the taken one included."""
        taken = self._taken is not None and self._taken.kind != "heartbeat"
        return len(self._queues["cursor"]) + len(self._queues["event"]) + taken

    @property
    def oldest(self) -> int | None:
        """The lowest ``seq`` waiting (the taken event's included), or ``None`` when empty."""
        seqs = [q[0].seq for q in self._queues.values() if q]
        if self._taken is not None:
            seqs.append(self._taken.seq)
        return min(seqs, default=None)

    def __len__(self) -> int:
        """Every event waiting, heartbeats and the taken one included."""
        return sum(map(len, self._queues.values())) + (self._taken is not None)

    def add(self, item: Queued) -> Added:
        """Queue ``item`` (its ``seq`` above every queued one), applying the bounds."""
        queue = self._queues[item.kind]
        if item.kind == "heartbeat":
            evicted = queue.popleft() if len(queue) >= self._ring else None
            queue.append(item)
            return Added(True, evicted)
        evicted = None
        if self.events >= self._max_events:
            cursors = self._queues["cursor"]
            if not cursors:
                return Added(False)
            evicted = cursors.popleft()
        queue.append(item)
        return Added(True, evicted)

    def take(self) -> Queued | None:
        """The next event to send: the taken one again if it was not :meth:`done`, else the
        lowest ``seq`` waiting (now taken: no bound evicts it), or ``None``."""
        if self._taken is None:
            heads = [q for q in self._queues.values() if q]
            if not heads:
                return None
            self._taken = min(heads, key=lambda q: q[0].seq).popleft()
        return self._taken

    def take_heartbeats(self) -> list[Queued]:
        """Remove and return the heartbeats that come next in ``seq`` order (to be sent
        together, and dropped if that fails); empty if the next event is no heartbeat or one
        is taken."""
        if self._taken is not None:
            return []
        others = [q[0].seq for q in (self._queues["cursor"], self._queues["event"]) if q]
        below = min(others, default=None)
        beats = self._queues["heartbeat"]
        run: list[Queued] = []
        while beats and (below is None or beats[0].seq < below):
            run.append(beats.popleft())
        return run

    def done(self) -> Queued:
        """The taken event was delivered: forget it and return it.

        Raises:
            LookupError: none is taken.
        """
        taken = self._taken
        if taken is None:
            raise LookupError("no event taken")
        self._taken = None
        return taken
