"""What the per-job state machine folds: observed events and clock ticks.

The daemon's clock enters the machine only through these inputs, so a recorded sequence of
inputs replays to the same decisions (ARCHITECTURE.md section 4, invariant 1). For that, the shell
must record its ticks along with the events' bus offsets.
"""

from __future__ import annotations

from typing import NamedTuple, TypeAlias

from trainguard.schemas import Event, HeartbeatBatch, JobRequest


class Observed(NamedTuple):
    """An event as the daemon consumed it from the bus.

    Inputs are named tuples (immutable, and half the cost of a frozen dataclass to build: one
    per record the daemon or a replay folds).

    Attributes:
        at_ns: the bus record's append timestamp in nanoseconds since the Unix epoch (the
            broker's or the embedded bus's clock, not the sender's ``ts``).
        offset: the record's offset in its partition, or ``None`` when the event did not come
            from a bus (tests, what-if runs). Carried for the audit trail; the machine does not
            decide on it.
        event: the decoded and verified event, an operator's request about the job, or a
            node's batch of heartbeats (folded as the heartbeats it carries).
    """

    at_ns: int
    offset: int | None
    event: Event | JobRequest | HeartbeatBatch


class Tick(NamedTuple):
    """The daemon's clock reached ``at_ns`` (nanoseconds since the Unix epoch).

    The shell schedules ticks at :func:`trainguard.daemon.core._machine.next_deadline` so timeouts
    fire without waiting for the next event, and right after it published a command.

    Attributes:
        at_ns: the tick record's bus append time (ns since the Unix epoch).
        command_seq: ``seq`` of the job's latest command that was on the bus when the tick was
            appended (``ClockTick.command_seq``; 0: none yet), or ``None`` when the tick does
            not say (written before ``tick/1.2``): timeouts that start with a command count
            from the first tick naming it.
    """

    at_ns: int
    command_seq: int | None = None


Input: TypeAlias = Observed | Tick
