"""Issue 6 end to end: a forged heartbeat never masks a hang. The charlm job runs with keys
(``trainguard keys init``, handed to the daemon, the supervisor and the workers through the
environment as docs/security.md says, the daemon with ``require_auth``); rank 1's training
thread hangs after step 30 while a rogue bus client keeps publishing heartbeats that show both
ranks advancing, without a MAC, with a wrong MAC, and with a valid MAC of another job's key. The
daemon refuses and dead-letters each forgery with its reason, detects the hang, restores, and
the job ends bitwise equal to the uninterrupted run; the replay of its log reproduces every
decision (``JobRun.record``)."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.scenarios.conftest import SHAPE
from tests.scenarios.harness import JOB, JobRun, Shape, assert_exact, is_restore, only
from tests.support.buses import BusFactory
from trainguard.agent.bus import BusConfig, open_bus
from trainguard.agent.keys._keystore import KeyStore
from trainguard.daemon.admin._keys import KeyAdmin
from trainguard.schemas import Heartbeat, add_mac, encode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DETECT = Shape(steps=SHAPE.steps, checkpoint_every=10, seed=SHAPE.seed)
"""As in test_detection: checkpoints every 10 steps give the same run as the reference's 20."""

FAULTS = "slow@step=1,rank=0,factor=15,steps=27;hang@step=30,rank=1,seconds=20"
"""About 0.3 s per step up to step 27 (so the daemon learns the pace), then rank 1's training
thread blocks for 20 s after step 30 while its heartbeats go on (test_detection's hang)."""

FORGERY_INTERVAL_S = 0.2
"""Seconds between two rounds of forged heartbeats (one of each kind per rank)."""


@pytest.fixture
def keyed_run(
    tmp_path: Path, reference: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[JobRun, KeyAdmin]]:
    """A :class:`JobRun` on an embedded bus whose daemon, supervisor and workers hold keys,
    given through the environment they inherit."""
    admin = KeyAdmin(tmp_path / "keys")
    admin.init([JOB, "other-job"])
    public, event = admin.agent_bundle(JOB).write(tmp_path / "agent-secret")
    monkeypatch.setenv("TRAINGUARD_KEYS", str(admin.path))
    monkeypatch.setenv("TRAINGUARD_REQUIRE_AUTH", "true")
    monkeypatch.setenv("TRAINGUARD_DAEMON_PUBLIC_KEYS", str(public))
    monkeypatch.setenv("TRAINGUARD_EVENT_KEY", str(event))
    workdir = tmp_path / "run"
    workdir.mkdir()
    bus = BusFactory("sqlite", f"sqlite://{workdir / 'bus.db'}", "t.")
    run = JobRun(bus, workdir, DETECT, reference, context=f"forged heartbeats; {FAULTS}")
    try:
        yield run, admin
    finally:
        run.close()


class Rogue:
    """A bus client without the job's key that keeps sending heartbeats in which both ranks
    advance, in three forms: no MAC, a MAC under the job's key id made with a wrong key, and a
    valid MAC of another job's key.

    Args:
        bus: the job's bus.
        senders: ``(rank, host, pid)`` of the ranks to impersonate.
        other_key: ``(kid, key)`` of another job.
    """

    def __init__(
        self, bus: BusFactory, senders: list[tuple[int, str, int]], job_kid: str, other_key: Any
    ) -> None:
        self._bus = BusConfig(url=bus.url, prefix=bus.prefix, client_id="rogue")
        self._senders = senders
        self._forms = (None, (job_kid, os.urandom(32)), other_key)
        self._stop = threading.Event()
        self.sent = 0
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Rogue:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    async def _run(self) -> None:
        seq = itertools.count(time.time_ns() + 10**15)  # above the agents' seqs
        async with open_bus(self._bus) as bus:
            for step in itertools.count(31):
                if self._stop.is_set():
                    return
                for (rank, host, pid), form in itertools.product(self._senders, self._forms):
                    beat = Heartbeat(
                        job_id=JOB,
                        generation=0,
                        ts=time.time_ns(),
                        seq=next(seq),
                        rank=rank,
                        host=host,
                        pid=pid,
                        world_size=2,
                        step=step,
                        phase="train",
                        step_time_s=0.3,
                    )
                    forged = beat if form is None else add_mac(beat, *form)
                    await bus.publish("events", JOB, encode(forged))
                    self.sent += 1
                await asyncio.sleep(FORGERY_INTERVAL_S)


def at_step(rank: int, step: int) -> Callable[[Any], bool]:
    """Matches a heartbeat of ``rank`` at ``step`` or later."""
    return lambda m: isinstance(m, Heartbeat) and m.rank == rank and m.step >= step


async def dead_letters(bus: BusFactory) -> list[dict[str, Any]]:
    """Every dead-letter entry on ``bus``."""
    async with open_bus(BusConfig(url=bus.url, prefix=bus.prefix)) as client:
        ends = await client.end_offsets("dead-letter")
        pending = {tp: end for tp, end in ends.items() if end}
        entries: list[dict[str, Any]] = []
        if pending:
            async with await client.assign(dict.fromkeys(pending, 0)) as consumer:
                while len(entries) < sum(pending.values()):
                    entries += [orjson.loads(r.value or b"") for r in await consumer.getmany(1.0)]
        return entries


def test_forged_heartbeats_never_mask_a_hang(keyed_run: tuple[JobRun, KeyAdmin]) -> None:
    run, admin = keyed_run
    other = KeyStore(admin.path).load_daemon_keys().current_event_key("other-job")
    job_kid = KeyStore(admin.path).current("event", JOB)
    assert other is not None
    assert job_kid is not None
    run.start_daemon()
    run.start_job(FAULTS)
    senders = []
    for rank in (0, 1):
        seen = run.wait_for(f"rank {rank} at step 25", at_step(rank, 25)).message
        senders.append((rank, seen.host, seen.pid))
    with Rogue(run.bus, senders, job_kid, other) as rogue:
        run.wait_for("the restore of the hang", is_restore(1), timeout_s=60)
    code = run.finish()
    record = run.record()  # the replay of the log reproduces every decision

    incidents = [d for d in record.decisions() if d["decision"] == "incident_opened"]
    incident = only(incidents, "incident", run)
    assert incident["cause"] == "progress_timeout", run.describe()
    assert only(record.restores(), "restore", run).target is not None
    assert_exact(run, code, record)

    assert rogue.sent >= 6
    parked = [e for e in asyncio.run(dead_letters(run.bus)) if e["key"] == JOB]
    reasons = {e["reason"] for e in parked}
    assert "no MAC: the message carries no auth.mac" in reasons, run.describe()
    assert f"MAC under event key {job_kid} does not verify" in reasons, run.describe()
    assert f"MAC under unknown event key {other[0]}" in reasons, run.describe()
    forgeries = [e for e in parked if e["reason"].startswith(("no MAC", "MAC under"))]
    assert len(forgeries) == rogue.sent, run.describe()  # every one of them
    refused = [e for e in record.audit if e.get("entry") == "refused"]
    assert len(refused) == rogue.sent, run.describe()
