"""One supervisor per job and node: the node's slot, an exclusive advisory file lock.

A supervisor that starts reporting a previous supervisor's workers gone (the rejoin,
``docs/operations.md``, "A supervisor that restarts") must be sure that no supervisor of that
job and node runs: a second ``trainguard run`` of a live job would otherwise declare the
first one's healthy ranks dead. The slot is ``flock(LOCK_EX | LOCK_NB)`` on a file of the
per-user state folder; the kernel releases it when its holder exits, however it exits (a
SIGKILL, an out-of-memory kill), so a restarted supervisor finds it free at once. The file
holds the holder's pid, for the message of the supervisor refused, and stays after the holder
exits (removing it could let two processes lock two different files of one name).

The slot is named by the bus (a job id names a job within one bus and topic prefix), the job
id and the node's identity: its first global rank, or its node rank when it names no rank, so
that two supervisors of one job that act as two nodes on one machine take two slots.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from pathlib import Path

from trainguard.agent._errors import AgentError, ConfigError

__all__ = ["NodeSlot", "NodeTaken"]


class NodeTaken(AgentError):
    """Another live supervisor holds this job's slot on this node; the message names the job,
    the node and the holder's pid."""


class NodeSlot:
    """The held slot of one (bus, job, node); :meth:`release` (or process exit) frees it."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path
        """The lock file."""

    @staticmethod
    def name(bus: str, job_id: str, node: str) -> str:
        """The slot's name, ``<job_id>.<node>.<digest of bus>``: safe in a file name, and the
        same for every supervisor of the job and node on that bus."""
        digest = hashlib.sha256(bus.encode()).hexdigest()[:16]
        return f"{job_id}.{node}.{digest}"

    @classmethod
    def take(cls, folder: Path, bus: str, job_id: str, node: str) -> NodeSlot:
        """Take the slot without waiting.

        Args:
            folder: where the lock files live (created if missing).
            bus: the bus's identity (its URL and topic prefix): the namespace of job ids.
            job_id: the job's id (the wire schema's characters: safe in a file name).
            node: the node's identity within the job, e.g. ``rank0`` or ``node1``.

        Raises:
            NodeTaken: a live process holds the slot.
            ConfigError: the folder or the lock file cannot be created or locked.
        """
        path = folder / f"{cls.name(bus, job_id, node)}.lock"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # not inherited by the workers
        except OSError as exc:
            raise ConfigError(f"cannot create the supervisor lock {path}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise NodeTaken(
                f"job {job_id!r} already has a supervisor on this node ({node}): pid {holder} "
                f"holds {path}. Only one trainguard run per job and node; a supervisor "
                "restarted after the previous one died rejoins the job by itself"
            ) from None
        except OSError as exc:
            os.close(fd)
            raise ConfigError(f"cannot lock the supervisor lock {path}: {exc}") from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(fd, path)

    def release(self) -> None:
        """Free the slot (idempotent); the file stays."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)  # closing the last descriptor releases the lock
