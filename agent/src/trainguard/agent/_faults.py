"""Fault injection: rehearse failures in a real job (``TRAINGUARD_FAULTS``).

A spec is a ``;``-separated list of faults, each ``kind@key=value,key=value``; every fault fires
in :meth:`Agent.step <trainguard.agent.Agent.step>` of its rank, once that step is complete:

* ``kill@step=N,rank=R``: the rank sends itself SIGKILL (a crash: nothing is flushed).
* ``exit@step=N,rank=R,code=C``: the rank ends with ``os._exit(C)`` (default 1; no clean-up,
  no ``finally`` blocks, no lifecycle event), as a process dying on a fatal error would.
* ``hang@step=N,rank=R,seconds=S``: the training thread sleeps ``S`` seconds (default: for
  ever) while the agent's background thread keeps sending heartbeats, as in a stuck
  collective: alive, not progressing.

A fault fires once per job, in the first generation that reaches its step, unless it carries
the flag ``repeat`` (``kill@step=5,rank=1,repeat``); then it fires whenever its step is reached.
"Fired" is remembered in a marker file in a folder the job's generations share, because a
restarted process has no other memory of it. Example:
``TRAINGUARD_FAULTS="kill@step=20,rank=1; hang@step=50,rank=0,seconds=600"``.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

from trainguard.agent._errors import ConfigError

__all__ = ["Fault", "FaultInjector", "FaultKind", "parse_faults"]

FaultKind = Literal["kill", "exit", "hang"]

_KEYS: dict[str, set[str]] = {
    "kill": {"step", "rank"},
    "exit": {"step", "rank", "code"},
    "hang": {"step", "rank", "seconds"},
}


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault (see the module docstring).

    Attributes:
        kind: ``kill``, ``exit`` or ``hang``.
        step: the training step (>= 0) after which it fires.
        rank: the rank (>= 0) it fires on.
        code: exit status for ``exit``, 0-255.
        seconds: how long ``hang`` sleeps, seconds; ``math.inf`` for ever.
        repeat: fire whenever ``step`` is reached, not only the first time in the job.
    """

    kind: FaultKind
    step: int
    rank: int
    code: int = 1
    seconds: float = math.inf
    repeat: bool = False

    @property
    def fault_id(self) -> str:
        """Stable name of the fault (``kill-s20-r1``), used for its fired-marker file."""
        return f"{self.kind}-s{self.step}-r{self.rank}"


def parse_faults(spec: str) -> tuple[Fault, ...]:
    """Parse a fault spec (module docstring); ``""`` gives no faults.

    Raises:
        ConfigError: naming the bad part: unknown kind or key, a value that is not a number or
            out of range, ``step`` or ``rank`` missing, or two faults at one step of one rank.
    """
    faults: list[Fault] = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        kind, sep, args = (s.strip() for s in part.partition("@"))
        if kind not in _KEYS:
            raise ConfigError(f"fault {part!r}: unknown kind {kind!r} (known: {sorted(_KEYS)})")
        if not sep:
            raise ConfigError(f"fault {part!r}: expected {kind}@step=N,rank=R")
        values: dict[str, float] = {}
        repeat = False
        for item in filter(None, (a.strip() for a in args.split(","))):
            if item == "repeat":
                repeat = True
                continue
            key, eq, raw = (s.strip() for s in item.partition("="))
            if not eq or key not in _KEYS[kind]:
                raise ConfigError(
                    f"fault {part!r}: unexpected {item!r} (a {kind} takes "
                    f"{', '.join(sorted(_KEYS[kind]))} and the flag repeat)"
                )
            values[key] = _number(part, key, raw)
        missing = {"step", "rank"} - values.keys()
        if missing:
            raise ConfigError(f"fault {part!r}: missing {', '.join(sorted(missing))}")
        fault = Fault(
            cast(FaultKind, kind),  # checked against _KEYS above
            int(values["step"]),
            int(values["rank"]),
            code=int(values.get("code", 1)),
            seconds=values.get("seconds", math.inf),
            repeat=repeat,
        )
        if any((f.step, f.rank) == (fault.step, fault.rank) for f in faults):
            raise ConfigError(
                f"fault {part!r}: rank {fault.rank} already has a fault at step {fault.step}"
            )
        faults.append(fault)
    return tuple(faults)


def _number(part: str, key: str, raw: str) -> float:
    """The value of ``key=raw``: an integer >= 0, ``code`` at most 255, ``seconds`` a float."""
    try:
        value = float(raw) if key == "seconds" else int(raw)
    except ValueError as exc:
        raise ConfigError(f"fault {part!r}: {key}={raw!r} is not a number") from exc
    if not value >= 0 or (key == "code" and value > 255):
        bound = "in 0..255" if key == "code" else ">= 0"
        raise ConfigError(f"fault {part!r}: {key}={raw!r} must be {bound}")
    return value


class FaultInjector:
    """Fires the faults of one rank at step boundaries.

    Args:
        faults: parsed faults (of all ranks; this injector keeps the ones of ``rank``).
        rank: this process's rank.
        marker_dir: folder of fired-markers, shared by the job's generations; created when the
            first fault fires.
    """

    def __init__(self, faults: tuple[Fault, ...], rank: int, marker_dir: Path) -> None:
        self._by_step = {f.step: f for f in faults if f.rank == rank}
        self._marker_dir = marker_dir

    def at_step(self, step: int) -> None:
        """Fire the fault of ``step``, if any: ``kill`` and ``exit`` do not return, ``hang``
        returns after its ``seconds``. A dictionary lookup when there is none."""
        fault = self._by_step.get(step)
        if fault is None or not (fault.repeat or self._first_time(fault)):
            return
        match fault.kind:
            case "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            case "exit":
                os._exit(fault.code)
            case "hang":
                if math.isinf(fault.seconds):
                    threading.Event().wait()
                time.sleep(fault.seconds)

    def _first_time(self, fault: Fault) -> bool:
        """Create ``fault``'s marker; False when it existed (the fault fired before)."""
        self._marker_dir.mkdir(parents=True, exist_ok=True)
        try:
            # Exclusive create is the test and the mark in one step. It happens before the
            # fault fires, and the page cache outlives a SIGKILL, so the mark is not lost.
            os.close(os.open(self._marker_dir / fault.fault_id, os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            return False
        return True
