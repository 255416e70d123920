"""What the supervisor does to the processes it starts (workers and spares): have them die
with it, and signal their process groups."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

__all__ = ["die_with_parent", "signal_group"]


def die_with_parent() -> None:
    """In the forked worker, before exec: have Linux SIGKILL it when the supervisor dies
    (``prctl(PR_SET_PDEATHSIG)``), so that a killed supervisor leaves no orphan training on
    unsupervised. Elsewhere a no-op."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to the process group ``pgid``; a group that is gone (or not ours) is
    ignored."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
