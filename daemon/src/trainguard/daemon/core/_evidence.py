"""Wording of the evidence in decision reasons, and its numbers as data (:class:`Measures`).

Pure and platform independent: a replay on another machine must produce the same strings, so
signal names come from a fixed table rather than the running platform's ``signal`` module.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import TypeAlias

from trainguard.schemas import EXIT_CONFIG

# Numbers that are the same on Linux, macOS and the BSDs (those marked XSI in POSIX's `kill`
# utility are fixed by the standard); others are reported by number only.
_SIGNAL_NAMES = {
    1: "SIGHUP",
    2: "SIGINT",
    3: "SIGQUIT",
    4: "SIGILL",
    5: "SIGTRAP",
    6: "SIGABRT",
    8: "SIGFPE",
    9: "SIGKILL",
    11: "SIGSEGV",
    13: "SIGPIPE",
    14: "SIGALRM",
    15: "SIGTERM",
}

_LISTED = 8
"""Ranks spelled out in a reason before the rest are only counted."""


def exit_status(exit_code: int | None, signal: int | None) -> str:
    """``"with signal 9 (SIGKILL)"``, ``"with exit code 1"``, ``"with exit code 78 (a
    configuration error)"`` (:data:`~trainguard.schemas.EXIT_CONFIG`) or ``"without an exit
    status"``."""
    if signal is not None:
        name = _SIGNAL_NAMES.get(signal)
        return f"with signal {signal} ({name})" if name else f"with signal {signal}"
    if exit_code == EXIT_CONFIG:
        return f"with exit code {exit_code} (a configuration error)"
    if exit_code is not None:
        return f"with exit code {exit_code}"
    return "without an exit status"


def said_text(message: str) -> str:
    """``": <message>"``, the detail a report gave, for the end of a reason (at most
    :data:`_SAID_CHARS` characters of it, its start cut: the end says why), or ``""``."""
    if not message:
        return ""
    if len(message) > _SAID_CHARS:
        message = "..." + message[-(_SAID_CHARS - 3) :]
    return f": {message}"


_SAID_CHARS = 1024
"""Most characters of a report's message quoted in a reason (reasons are at most 4096)."""


def ranks_text(ranks: Iterable[int]) -> str:
    """``"rank 3"``, ``"ranks 1, 2"``, or the first eight and a count of the rest."""
    listed = sorted(ranks)
    if len(listed) == 1:
        return f"rank {listed[0]}"
    text = ", ".join(str(r) for r in listed[:_LISTED])
    if len(listed) > _LISTED:
        text += f" and {len(listed) - _LISTED} more"
    return f"ranks {text}"


def hosts_text(hosts: Iterable[str]) -> str:
    """``"host h1"`` or ``"hosts h1, h2"``; ``""`` when no host is known."""
    listed = sorted(set(hosts))
    if not listed:
        return ""
    if len(listed) == 1:
        return f"host {listed[0]}"
    text = ", ".join(listed[:_LISTED])
    if len(listed) > _LISTED:
        text += f" and {len(listed) - _LISTED} more"
    return f"hosts {text}"


def steps_text(steps: Iterable[int | None], *, reported: bool = False) -> str:
    """``" at step 37"``, ``" at steps 36-37"``, or ``""`` when no step is known.

    ``reported=True`` says the step is the last one the rank reported (``" after its last
    reported step 37"``): a rank that died was usually past it."""
    known = [s for s in steps if s is not None]
    if not known:
        return ""
    low, high = min(known), max(known)
    where = f"step {low}" if low == high else f"steps {low}-{high}"
    return f" after its last reported {where}" if reported else f" at {where}"


def seconds_text(ns: int) -> str:
    """A duration in nanoseconds as seconds, ``"12.5 s"`` (shortest exact-enough form)."""
    return f"{ns / 1_000_000_000:g} s"


def number_text(value: float) -> str:
    """A measured number for a reason: four significant digits, ``nan``/``inf`` as such."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.4g}"


Measure: TypeAlias = int | float | str
"""One number (or label) of the evidence: counts, seconds, losses, checksums."""


class Measures(Mapping[str, Measure]):
    """The numbers a detector compared, by name, in the order given: immutable and hashable.

    A decision holds its evidence as data besides the reason's words (``{"stalled_s": 7.2,
    "timeout_s": 5.0, ...}``); names carry their unit as a suffix (``_s``: seconds, ``_step``:
    a training step). ``to_dict`` forms of decisions render it as a JSON object.
    """

    __slots__ = ("_items",)

    def __init__(self, **named: Measure) -> None:
        self._items: tuple[tuple[str, Measure], ...] = tuple(named.items())

    def __getitem__(self, key: str) -> Measure:
        for name, value in self._items:
            if name == key:
                return value
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Measures):
            return self._items == other._items
        return super().__eq__(other)

    def __repr__(self) -> str:
        return f"Measures({dict(self._items)!r})"


NO_MEASURES = Measures()
"""The empty evidence (a shared immutable default)."""
