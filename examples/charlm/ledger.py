"""The sample ledger: which sample ids each rank consumed at each step, in which generation.

Every rank appends one JSON line per batch it trains to its own file: one per step, or one
per accumulated batch of the step under gradient accumulation::

    {"generation": 0, "step": 12, "rank": 1, "samples": [417, 9, 2203]}

and flushes it, so the line survives a SIGKILL of the process (the page cache outlives it; no
fsync, since surviving power loss is not the point). A process killed inside a write can leave
a torn last line; the reader skips it, and a writer reopening the file first cuts it off.

:func:`compare_ledgers` proves exactness after restores: for every step it takes the samples of
the latest generation that completed the step on every rank and compares the multiset of
``(step, rank, sample id)`` with an uninterrupted reference run.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType


class LedgerError(ValueError):
    """A ledger line is not a record (a torn last line aside)."""


@dataclass(frozen=True)
class LedgerRecord:
    """One rank's consumption at one step of one generation."""

    generation: int
    step: int
    rank: int
    samples: tuple[int, ...]


def ledger_path(directory: Path, rank: int) -> Path:
    """Return the ledger file of ``rank`` inside ``directory``."""
    return directory / f"ledger-rank-{rank}.jsonl"


class LedgerWriter:
    """Appends one rank's records to its ledger file, flushing every line.

    Args:
        path: the ledger file; created with its parent folders if missing.
        generation: the generation of the running process, written into every record.
        rank: the rank of the running process.

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, path: Path, generation: int, rank: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        _cut_torn_tail(path)
        self.generation = generation
        self.rank = rank
        self._file = path.open("a", encoding="utf-8")

    def record(self, step: int, samples: Sequence[int]) -> None:
        """Append the samples this rank consumed at ``step`` and flush."""
        line = json.dumps(
            {
                "generation": self.generation,
                "step": step,
                "rank": self.rank,
                "samples": list(samples),
            }
        )
        # One write call per line keeps a torn line to the one being written when killed.
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()

    def __enter__(self) -> LedgerWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _cut_torn_tail(path: Path) -> None:
    """Truncate ``path`` after its last newline, dropping a line torn by a killed writer."""
    if not path.exists():
        return
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep != len(data):
        with path.open("r+b") as file:
            file.truncate(keep)
            os.fsync(file.fileno())


def read_ledger(paths: Iterable[Path]) -> list[LedgerRecord]:
    """Read the records of ``paths``, skipping a torn last line (one without its newline).

    Raises:
        LedgerError: if any other line is not a valid record.
    """
    records: list[LedgerRecord] = []
    for path in paths:
        lines = path.read_bytes().split(b"\n")
        # The text after the last newline is empty for an intact file and torn otherwise.
        for number, line in enumerate(lines[:-1], start=1):
            try:
                raw = json.loads(line)
                records.append(
                    LedgerRecord(
                        int(raw["generation"]),
                        int(raw["step"]),
                        int(raw["rank"]),
                        tuple(int(i) for i in raw["samples"]),
                    )
                )
            except (ValueError, KeyError, TypeError) as error:
                raise LedgerError(f"{path}:{number}: not a ledger record: {error}") from error
    return records


def effective_samples(
    records: Iterable[LedgerRecord], world_size: int
) -> dict[int, dict[int, tuple[int, ...]]]:
    """Return ``{step: {rank: samples}}`` from the latest generation that completed each step.

    A generation completed a step if it holds a record of that step for every rank
    ``0 .. world_size - 1``. Steps no generation completed are absent. A rank's samples of a
    step are those of all its records of the step in that generation, in order: the batches
    the step accumulated (gradient accumulation); a record written twice counts twice, so
    that :func:`compare_ledgers` sees its samples repeated.
    """
    by_generation: dict[tuple[int, int], dict[int, tuple[int, ...]]] = {}
    for record in records:
        ranks = by_generation.setdefault((record.step, record.generation), {})
        ranks[record.rank] = ranks.get(record.rank, ()) + record.samples
    effective: dict[int, dict[int, tuple[int, ...]]] = {}
    for (step, _generation), ranks in sorted(by_generation.items()):
        if set(ranks) == set(range(world_size)):
            effective[step] = ranks  # later generations of the step overwrite earlier ones
    return effective


@dataclass(frozen=True)
class LedgerComparison:
    """Differences between a run's effective ledger and a reference's, as ``(step, rank, id)``.

    Attributes:
        missing: consumed by the reference but not by the run (skipped samples), with counts.
        extra: consumed by the run but not by the reference (repeated or foreign samples).
    """

    missing: Counter[tuple[int, int, int]] = field(default_factory=Counter)
    extra: Counter[tuple[int, int, int]] = field(default_factory=Counter)

    @property
    def exact(self) -> bool:
        """True if the run consumed exactly the reference's samples at the same steps and ranks."""
        return not self.missing and not self.extra


def compare_ledgers(
    run: Iterable[LedgerRecord], reference: Iterable[LedgerRecord], world_size: int
) -> LedgerComparison:
    """Compare the effective samples of ``run`` with those of ``reference``.

    Both sides go through :func:`effective_samples`, then are compared as multisets of
    ``(step, rank, sample id)`` so a sample repeated within a step also counts.
    """
    sides = [
        Counter(
            (step, rank, sample)
            for step, ranks in effective_samples(records, world_size).items()
            for rank, samples in ranks.items()
            for sample in samples
        )
        for records in (run, reference)
    ]
    return LedgerComparison(missing=sides[1] - sides[0], extra=sides[0] - sides[1])
