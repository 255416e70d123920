"""``trainguard report`` as users run it (a separate process) on an embedded bus holding a
job's record: the scripted job of ``test_report.py`` (one kill, ``tests/support/report_script.py``),
its events published with their time gaps shrunk 100-fold and folded by a real daemon service,
which writes the audit and commands the report reads.

The record must not depend on how fast the daemon's commands reach the bus (a command is
appended with its partition's next transaction, up to ``commit_interval_s`` after its decision,
later under load). The report measures a restore from its command's append time and counts
the steps a restore's generation reported before its ``resume`` was appended, so the events
follow the commands as real processes do (:func:`prerequisite`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from tests.support.buses import BusFactory
from tests.support.report_script import JOB, killed_once
from tests.support.service_support import JOB as FORGED_JOB
from tests.support.service_support import (
    beat,
    daemon_config,
    eventually,
    publish,
    read_all,
    record_forgery,
    running,
    started,
)
from trainguard.agent.bus import DEFAULT_TOPICS, Bus, open_bus
from trainguard.daemon import DaemonService, MachineConfig
from trainguard.daemon.forensics._export_file import ExportHeader, dump
from trainguard.daemon.forensics._job_log import read_bus
from trainguard.daemon.service._settings import DaemonConfig
from trainguard.schemas import (
    Command,
    Event,
    Heartbeat,
    JobRequest,
    Lifecycle,
    Restore,
    Resume,
    decode,
    encode,
)

pytestmark = pytest.mark.timeout(120)

CLI = [sys.executable, "-m", "trainguard.daemon.cli"]
SHRINK = 100
"""The scripted time gaps are slept 100 times shorter (65.6 s of job in about 0.7 s, plus the
waits for the daemon's commands)."""


def prerequisite(event: Event | JobRequest) -> tuple[type[Restore | Resume], int] | None:
    """The command of the daemon that ``event`` can only follow, as ``(kind, generation)``:
    none in generation 0; the ``restore`` of its generation for a restored process's start,
    its ``init`` heartbeats and its acknowledgement (the supervisor starts the processes on
    that order); that generation's ``resume`` for anything else (the agent's ``ready`` waits
    for it before the first step)."""
    if event.generation == 0:
        return None
    starting = (isinstance(event, Lifecycle) and event.kind in ("started", "restored")) or (
        isinstance(event, Heartbeat) and event.phase == "init"
    )
    return (Restore if starting else Resume), event.generation


async def issued(client: Bus, kind: type[Restore | Resume], generation: int) -> None:
    """Return once the ``kind`` command of ``generation`` is on ``client``'s ``commands``
    (committed: what agents and supervisors read)."""

    async def on_bus() -> bool:
        values = await read_all(client, "commands")
        commands = [decode(v, expect=Command) for v in values if v]
        return any(isinstance(c, kind) and c.generation == generation for c in commands)

    await eventually(on_bus)


async def record_job(bus: BusFactory) -> None:
    """Publish the scripted job's events (fresh time stamps), each once its
    :func:`prerequisite` is on ``commands``, while a daemon service folds them; return once
    the daemon has seen the job finish."""
    script = killed_once()
    config = DaemonConfig(
        bus=bus.config(topics=DEFAULT_TOPICS),
        machine=MachineConfig(daemon_id="report-test"),
        group_id=bus.group("daemon"),
        poll_s=0.02,
        # Commands reach the bus up to 50 scripted seconds after their decision, longer than
        # generation 1 trains: events that did not wait for them would precede them.
        commit_interval_s=0.5,
    )
    stop = asyncio.Event()
    service = DaemonService(config)
    task = asyncio.ensure_future(service.run(stop))
    try:
        async with open_bus(bus.config(topics=DEFAULT_TOPICS)) as client:
            seen: set[tuple[type[Restore | Resume], int]] = set()
            previous = script.events[0].at_ms
            for stamped in script.events:
                await asyncio.sleep((stamped.at_ms - previous) / 1000 / SHRINK)
                after = prerequisite(stamped.message)
                if after is not None and after not in seen:
                    await issued(client, *after)
                    seen.add(after)
                previous = stamped.at_ms
                event = dataclasses.replace(stamped.message, ts=time.time_ns())
                await client.publish("events", JOB, encode(event))
            deadline = time.monotonic() + 60
            while not (job := service.jobs.get(JOB)) or job.phase != "finished":
                assert time.monotonic() < deadline, "the daemon did not see the job finish"
                await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> BusFactory:
    """An embedded bus holding the scripted job, folded by a daemon."""
    folder = tmp_path_factory.mktemp("report-cli")
    bus = BusFactory("sqlite", f"sqlite://{folder / 'bus.db'}", "r.")
    asyncio.run(record_job(bus))
    return bus


def report(bus: BusFactory, *args: str) -> subprocess.CompletedProcess[str]:
    """``trainguard report ARGS`` on ``bus``, printing 250 columns wide (rich reads
    ``COLUMNS``) so that no line of the text report is wrapped."""
    return subprocess.run(
        [*CLI, "report", *args, "--bus", bus.url, "--prefix", bus.prefix],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "250"},
    )


def test_text_report_names_the_incident_and_its_cost(recorded: BusFactory) -> None:
    done = report(recorded, JOB)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for expected in (
        "Where the wall time went",
        "goodput",
        "0 -> 40 (5 recomputed)",
        "exited",
        "s20",  # restored to step 20
        "Young",
        "Communications of the ACM 17(9), 1974",
        "Future Generation Computer Systems 22(3), 2006",
    ):
        assert expected in out, f"{expected!r} not in:\n{out}"


def test_json_report(recorded: BusFactory) -> None:
    done = report(recorded, JOB, "--format", "json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert (doc["job_id"], doc["ended"], doc["final_step"]) == (JOB, "finished", 40)
    [incident] = doc["incidents"]
    assert (incident["cause"], incident["ranks"], incident["target_step"]) == ("exited", [1], 20)
    assert (incident["reached_step"], incident["recomputed_steps"]) == (25, 5)
    assert doc["causes"] == {"exited": 1}
    assert sum(doc["time_s"].values()) == pytest.approx(doc["wall_s"])
    assert doc["goodput"] == pytest.approx(doc["productive_s"] / doc["wall_s"])
    assert doc["checkpoint"]["failures"] == 1
    assert doc["checkpoint"]["interval_steps"] == 10


def test_html_report_holds_the_timeline(recorded: BusFactory, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    done = report(recorded, JOB, "--html", str(page))
    assert done.returncode == 0, done.stderr
    html = page.read_text()
    assert '<svg id="timeline"' in html
    assert html.count('class="span"') >= 4  # init and train, per rank and generation
    assert html.count('class="seg"') >= 5  # startup, productive, recomputed, restore, ...
    assert "i1 exited" in html
    assert "<script" not in html
    assert "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_an_unknown_job_is_a_clear_error(recorded: BusFactory) -> None:
    done = report(recorded, "no-such-job")
    assert done.returncode == 2
    assert "no-such-job" in done.stderr


def test_the_report_of_an_export_file(recorded: BusFactory, tmp_path: Path) -> None:
    """``--file``: the job's record exported to a file reports the same numbers."""
    log = asyncio.run(read_bus(recorded.url, recorded.prefix, JOB))
    header = ExportHeader(
        job_id=JOB,
        source=log.source,
        partition=log.partition,
        partitions=log.partitions,
        exported_at_ms=0,
        trainguard="test",
    )
    exported = tmp_path / "job.tgjsonl.gz"
    topics = ("events", "commands", "manifests", "audit")
    dump(exported, header, {topic: getattr(log, topic) for topic in topics})
    from_file = subprocess.run(
        [*CLI, "report", "--file", str(exported), "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert from_file.returncode == 0, from_file.stderr
    from_bus = report(recorded, JOB, "--format", "json")
    assert orjson.loads(from_file.stdout) == orjson.loads(from_bus.stdout)


def test_the_report_leaves_out_what_the_daemon_refused(tmp_path: Path) -> None:
    """A forged heartbeat the daemon refused (its audit trail says so) counts for nothing."""
    forged_bus, _ = asyncio.run(record_forgery(tmp_path))
    done = report(forged_bus, FORGED_JOB, "--format", "json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    # Folded, the forged heartbeat would make step 10,000 the final timeline's last.
    assert (doc["ended"], doc["final_step"], doc["world_size"]) == ("running", 4, 2)


def test_the_report_leaves_out_what_the_state_machine_rejected(tmp_path: Path) -> None:
    """Events the daemon took in but its state machine rejected (a resent heartbeat whose seq
    was used already, here claiming step 10,000 of a 3-rank job) count for nothing."""
    factory = BusFactory("sqlite", f"sqlite://{tmp_path / 'bus.db'}", "x.")
    bogus = dataclasses.replace(beat(0, 1, 10_000), world_size=3)

    async def record() -> None:
        async with factory.open(topics=DEFAULT_TOPICS) as bus:
            await publish(bus, started(0), started(1), beat(0, 1, 4), beat(1, 1, 4), bogus)
            async with running(DaemonService(daemon_config(factory))):

                async def rejected() -> bool:
                    entries = [orjson.loads(v) for v in await read_all(bus, "audit")]
                    return any(d["decision"] == "rejected" for e in entries for d in e["decisions"])

                await eventually(rejected)

    asyncio.run(record())
    done = report(factory, FORGED_JOB, "--format", "json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert (doc["final_step"], doc["world_size"]) == (4, 2)
