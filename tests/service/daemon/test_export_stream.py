"""A whole export file replayed as it is read (``_export_stream``, ``replay_file``): the same
replay as reading the file first, in the calling process or with a reader process; files with
the events first (older writers) too; damage the reader process reaches reported as in the calling
process (``tests/unit/daemon/test_export_damage.py``); the reader process ended with the stream,
and its death reported."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from tests.support import recorded
from tests.support.buses import BusFactory
from tests.support.export_files import DAMAGES, export_header, export_record
from tests.support.recorded import JOB
from trainguard.agent.bus import Record
from trainguard.daemon.core._audit_entry import MalformedAudit
from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.forensics._export_file import FILE_ORDER, MalformedExport, dump
from trainguard.daemon.forensics._export_stream import BATCH, EventStream
from trainguard.daemon.forensics._job_log import UnknownJob, read_bus, read_file, replay_file
from trainguard.daemon.forensics._replay import replay, verify

pytestmark = pytest.mark.timeout(180)

DEFAULT = MachineConfig(daemon_id="replay")


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The recorded job (a restore among its decisions), exported as ``dump`` writes it."""
    folder = tmp_path_factory.mktemp("stream")
    factory: BusFactory = recorded.recorded_bus(folder / "bus")
    log = asyncio.run(read_bus(factory.url, factory.prefix, JOB))
    path = folder / "job.tgjsonl.gz"
    header = export_header(partition=log.partition, partitions=log.partitions)
    topics = {"events": log.events, "commands": log.commands, "manifests": log.manifests}
    dump(path, header, {**topics, "audit": log.audit})
    return path


def _topics_in_file(path: Path) -> list[str]:
    with gzip.open(path, "rb") as f:
        lines = f.read().splitlines()[1:]
    return list(dict.fromkeys(orjson.loads(line)["topic"] for line in lines))


def test_the_events_come_last_in_the_file(exported: Path) -> None:
    assert _topics_in_file(exported) == list(FILE_ORDER)


@pytest.mark.parametrize("process", [False, True], ids=["in-process", "reader-process"])
def test_a_streamed_replay_equals_the_replay_of_the_file_read_whole(
    exported: Path, process: bool
) -> None:
    log = read_file(exported)
    whole = replay(log.job_id, log.events, log.trail(), DEFAULT)
    assert whole.replayed, "the job decided things"

    done = replay_file(exported, JOB, DEFAULT, process=process)

    assert done.result.rows == whole.rows
    assert done.result.replayed == whole.replayed
    assert done.result.recorded == whole.recorded
    assert verify(done.result.replayed, done.result.recorded) is None
    assert (done.count, done.first, done.last) == (len(log.events), log.events[0], log.events[-1])
    assert done.trail.groups == log.trail().groups


@pytest.mark.parametrize("process", [False, True], ids=["in-process", "reader-process"])
def test_a_file_with_the_events_first_streams_the_same(
    exported: Path, tmp_path: Path, process: bool
) -> None:
    with gzip.open(exported, "rb") as f:
        header, *lines = f.read().splitlines()
    events_first = sorted(lines, key=lambda line: orjson.loads(line)["topic"] != "events")
    old = tmp_path / "old.tgjsonl.gz"
    with gzip.open(old, "wb") as f:
        f.write(b"".join(line + b"\n" for line in [header, *events_first]))
    assert _topics_in_file(old)[0] == "events"

    done = replay_file(old, JOB, DEFAULT, process=process)

    assert done.result.replayed == replay_file(exported, JOB, DEFAULT).result.replayed
    assert verify(done.result.replayed, done.result.recorded) is None


def test_another_job_or_no_event_is_an_unknown_job(exported: Path, tmp_path: Path) -> None:
    with pytest.raises(UnknownJob, match="holds job 'replay-job', not 'other'"):
        replay_file(exported, "other", DEFAULT)
    empty = tmp_path / "empty.tgjsonl.gz"
    dump(empty, export_header(), {})
    with pytest.raises(UnknownJob, match="holds no event"):
        replay_file(empty, None, DEFAULT)


def _stream_all(path: Path, process: bool) -> list[Record]:
    with EventStream(path, process=process) as stream:
        return list(stream)


@pytest.mark.parametrize("damage", ["truncated", "offsets out of order", "lines missing"])
def test_the_reader_process_reports_damage_the_same(damage: str, tmp_path: Path) -> None:
    path = tmp_path / "job.tgjsonl.gz"
    dump(path, export_header(), {"events": [export_record(0), export_record(1)]})
    change, reason = DAMAGES[damage]
    change(path)
    with pytest.raises(MalformedExport, match=r"job\.tgjsonl\.gz") as caught:
        _stream_all(path, process=True)
    assert reason in str(caught.value)


def _long_file(path: Path, events: int) -> None:
    """A file of ``events`` records, larger than a pipe's buffer (the reader waits on it)."""
    value = b'{"schema":"x","pad":"' + os.urandom(200).hex().encode() + b'"}'
    records = [Record("events", 0, i, JOB, value, 1_767_225_600_000 + i) for i in range(events)]
    dump(path, export_header(), {"events": records})


def test_records_come_in_order_across_batches(tmp_path: Path) -> None:
    path = tmp_path / "long.tgjsonl.gz"
    _long_file(path, 3 * BATCH + 5)
    with EventStream(path, process=True) as stream:
        offsets = [record.offset for record in stream]
        assert stream.count == len(offsets)
    assert offsets == list(range(3 * BATCH + 5))


def test_leaving_the_stream_early_ends_the_reader_process(tmp_path: Path) -> None:
    path = tmp_path / "long.tgjsonl.gz"
    _long_file(path, 20 * BATCH)
    with EventStream(path, process=True) as stream:
        reader = stream._reader
        assert reader is not None
        first = next(iter(stream))
        assert first.offset == 0
        assert reader.poll() is None, "the reader waits on the full pipe"
    assert reader.returncode is not None


def test_a_reader_process_that_dies_is_an_os_error(tmp_path: Path) -> None:
    path = tmp_path / "long.tgjsonl.gz"
    _long_file(path, 20 * BATCH)
    with EventStream(path, process=True) as stream:
        assert stream._reader is not None
        stream._reader.kill()
        with pytest.raises(OSError, match="the export reader process ended"):
            for _ in stream:
                pass


def test_the_reader_is_deaf_to_what_its_interpreter_prints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Output on the reader's standard output (a ``sitecustomize``) and more on its standard
    error than a pipe holds (``PYTHONVERBOSE`` writes such amounts) leave the records alone."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\nprint('hello from sitecustomize')\nsys.stderr.write('x' * 200_000)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(site))
    path = tmp_path / "long.tgjsonl.gz"
    _long_file(path, 4 * BATCH)
    with EventStream(path, process=True) as stream:
        offsets = [record.offset for record in stream]
    assert offsets == list(range(4 * BATCH))


def test_stopping_and_continuing_the_reader_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop and continue can cut a write short (seen with ``PYTHONUNBUFFERED``, where every
    write reached the pipe raw): every record still arrives, in order."""
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    path = tmp_path / "long.tgjsonl.gz"
    _long_file(path, 30 * BATCH)
    offsets: list[int] = []
    with EventStream(path, process=True) as stream:
        assert stream._reader is not None
        pid = stream._reader.pid
        for record in stream:
            offsets.append(record.offset)
            if record.offset % BATCH == 0 and stream._reader.poll() is None:
                os.kill(pid, signal.SIGSTOP)
                os.kill(pid, signal.SIGCONT)
    assert offsets == list(range(30 * BATCH))


def test_no_timeline_prints_the_verdict_only(exported: Path) -> None:
    def replay_cli(*options: str) -> list[dict[str, object]]:
        command = [sys.executable, "-m", "trainguard.daemon.cli", "replay", JOB]
        done = subprocess.run(
            [*command, "--file", str(exported), "--format", "jsonl", *options],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return [json.loads(line) for line in done.stdout.splitlines()]

    full = replay_cli()
    [verdict] = replay_cli("--no-timeline")
    assert verdict == full[-1]
    assert verdict["ok"] is True
    assert any(line["type"] == "row" for line in full)
    [windowed] = replay_cli("--no-timeline", "--from-offset", "0")
    assert windowed == verdict


def test_damage_read_with_the_audit_trail_is_named_as_gzip_damage(
    exported: Path, tmp_path: Path
) -> None:
    """The audit records come first, before gzip checks the file at its end: an entry that does
    not parse in a damaged file is reported as the damage (as reading the whole file first
    reports it), and as a bad entry only in an intact file."""
    with gzip.open(exported, "rb") as f:
        lines = f.read().splitlines()
    first_audit = next(i for i, line in enumerate(lines) if b'"topic":"audit"' in line)
    entry = orjson.loads(lines[first_audit])
    entry["value_b64"] = base64.b64encode(b"not an audit entry").decode()
    lines[first_audit] = orjson.dumps(entry)
    # Enough events after it that gzip has not reached its trailer when the trail is read.
    last = orjson.loads(lines[-1])
    assert last["topic"] == "events"
    for i in range(1, 2_001):
        value = base64.b64encode(b'{"pad":"' + os.urandom(150).hex().encode() + b'"}').decode()
        lines.append(orjson.dumps({**last, "offset": last["offset"] + i, "value_b64": value}))
    header = orjson.loads(lines[0])
    header["counts"]["events"] += 2_000
    lines[0] = orjson.dumps(header)
    bad_entry = tmp_path / "bad-entry.tgjsonl.gz"
    bad_entry.write_bytes(gzip.compress(b"".join(line + b"\n" for line in lines)))
    with pytest.raises(MalformedAudit):
        replay_file(bad_entry, JOB, DEFAULT, process=False)

    damaged = bytearray(bad_entry.read_bytes())
    damaged[-8] ^= 0xFF  # the CRC-32 in the gzip trailer (RFC 1952): gzip finds the damage
    bad_entry.write_bytes(bytes(damaged))
    with pytest.raises(MalformedExport, match="not a complete gzip file"):
        replay_file(bad_entry, JOB, DEFAULT, process=False)
    with pytest.raises(MalformedExport, match="not a complete gzip file"):
        read_file(bad_entry)


def test_a_process_started_with_closed_standard_streams_still_gets_its_records(
    tmp_path: Path,
) -> None:
    """With 0 and 1 closed, the pipe takes those numbers; the reader's standard streams must
    not replace it."""
    path = tmp_path / "long.tgjsonl.gz"
    _long_file(path, 2 * BATCH)
    out = tmp_path / "offsets.json"
    script = (
        "import json, os, sys\n"
        "from pathlib import Path\n"
        "from trainguard.daemon.forensics._export_stream import EventStream\n"
        "os.close(0); os.close(1)\n"
        "with EventStream(Path(sys.argv[1]), process=True) as stream:\n"
        "    offsets = [r.offset for r in stream]\n"
        "Path(sys.argv[2]).write_text(json.dumps(offsets))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(path), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text()) == list(range(2 * BATCH))
