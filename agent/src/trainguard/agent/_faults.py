"""Fault injection: rehearse failures in a real job (``TRAINGUARD_FAULTS``).

A spec is a ``;``-separated list of faults, each ``kind@key=value,key=value``:

* ``kill@step=N,rank=R``: the rank sends itself SIGKILL when it reaches step N.
* ``exit@step=N,rank=R,code=C``: the rank exits with status C (default 1) at step N.

A fault fires once, in the first generation that reaches its step, unless it carries the flag
``repeat`` (``kill@step=5,rank=1,repeat``), then it fires again in every generation. "Fired"
is remembered in a marker file, because a restarted process has no other memory of it.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

from trainguard.agent._errors import ConfigError

__all__ = ["Fault", "FaultInjector", "parse_faults"]

_KINDS = {"kill": {"step", "rank"}, "exit": {"step", "rank", "code"}}


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault.

    Attributes:
        kind: ``kill`` or ``exit``.
        step: the training step at which it fires.
        rank: the rank it fires on.
        code: exit status for ``exit``.
        repeat: fire in every generation, not only the first that reaches ``step``.
    """

    kind: str
    step: int
    rank: int
    code: int = 1
    repeat: bool = False

    @property
    def fault_id(self) -> str:
        """Stable name of the fault, used for its fired-marker file."""
        return f"{self.kind}-s{self.step}-r{self.rank}"


def parse_faults(spec: str) -> tuple[Fault, ...]:
    """Parse a fault spec; raises :class:`ConfigError` naming the bad part."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        kind, sep, args = part.partition("@")
        if kind not in _KINDS:
            raise ConfigError(f"fault {part!r}: unknown kind {kind!r} (known: {sorted(_KINDS)})")
        if not sep:
            raise ConfigError(f"fault {part!r}: expected {kind}@step=N,rank=R")
        values: dict[str, int] = {}
        repeat = False
        for item in filter(None, (a.strip() for a in args.split(","))):
            if item == "repeat":
                repeat = True
                continue
            key, eq, raw = item.partition("=")
            if not eq or key not in _KINDS[kind]:
                raise ConfigError(f"fault {part!r}: unexpected {item!r} for {kind}")
            try:
                values[key] = int(raw)
            except ValueError as exc:
                raise ConfigError(f"fault {part!r}: {key}={raw!r} is not an integer") from exc
        missing = {"step", "rank"} - values.keys()
        if missing:
            raise ConfigError(f"fault {part!r}: missing {', '.join(sorted(missing))}")
        if values["step"] < 0 or values["rank"] < 0:
            raise ConfigError(f"fault {part!r}: step and rank must be >= 0")
        faults.append(Fault(kind, values["step"], values["rank"], values.get("code", 1), repeat))
    return tuple(faults)


class FaultInjector:
    """Fires the faults of one rank at step boundaries.

    Args:
        faults: parsed faults (all ranks; this injector keeps the ones for ``rank``).
        rank: this process's rank.
        marker_dir: folder of fired-markers, shared by the job's generations.
    """

    def __init__(self, faults: tuple[Fault, ...], rank: int, marker_dir: Path) -> None:
        self._by_step = {f.step: f for f in faults if f.rank == rank}
        self._marker_dir = marker_dir

    def at_step(self, step: int) -> None:
        """Fire the fault scheduled for ``step``, if any (does not return for kill/exit)."""
        fault = self._by_step.get(step)
        if fault is None:
            return
        if not fault.repeat:
            marker = self._marker_dir / fault.fault_id
            if marker.exists():
                return
            self._marker_dir.mkdir(parents=True, exist_ok=True)
            # Written before firing: the process may not get another chance.
            with marker.open("w") as f:
                f.flush()
                os.fsync(f.fileno())
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(fault.code)
