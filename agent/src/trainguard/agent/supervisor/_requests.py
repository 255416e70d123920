"""Sending a job request (stop, continue) and reading the job's latest command: what
``trainguard run`` and ``trainguard stop`` share (``docs/operations.md``, "Stopping and
continuing a job")."""

from __future__ import annotations

import time

from trainguard.agent.bus import Bus
from trainguard.agent.keys._command_gate import CommandGate, Ignored
from trainguard.agent.keys._keystore import EventKey
from trainguard.schemas import Abort, JobRequest, RequestKind, Restore, Resume, add_mac, encode

__all__ = ["encode_request", "latest_command"]

_MAX_REASON = 4096
"""Longest ``reason`` a request may carry (``common.v1.json#/$defs/message``)."""


def encode_request(
    job_id: str,
    kind: RequestKind,
    *,
    generation: int,
    host: str,
    pid: int,
    seq: int,
    reason: str = "",
    key: EventKey | None = None,
) -> bytes:
    """A :class:`~trainguard.schemas.JobRequest`, encoded (with its MAC when ``key`` is given).

    Args:
        job_id: the job.
        kind: ``stop`` or ``continue``.
        generation: the job's generation as the sender knows it from its latest command (0
            when there is none).
        host, pid: the sender.
        seq: the sender's next sequence number (strictly increasing per ``(host, pid)``).
        reason: why, in words; cut to 4096 characters.
        key: the job's event key: the request carries its MAC (``None``: unauthenticated).

    Raises:
        SchemaError: a field breaks the wire schema.
    """
    request = JobRequest(
        job_id=job_id,
        generation=generation,
        ts=time.time_ns(),
        seq=seq,
        host=host,
        pid=pid,
        kind=kind,
        reason=reason[:_MAX_REASON],
    )
    if key is not None:
        request = add_mac(request, key.kid, key.secret)
    return encode(request)


async def latest_command(
    bus: Bus, job_id: str, gate: CommandGate
) -> tuple[Restore | Resume | Abort | None, Ignored | None]:
    """The job's latest command on the compacted ``commands`` topic, if ``gate`` admits it.

    Returns:
        ``(command, None)``; ``(None, None)`` when the job has no command; ``(None, why)``
        when its latest record is no command this process may act on (unsigned, stale, ...).

    Raises:
        BusError: the bus cannot be read.
    """
    record = (await bus.latest_per_key("commands")).get(job_id)
    if record is None or record.value is None:
        return None, None
    verdict = gate.admit(record.value)
    if isinstance(verdict, Ignored):
        return None, verdict
    return verdict, None
