"""Checkpoint shards: durable atomic writes, digests, verified safe loads, RNG capture."""

from __future__ import annotations

import hashlib
import os
import random
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from trainguard.agent import ShardCorrupt, ShardError, ShardMissing
from trainguard.agent.checkpoint._shards import (
    HostStager,
    capture_rng,
    load_shard,
    restore_rng,
    shard_path,
    uri_to_path,
    write_shard,
)

WEIGHTS = torch.arange(6.0).reshape(2, 3)
STATE = {"w": WEIGHTS, "meta": {"lr": 0.1, "ids": [1, 2]}}


def test_written_shard_reports_its_uri_size_and_digest(tmp_path: Path):
    path = shard_path(tmp_path, "job", 2, 40, 1)
    assert path == tmp_path / "job" / "g000002" / "s0000000040" / "rank00001.pt"
    written = write_shard(path, STATE)
    data = path.read_bytes()
    assert uri_to_path(written.uri) == path
    assert written.uri.startswith("file:///")
    assert written.size_bytes == len(data)
    assert written.digest == f"sha256:{hashlib.sha256(data).hexdigest()}"
    # The SHA-256 covers every byte: torch's zip CRC32, never checked by torch.load, is skipped.
    assert {i.CRC for i in zipfile.ZipFile(path).infolist()} == {0}
    assert os.listdir(path.parent) == [path.name]  # no temporary file left behind
    loaded = load_shard(written.uri, written.digest)
    assert torch.equal(loaded["w"], WEIGHTS)
    assert loaded["meta"] == STATE["meta"]


def test_the_shard_appears_only_complete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "s" / "rank00000.pt"
    seen: list[bool] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        seen.append(path.exists())
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write_shard(path, STATE)
    # The file's fsync happens while only the temporary name exists; the folder's after.
    assert seen == [False, True]


def test_a_failed_write_leaves_the_previous_shard_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    path = tmp_path / "rank00000.pt"
    before = write_shard(path, STATE)

    def broken_save(obj: object, f: object) -> None:
        f.write(b"partial bytes")  # type: ignore[attr-defined]
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="No space left"):
        write_shard(path, STATE)
    assert os.listdir(tmp_path) == [path.name]
    assert f"sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}" == before.digest


def test_a_corrupt_shard_is_refused_before_deserialization(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    written = write_shard(tmp_path / "rank00000.pt", STATE)
    path = uri_to_path(written.uri)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.load must not see an unverified shard")

    monkeypatch.setattr(torch, "load", no_load)
    with pytest.raises(ShardCorrupt, match=f"expected {written.digest}"):
        load_shard(written.uri, written.digest)


def test_missing_and_foreign_shards(tmp_path: Path):
    digest = "sha256:" + "0" * 64
    with pytest.raises(ShardMissing):
        load_shard((tmp_path / "gone.pt").as_uri(), digest)
    with pytest.raises(ShardError, match="only file:// URIs"):
        load_shard("s3://bucket/shard.pt", digest)


def test_verified_bytes_holding_arbitrary_objects_are_still_refused(tmp_path: Path):
    path = tmp_path / "evil.pt"
    torch.save({"path": Path("/")}, path)  # pickles a class: weights_only refuses it
    digest = f"sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}"
    with pytest.raises(ShardError, match="cannot be loaded"):
        load_shard(path.as_uri(), digest)


def test_rng_states_survive_a_shard_round_trip_exactly(tmp_path: Path):
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    np.random.standard_normal()  # leaves a cached Gaussian in NumPy's legacy state
    written = write_shard(tmp_path / "rng.pt", {"rng": capture_rng()})
    expected = (torch.rand(4), random.random(), np.random.standard_normal(3))
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    restore_rng(load_shard(written.uri, written.digest)["rng"])
    assert torch.equal(torch.rand(4), expected[0])
    assert random.random() == expected[1]
    assert np.array_equal(np.random.standard_normal(3), expected[2])


def test_host_copy_is_independent_of_the_training_state():
    weights = torch.zeros(3)
    groups = [{"lr": 0.1, "params": (0, 1)}]
    copy = HostStager().stage({"w": weights, "groups": groups, "n": 5})
    weights.add_(1.0)
    groups[0]["lr"] = 0.2
    assert torch.equal(copy["w"], torch.zeros(3))
    assert copy["groups"] == [{"lr": 0.1, "params": (0, 1)}]
    assert isinstance(copy["groups"][0]["params"], tuple)
    assert copy["n"] == 5


def test_the_stager_reuses_its_buffers_while_the_shapes_stay():
    stager = HostStager()
    first = stager.stage({"w": torch.ones(4), "b": [torch.zeros(2, dtype=torch.int64)]})
    second = stager.stage({"w": torch.full((4,), 2.0), "b": [torch.ones(2, dtype=torch.int64)]})
    assert second["w"].data_ptr() == first["w"].data_ptr()  # no new allocation
    assert torch.equal(second["w"], torch.full((4,), 2.0))
    assert torch.equal(second["b"][0], torch.ones(2, dtype=torch.int64))
    third = stager.stage({"w": torch.ones(5)})  # new shapes: new buffers
    assert third["w"].shape == (5,)
    assert torch.equal(second["w"], torch.full((4,), 2.0))  # the old copy is not touched


def test_leaves_that_can_change_are_copied_and_scalars_are_kept():
    import numpy as np

    class Counter:
        def __init__(self) -> None:
            self.n = 1

    counter, array, blob = Counter(), np.zeros(2), bytearray(b"ab")
    sub = torch.zeros(2).as_subclass(_Marked)
    copy = HostStager().stage(
        {"c": counter, "a": array, "b": blob, "sub": sub, "dtype": torch.float16, "s": "x"}
    )
    counter.n, array[0], blob[0] = 2, 7.0, ord("z")
    sub.add_(1.0)
    assert (copy["c"].n, copy["a"][0], bytes(copy["b"])) == (1, 0.0, b"ab")
    assert type(copy["sub"]) is _Marked
    assert torch.equal(copy["sub"], torch.zeros(2))
    assert copy["dtype"] is torch.float16
    assert copy["s"] == "x"


class _Marked(torch.Tensor):
    """A tensor subclass the stager knows nothing of (cloned)."""


def test_namedtuples_and_sparse_tensors_are_staged_too():
    from collections import namedtuple

    pair = namedtuple("pair", "a b")
    dense, sparse = torch.ones(2), torch.eye(3).to_sparse()
    top = torch.max(torch.tensor([[1.0, 3.0], [2.0, 0.0]]), dim=1)  # a torch.return_types
    copy = HostStager().stage({"p": pair(dense, 5), "s": sparse, "top": top})
    dense.add_(1.0)
    sparse.values().add_(1.0)
    assert type(copy["p"]) is pair
    assert torch.equal(copy["p"].a, torch.ones(2))
    assert copy["p"].b == 5
    assert torch.equal(copy["s"].to_dense(), torch.eye(3))
    assert type(copy["top"]) is type(top)
    assert torch.equal(copy["top"].values, torch.tensor([3.0, 2.0]))


def test_state_a_restore_could_not_load_is_refused_at_the_write(tmp_path):

    with pytest.raises(ShardError, match=r"cannot load .*numpy"):
        write_shard(tmp_path / "s.pt", {"a": np.zeros(2)})
    assert list(tmp_path.iterdir()) == []  # nothing left behind
    written = write_shard(tmp_path / "t.pt", {"w": torch.ones(2), "n": [1, "x", {"k": 2.0}]})
    assert load_shard(written.uri, written.digest)["n"] == [1, "x", {"k": 2.0}]
