"""DCP checkpoints (``checkpoint_format="dcp"``): every file digested as written and verified
before DCP reads a byte of it; FSDP2 snapshots resharded onto other world sizes (real ranks,
gloo); the agent's sync and async saves announce the rank's files."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict_saver import save

from tests.support import dcp_ranks
from tests.support.dcp_ranks import snapshot_of
from tests.support.jobbus import JOB, of_type, read_events
from trainguard.agent import AgentError, ShardCorrupt, ShardError, ShardMissing
from trainguard.agent.checkpoint import dcp_problems
from trainguard.agent.checkpoint._dcp import load_dcp, storage_writer
from trainguard.schemas import Checkpoint, DataCursor, Manifest, Shard, files_digest

CURSOR = DataCursor(data_version="v1", seed=3, epoch=0, offset=64, world_size=1)


def state_of(seed: int) -> dict[str, Any]:
    """A small model-and-optimizer-like state: tensors, nested, and a non-tensor value."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
        "optim": {"step": 7, "exp_avg": torch.randn(64, 32, generator=g)},
    }


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: zeros_like(v)
        if isinstance(v, dict)
        else torch.zeros_like(v)
        if torch.is_tensor(v)
        else 0
        for k, v in state.items()
    }


def assert_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, dict):
            assert_equal(value, b[key])
        elif torch.is_tensor(value):
            assert torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


def saved_alone(folder: Path, state: dict[str, Any]) -> tuple[Shard, ...]:
    """Save ``state`` in one process (no process group) as rank 0 of world size 1."""
    write = storage_writer(folder.as_uri())
    save(state, storage_writer=write.writer, no_dist=True)
    write.write_sidecar(0, {"rng": {}, "step": 3})
    files = write.files()
    uri = folder.as_uri()
    size = sum(f.size_bytes for f in files)
    return (Shard(rank=0, uri=uri, size_bytes=size, digest=files_digest(files), files=files),)


def test_every_file_is_listed_with_the_digest_of_its_bytes(tmp_path: Path) -> None:
    import hashlib

    (shard,) = saved_alone(tmp_path / "s", state_of(0))
    assert shard.files is not None
    names = [f.name for f in shard.files]
    assert names == sorted(os.listdir(tmp_path / "s"))  # nothing left out, no temporary file
    assert ".metadata" in names
    assert "trainguard.rank00000.pt" in names
    for f in shard.files:
        data = (tmp_path / "s" / f.name).read_bytes()
        assert (f.size_bytes, f.digest) == (len(data), f"sha256:{hashlib.sha256(data).hexdigest()}")
    loaded = zeros_like(state_of(0))
    assert load_dcp(snapshot_of((shard,)), loaded, 0, process_group=None) == {"rng": {}, "step": 3}
    assert_equal(loaded, state_of(0))
    assert dcp_problems((shard,), verify=True) == []


def test_any_dcp_reader_reads_it_with_no_zip_crc_computed(tmp_path: Path) -> None:
    """The writes skip torch's zip CRC32 (SHA-256 covers every byte); DCP's own reader and
    ``torch.load`` read the files as they are, and the writing thread's option is back."""
    import zipfile

    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.serialization import get_crc32_options

    saved_alone(tmp_path / "s", state_of(0))
    assert get_crc32_options()
    sidecar = tmp_path / "s" / "trainguard.rank00000.pt"
    assert {i.CRC for i in zipfile.ZipFile(sidecar).infolist()} == {0}
    assert torch.load(sidecar, weights_only=True) == {"rng": {}, "step": 3}
    loaded = zeros_like(state_of(0))
    load(loaded, storage_reader=FileSystemReader(tmp_path / "s"), no_dist=True)
    assert_equal(loaded, state_of(0))


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[random.Random(path.name).randrange(len(data))] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1])


def malicious(path: Path) -> None:
    """Replace the file with a pickle that, once unpickled, leaves a marker file."""
    marker = path.parent / "PWNED"

    class Payload:
        def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
            return (Path.write_text, (marker, "unpickled"))

    path.write_bytes(pickle.dumps(Payload()))


DAMAGE: dict[str, tuple[str, Callable[[Path], None], type[ShardError]]] = {
    "flipped .distcp": ("__0_0.distcp", flip, ShardCorrupt),
    "flipped .metadata": (".metadata", flip, ShardCorrupt),
    "flipped agent file": ("trainguard.rank00000.pt", flip, ShardCorrupt),
    "truncated .distcp": ("__0_0.distcp", truncate, ShardCorrupt),
    "missing .distcp": ("__0_0.distcp", Path.unlink, ShardMissing),
    "malicious .metadata": (".metadata", malicious, ShardCorrupt),
    "malicious .distcp": ("__0_0.distcp", malicious, ShardCorrupt),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_damage_is_caught_before_deserialization(tmp_path: Path, case: str) -> None:
    name, damage, error = DAMAGE[case]
    (shard,) = saved_alone(tmp_path / "s", state_of(1))
    damage(tmp_path / "s" / name)
    loaded = zeros_like(state_of(1))
    with pytest.raises(error, match=name.replace(".", r"\.")):
        load_dcp(snapshot_of((shard,)), loaded, 0, process_group=None)
    assert not (tmp_path / "s" / "PWNED").exists()
    problems = dcp_problems((shard,), verify=True)
    assert len(problems) == 1
    assert name in problems[0]


def test_a_file_the_manifest_does_not_list_is_refused(tmp_path: Path) -> None:
    (shard,) = saved_alone(tmp_path / "s", state_of(2))
    assert shard.files is not None
    # A manifest that leaves out .metadata is no DCP snapshot the daemon would commit.
    bare = dataclasses.replace(shard, files=tuple(f for f in shard.files if f.name != ".metadata"))
    with pytest.raises(ShardCorrupt, match="digest does not match its file list"):
        load_dcp(snapshot_of((bare,)), zeros_like(state_of(2)), 0, process_group=None)
    signed = dataclasses.replace(bare, digest=files_digest(bare.files or ()))
    with pytest.raises(ShardCorrupt, match=r"lists no \.metadata"):
        load_dcp(snapshot_of((signed,)), zeros_like(state_of(2)), 0, process_group=None)


def spawn(fn: Callable[..., None], nprocs: int, *args: Any) -> None:
    """Run ``fn(rank, nprocs, *args)`` in ``nprocs`` fresh processes; raise if one fails."""
    from torch.multiprocessing.spawn import spawn as start

    start(  # type: ignore[no-untyped-call]
        dcp_ranks.exit_after, args=(fn, nprocs, *args), nprocs=nprocs, join=True
    )


@pytest.mark.slow
def test_an_fsdp2_snapshot_reshards_onto_other_world_sizes(tmp_path: Path) -> None:
    """Saved by 2 ranks, loaded by 1 and 4: every tensor of the model and the optimizer
    equals the saved one; only ranks the snapshot had find their own agent state."""
    uri = (tmp_path / "ckpt").as_uri()
    spawn(dcp_ranks.save_rank, 2, str(tmp_path), uri)
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)
    for world_size in (1, 4):
        tag = f"w{world_size}"
        spawn(dcp_ranks.load_rank, world_size, str(tmp_path), uri, 2, tag)
        outcomes = [
            json.loads((tmp_path / f"outcome-{tag}-{r}.json").read_text())
            for r in range(world_size)
        ]
        assert [o.get("own") for o in outcomes] == [
            {"rank": r} if r < 2 else None for r in range(world_size)
        ]
        assert_equal(torch.load(tmp_path / f"loaded-{tag}.pt", weights_only=True), reference)


@pytest.mark.slow
def test_a_damaged_file_fails_the_load_on_every_rank(tmp_path: Path) -> None:
    """Whichever rank reads the damaged file, every rank raises the verification error
    (DCP gathers the failures), so every rank reports the snapshot as unusable."""
    uri = (tmp_path / "ckpt").as_uri()
    spawn(dcp_ranks.save_rank, 2, str(tmp_path), uri)
    flip(tmp_path / "ckpt" / "__1_0.distcp")
    spawn(dcp_ranks.load_rank, 2, str(tmp_path), uri, 2, "damaged")
    for rank in (0, 1):
        outcome = json.loads((tmp_path / f"outcome-damaged-{rank}.json").read_text())
        assert outcome["error"] == "ShardCorrupt"
        assert "__1_0.distcp" in outcome["message"]


@pytest.mark.parametrize("blocking", [True, False])
def test_the_agent_announces_its_files_and_loads_them_back(
    make_agent: Callable[..., Any], bus_url: str, blocking: bool
) -> None:
    state = state_of(3)
    with make_agent(checkpoint_format="dcp") as agent:
        agent.ready(0)
        agent.step(5)
        torch.manual_seed(99)
        expected_draw = torch.rand(3)
        torch.manual_seed(99)
        event = agent.checkpoint(5, state, cursor=CURSOR, blocking=blocking).result()
        # The caller may change its tensors once checkpoint() returned, also when not blocking.
        state["model"]["w"].add_(1.0)
    (announced,) = of_type(read_events(bus_url, JOB), Checkpoint)
    assert announced == event
    assert event.files is not None
    assert event.shard_uri.endswith(f"/{JOB}/g000000/s0000000005")
    assert {f.name for f in event.files} == {
        ".metadata",
        "__0_0.distcp",
        "trainguard.rank00000.pt",
    }
    assert event.digest == files_digest(event.files)
    assert event.size_bytes == sum(f.size_bytes for f in event.files)
    manifest = Manifest(
        job_id=JOB,
        snapshot_id=f"{JOB}/g0/s5",
        generation=0,
        ts=1,
        step=5,
        world_size=1,
        shards=(
            Shard(
                rank=0,
                uri=event.shard_uri,
                size_bytes=event.size_bytes,
                digest=event.digest,
                files=event.files,
            ),
        ),
        cursor=CURSOR,
    )
    with make_agent(checkpoint_format="dcp", generation=1) as agent:
        with pytest.raises(AgentError, match="pass state="):
            agent.load(manifest)
        loaded = agent.load(manifest, state=zeros_like(state_of(3)))
        assert torch.equal(torch.rand(3), expected_draw)  # the RNG state came back too
    assert_equal(loaded, state_of(3))


def test_object_storage_needs_the_dcp_format(make_agent: Callable[..., Any]) -> None:
    from trainguard.agent import ConfigError

    with pytest.raises(ConfigError, match="only the dcp checkpoint format"):
        make_agent(checkpoint_uri="s3://bucket/ckpt")
    with pytest.raises(ConfigError, match="is no URL"):
        make_agent(checkpoint_format="dcp", checkpoint_uri="bucket/ckpt")
    # The settings alone (the storage is not asked: no S3 server here).
    make_agent(checkpoint_format="dcp", checkpoint_uri="s3://bucket/ckpt", probe_storage=False)
    with pytest.raises(ConfigError, match="no storage for nosuchscheme://"):
        make_agent(checkpoint_format="dcp", checkpoint_uri="nosuchscheme://bucket/ckpt")


@pytest.mark.s3
def test_a_save_to_a_missing_bucket_fails_in_one_line(
    make_agent: Callable[..., Any], bus_url: str, s3_env: Any
) -> None:
    """A save the storage refuses is a failed checkpoint, reported with the storage's own
    reason in one line (not DCP's gathered tracebacks); training goes on. (The bucket goes
    missing after the start: the check at start is off.)"""
    from trainguard.schemas import Lifecycle

    store = "s3://no-such-bucket-trainguard/ckpt"
    agent = make_agent(checkpoint_format="dcp", checkpoint_uri=store, probe_storage=False)
    with agent:
        agent.ready(0)
        for blocking in (True, False):
            failed = agent.checkpoint(2, state_of(5), cursor=CURSOR, blocking=blocking)
            error = failed.exception()
            assert isinstance(error, RuntimeError)
            assert str(error).startswith("DCP save failed on rank 0: FileNotFoundError: ")
            assert "\n" not in str(error)
        assert agent.stats.checkpoint_failures == 2
    reports = [e for e in of_type(read_events(bus_url, JOB), Lifecycle) if e.kind == "error"]
    assert len(reports) == 2
    assert all("\n" not in e.message and "bucket" in e.message for e in reports)


@pytest.mark.s3
def test_a_missing_bucket_is_a_config_error_at_start(
    make_agent: Callable[..., Any], s3_env: Any
) -> None:
    """Found when the agent is made, before any training, with the URI and S3's reason."""
    from trainguard.agent import ConfigError

    store = "s3://no-such-bucket-trainguard/ckpt"
    with pytest.raises(ConfigError) as raised:
        make_agent(checkpoint_format="dcp", checkpoint_uri=store)
    message = str(raised.value)
    assert message.startswith(f"checkpoint_uri {store!r}: the storage refused a test write of ")
    assert message.endswith(": FileNotFoundError: The specified bucket does not exist")


@pytest.mark.s3
def test_bad_credentials_are_a_config_error_at_start(
    make_agent: Callable[..., Any], s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainguard.agent import ConfigError

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(ConfigError, match=r"refused a test write .*: PermissionError: "):
        make_agent(checkpoint_format="dcp", checkpoint_uri=f"s3://{s3_bucket}/ckpt")


def test_an_s3_endpoint_that_does_not_answer_is_unavailable_not_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Connection refused (nothing listens on the port): tried again, then StorageUnavailable,
    which a restart may cure."""
    import socket

    from trainguard.agent import ConfigError, StorageUnavailable
    from trainguard.agent.checkpoint._probe import probe_storage

    with socket.socket() as s:  # a port nothing listens on once it is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with pytest.raises(StorageUnavailable) as raised:
        probe_storage("s3://bucket/ckpt", JOB, 0, pauses_s=(0.1,))
    assert not isinstance(raised.value, ConfigError)
    assert "in 2 attempts" in str(raised.value)
    assert f'Could not connect to the endpoint URL: "http://127.0.0.1:{port}/' in str(raised.value)


@pytest.mark.s3
def test_the_check_at_start_leaves_no_object_behind(
    make_agent: Callable[..., Any], s3_bucket: str
) -> None:
    import fsspec

    make_agent(
        checkpoint_format="dcp", checkpoint_uri=f"s3://{s3_bucket}/ckpt", rank=1, world_size=2
    )
    assert fsspec.filesystem("s3").find(s3_bucket) == []


@pytest.mark.s3
def test_a_dcp_checkpoint_on_object_storage_round_trips_and_is_verified(
    make_agent: Callable[..., Any], bus_url: str, s3_bucket: str
) -> None:
    """Written to a real S3-compatible server through fsspec (credentials from the AWS
    variables), announced with its objects' digests, loaded back verified; a replaced object
    is refused, a missing one reported missing, and dcp_problems finds both."""
    import fsspec

    store = f"s3://{s3_bucket}/ckpt"
    with make_agent(checkpoint_format="dcp", checkpoint_uri=store) as agent:
        agent.ready(0)
        event = agent.checkpoint(4, state_of(4), cursor=CURSOR, blocking=False).result()
    assert event.shard_uri == f"{store}/{JOB}/g000000/s0000000004"
    assert event.files is not None
    fs = fsspec.filesystem("s3")
    stored = {p.rsplit("/", 1)[1]: fs.size(p) for p in fs.ls(event.shard_uri, detail=False)}
    assert stored == {f.name: f.size_bytes for f in event.files}
    shards = (
        Shard(
            rank=0,
            uri=event.shard_uri,
            size_bytes=event.size_bytes,
            digest=event.digest,
            files=event.files,
        ),
    )
    loaded = zeros_like(state_of(4))
    assert load_dcp(snapshot_of(shards), loaded, 0, process_group=None) is not None
    assert_equal(loaded, state_of(4))
    assert dcp_problems(shards, verify=True) == []

    distcp = f"{event.shard_uri}/__0_0.distcp"
    data = bytearray(fs.cat_file(distcp))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(distcp, bytes(data))
    with pytest.raises(ShardCorrupt, match=r"__0_0\.distcp has digest"):
        load_dcp(snapshot_of(shards), zeros_like(state_of(4)), 0, process_group=None)
    fs.rm_file(distcp)
    with pytest.raises(ShardMissing, match=r"__0_0\.distcp"):
        load_dcp(snapshot_of(shards), zeros_like(state_of(4)), 0, process_group=None)
    assert dcp_problems(shards, verify=True) == [f"{distcp} is missing"]


def test_a_write_that_fails_records_nothing_and_ends_its_hashing_thread(tmp_path: Path) -> None:
    import threading

    from torch.distributed.checkpoint.filesystem import FileSystem

    from trainguard.agent.checkpoint._dcp import _POOL, DigestingFileSystem, _Ledger

    ledger = _Ledger()
    fs = DigestingFileSystem(FileSystem(), ledger=ledger)

    def fill_then_fail() -> None:
        with fs.create_stream(tmp_path / "f", "wb") as out:
            out.write(b"x" * ((9 << 20) + 5))  # nine full chunks queued, one partly filled
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        fill_then_fail()
    assert ledger.files() == ()
    assert not [t for t in threading.enumerate() if t.name.startswith("trainguard-sha256")]
    assert len(_POOL._free) == _POOL._made  # every chunk buffer is back in the pool
    with fs.create_stream(tmp_path / "g", "wb") as out:
        out.write(b"y" * (2 << 20))
    (written,) = ledger.files()
    assert (written.name, written.size_bytes) == ("g", 2 << 20)


def test_the_digest_is_the_sha256_of_the_bytes_whatever_the_sizes_of_the_writes(
    tmp_path: Path,
) -> None:
    """Writes of every size, straddling the 1 MiB chunks the helper thread hashes, from
    buffers the caller reuses at once (as DCP does): the digest is ``sha256sum``'s."""
    import hashlib

    from torch.distributed.checkpoint.filesystem import FileSystem

    from trainguard.agent.checkpoint._dcp import DigestingFileSystem, _Ledger

    ledger = _Ledger()
    fs = DigestingFileSystem(FileSystem(), ledger=ledger)
    rng = random.Random(5)
    buffer = bytearray(9 << 20)
    expected = hashlib.sha256()
    with fs.create_stream(tmp_path / "f", "wb") as out:
        for size in [0, 1, 4095, (1 << 20) - 3, 5, 1 << 20, 9 << 20, 17] * 2:
            buffer[:size] = rng.randbytes(size)
            out.write(memoryview(buffer)[:size])
            expected.update(memoryview(buffer)[:size])
            buffer[:size] = bytes(size)  # the caller reuses its buffer once write returns
    (written,) = ledger.files()
    data = (tmp_path / "f").read_bytes()
    assert written.size_bytes == len(data)
    assert written.digest == f"sha256:{hashlib.sha256(data).hexdigest()}"
    assert written.digest == f"sha256:{expected.hexdigest()}"


def test_a_rank_reads_only_the_manifest_part_of_the_file_it_loads(tmp_path: Path) -> None:
    """At 4,096 ranks a rank's file is looked up in its own rank's shard only: reading its
    file checked no other rank's (the truth test of the lazy file map listed every part on
    every rank: 16 parts, 3 MB, per rank at 16,384 ranks)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    from trainguard.agent.checkpoint._dcp import DigestingFileSystem, _SnapshotFiles
    from trainguard.schemas import StoredFile, sha256_digest

    data = b"rank 7's tensors"
    (tmp_path / "__7_0.distcp").write_bytes(data)
    asked: list[int] = []

    class FourThousandRanks:
        world_size = 4096

        def shard(self, rank: int) -> Shard:
            asked.append(rank)
            name = f"__{rank}_0.distcp"
            digest = sha256_digest(data if rank == 7 else b"")
            files = (StoredFile(name=name, size_bytes=len(data), digest=digest),)
            return Shard(
                rank=rank,
                uri=tmp_path.as_uri(),
                size_bytes=len(data),
                digest=files_digest(files),
                files=files,
            )

        def shards(self) -> tuple[Shard, ...]:
            raise AssertionError("every part was read")

    files = _SnapshotFiles(FourThousandRanks())  # type: ignore[arg-type]
    reader = DigestingFileSystem(FileSystem(), expected=files)
    assert reader.read_verified(tmp_path / "__7_0.distcp", "__7_0.distcp") == data
    assert asked == [7]
