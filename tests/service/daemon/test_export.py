"""``trainguard export`` / ``import``: a job's record as one file, back onto a fresh embedded
bus with its bus times, and replayed there (or from the file) to the same decisions; replaying
a damaged file is a usage error. Damaged files on their own:
``tests/unit/daemon/test_export_damage.py``."""

from __future__ import annotations

import base64
import gzip
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.support import recorded
from tests.support.buses import BusFactory
from tests.support.export_files import export_header, export_record
from tests.support.recorded import JOB
from trainguard.daemon.forensics._export_file import JOB_TOPICS, dump, load

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


def test_the_replay_command_import_suggests_works_as_printed(tmp_path: Path) -> None:
    """Pasted into a shell, the suggested ``trainguard replay`` reads the imported job: the bus
    path is quoted (it held a space, and the hint split it in two)."""
    record = Path(__file__).parent / "data" / "charlm-demo-5296f9b.tgjsonl.gz"
    bus = f"sqlite://{tmp_path / 'my runs' / 'bus.db'}"
    done = trainguard("import", record, "--bus", bus, "--prefix", "x.")
    assert done.returncode == 0, done.stderr
    hint = done.stdout.strip().split("replay it with: ", 1)[1]
    program, *args = shlex.split(hint)
    assert program == "trainguard"
    replayed = trainguard(*args, "--no-timeline")
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "the replay reproduces the recorded decisions" in replayed.stdout


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
    dump(exported, export_header(), {"events": [export_record(0)]})
    done = trainguard("import", exported, "--bus", "kafka://127.0.0.1:9")
    assert done.returncode == 2
    assert "LogAppendTime" in done.stderr
    assert "--file" in done.stderr


# -- damaged files --------------------------------------------------------------------------------


def test_replaying_a_damaged_file_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "job.tgjsonl.gz"
    path.write_text("not a job record")
    done = trainguard("replay", JOB, "--file", path)
    assert done.returncode == 2
    assert "not a complete gzip file" in done.stderr
