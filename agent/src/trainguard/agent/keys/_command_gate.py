"""Which commands an agent or a supervisor acts on (``docs/security.md``, commands).

A record of the ``commands`` topic keyed by the job passes, in this order:

1. it decodes as a command (else ``undecodable``);
2. with the daemon's public keys: its Ed25519 signature verifies under one of them (else
   ``unsigned``, ``unknown_kid`` or ``bad_signature``);
3. it names the job (else ``wrong_job``: e.g. another job's signed command re-keyed);
4. its generation is not older than the floor: this process's generation, and with keys also
   the newest generation accepted so far (else ``stale_generation``);
5. with keys, it is no replay: a ``(generation, seq)`` accepted before comes back with the
   same content (``duplicate``: a harmless re-read, not acted on twice) or with other content
   (``replayed``), or its ``seq`` is not above the last one accepted in its generation
   (``replayed``). The daemon numbers a job's commands 1, 2, 3, ... across generations, so a
   command it sends is always newer.

Without keys, step 2 and the ``replayed`` checks of step 5 are skipped: every decodable
command of the job at or above this process's generation is taken (insecure: anyone who can
write to the bus can order a restore), except a ``duplicate``: a command re-sent or re-read
with the same content is acted on once, with or without keys. Pure: no I/O, no clock; the gate
counts what it ignores, and :func:`log_ignored` says it in the caller's log.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, TypeAlias

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from structlog.typing import FilteringBoundLogger

from trainguard.schemas import (
    Abort,
    Command,
    Restore,
    Resume,
    SchemaError,
    Unauthenticated,
    decode,
    verify_signature,
)

__all__ = ["CommandGate", "IgnoreReason", "Ignored", "log_ignored"]

IgnoreReason: TypeAlias = Literal[
    "undecodable",
    "unsigned",
    "unknown_kid",
    "bad_signature",
    "wrong_job",
    "stale_generation",
    "replayed",
    "duplicate",
]
"""Why a command was not acted on (module docstring)."""

_AUTH_REASONS: Mapping[str, IgnoreReason] = {
    "missing": "unsigned",
    "unknown_kid": "unknown_kid",
    "bad_signature": "bad_signature",
    "bad_mac": "bad_signature",
}


@dataclass(frozen=True, slots=True)
class Ignored:
    """A command that is not acted on.

    Attributes:
        reason: the :data:`IgnoreReason`.
        detail: what was wrong, for the log (never key material).
        generation: the command's generation, when it decoded.
        seq: its ``seq``, when it decoded.
    """

    reason: IgnoreReason
    detail: str
    generation: int | None = None
    seq: int | None = None


class CommandGate:
    """Admits the commands of one job that one process may act on (module docstring).

    Args:
        job_id: the job.
        generation: this process's generation: older commands are stale.
        keys: the daemon's public keys by kid, or ``None`` to accept unsigned commands.

    Attributes:
        ignored: commands ignored so far, by :data:`IgnoreReason`.
    """

    def __init__(
        self, job_id: str, generation: int, keys: Mapping[str, Ed25519PublicKey] | None
    ) -> None:
        self._job_id = job_id
        self._floor = generation
        self._keys = keys
        # (generation, seq) -> the accepted command without its signature; the highest seq
        # accepted per generation.
        self._seen: dict[tuple[int, int], Command] = {}
        self._last_seq: dict[int, int] = {}
        self.ignored: collections.Counter[IgnoreReason] = collections.Counter()

    def admit(self, data: bytes) -> Restore | Resume | Abort | Ignored:
        """The command in ``data`` if it may be acted on, else why not (counted in
        :attr:`ignored`)."""
        verdict = self._judge(data)
        if isinstance(verdict, Ignored):
            self.ignored[verdict.reason] += 1
        return verdict

    def _judge(self, data: bytes) -> Restore | Resume | Abort | Ignored:
        try:
            command = decode(data, expect=Command)
        except SchemaError as exc:
            return Ignored("undecodable", str(exc))
        assert isinstance(command, Restore | Resume | Abort)  # expect=Command
        generation, seq = command.generation, command.seq
        if self._keys is not None:
            try:
                verify_signature(data, self._keys)
            except Unauthenticated as exc:
                return Ignored(_AUTH_REASONS[exc.code], exc.reason, generation, seq)
        if command.job_id != self._job_id:
            return Ignored("wrong_job", f"a command of job {command.job_id!r}", generation, seq)
        if generation < self._floor:
            return Ignored(
                "stale_generation",
                f"generation {generation} is older than {self._floor}",
                generation,
                seq,
            )
        content = dataclasses.replace(command, auth=None)
        seen = self._seen.get((generation, seq))
        if seen == content:
            return Ignored("duplicate", "taken already", generation, seq)
        if self._keys is None:
            # Nothing tells the daemon's command from a forgery: only a re-read is recognised.
            self._seen[(generation, seq)] = content
            return command
        if seen is not None:
            return Ignored("replayed", "another command had this seq", generation, seq)
        last = self._last_seq.get(generation)
        if last is not None and seq <= last:
            return Ignored(
                "replayed", f"seq {seq} is not after {last}, accepted already", generation, seq
            )
        self._seen[(generation, seq)] = content
        self._last_seq[generation] = seq
        self._floor = max(self._floor, generation)
        return command


def log_ignored(log: FilteringBoundLogger, ignored: Ignored, offset: int) -> None:
    """Say in ``log`` why the command at ``offset`` (of ``commands``) was not acted on: a
    warning, or a debug line for a ``duplicate`` (a harmless re-read)."""
    report = log.debug if ignored.reason == "duplicate" else log.warning
    report(
        "command ignored",
        reason=ignored.reason,
        detail=ignored.detail,
        command_generation=ignored.generation,
        seq=ignored.seq,
        offset=offset,
    )
