"""Firing the faults of ``TRAINGUARD_FAULTS`` (:mod:`._faults`) at the agent's hooks.

The agent calls one hook per place a fault can strike, each a dictionary lookup when no fault
is due:

* :meth:`FaultInjector.pace` in ``Agent.step`` before the step is recorded (``slow``);
* :meth:`FaultInjector.loss` in ``Agent.perturb_loss`` (``nan``, ``spike``);
* :meth:`FaultInjector.after_step` in ``Agent.step`` after the step is recorded (``kill``,
  ``exit``, ``error``, ``hang``, ``bitflip``);
* :meth:`FaultInjector.before_write` before a checkpoint shard is written
  (``stall-checkpoint``).

"Fired" is remembered in a marker file per fault and rank, in a folder the job's generations
share, because a restarted process has no other memory of it. The sustained faults (``slow``,
``spike``) act from their step for their ``steps``, and stop when the process restores in
process (:meth:`FaultInjector.end_generation`) or ends.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import structlog

from trainguard.agent.faults._plan import Fault

if TYPE_CHECKING:
    from torch import nn

__all__ = ["FaultInjector", "InjectedError", "Scalable"]


class Scalable(Protocol):
    """A loss: anything that multiplies by a float (a tensor, a float)."""

    def __mul__(self, other: float, /) -> Any: ...


_L = TypeVar("_L", bound=Scalable)

_LOSS_KINDS = frozenset({"nan", "spike"})
_STEP_KINDS = frozenset({"kill", "exit", "error", "hang", "bitflip"})


class InjectedError(RuntimeError):
    """The exception of an ``error`` fault: an uncaught error of the training loop."""


class FaultInjector:
    """Fires the faults of one rank.

    Args:
        faults: parsed faults (of all ranks; this injector keeps those of ``rank`` and those
            of every rank).
        rank: this process's rank.
        marker_dir: folder of fired-markers, shared by the job's generations; created when the
            first fault fires.
    """

    def __init__(self, faults: tuple[Fault, ...], rank: int, marker_dir: Path) -> None:
        self._by_step = {f.step: f for f in faults if f.rank in (None, rank)}
        self.perturbs_loss = any(f.kind in _LOSS_KINDS for f in self._by_step.values())
        """Whether a ``nan`` or ``spike`` fault is planned for this rank: without one,
        :meth:`loss` returns every loss untouched."""
        self._rank = rank
        self._marker_dir = marker_dir
        self._log = structlog.get_logger("trainguard.agent").bind(rank=rank)
        self._slow: Fault | None = None
        self._spike: Fault | None = None
        self._loss_step: int | None = None  # the last step perturb_loss was asked about
        self._module: nn.Module | None = None

    def watch(self, module: nn.Module) -> None:
        """The model whose parameter ``bitflip`` corrupts."""
        self._module = module

    def end_generation(self) -> None:
        """Stop the sustained faults: the process reloads a snapshot in process."""
        self._slow = self._spike = None

    def pace(self, step: int, elapsed_s: float) -> bool:
        """``slow``: sleep ``(factor - 1) * elapsed_s`` seconds, ``elapsed_s`` being step
        ``step``'s own duration so far; return whether it slept."""
        fault = self._by_step.get(step)
        if fault is not None and fault.kind == "slow" and self._fires(fault):
            self._slow = fault
        slow = self._slow
        if slow is None:
            return False
        if not slow.covers(step):
            self._slow = None
            return False
        time.sleep((slow.factor - 1) * elapsed_s)
        return True

    def loss(self, step: int, loss: _L) -> _L:
        """``nan`` and ``spike``: ``loss`` scaled for step ``step``, or ``loss`` itself."""
        self._loss_step = step
        fault = self._by_step.get(step)
        if fault is not None and fault.kind in _LOSS_KINDS and self._fires(fault):
            if fault.kind == "nan":
                return cast(_L, loss * math.nan)
            self._spike = fault
        spike = self._spike
        if spike is None:
            return loss
        if not spike.covers(step):
            self._spike = None
            return loss
        return cast(_L, loss * spike.factor)

    def after_step(self, step: int) -> None:
        """``kill`` and ``exit`` do not return, ``error`` raises :class:`InjectedError`,
        ``hang`` returns after its ``seconds``, ``bitflip`` corrupts the watched model. A
        dictionary lookup when nothing is due.

        Raises:
            InjectedError: an ``error`` fault of ``step``.
        """
        fault = self._by_step.get(step)
        if fault is None:
            return
        if fault.kind in _LOSS_KINDS and self._loss_step != step:
            self._log.error(
                "fault_not_applied",
                fault=fault.marker(self._rank),
                why="the training loop does not pass its loss through agent.perturb_loss()",
            )
            return
        if fault.kind == "bitflip" and self._module is None:
            self._log.error(
                "fault_not_applied",
                fault=fault.marker(self._rank),
                why="the training loop did not register its model with agent.watch()",
            )
            return
        if fault.kind not in _STEP_KINDS or not self._fires(fault):
            return
        match fault.kind:
            case "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            case "exit":
                os._exit(fault.code)
            case "error":
                raise InjectedError(f"injected fault {fault.marker(self._rank)}")
            case "hang":
                if math.isinf(fault.seconds):
                    threading.Event().wait()
                time.sleep(fault.seconds)
            case "bitflip":
                from trainguard.agent.checkpoint._checksum import flip_bit

                assert self._module is not None  # checked above
                self._log.warning("bit_flipped", detail=flip_bit(self._module, fault.bit))

    def before_write(self, step: int) -> None:
        """``stall-checkpoint``: sleep its ``seconds`` before the shard of ``step`` is
        written (on whichever thread writes it)."""
        fault = self._by_step.get(step)
        if fault is not None and fault.kind == "stall-checkpoint" and self._fires(fault):
            time.sleep(fault.seconds)

    def _fires(self, fault: Fault) -> bool:
        """Whether ``fault`` fires now (a repeating one, or the first time in the job); logs it.

        The marker is created before the fault acts, with an exclusive create (the test and
        the mark in one step); the page cache outlives a SIGKILL, so the mark is not lost.
        """
        if not fault.repeat:
            self._marker_dir.mkdir(parents=True, exist_ok=True)
            try:
                path = self._marker_dir / fault.marker(self._rank)
                os.close(os.open(path, os.O_CREAT | os.O_EXCL, 0o644))
            except FileExistsError:
                return False
        self._log.warning("fault_fired", fault=fault.marker(self._rank), kind=fault.kind)
        return True
