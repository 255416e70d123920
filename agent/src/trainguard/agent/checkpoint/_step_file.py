"""The last step a worker completed, shared with its supervisor through a small file.

A supervisor in launcher mode gives each worker a file of its own (``TRAINGUARD_STEP_FILE``)
holding one signed 64-bit integer in native byte order, -1 for "no step yet". The worker's
agent maps it into memory (``mmap``, shared) and stores each completed step into it: one
aligned 8-byte store, tens of nanoseconds, no system call. The kernel's page cache holds the
stored value whatever becomes of the process (an exit, a crash, SIGKILL), so when the worker
is gone the supervisor reads the step it last completed and reports it with the exit
(lifecycle ``exited``, ``step``); that is better evidence than the last heartbeat's step,
which may be a second behind. An aligned 8-byte store is not torn on the platforms torch runs
on (x86-64, AArch64), so a reader never sees half of one.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

__all__ = ["STEP_FILE_ENV", "StepRecorder", "read_step_file", "reset_step_file"]

STEP_FILE_ENV = "TRAINGUARD_STEP_FILE"
"""Environment variable naming a worker's step file (set by ``trainguard run``)."""

_FORMAT = struct.Struct("=q")
"""One signed 64-bit integer, native byte order and size: what ``memoryview.cast("q")``
stores."""

_NO_STEP = -1


def reset_step_file(path: Path) -> None:
    """Create or overwrite ``path`` with "no step yet", before a worker starts.

    Raises:
        OSError: the file cannot be written.
    """
    path.write_bytes(_FORMAT.pack(_NO_STEP))


def read_step_file(path: Path) -> int | None:
    """The last step the worker recorded in ``path``, or ``None`` when it recorded none, the
    file is missing or does not hold one value."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) != _FORMAT.size:
        return None
    (step,) = _FORMAT.unpack(data)
    return step if step >= 0 else None


class StepRecorder:
    """The worker's side: ``record(step)`` stores ``step`` into the mapped file.

    Args:
        path: the step file (it must exist and hold one value: :func:`reset_step_file`).

    Raises:
        OSError: the file cannot be opened or mapped.
        ValueError: the file does not hold exactly one value.
    """

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != _FORMAT.size:
                raise ValueError(f"{path} is not a step file ({_FORMAT.size} bytes)")
            self._map = mmap.mmap(fd, _FORMAT.size, access=mmap.ACCESS_WRITE)  # shared
        finally:
            os.close(fd)  # the mapping keeps the file
        self.cell: memoryview | None = memoryview(self._map).cast("q")
        """The mapped value: ``cell[0] = step`` is the store (``None`` once closed)."""

    def record(self, step: int) -> None:
        """Store ``step`` (an ``int``, ``0 <= step < 2**63``); a no-op once closed."""
        cell = self.cell
        if cell is not None:
            cell[0] = step

    def close(self) -> None:
        """Unmap the file (its last value stays in it). Idempotent."""
        cell, self.cell = self.cell, None
        if cell is not None:
            cell.release()  # the map cannot close while a view exports it
            self._map.close()
