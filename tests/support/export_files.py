"""Export files for the tests of ``trainguard export`` and of reading such files: a header, a
record, and :data:`DAMAGES`, the ways a file gets damaged, each with the reason a reader gives."""

from __future__ import annotations

import gzip
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from tests.support.recorded import JOB
from trainguard.agent.bus import Record
from trainguard.daemon.forensics._export_file import ExportHeader


def export_header(**fields: Any) -> ExportHeader:
    base: dict[str, Any] = {
        "job_id": JOB,
        "source": "sqlite:///bus.db (prefix 't.')",
        "partition": 0,
        "partitions": 6,
        "exported_at_ms": 1_767_225_600_000,
        "trainguard": "0.1.0",
    }
    return ExportHeader(**{**base, **fields})


def export_record(offset: int, key: str = JOB) -> Record:
    return Record("events", 0, offset, key, b'{"schema":"x"}', 1_767_225_600_000 + offset)


# -- damaged files --------------------------------------------------------------------------------


def _lines(path: Path) -> list[bytes]:
    with gzip.open(path, "rb") as f:
        return f.read().splitlines()


def _rewrite(path: Path, lines: list[bytes]) -> None:
    with gzip.open(path, "wb") as f:
        f.write(b"".join(line + b"\n" for line in lines))


def _edit_line(n: int, change: Callable[[dict[str, Any]], object]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        lines = _lines(path)
        obj = orjson.loads(lines[n])
        change(obj)
        lines[n] = orjson.dumps(obj)
        _rewrite(path, lines)

    return damage


def _rewrite_raw(path: Path, data: bytes) -> None:
    path.write_bytes(data)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-12])


def _garble(path: Path) -> None:
    path.write_bytes(b"hello")


DAMAGES: dict[str, tuple[Callable[[Path], None], str]] = {
    "not gzip": (_garble, "not a complete gzip file"),
    "not compressed": (
        lambda p: _rewrite_raw(p, gzip.decompress(p.read_bytes())),
        "it looks like uncompressed JSON Lines: compress it with gzip first",
    ),
    "truncated": (_truncate, "not a complete gzip file"),
    "empty": (lambda p: _rewrite(p, []), "empty; a job record starts with a header line"),
    "not json": (lambda p: _rewrite(p, [*_lines(p), b"{oops"]), ":4: not JSON"),
    "no header": (lambda p: _rewrite(p, _lines(p)[1:]), ":1: not a trainguard job record"),
    "other version": (_edit_line(0, lambda h: h.update(version=2)), "format version 2"),
    "a topic's count missing": (
        _edit_line(0, lambda h: h["counts"].pop("audit")),
        "bad header field counts",
    ),
    "a negative count": (
        _edit_line(0, lambda h: h["counts"].update(audit=-1)),
        "a count >= 0 for each of events, commands, manifests, audit",
    ),
    "bad base64": (
        _edit_line(1, lambda r: r.update(value_b64="%%%")),
        ":2: bad record",
    ),
    "base64 not ASCII": (
        _edit_line(1, lambda r: r.update(value_b64="é" * 4)),
        ":2: bad record (string argument should contain only ASCII characters)",
    ),
    "base64 past its padding": (
        _edit_line(1, lambda r: r.update(value_b64="AA==AA==")),
        ":2: bad record (Excess data after padding)",
    ),
    "offset a boolean": (
        _edit_line(1, lambda r: r.update(offset=True)),
        ":2: bad record (True is not an integer)",
    ),
    "unknown topic": (
        _edit_line(1, lambda r: r.update(topic="logs")),
        ":2: bad record (topic 'logs' is not one of",
    ),
    "key a number": (_edit_line(1, lambda r: r.update(key=7)), ":2: bad record (key 7)"),
    "not an object": (
        lambda p: _rewrite(p, [*_lines(p), b"[1, 2]"]),
        ":4: bad record (a record line must be an object)",
    ),
    "two headers": (
        lambda p: _rewrite(p, [*_lines(p)[:2], _lines(p)[0], *_lines(p)[2:]]),
        ":3: a second header",
    ),
    "missing field": (_edit_line(2, lambda r: r.pop("at_ms")), ":3: record without 'at_ms'"),
    "offsets out of order": (_edit_line(2, lambda r: r.update(offset=0)), "out of order"),
    "another job": (_edit_line(2, lambda r: r.update(key="other")), "keyed 'other'"),
    "lines missing": (lambda p: _rewrite(p, _lines(p)[:-1]), "announces 2 events records"),
}
