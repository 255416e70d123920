"""The simulated ranks' records on the wire: what :mod:`._model` emits, as the bytes real agents
and supervisors would send (``docs/wire-contract.md``), MACed with the job's event key.

A simulation sends one record per rank per heartbeat: 16,384 a second at the scale of the
issue, on one core beside the daemon. So each emission is encoded once through the real codec
(:func:`~trainguard.schemas.encode`, which validates it against its schema) for its first rank,
and the other ranks' records are that wire object with the fields that differ per rank (rank,
host, pid, seq, and the shard's URI and digest) replaced and serialised canonically (sorted
keys, as ``encode`` writes them); the MAC is the HMAC-SHA256 of those canonical bytes, laid out
as :func:`~trainguard.schemas.add_mac` lays it out. The first rank's record is checked against
``encode(add_mac(message))`` byte for byte, so a change of the contract fails loudly here
instead of feeding the daemon records no agent would send.

With ``SimParams.batch_heartbeats`` the heartbeats of one instant go as one ``heartbeat-batch``
record per node instead, from the node's supervisor: entries are the ranks' heartbeats without
``job_id`` and ``host`` (edited from one template per variant, as above), and the first batch of
each instant is decoded and encoded again through the codec and checked byte for byte.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from trainguard.daemon.sim._model import Beats, Emission, ExitReport, Reports, Shards, SimParams
from trainguard.schemas import (
    Checkpoint,
    DataCursor,
    Event,
    Heartbeat,
    HeartbeatBatch,
    Lifecycle,
    add_mac,
    decode,
    encode,
)

__all__ = ["Wire", "WireError", "host_name", "rank_pid", "supervisor_pid"]

_NS_PER_MS = 1_000_000


class WireError(RuntimeError):
    """The fast encoding of a record differs from the codec's: the wire contract changed under
    the simulator."""


def host_name(host: int) -> str:
    """The name of simulated node ``host`` (a replacement node has a new number)."""
    return f"sim-node-{host:05d}"


def rank_pid(rank: int, generation: int) -> int:
    """The process id of ``rank``'s worker in ``generation`` (a restart is a new process)."""
    return 100_000 + (generation * 1_000_003 + rank) % 2_000_000_000


def supervisor_pid(host: int) -> int:
    """The process id of node ``host``'s supervisor."""
    return 1_000 + host


class Wire:
    """Encodes the simulated job's emissions, one record value per rank (module docstring).

    Args:
        job_id: the job.
        params: the simulated job.
        host_of: rank -> the id of the node it runs on now.
        event_key: ``(kid, key)`` of the job's event key, or ``None`` to send unauthenticated
            events (a daemon without keys).
        checkpoints: the folder the shards' URIs name (step folders under it; the shards
            themselves are never written).
    """

    def __init__(
        self,
        job_id: str,
        params: SimParams,
        host_of: Callable[[int], int],
        event_key: tuple[str, bytes] | None,
        checkpoints: Path,
    ) -> None:
        self._job = job_id
        self._checkpoints = checkpoints
        self._p = params
        self._host_of = host_of
        self._key = event_key
        self._mac = None if event_key is None else hmac.new(event_key[1], digestmod=hashlib.sha256)
        self._seq: dict[tuple[int | None, int, int], int] = {}
        self.heartbeats = 0
        """Rank heartbeats encoded so far, batched or not."""
        self.batches = 0
        """``heartbeat-batch`` records encoded so far."""
        digest = hashlib.sha256(f"{job_id}/dataset".encode()).hexdigest()
        self.data_version = f"sha256:{digest[:16]}"

    # -- the interface ---------------------------------------------------------------------

    def encode(self, emission: Emission) -> list[bytes]:
        """The record values of ``emission``, one per rank (one per node for batched
        heartbeats), in rank order.

        Raises:
            WireError: the first rank's fast encoding differs from the codec's.
        """
        match emission:
            case Beats():
                return self._beats(emission)
            case Shards():
                return self._shards(emission)
            case Reports():
                return self._reports(emission)
            case ExitReport():
                return [self._exit(emission)]

    def step_folder(self, generation: int, step: int) -> Path:
        """The folder of the shards of ``step`` written in ``generation``, where the daemon
        stores the step's manifest once it commits."""
        return self._checkpoints / self._job / f"g{generation:06d}" / f"s{step:010d}"

    def cursor(self, step: int) -> DataCursor:
        """The job's data position after ``step`` (global, world-size independent)."""
        consumed = step * self._p.ranks * self._p.samples_per_rank
        epoch, offset = divmod(consumed, self._p.dataset_samples)
        return DataCursor(
            data_version=self.data_version,
            seed=1234,
            epoch=epoch,
            offset=offset,
            world_size=self._p.ranks,
        )

    # -- per kind --------------------------------------------------------------------------

    def _head(self, rank: int, generation: int, at_ms: int) -> dict[str, Any]:
        host = self._host_of(rank)
        pid = rank_pid(rank, generation)
        return {
            "job_id": self._job,
            "generation": generation,
            "ts": at_ms * _NS_PER_MS,
            "seq": self._next_seq(rank, host, pid),
            "rank": rank,
            "host": host_name(host),
            "pid": pid,
        }

    def _beats(self, b: Beats) -> list[bytes]:
        def message(rank: int, head: dict[str, Any]) -> Event:
            return Heartbeat(
                **head,
                world_size=self._p.ranks,
                step=b.step,
                phase=b.phase,
                step_time_s=None if b.age_ms is None else self._p.step_s,
                loss=float("nan") if rank in b.nan_ranks else b.loss,
                samples=b.step * self._p.samples_per_rank,
                param_checksum=_odd(b.checksum) if rank in b.odd_ranks else b.checksum,
                step_age_s=None if b.age_ms is None else b.age_ms / 1000,
            )

        # Ranks whose record differs in more than identity get a template of their own.
        def variant(rank: int) -> tuple[bool, bool]:
            return rank in b.nan_ranks, rank in b.odd_ranks

        self.heartbeats += len(b.ranks)
        if self._p.batch_heartbeats:
            return self._batches(b, message, variant)
        return self._render(b.ranks, b.generation, b.at_ms, message, variant)

    def _batches(
        self,
        b: Beats,
        message: Callable[[int, dict[str, Any]], Event],
        variant: Callable[[int], object],
    ) -> list[bytes]:
        """One ``heartbeat-batch`` record per node of ``b.ranks``' heartbeats (module
        docstring), in the order of the nodes' first ranks."""
        nodes: dict[int, list[int]] = {}
        for rank in b.ranks:
            nodes.setdefault(self._host_of(rank), []).append(rank)
        templates: dict[object, dict[str, Any]] = {}
        out: list[bytes] = []
        for host, ranks in nodes.items():
            entries = []
            for rank in ranks:
                head = self._head(rank, b.generation, b.at_ms)
                kind = variant(rank)
                entry = templates.get(kind)
                if entry is None:
                    entry = orjson.loads(encode(message(rank, head)))
                    for batch_field in ("schema", "job_id", "host"):
                        del entry[batch_field]
                    templates[kind] = entry
                del head["job_id"], head["host"]
                entries.append({**entry, **head})
            pid = supervisor_pid(host)
            batch = {
                "schema": HeartbeatBatch.SCHEMA,
                "job_id": self._job,
                "ts": b.at_ms * _NS_PER_MS,
                "seq": self._next_seq(None, host, pid),
                "host": host_name(host),
                "pid": pid,
                "beats": entries,
            }
            canonical = orjson.dumps(batch, option=orjson.OPT_SORT_KEYS)
            if out:
                out.append(self._seal(canonical))
                continue
            first = decode(canonical, expect=HeartbeatBatch)  # validated
            if encode(first) != canonical:
                raise WireError("the simulator's heartbeat batch differs from the codec's")
            out.append(self._sealed(first))
        self.batches += len(out)
        return out

    def _shards(self, s: Shards) -> list[bytes]:
        cursor = self.cursor(s.step)
        folder = self.step_folder(s.generation, s.step).as_uri()

        def uri(rank: int) -> str:
            return f"{folder}/rank{rank:05d}.pt"

        def shard(rank: int, head: dict[str, Any]) -> Event:
            return Checkpoint(
                **head,
                world_size=self._p.ranks,
                step=s.step,
                shard_uri=uri(rank),
                size_bytes=187_000_000,
                digest=_digest(uri(rank)),
                cursor=cursor,
            )

        def extra(rank: int) -> dict[str, Any]:
            return {"shard_uri": uri(rank), "digest": _digest(uri(rank))}

        # The shard carries the rank's cursor: an agent sends no data-cursor event with it.
        return self._render(s.ranks, s.generation, s.at_ms, shard, extra=extra)

    def _reports(self, r: Reports) -> list[bytes]:
        target = r.target if r.kind == "restored" else None

        def report(rank: int, head: dict[str, Any]) -> Event:
            return Lifecycle(
                **head,
                kind=r.kind,
                step=r.step,
                world_size=self._p.ranks if r.kind == "started" else None,
                cursor=None if target is None else target.cursor,
                snapshot_id=None if target is None else target.snapshot_id,
            )

        return self._render(r.ranks, r.generation, r.at_ms, report)

    def _exit(self, e: ExitReport) -> bytes:
        pid = supervisor_pid(e.host)
        report = Lifecycle(
            job_id=self._job,
            generation=e.generation,
            ts=e.at_ms * _NS_PER_MS,
            seq=self._next_seq(None, e.host, pid),
            rank=None,
            host=host_name(e.host),
            pid=pid,
            kind="exited",
            ranks=e.ranks,
            signal=9,
        )
        return self._sealed(report)

    # -- plumbing --------------------------------------------------------------------------

    def _render(
        self,
        ranks: tuple[int, ...],
        generation: int,
        at_ms: int,
        message: Callable[[int, dict[str, Any]], Event],
        variant: Callable[[int], object] = lambda rank: None,
        extra: Callable[[int], dict[str, Any]] = lambda rank: {},
    ) -> list[bytes]:
        """One record per rank of ``ranks``: the codec's encoding of ``message`` for the first
        rank of each variant, edited for the others."""
        templates: dict[object, dict[str, Any]] = {}
        out = []
        for rank in ranks:
            head = self._head(rank, generation, at_ms)
            kind = variant(rank)
            wire = templates.get(kind)
            if wire is None:
                sealed = self._sealed(message(rank, head))
                templates[kind] = orjson.loads(self._canonical_of(sealed))
                out.append(sealed)
                continue
            wire.update(head)
            wire.update(extra(rank))
            out.append(self._seal(orjson.dumps(wire, option=orjson.OPT_SORT_KEYS)))
        return out

    def _sealed(self, message: Event | HeartbeatBatch) -> bytes:
        """``message`` through the codec (validated), MACed, and checked against the fast
        path's layout.

        Raises:
            WireError: the fast path would have written other bytes.
        """
        if self._key is None:
            return encode(message)
        real = encode(add_mac(message, *self._key))
        fast = self._seal(encode(message))
        if fast != real:
            raise WireError(
                f"the simulator's MAC layout differs from the codec's for {message.SCHEMA}"
            )
        return real

    def _seal(self, canonical: bytes) -> bytes:
        """Canonical bytes with the MAC in front, as ``encode(add_mac(...))`` writes them."""
        if self._key is None or self._mac is None:
            return canonical
        mac = self._mac.copy()
        mac.update(canonical)
        tag = base64.b64encode(mac.digest())
        return (
            b'{"auth":{"kid":"'
            + self._key[0].encode()
            + b'","mac":"'
            + tag
            + b'"},'
            + (canonical[1:])
        )

    def _canonical_of(self, sealed: bytes) -> bytes:
        if self._key is None:
            return sealed
        wire = orjson.loads(sealed)
        wire.pop("auth")
        return orjson.dumps(wire, option=orjson.OPT_SORT_KEYS)

    def _next_seq(self, rank: int | None, host: int, pid: int) -> int:
        key = (rank, host, pid)
        seq = self._seq[key] = self._seq.get(key, 0) + 1
        return seq


def _digest(uri: str) -> str:
    return "sha256:" + hashlib.sha256(uri.encode()).hexdigest()


def _odd(checksum: str | None) -> str | None:
    """The checksum a silently corrupted replica reports instead of ``checksum``."""
    return None if checksum is None else f"{int(checksum, 16) ^ 0xFFFFFFFF:08x}"
