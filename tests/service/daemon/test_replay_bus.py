"""Replay of a job the real daemon service decided on a real bus (embedded, and Kafka marked
``kafka``), and ``trainguard replay`` as users run it (a separate process)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from tests.support import recorded
from tests.support.buses import BusFactory
from tests.support.recorded import JOB, record_job
from trainguard.agent.bus import DEFAULT_TOPICS, BusConfig, open_bus
from trainguard.daemon import MachineConfig
from trainguard.daemon.forensics._job_log import read_bus
from trainguard.daemon.forensics._replay import replay, verify

pytestmark = pytest.mark.timeout(180)

CLI = [sys.executable, "-m", "trainguard.daemon.cli"]


def trainguard(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """Run the ``trainguard`` command line; never raises for an exit status."""
    return subprocess.run(
        [*CLI, *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.fixture(scope="module")
def recorded_bus(tmp_path_factory: pytest.TempPathFactory) -> BusFactory:
    """An embedded bus holding the recorded job, made once."""
    return recorded.recorded_bus(tmp_path_factory.mktemp("recorded"))


@pytest.fixture
def bus_copy(recorded_bus: BusFactory, tmp_path: Path) -> BusFactory:
    """A copy of :func:`recorded_bus` a test may write to."""
    source = Path(recorded_bus.url.removeprefix("sqlite://"))
    target = tmp_path / "bus.db"
    shutil.copy(source, target)
    for suffix in ("-wal", "-shm"):
        if Path(str(source) + suffix).exists():
            shutil.copy(str(source) + suffix, str(target) + suffix)
    return BusFactory("sqlite", f"sqlite://{target}", recorded_bus.prefix)


@pytest.mark.anyio
async def test_a_job_decided_by_two_daemons_replays_exactly_from_the_bus(
    bus_factory: BusFactory,
) -> None:
    await record_job(bus_factory)
    log = await read_bus(bus_factory.url, bus_factory.prefix, JOB)
    trail = log.trail()
    result = replay(JOB, log.events, trail, MachineConfig(daemon_id="unused"))

    assert verify(result.replayed, result.recorded) is None
    assert [trail.configs[c]["daemon_id"] for c, _ in result.runs] == ["daemon-a", "daemon-b"]
    entries = [orjson.loads(r.value) for r in log.audit if r.value is not None]
    assert [e["config"]["daemon_id"] for e in entries if e["entry"] == "config"] == [
        "daemon-a",
        "daemon-b",
    ]
    decided = [e for e in entries if e["entry"] == "decisions"]
    assert all(e["input"]["type"] and e["config_id"] for e in decided)
    # A tick in the log decided the restore (other ticks may be pulses, or record anomalies
    # such as the bus gap while the second daemon's group formed).
    [timeout] = [r for r in result.rows if r.kind == "tick" and r.transition is not None]
    assert timeout.transition == ("running", "restoring")
    assert result.state.phase == "finished"


@pytest.mark.anyio
@pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True)
async def test_the_audit_topic_keeps_every_entry(bus_factory: BusFactory) -> None:
    """``audit`` is created with delete (time-based) retention, never compacted: entries with
    one key (the job) are all kept."""
    [spec] = [t for t in DEFAULT_TOPICS if t.name == "audit"]
    assert not spec.compacted
    await record_job(bus_factory)
    config = BusConfig(url=bus_factory.url, prefix=bus_factory.prefix)
    async with open_bus(config) as bus:
        ends = await bus.end_offsets("audit")
    log = await read_bus(bus_factory.url, bus_factory.prefix, JOB)
    assert len(log.audit) == sum(ends.values()) > 4


# -- the command line -----------------------------------------------------------------------------


def test_replay_prints_the_timeline_and_verifies(recorded_bus: BusFactory) -> None:
    done = trainguard("replay", JOB, "--bus", recorded_bus.url, "--prefix", recorded_bus.prefix)
    assert done.returncode == 0, done.stderr + done.stdout
    out = done.stdout
    assert "decided by 2 daemon runs" in out
    # Two instances with one set of settings: a takeover, not a restart under another config.
    assert "(daemon_id daemon-b) from offset" in out
    assert "another daemon process took over, same settings" in out
    assert "restarted" not in out
    assert "restore issued: generation 1" in out
    assert "resume issued: generation 1" in out
    assert "✓ the replay reproduces the recorded decisions" in out


def test_replay_jsonl_is_one_object_per_input_and_a_verdict(recorded_bus: BusFactory) -> None:
    done = trainguard(
        "replay", JOB, "--bus", recorded_bus.url, "--prefix", recorded_bus.prefix,
        "--format", "jsonl",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    rows, verdict = lines[:-1], lines[-1]
    assert {row["type"] for row in rows} == {"row"}
    assert [row["offset"] for row in rows] == sorted(row["offset"] for row in rows)
    assert verdict["type"] == "verdict"
    assert verdict["ok"] is True
    assert verdict["replayed"] == sum(1 for row in rows if row["decisions"])


def test_a_window_shows_only_its_part(recorded_bus: BusFactory) -> None:
    args = ["replay", JOB, "--bus", recorded_bus.url, "--prefix", recorded_bus.prefix]
    every = [
        json.loads(line) for line in trainguard(*args, "--format", "jsonl").stdout.splitlines()
    ]
    middle = every[len(every) // 2]["offset"]
    done = trainguard(*args, "--format", "jsonl", "--from-offset", middle, "--to-offset", middle)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()][:-1]
    assert [row["offset"] for row in rows] == [middle]
    since = every[-3]["at"]
    done = trainguard(*args, "--format", "jsonl", "--since", since)
    assert done.returncode == 0, done.stderr
    assert all(json.loads(line)["type"] != "row" or json.loads(line)["at"] >= since
               for line in done.stdout.splitlines())  # fmt: skip


def test_a_tampered_trail_fails_with_the_first_difference(bus_copy: BusFactory) -> None:
    async def forge() -> None:
        config = BusConfig(url=bus_copy.url, prefix=bus_copy.prefix)
        async with open_bus(config) as bus:
            log = await read_bus(bus_copy.url, bus_copy.prefix, JOB)
            entries = [orjson.loads(r.value) for r in log.audit if r.value is not None]
            entry = next(e for e in entries if e["entry"] == "decisions")
            entry["decisions"][0]["reason"] = "forged"
            await bus.publish("audit", JOB, orjson.dumps(entry))

    asyncio.run(forge())
    done = trainguard("replay", JOB, "--bus", bus_copy.url, "--prefix", bus_copy.prefix)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "✗ the replay differs from the audit trail at offset" in done.stdout
    assert '-    "reason": "forged"' in done.stdout
    assert "rules version" not in done.stdout  # recorded under this build's rules


def test_an_unknown_job_or_a_bad_window_is_a_usage_error(recorded_bus: BusFactory) -> None:
    args = ["--bus", recorded_bus.url, "--prefix", recorded_bus.prefix]
    done = trainguard("replay", "no-such-job", *args)
    assert done.returncode == 2
    assert "holds no event of job 'no-such-job'" in done.stderr
    done = trainguard("replay", JOB, *args, "--since", "yesterday")
    assert done.returncode == 2
    assert "neither ms since the epoch nor an ISO 8601 time" in done.stderr
    done = trainguard("replay", JOB, *args, "--from-offset", "9", "--to-offset", "3")
    assert done.returncode == 2
    assert "ends (3) before it starts (9)" in done.stderr


def test_what_if_a_longer_heartbeat_timeout_shows_the_restore_disappear(
    recorded_bus: BusFactory, tmp_path: Path
) -> None:
    other = tmp_path / "patient.toml"
    other.write_text("[machine]\nheartbeat_timeout_s = 60.0\n")
    args = ["replay", JOB, "--bus", recorded_bus.url, "--prefix", recorded_bus.prefix]
    done = trainguard(*args, "--what-if", other)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "heartbeat_timeout_s" in done.stdout
    assert "1.0 → 60.0" in done.stdout
    assert "disappears restore issued: generation 1" in done.stdout

    done = trainguard(*args, "--what-if", other, "--format", "jsonl")
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    [setting] = [line for line in lines if line["type"] == "config"]
    assert (setting["key"], setting["recorded"], setting["what_if"]) == (
        "heartbeat_timeout_s",
        1.0,
        60.0,
    )
    changes = [line for line in lines if line["type"] == "change"]
    gone = [c["before"]["decision"] for c in changes if c["change"] == "disappears"]
    assert "incident_opened" in gone
    assert lines[-1]["type"] == "verdict"
