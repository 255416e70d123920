"""Fault specs: rehearse failures in a real job (``TRAINGUARD_FAULTS``).

A spec is a ``;``-separated list of faults, each ``kind@key=value,key=value``; the agent of
each rank fires the faults meant for it (:mod:`._injector`). Steps count training steps as the
loop reports them to :meth:`Agent.step <trainguard.agent.Agent.step>`:

* ``kill@step=N,rank=R``: after step N, the rank sends itself SIGKILL (a crash: nothing is
  flushed).
* ``exit@step=N,rank=R,code=C``: after step N, the rank ends with ``os._exit(C)`` (default 1;
  no clean-up, no ``finally`` blocks, no lifecycle event), as a process dying on a fatal error
  would.
* ``error@step=N,rank=R``: after step N, :meth:`Agent.step <trainguard.agent.Agent.step>`
  raises ``InjectedError`` (a ``RuntimeError``) into the training loop, as a bug or a failed
  collective would: the process ends with the exception's traceback, unless the loop catches
  it.
* ``hang@step=N,rank=R,seconds=S``: after step N, the training thread sleeps ``S`` seconds
  (default: for ever) while the agent's background thread keeps sending heartbeats, as in a
  stuck collective: alive, not progressing.
* ``slow@step=N,rank=R,factor=F,steps=K``: from step N on, each of the rank's steps takes F
  times as long (F >= 1): the training thread sleeps ``(F - 1)`` times the step's own duration
  before the step is recorded. For K steps (default: until the process restores or ends).
* ``nan@step=N,rank=R``: the loss of step N becomes NaN (``loss * nan``), and so do the
  gradients it is differentiated into: the parameters diverge for real. Needs
  :meth:`Agent.perturb_loss <trainguard.agent.Agent.perturb_loss>` in the loop.
* ``spike@step=N,factor=F,rank=R,steps=K``: from step N on, the loss (and so the gradients) is
  multiplied by F (> 0) on rank R, or on every rank without ``rank``; for K steps (default:
  until the process restores or ends). Needs ``Agent.perturb_loss``.
* ``bitflip@step=N,rank=R,bit=B``: after step N, bit B of the first element of the first
  floating-point parameter of the rank's watched model is flipped (default: the highest
  mantissa bit, which changes the value by a factor between 2/3 and 3/2): silent corruption of
  one data-parallel replica. Needs :meth:`Agent.watch <trainguard.agent.Agent.watch>`.
* ``stall-checkpoint@step=N,seconds=S,rank=R``: the checkpoint write of step N takes S more
  seconds (S > 0) on rank R, or on every rank without ``rank``: a slow but legitimate write.
  Fires only if the loop checkpoints step N.

A fault fires once per job, in the first generation that reaches its step, unless it carries
the flag ``repeat`` (``kill@step=5,rank=1,repeat``); then it fires whenever its step is reached.
Example: ``TRAINGUARD_FAULTS="kill@step=20,rank=1; hang@step=50,rank=0,seconds=600"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, cast

from trainguard.agent._errors import ConfigError

__all__ = ["Fault", "FaultKind", "parse_faults"]

FaultKind = Literal[
    "kill", "exit", "error", "hang", "slow", "nan", "spike", "bitflip", "stall-checkpoint"
]

_KEYS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "kill": (frozenset({"step", "rank"}), frozenset()),
    "exit": (frozenset({"step", "rank"}), frozenset({"code"})),
    "error": (frozenset({"step", "rank"}), frozenset()),
    "hang": (frozenset({"step", "rank"}), frozenset({"seconds"})),
    "slow": (frozenset({"step", "rank", "factor"}), frozenset({"steps"})),
    "nan": (frozenset({"step", "rank"}), frozenset()),
    "spike": (frozenset({"step", "factor"}), frozenset({"rank", "steps"})),
    "bitflip": (frozenset({"step", "rank"}), frozenset({"bit"})),
    "stall-checkpoint": (frozenset({"step", "seconds"}), frozenset({"rank"})),
}
"""Kind -> (required keys, optional keys)."""

_INTEGERS = frozenset({"step", "rank", "code", "steps", "bit"})


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault (see the module docstring for the kinds).

    Attributes:
        kind: what happens.
        step: the training step (>= 0) it fires at.
        rank: the rank (>= 0) it fires on; ``None`` for every rank (``spike``,
            ``stall-checkpoint``).
        code: exit status for ``exit``, 0-255.
        seconds: how long ``hang`` sleeps (``math.inf``: for ever), or how much longer a
            ``stall-checkpoint`` write takes, seconds.
        factor: ``slow``: step time multiplier (>= 1); ``spike``: loss multiplier (> 0).
        steps: how many steps ``slow`` and ``spike`` last; ``None`` until the process restores
            or ends.
        bit: ``bitflip``: the bit to flip (0 = least significant); ``None`` for the highest
            mantissa bit of the parameter's dtype.
        repeat: fire whenever ``step`` is reached, not only the first time in the job.
    """

    kind: FaultKind
    step: int
    rank: int | None
    code: int = 1
    seconds: float = math.inf
    factor: float = 1.0
    steps: int | None = None
    bit: int | None = None
    repeat: bool = False

    def marker(self, rank: int) -> str:
        """Name of the file that records this fault fired on ``rank`` (``kill-s20-r1``)."""
        return f"{self.kind}-s{self.step}-r{rank}"

    def covers(self, step: int) -> bool:
        """Whether a sustained fault (``slow``, ``spike``) that fired at :attr:`step` still
        acts at ``step``."""
        return self.step <= step and (self.steps is None or step < self.step + self.steps)


def parse_faults(spec: str) -> tuple[Fault, ...]:
    """Parse a fault spec (module docstring); ``""`` gives no faults.

    Raises:
        ConfigError: naming the bad part: unknown kind or key, a required key missing, a value
            that is not a number or out of range, or two faults at one step of one rank.
    """
    faults: list[Fault] = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        fault = _parse_one(part)
        for other in faults:
            if other.step == fault.step and (
                other.rank is None or fault.rank is None or other.rank == fault.rank
            ):
                who = "every rank" if fault.rank is None else f"rank {fault.rank}"
                raise ConfigError(
                    f"fault {part!r}: {who} already has a fault at step {fault.step} ({other.kind})"
                )
        faults.append(fault)
    return tuple(faults)


def _parse_one(part: str) -> Fault:
    kind, sep, args = (s.strip() for s in part.partition("@"))
    if kind not in _KEYS:
        raise ConfigError(f"fault {part!r}: unknown kind {kind!r} (known: {sorted(_KEYS)})")
    required, optional = _KEYS[kind]
    if not sep:
        usage = ",".join(f"{k}=..." for k in sorted(required))
        raise ConfigError(f"fault {part!r}: expected {kind}@{usage}")
    values: dict[str, float] = {}
    repeat = False
    for item in filter(None, (a.strip() for a in args.split(","))):
        if item == "repeat":
            repeat = True
            continue
        key, eq, raw = (s.strip() for s in item.partition("="))
        if not eq or key not in required | optional:
            raise ConfigError(
                f"fault {part!r}: unexpected {item!r} (a {kind} takes "
                f"{', '.join(sorted(required | optional))} and the flag repeat)"
            )
        values[key] = _number(part, kind, key, raw)
    missing = required - values.keys()
    if missing:
        raise ConfigError(f"fault {part!r}: missing {', '.join(sorted(missing))}")
    rank, steps, bit = values.get("rank"), values.get("steps"), values.get("bit")
    return Fault(
        cast(FaultKind, kind),  # checked against _KEYS above
        int(values["step"]),
        None if rank is None else int(rank),
        code=int(values.get("code", 1)),
        seconds=values.get("seconds", math.inf),
        factor=values.get("factor", 1.0),
        steps=None if steps is None else int(steps),
        bit=None if bit is None else int(bit),
        repeat=repeat,
    )


def _number(part: str, kind: str, key: str, raw: str) -> float:
    """The value of ``key=raw`` in a fault of ``kind``, checked against its range.

    Raises:
        ConfigError: not a number, or out of range.
    """
    try:
        value = int(raw) if key in _INTEGERS else float(raw)
    except ValueError as exc:
        raise ConfigError(f"fault {part!r}: {key}={raw!r} is not a number") from exc
    bounds = {
        "code": (0, 255, "in 0..255"),
        "steps": (1, math.inf, ">= 1"),
        "bit": (0, 63, "in 0..63"),
        "factor": (1, math.inf, ">= 1") if kind == "slow" else (0, math.inf, "> 0"),
        "seconds": (0, math.inf, "> 0") if kind == "stall-checkpoint" else (0, math.inf, ">= 0"),
    }
    low, high, text = bounds.get(key, (0, math.inf, ">= 0"))
    strict = key in ("factor", "seconds") and text == "> 0"
    finite = key == "factor" or kind == "stall-checkpoint"
    ok = (value > low if strict else value >= low) and value <= high
    if not ok or (finite and not math.isfinite(value)):
        raise ConfigError(f"fault {part!r}: {key}={raw!r} must be {text}")
    return value
