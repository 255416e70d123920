"""Committed manifests stored beside their checkpoints (``docs/checkpoints.md``, "Manifests"),
by a real daemon on a real bus: the head and parts a restore command's reference names, the
whole manifest on ``manifests`` while it fits a record and its head once it does not, read
back whole by the catalog's reader, and a commit that storage refuses logged and counted while
the daemon goes on."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from tests.support.buses import BusFactory
from tests.support.service_support import (
    JOB,
    JobEvents,
    daemon_config,
    eventually,
    publish,
    read_all,
)
from tests.support.service_support import running as run_daemon
from trainguard.agent.bus import DEFAULT_TOPICS
from trainguard.agent.checkpoint import read_manifests
from trainguard.daemon import DaemonService
from trainguard.daemon.service._settings import DaemonConfig
from trainguard.schemas import (
    Checkpoint,
    CheckpointMeta,
    Manifest,
    ManifestHead,
    decode,
    head_path,
    sha256_digest,
    snapshot_ref,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

STEP = 10


def shards(root: Path, world_size: int) -> list[Checkpoint]:
    """Every rank's shard of :data:`STEP`, named in a step folder that exists under ``root``
    (the daemon reads no shard; it writes the manifest beside them)."""
    folder = root / JOB / "g000000" / f"s{STEP:010d}"
    folder.mkdir(parents=True)
    events = JobEvents(JOB)
    return [
        dataclasses.replace(
            events.shard(rank, 1, STEP),
            world_size=world_size,
            shard_uri=(folder / f"rank{rank:05d}.pt").as_uri(),
        )
        for rank in range(world_size)
    ]


def stored(folder: str, name: str = "manifest.json") -> Path:
    """File ``name`` of the manifest stored in step folder ``folder`` (a ``file://`` URI)."""
    return Path(head_path(folder).removeprefix("file://")).with_name(name)


def stored_digest(folder: str) -> str:
    """The SHA-256 of the head stored in step folder ``folder``."""
    return sha256_digest(stored(folder).read_bytes())


def swap_a_shard_in_the_part(folder: str) -> None:
    """Make the part stored in ``folder`` name rank 8's file for rank 7 (a part that is not
    the head's)."""
    part = stored(folder, "part-00000.json")
    part.write_bytes(part.read_bytes().replace(b"rank00007", b"rank00008"))


def sample(service: DaemonService, name: str, **labels: str) -> float:
    value = service.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def committed(
    bus_factory: BusFactory, config: DaemonConfig, events: list[Checkpoint]
) -> tuple[DaemonService, bytes]:
    """Run a daemon over ``events`` until the step commits; its service and the record it
    published on ``manifests``."""
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        await publish(bus, *events)
        async with run_daemon(DaemonService(config)) as service:

            async def published() -> list[bytes]:
                return await read_all(bus, "manifests")

            (record,) = await eventually(published, timeout_s=60)
    return service, record


async def test_a_committed_manifest_is_stored_beside_its_checkpoint_and_published_whole(
    bus_factory: BusFactory, tmp_path: Path
) -> None:
    service, record = await committed(
        bus_factory, daemon_config(bus_factory), shards(tmp_path, world_size=2)
    )
    manifest = decode(record, expect=Manifest)
    ref = snapshot_ref(manifest)
    assert stored_digest(ref.folder) == ref.manifest_digest
    assert stored(ref.folder, "part-00000.json").is_file()
    assert sample(service, "trainguard_manifests_stored_total", result="ok") == 1


async def test_a_manifest_larger_than_a_record_is_published_as_its_head(
    bus_factory: BusFactory, tmp_path: Path
) -> None:
    """600 ranks: the whole manifest (about 110 KB) fits a record of the bus (1 MiB) but not
    the codec's 64 KiB its readers apply; the head goes on ``manifests``, and the catalog's
    reader puts the manifest back together from the parts beside the checkpoint; a part that
    is not the head's makes that snapshot unreadable."""
    config = daemon_config(bus_factory)
    assert config.bus.max_message_bytes > 110_000
    events = shards(tmp_path, world_size=600)
    _, record = await committed(bus_factory, config, events)
    head = decode(record, expect=ManifestHead)
    assert (head.world_size, [p.ranks for p in head.parts]) == (600, [600])
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        log = await read_manifests(bus, JOB)
        (manifest,) = log.manifests
        assert [s.uri for s in manifest.shards] == [e.shard_uri for e in events]
        assert snapshot_ref(manifest).manifest_digest == stored_digest(head.folder)
        swap_a_shard_in_the_part(head.folder)
        log = await read_manifests(bus, JOB)
        assert log.manifests == ()
        assert "has digest" in log.unreadable[head.snapshot_id]
        # Looking for another snapshot reads no part of this one (nor finds it unreadable).
        log = await read_manifests(bus, JOB, snapshot_id=f"{JOB}/g0/s999")
        assert (log.manifests, log.unreadable, log.others) == ((), {}, (head.snapshot_id,))


async def test_a_manifest_storage_refuses_is_logged_and_counted_and_the_commit_stands(
    bus_factory: BusFactory, tmp_path: Path
) -> None:
    """The step folder is gone (a store the daemon cannot write): the commit is published and
    the daemon goes on; restores to it read the whole manifest from the bus."""
    events = shards(tmp_path, world_size=2)
    folder = tmp_path / JOB / "g000000" / f"s{STEP:010d}"
    folder.rmdir()
    with capture_logs() as logs:
        service, record = await committed(bus_factory, daemon_config(bus_factory), events)
    assert decode(record, expect=Manifest).step == STEP
    assert sample(service, "trainguard_manifests_stored_total", result="failed") == 1
    (failed,) = [e for e in logs if e["event"] == "manifest not stored beside the checkpoint"]
    assert (failed["log_level"], failed["restores_read"]) == ("warning", "the bus")
    assert "FileNotFoundError" in failed["error"]
    assert not folder.exists()


async def test_a_folder_outside_the_jobs_layout_is_never_written(
    bus_factory: BusFactory, tmp_path: Path
) -> None:
    """Rank 0 names another job's step folder (a compromised worker, or a typo): the daemon,
    which may write wherever it prunes, writes nothing there; it logs why, and the commit
    stands (a restore reads the whole manifest from the bus)."""
    events = shards(tmp_path, world_size=2)
    victim = tmp_path / "other-job" / "g000000" / f"s{STEP:010d}"
    victim.mkdir(parents=True)
    events = [
        dataclasses.replace(e, shard_uri=(victim / f"rank{e.rank:05d}.pt").as_uri()) for e in events
    ]
    with capture_logs() as logs:
        service, record = await committed(bus_factory, daemon_config(bus_factory), events)
    assert decode(record, expect=Manifest).step == STEP
    assert list(victim.iterdir()) == []
    (failed,) = [e for e in logs if e["event"] == "manifest not stored beside the checkpoint"]
    assert f"not a <root>/{JOB}/g<generation>/s<step> folder" in failed["error"]
    assert sample(service, "trainguard_manifests_stored_total", result="failed") == 1


@pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True)
async def test_storage_that_raises_anything_or_hangs_stalls_the_fold_once(
    bus_factory: BusFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A storage library raising what it likes is logged like a refusal; one that hangs costs
    the store's timeout once: while it has not returned, later commits are published without
    storing (they used to wait for the timeout each, on threads they then tied up)."""
    calls: list[str] = []
    hung = threading.Event()

    def store(split: Any) -> None:
        calls.append(split.ref.snapshot_id)
        if len(calls) == 1:
            raise TypeError("a storage library's own error")
        hung.wait(120)  # past the daemon's 10-s timeout, until the test is done

    monkeypatch.setattr("trainguard.daemon.service._daemon.store_manifest", store)
    steps = (10, 20, 30)
    events = []
    for step in steps:
        folder = tmp_path / JOB / "g000000" / f"s{step:010d}"
        folder.mkdir(parents=True)
        events += [
            dataclasses.replace(
                JobEvents(JOB).shard(rank, step, step),  # seq = step: each is news
                shard_uri=(folder / f"rank{rank}.pt").as_uri(),
            )
            for rank in range(2)
        ]
    with capture_logs() as logs:
        async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
            await publish(bus, *events)
            async with run_daemon(DaemonService(daemon_config(bus_factory))):

                async def published() -> bool:
                    return len(await read_all(bus, "manifests")) == len(steps)

                try:
                    await eventually(published, timeout_s=60)
                finally:
                    hung.set()
    errors = [e["error"] for e in logs if e["event"] == "manifest not stored beside the checkpoint"]
    assert errors == [
        "TypeError: a storage library's own error",
        "storage did not answer within 10 s",
        "an earlier manifest's store has not returned for over 10 s",
    ]
    assert len(calls) == 2


async def test_a_head_larger_than_a_record_is_stored_and_not_published(
    bus_factory: BusFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's metadata makes the head larger than the records readers of ``manifests``
    accept (64 KiB; 4 KiB here): the head is stored beside the checkpoint, where restores read
    it, and not published, with an error; the daemon goes on (it raised inside the state
    machine's commit, on every fold of that record)."""
    monkeypatch.setattr("trainguard.daemon.service._daemon.DEFAULT_MAX_BYTES", 4096)
    meta = CheckpointMeta(hyperparameters={"pad": "x" * 5000})
    events = [dataclasses.replace(e, metadata=meta) for e in shards(tmp_path, world_size=2)]
    with capture_logs() as logs:
        async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
            await publish(bus, *events)
            async with run_daemon(DaemonService(daemon_config(bus_factory))) as service:
                await eventually(lambda: _logged(logs, "committed"), timeout_s=60)
            assert await read_all(bus, "manifests") == []
    (too_large,) = [e for e in logs if e["event"].startswith("manifest head larger")]
    assert too_large["head_bytes"] > 4096
    folder = tmp_path / JOB / "g000000" / f"s{STEP:010d}" / "trainguard" / "manifest.json"
    assert folder.stat().st_size == too_large["head_bytes"]
    assert sample(service, "trainguard_manifests_stored_total", result="ok") == 1


async def _logged(logs: list[MutableMapping[str, Any]], event: str) -> bool:
    return any(e["event"] == event for e in logs)
