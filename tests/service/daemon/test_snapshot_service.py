"""State snapshots in the daemon service on a real bus: a daemon restarted from snapshots holds
exactly the states of a fold from offset 0 and decides exactly as it would (the replay of the
audit trail verifies), reading only the records after the snapshots; a tampered, foreign,
missing or unreadable snapshot is refused with its reason and the partition is folded from the
log to the same states; rotated keys read old snapshots and write new ones under the new ids.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from tests.support.buses import BusFactory
from tests.support.service_support import eventually, running
from tests.support.snapshot_jobs import (
    HERE,
    A,
    B,
    C,
    D,
    E,
    daemon_config,
    fallbacks,
    first_daemon,
    folded,
    killed,
    latest_headers,
    publish,
    started,
    total_records,
    training,
)
from tests.support.snapshot_keys import make_keys
from trainguard.agent.bus import DEFAULT_TOPICS, Bus, TopicPartition
from trainguard.agent.keys._keystore import DaemonKeys
from trainguard.daemon import DaemonService, MachineConfig
from trainguard.daemon.admin._keys import KeyAdmin
from trainguard.daemon.core import JobState
from trainguard.daemon.core._machine import unacted_command
from trainguard.daemon.forensics._job_log import read_bus
from trainguard.daemon.forensics._replay import replay, verify
from trainguard.daemon.service._metrics import DaemonMetrics
from trainguard.daemon.service._settings import SecurityConfig
from trainguard.daemon.service._snapshot_envelope import Round
from trainguard.daemon.service._snapshot_store import Snapshots
from trainguard.schemas import Restore, decode

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]


async def test_a_daemon_restarted_from_snapshots_holds_and_decides_what_a_full_fold_does(
    bus_factory: BusFactory,
) -> None:
    keys = make_keys(1)
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        await first_daemon(bus_factory, bus, keys)
        covered = await total_records(bus)
        later = [*training(A, range(12, 16)), started(D, 0), started(D, 1)]
        later += [*training(C, range(6, 8)), *training(E, range(6, 8)), killed(A, 1)]
        await publish(bus, later)

        b = DaemonService(daemon_config(bus_factory, "daemon-b"), keys=keys)

        async def caught_up() -> bool:
            # Its own ticks too: the one naming the restore it published.
            acted = all(unacted_command(s) is None for s in b.jobs.values())
            return acted and b.counters["folded"] == await total_records(bus) - covered

        async with running(b):
            await eventually(lambda: _restores(bus), timeout_s=60.0)
            await eventually(lambda: folded(b, len(later)), timeout_s=60.0)
            await eventually(caught_up, timeout_s=60.0)
        # Taken once b stopped: a pulse may tick between the catch-up and the stop, and c
        # folds that tick too (b folded everything it wrote: the count below).
        states = dict(b.jobs)
        # It read only what came after the snapshots: the later records and its own ticks.
        count = b.counters["folded"]
        assert count == len(later) + b.counters["ticks"] == await total_records(bus) - covered
        assert states[A].phase == "restoring"
        assert (states[B].phase, states[D].phase) == ("finished", "running")

        # A daemon without keys folds the log from offset 0 to the same states.
        c = DaemonService(daemon_config(bus_factory, "daemon-c"))
        before = await bus.end_offsets("snapshots")
        async with running(c):
            await asyncio.wait_for(c.ready.wait(), 60)
            assert c.jobs == states
        assert c.counters["folded"] == await total_records(bus)
        assert await bus.end_offsets("snapshots") == before, "no keys: no snapshot written"
        assert len(await _restores(bus)) == 1

    # Every decision b made from the snapshots is the one a fold from offset 0 makes.
    for job in (A, C, D):
        log = await read_bus(bus_factory.url, bus_factory.prefix, job)
        result = replay(job, log.events, log.trail(), MachineConfig(daemon_id="unused"))
        assert verify(result.replayed, result.recorded) is None, job
        assert result.state == states[job]


@pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True)
async def test_a_job_whose_snapshot_is_older_than_the_others_costs_only_its_own_records(
    bus_factory: BusFactory,
) -> None:
    """C's state does not change while b runs, so b leaves C's snapshot at the first round's
    position P1 and writes A's at P2. The next daemon reads from P1 (C is not finished), skips
    A's records below P2, and ends with the states of a fold from offset 0."""
    keys = make_keys(1)
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        await first_daemon(bus_factory, bus, keys)
        first = training(A, range(12, 16))
        await publish(bus, first)
        async with running(DaemonService(daemon_config(bus_factory, "daemon-b"), keys=keys)) as b:
            await eventually(lambda: folded(b, len(first)), timeout_s=60.0)
        headers = await latest_headers(bus)
        assert headers[C].offset == headers[B].offset < headers[A].offset
        assert headers[A].round_jobs == 3

        second = [*training(C, range(6, 9)), *training(A, range(16, 18))]
        await publish(bus, second)
        c = DaemonService(daemon_config(bus_factory, "daemon-c"), keys=keys)
        async with running(c):
            await eventually(lambda: folded(c, len(second)), timeout_s=60.0)
        states = dict(c.jobs)  # once c stopped, as above
        assert c.counters["folded"] == len(second)  # not A's records between P1 and P2
        full = DaemonService(daemon_config(bus_factory, "daemon-d"))
        async with running(full):
            await asyncio.wait_for(full.ready.wait(), 60)
            assert full.jobs == states


def _flip_last_bit(value: bytes) -> bytes:
    return value[:-1] + bytes([value[-1] ^ 1])


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        ("flip", "bad_signature"),
        ("foreign", "wrong_job"),
        ("missing", "incomplete"),
        ("other_keys", "unknown_kid"),
    ],
)
@pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True)
async def test_a_bad_snapshot_is_refused_and_the_state_recovered_from_the_log(
    bus_factory: BusFactory, tamper: str, reason: str
) -> None:
    keys = make_keys(1)
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        expected = await first_daemon(bus_factory, bus, keys)
        latest = await bus.latest_per_key("snapshots")
        reader = keys
        if tamper == "flip":
            await bus.publish("snapshots", A, _flip_last_bit(latest[A].value or b""))
        elif tamper == "foreign":
            await bus.publish("snapshots", A, latest[C].value)
        elif tamper == "missing":
            await bus.publish("snapshots", C, None)
        else:
            reader = make_keys(2)
        ends = await bus.end_offsets("events")
        records_here = sum(end for tp, end in ends.items() if tp.partition == HERE)
        records = sum(ends.values())

        b = DaemonService(daemon_config(bus_factory, "daemon-b"), keys=reader)
        with capture_logs() as logs:
            async with running(b):
                await asyncio.wait_for(b.ready.wait(), 60)
                assert b.jobs == expected
    refusals = [e for e in logs if e["event"].startswith("snapshots unusable")]
    assert (HERE, reason) in [(e["partition"], e["reason"]) for e in refusals]
    assert {e["log_level"] for e in refusals} == {"error"}
    assert fallbacks(b, reason) >= 1
    if tamper == "other_keys":
        assert b.counters["folded"] == records  # every partition from offset 0
    else:
        assert b.counters["folded"] == records_here  # only the bad partition from 0


@pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True)
async def test_rotated_keys_read_old_snapshots_and_write_new_ones_while_the_job_runs(
    bus_factory: BusFactory, tmp_path: Path
) -> None:
    """The key directory's whole cycle (``trainguard keys init``, ``rotate``, ``retire``): a
    daemon started after a rotation reads the snapshots written under the old keys; a rotation
    while it runs (the directory is reloaded) moves its next snapshots to the new keys while the
    job trains; once every snapshot was written again, the old keys can be retired."""
    admin = KeyAdmin(tmp_path / "keys")
    admin.init()
    first_keys = admin.store.load_daemon_keys()
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        await first_daemon(bus_factory, bus, first_keys)
        covered = await total_records(bus)

        admin.rotate("signing")
        admin.rotate("data")
        second_keys = admin.store.load_daemon_keys()
        assert first_keys.signing_kid in second_keys.verify
        assert first_keys.data_kid in second_keys.data
        config = dataclasses.replace(
            daemon_config(bus_factory, "daemon-b", interval_s=0.2),
            security=SecurityConfig(key_reload_s=0.2),
        )
        b = DaemonService(config, keys=second_keys)
        end = TopicPartition("events", HERE)

        async def written_under(keys: DaemonKeys) -> bool:
            header = (await latest_headers(bus))[A]
            at = (await bus.end_offsets("events"))[end]
            return (header.signing_kid, header.data_kid, header.offset) == (
                keys.signing_kid,
                keys.data_kid,
                at,
            )

        async with running(b):
            await asyncio.wait_for(b.ready.wait(), 60)
            assert fallbacks(b, "unknown_kid") == 0  # the old snapshots were read
            await publish(bus, training(A, range(12, 16)))
            await eventually(lambda: written_under(second_keys), timeout_s=60.0)

            admin.rotate("signing")  # while the daemon runs and the job trains
            admin.rotate("data")
            third_keys = admin.store.load_daemon_keys()
            await publish(bus, training(A, range(16, 20)))
            await eventually(lambda: written_under(third_keys), timeout_s=60.0)
        assert b.counters["folded"] == 16 == await total_records(bus) - covered
        headers = await latest_headers(bus)
        # The finished job's unchanged state was written again too, under the newest ids.
        assert {(h.signing_kid, h.data_kid) for h in headers.values()} == {
            (third_keys.signing_kid, third_keys.data_kid)
        }

        for old in (first_keys, second_keys):
            admin.retire(old.signing_kid)
            admin.retire(old.data_kid)
        retired = admin.store.load_daemon_keys()
        assert set(retired.verify) == {third_keys.signing_kid}
        assert set(retired.data) == {third_keys.data_kid}
        c = DaemonService(daemon_config(bus_factory, "daemon-c"), keys=retired)
        async with running(c):
            await asyncio.wait_for(c.ready.wait(), 60)
        assert c.counters["folded"] == 0
        assert c.jobs == b.jobs


async def _restores(bus: Bus) -> list[Restore]:
    """Every restore on ``commands`` (all records, not only the latest per job)."""
    ends = {tp: end for tp, end in (await bus.end_offsets("commands")).items() if end > 0}
    values: list[bytes] = []
    if ends:
        async with await bus.assign(dict.fromkeys(ends, 0)) as consumer:
            seen = dict.fromkeys(ends, 0)
            while any(seen[tp] < end for tp, end in ends.items()):
                for record in await consumer.getmany(timeout_s=1.0):
                    if record.offset < ends[record.tp]:
                        values.append(record.value or b"")
                for tp in ends:  # past transaction markers, which no record carries
                    seen[tp] = await consumer.position(tp)
    return [c for c in map(decode, values) if isinstance(c, Restore)]


@pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True)
async def test_a_round_is_written_once_enough_records_were_folded_before_its_time(
    bus_factory: BusFactory,
) -> None:
    """``snapshot_interval_records``: with an hour between rounds by time, a round is written
    while the daemon runs once it folded that many records, and not before, so that a restart
    of a job sending thousands of records a second refolds a bounded tail."""
    keys = make_keys(1)
    config = dataclasses.replace(
        daemon_config(bus_factory, "daemon-a"),
        snapshot_interval_records=12,
        tick_interval_s=3600.0,  # the daemon's own ticks are folded records too: none here
    )
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        b = DaemonService(config, keys=keys)
        async with running(b):
            await publish(bus, [started(A, 0), started(A, 1), *training(A, range(4))])
            await eventually(lambda: folded(b, 10), timeout_s=60.0)
            assert not await _written(bus), "10 records: no round yet"
            await publish(bus, training(A, range(4, 8)))
            await eventually(lambda: folded(b, 18), timeout_s=60.0)
            await eventually(lambda: _written(bus), timeout_s=60.0)
            headers = await latest_headers(bus)
            assert headers[A].offset >= 12


async def _written(bus: Bus) -> bool:
    return bool(await bus.latest_per_key("snapshots"))


async def test_the_fold_goes_on_while_a_round_is_sealed_and_the_round_names_its_own_position(
    bus_factory: BusFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sealing a round (encoding, compressing, encrypting, signing) takes about a second of
    CPU at 16,384 ranks; the daemon seals in a worker thread and folds on meanwhile, where it
    used to wait for the seal with every record behind it. Here the seal is held until the
    daemon folded records that arrived after it began: the round written then holds the
    states it was sealed with and names their position (not the later one it is committed
    with), and a daemon taking the partition on would rebuild from it."""
    keys = make_keys(1)
    config = dataclasses.replace(
        daemon_config(bus_factory, "daemon-a"),
        snapshot_interval_records=12,
        tick_interval_s=3600.0,  # the daemon's own ticks are folded records too: none here
    )
    began, release = threading.Event(), threading.Event()
    sealing: list[tuple[dict[str, JobState], Round]] = []
    seal_round = Snapshots._seal_round

    def held(self: Snapshots, states: dict[str, JobState], round: Round, *args: Any) -> Any:
        sealing.append((dict(states), round))
        began.set()
        release.wait(timeout=120.0)
        return seal_round(self, states, round, *args)

    monkeypatch.setattr(Snapshots, "_seal_round", held)
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        b = DaemonService(config, keys=keys)
        try:
            async with running(b):
                first = [started(A, 0), started(A, 1), *training(A, range(5))]
                await publish(bus, first)
                await eventually(lambda: folded(b, len(first)), timeout_s=60.0)
                await eventually(lambda: asyncio.to_thread(began.wait, 0), timeout_s=60.0)
                await publish(bus, training(A, range(5, 8)))
                # Folded while the seal is held (the old loop stood still here).
                await eventually(lambda: folded(b, len(first) + 6), timeout_s=60.0)
                assert not await _written(bus), "not sent before it is sealed"
                release.set()
                await eventually(lambda: _written(bus), timeout_s=60.0)
                [(states, round)] = sealing
                assert len(first) <= round.offset < len(first) + 6
                assert states[A] != b.jobs[A], "the job moved on while the round was sealed"
                headers = await latest_headers(bus)
                assert headers[A].offset == round.offset
                positions = await bus.group_positions(config.group, "events")
                committed = {tp.partition: offset for tp, offset in positions.items()}
                assert committed[HERE] >= round.offset
                loader = Snapshots(config.machine, DaemonMetrics(), max_message_bytes=1 << 20)
                rebuild = (await loader.load(bus, committed, keys))[HERE]
                assert rebuild.newest.offset == round.offset
                assert rebuild.states == states
        finally:
            release.set()
