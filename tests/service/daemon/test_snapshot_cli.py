"""``trainguard snapshots list|show|verify`` over an embedded bus holding snapshots sealed with
the keys of a real key directory (``trainguard keys`` layout)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from msgspec import structs
from typer.testing import CliRunner

from trainguard.agent.bus import DEFAULT_TOPICS, BusConfig, open_bus
from trainguard.agent.bus._partitioner import partition_for
from trainguard.agent.keys._keystore import DaemonKeys
from trainguard.daemon.admin._keys import KeyAdmin
from trainguard.daemon.cli import app
from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.core._state import JobState, new_job
from trainguard.daemon.service._snapshot_chunks import split
from trainguard.daemon.service._snapshot_envelope import Round, seal

PARTITIONS = next(t.partitions for t in DEFAULT_TOPICS if t.name == "snapshots")
_NAMES = [f"cli-{i}" for i in range(100)]
HERE = partition_for("cli-0", PARTITIONS)
ONE, TWO = [n for n in _NAMES if partition_for(n, PARTITIONS) == HERE][:2]
"""Two jobs on one partition: one round of two snapshots."""
ALONE = next(n for n in _NAMES if partition_for(n, PARTITIONS) != HERE)
CFG = MachineConfig(daemon_id="cli-test")
runner = CliRunner()


def state(job: str, phase: Any = "running") -> JobState:
    return structs.replace(
        new_job(job), phase=phase, generation=2, clock_ns=1_767_225_600_000_000_000
    )


def sealed(s: JobState, jobs: list[str], offset: int, keys: DaemonKeys) -> bytes:
    return seal(
        s,
        Round.of(partition_for(s.job_id, PARTITIONS), offset, jobs),
        signing_kid=keys.signing_kid,
        signing_key=keys.signing,
        data_kid=keys.data_kid,
        data_key=keys.data[keys.data_kid],
        nonce=bytes(12),
        config=CFG,
        version="test",
    )


def publish(
    url: str, records: Sequence[tuple[str, bytes | None]], partition: int | None = None
) -> None:
    async def run() -> None:
        async with open_bus(BusConfig(url=url)) as bus:
            for key, value in records:
                await bus.publish("snapshots", key, value, partition=partition)

    asyncio.run(run())


@pytest.fixture
def deployment(tmp_path: Path) -> dict[str, Any]:
    """A key directory and a bus with one complete round on each of two partitions."""
    admin = KeyAdmin(tmp_path / "keys")
    admin.init()
    keys = admin.store.load_daemon_keys()
    url = f"sqlite://{tmp_path / 'bus.db'}"
    publish(
        url,
        [
            (ONE, sealed(state(ONE), [ONE, TWO], 40, keys)),
            (TWO, sealed(state(TWO, "finished"), [ONE, TWO], 40, keys)),
            (ALONE, sealed(state(ALONE), [ALONE], 7, keys)),
        ],
    )
    return {"url": url, "admin": admin, "keys": keys, "dir": str(tmp_path / "keys")}


def cli(*args: str) -> Any:
    return runner.invoke(app, list(args))


def test_list_shows_each_jobs_latest_snapshot(deployment: dict[str, Any]) -> None:
    result = cli("snapshots", "list", "--bus", deployment["url"], "--format", "json")
    assert result.exit_code == 0, result.output
    rows = {r["job_id"]: r for r in orjson.loads(result.stdout)}
    assert set(rows) == {ONE, TWO, ALONE}
    assert (rows[ONE]["partition"], rows[ONE]["offset"], rows[ONE]["round_jobs"]) == (HERE, 40, 2)
    assert rows[ALONE]["signing_kid"] == deployment["keys"].signing_kid
    assert rows[ONE]["created"] == "2026-01-01T00:00:00.000Z"
    text = cli("snapshots", "list", "--bus", deployment["url"])
    assert text.exit_code == 0
    assert ONE in text.stdout
    assert deployment["keys"].data_kid in text.stdout


def test_show_decrypts_with_the_key_its_header_names_even_rotated_and_retired(
    deployment: dict[str, Any],
) -> None:
    admin: KeyAdmin = deployment["admin"]
    old = deployment["keys"]
    admin.rotate("data")
    admin.rotate("signing")
    admin.retire(old.data_kid)
    admin.retire(old.signing_kid)
    args = ("snapshots", "show", ONE, "--bus", deployment["url"], "--keys", deployment["dir"])
    result = cli(*args, "--format", "json")
    assert result.exit_code == 0, result.output
    summary = orjson.loads(result.stdout)
    assert (summary["phase"], summary["generation"], summary["offset"]) == ("running", 2, 40)
    assert summary["data_kid"] == old.data_kid
    text = cli(*args)
    assert text.exit_code == 0
    assert "running" in text.stdout


def test_show_without_the_named_key_fails_and_names_it(
    deployment: dict[str, Any], tmp_path: Path
) -> None:
    other = KeyAdmin(tmp_path / "other")
    other.init()
    result = cli(
        "snapshots", "show", ONE, "--bus", deployment["url"], "--keys", str(tmp_path / "other")
    )
    assert result.exit_code == 2
    assert deployment["keys"].signing_kid in result.output
    missing = cli("snapshots", "show", "nobody", "--bus", deployment["url"])
    assert missing.exit_code == 2
    assert "no snapshot of job 'nobody'" in missing.output


def test_verify_passes_a_sound_set_and_names_what_is_wrong(deployment: dict[str, Any]) -> None:
    args = ("snapshots", "verify", "--bus", deployment["url"], "--keys", deployment["dir"])
    good = cli(*args)
    assert good.exit_code == 0, good.output
    assert "3 of 3 snapshots verified" in good.stdout

    value = sealed(state(ALONE), [ALONE], 9, deployment["keys"])
    publish(deployment["url"], [(ALONE, value[:-1] + bytes([value[-1] ^ 1])), (TWO, None)])
    bad = cli(*args)
    assert bad.exit_code == 1
    assert f"job {ALONE} (partition" in bad.stdout
    assert "bad_signature" in bad.stdout
    assert f"partition {HERE}: incomplete" in bad.stdout
    shown = cli("snapshots", "show", ALONE, "--bus", deployment["url"], "--keys", deployment["dir"])
    assert shown.exit_code == 1
    assert "refused: bad_signature" in shown.output


def test_a_snapshot_in_chunks_is_listed_shown_and_verified(deployment: dict[str, Any]) -> None:
    """ONE's snapshot cut into chunks of 200 bytes behind its head: ``list`` gives its whole
    size and its chunks, ``show`` and ``verify`` open it; with a chunk gone, ``verify`` and
    ``show`` name the missing chunk."""
    keys = deployment["keys"]
    envelope = sealed(state(ONE), [ONE, TWO], 40, keys)
    head, chunks = split(envelope, 200, keys.signing)
    partition = partition_for(ONE, PARTITIONS)
    publish(deployment["url"], [(ONE, head)])
    publish(deployment["url"], chunks, partition=partition)
    listed = cli("snapshots", "list", "--bus", deployment["url"], "--format", "json")
    assert listed.exit_code == 0, listed.output
    rows = {r["job_id"]: r for r in orjson.loads(listed.stdout)}
    assert set(rows) == {ONE, TWO, ALONE}, "chunks are no jobs"
    assert (rows[ONE]["bytes"], rows[ONE]["chunks"], rows[ONE]["offset"]) == (
        len(envelope),
        len(chunks),
        40,
    )
    assert rows[TWO]["chunks"] == 0
    text = cli("snapshots", "list", "--bus", deployment["url"])
    assert f"{len(envelope):>9} {len(chunks):>6}" in text.stdout
    shown = cli("snapshots", "show", ONE, "--bus", deployment["url"], "--keys", deployment["dir"])
    assert shown.exit_code == 0, shown.output
    args = ("snapshots", "verify", "--bus", deployment["url"], "--keys", deployment["dir"])
    good = cli(*args)
    assert good.exit_code == 0, good.output
    assert "3 of 3 snapshots verified" in good.stdout

    publish(deployment["url"], [(chunks[1][0], None)], partition=partition)
    bad = cli(*args)
    assert bad.exit_code == 1
    assert f"job {ONE} (partition {partition}): chunk_missing: chunk 2 of" in bad.stdout
    assert f"partition {partition}: chunk_missing" not in bad.stdout  # the job's, not the round's
    shown = cli("snapshots", "show", ONE, "--bus", deployment["url"], "--keys", deployment["dir"])
    assert shown.exit_code == 1
    assert "refused: chunk_missing" in shown.output
