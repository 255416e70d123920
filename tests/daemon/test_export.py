"""``trainguard export`` / ``import``: a job's record as one file, back onto a fresh embedded
bus with its bus times, and replayed there (or from the file) to the same decisions; damaged
files are refused with a reason."""

from __future__ import annotations

import base64
import gzip
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.buses import BusFactory
from tests.daemon import recorded
from tests.daemon.recorded import JOB
from trainguard.agent.bus import Record
from trainguard.daemon.forensics._export_file import (
    JOB_TOPICS,
    ExportHeader,
    MalformedExport,
    dump,
    load,
)

pytestmark = pytest.mark.timeout(180)

CLI = [sys.executable, "-m", "trainguard.daemon.cli"]


def trainguard(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.fixture(scope="module")
def recorded_bus(tmp_path_factory: pytest.TempPathFactory) -> BusFactory:
    return recorded.recorded_bus(tmp_path_factory.mktemp("recorded"))


def replay_jsonl(*source: str | Path) -> list[dict[str, Any]]:
    done = trainguard("replay", JOB, *source, "--format", "jsonl")
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def decisions(lines: list[dict[str, Any]]) -> list[tuple[int, str, list[Any]]]:
    """Each row's time, input and decisions (offsets aside: an import renumbers them)."""
    return [
        (line["at_ms"], json.dumps(line["input"]), line["decisions"])
        for line in lines
        if line["type"] == "row"
    ]


def test_export_import_into_a_fresh_bus_and_replay_give_the_same_decisions(
    recorded_bus: BusFactory, tmp_path: Path
) -> None:
    source = ["--bus", recorded_bus.url, "--prefix", recorded_bus.prefix]
    exported = tmp_path / "job.tgjsonl.gz"
    done = trainguard("export", JOB, *source, "-o", exported)
    assert done.returncode == 0, done.stderr
    assert f"wrote job {JOB}" in done.stdout

    fresh = f"sqlite://{tmp_path / 'fresh' / 'bus.db'}"
    done = trainguard("import", exported, "--bus", fresh, "--prefix", "x.")
    assert done.returncode == 0, done.stderr
    assert f"imported job {JOB}" in done.stdout

    original = replay_jsonl(*source)
    imported = replay_jsonl("--bus", fresh, "--prefix", "x.")
    from_file = replay_jsonl("--file", exported)
    assert decisions(imported) == decisions(original)
    assert decisions(from_file) == decisions(original)
    assert any(row[2] for row in decisions(original)), "the job decided things"
    for lines in (imported, from_file):
        assert lines[-1]["type"] == "verdict"
        assert lines[-1]["ok"] is True

    done = trainguard("import", exported, "--bus", fresh, "--prefix", "x.")
    assert done.returncode == 2
    assert f"already holds events of job '{JOB}'" in done.stderr


def test_the_file_holds_a_header_and_every_record_with_its_bytes(
    recorded_bus: BusFactory, tmp_path: Path
) -> None:
    exported = tmp_path / "job.tgjsonl.gz"
    done = trainguard(
        "export", JOB, "--bus", recorded_bus.url, "--prefix", recorded_bus.prefix, "-o", exported
    )
    assert done.returncode == 0, done.stderr
    with gzip.open(exported, "rt") as f:
        header, *lines = [json.loads(line) for line in f]
    assert header["format"] == "trainguard-job-record"
    assert header["version"] == 1
    assert header["job_id"] == JOB
    assert header["source"].startswith(recorded_bus.url)
    assert sum(header["counts"].values()) == len(lines)
    assert {line["topic"] for line in lines} == set(JOB_TOPICS)
    events = [line for line in lines if line["topic"] == "events"]
    assert [e["offset"] for e in events] == sorted(e["offset"] for e in events)
    first = orjson.loads(base64.b64decode(events[0]["value_b64"]))
    assert first["job_id"] == JOB


def test_export_to_standard_output_writes_the_file_there(
    recorded_bus: BusFactory, tmp_path: Path
) -> None:
    source = ["--bus", recorded_bus.url, "--prefix", recorded_bus.prefix]
    done = subprocess.run(
        [*CLI, "export", JOB, *source, "-o", "-"], capture_output=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert b"to standard output" in done.stderr
    piped = tmp_path / "piped.tgjsonl.gz"
    piped.write_bytes(done.stdout)
    header, records = load(piped)
    assert header.job_id == JOB
    assert records["events"]
    assert not (Path.cwd() / "-").exists()


def test_a_kafka_target_is_refused_with_the_reason(tmp_path: Path) -> None:
    exported = tmp_path / "job.tgjsonl.gz"
    dump(exported, _header(), {"events": [_record(0)]})
    done = trainguard("import", exported, "--bus", "kafka://127.0.0.1:9")
    assert done.returncode == 2
    assert "LogAppendTime" in done.stderr
    assert "--file" in done.stderr


# -- damaged files --------------------------------------------------------------------------------


def _header(**fields: Any) -> ExportHeader:
    base: dict[str, Any] = {
        "job_id": JOB,
        "source": "sqlite:///bus.db (prefix 't.')",
        "partition": 0,
        "partitions": 6,
        "exported_at_ms": 1_767_225_600_000,
        "trainguard": "0.1.0",
    }
    return ExportHeader(**{**base, **fields})


def _record(offset: int, key: str = JOB) -> Record:
    return Record("events", 0, offset, key, b'{"schema":"x"}', 1_767_225_600_000 + offset)


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


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_file_is_refused_with_a_clear_reason(damage: str, tmp_path: Path) -> None:
    path = tmp_path / "job.tgjsonl.gz"
    dump(path, _header(), {"events": [_record(0), _record(1)]})
    load(path)  # intact
    change, reason = DAMAGES[damage]
    change(path)
    with pytest.raises(MalformedExport, match=r"job\.tgjsonl\.gz") as caught:
        load(path)
    assert reason in str(caught.value)


def test_a_damaged_byte_anywhere_in_the_compressed_stream_is_named_as_such(
    tmp_path: Path,
) -> None:
    """Garbage decompressed from a damaged byte (a line that is not JSON, or records that look
    valid but break an order or a count) is reported as the gzip damage it comes from."""
    path = tmp_path / "job.tgjsonl.gz"
    dump(path, _header(), {"events": [_record(i) for i in range(200)]})
    intact = path.read_bytes()
    gzip_header, trailer = 10, 8
    for position in range(gzip_header, len(intact), 3):
        damaged = bytearray(intact)
        damaged[position] ^= 0xFF
        path.write_bytes(bytes(damaged))
        with pytest.raises(MalformedExport) as caught:
            load(path)
        assert "not a complete gzip file" in str(caught.value), (position, str(caught.value))
    assert len(intact) - trailer > gzip_header


def test_replaying_a_damaged_file_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "job.tgjsonl.gz"
    path.write_text("not a job record")
    done = trainguard("replay", JOB, "--file", path)
    assert done.returncode == 2
    assert "not a complete gzip file" in done.stderr
