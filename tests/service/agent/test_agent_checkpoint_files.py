"""Agent.checkpoint_files and Agent.load_files against a real embedded bus: a folder a
framework wrote is announced as an index of its files, and a restore checks every file
before returning the folder; a changed file is reported and never handed on. Commands are
published by hand, as the daemon would."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.support import jobbus as daemon
from tests.support.jobbus import JOB, lifecycles, of_type, read_events
from trainguard.agent import ShardCorrupt, ShardError, digest_files
from trainguard.schemas import Checkpoint, DataCursor

CURSOR = DataCursor(data_version="v1", seed=5, epoch=0, offset=80, world_size=1)


def framework_folder(root: Path) -> Path:
    """A folder as a framework leaves it: a few files of bytes."""
    folder = root / "checkpoint-10"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    (folder / "optimizer.pt").write_bytes(b"adam" * 3000)
    (folder / "rng_state.pth").write_bytes(b"rng" * 10)
    return folder


def committed(make_agent, bus_url: str, folder: Path):
    """Generation 0 announces ``folder`` at step 10; the manifest the daemon would commit."""
    with make_agent() as agent:
        agent.ready(0)
        agent.step(10)
        files = digest_files(folder, [p.name for p in folder.iterdir()])
        agent.checkpoint_files(10, folder, files, cursor=CURSOR).result()
    manifest = daemon.committed_manifest(read_events(bus_url, JOB), JOB, world_size=1)
    assert manifest is not None
    return manifest


def test_the_folder_is_announced_as_a_shard_and_restored_verified(
    make_agent, bus_url, tmp_path: Path
):
    folder = framework_folder(tmp_path / "out")
    torch.manual_seed(1)
    random.seed(2)
    manifest = committed(make_agent, bus_url, folder)
    (event,) = of_type(read_events(bus_url, JOB), Checkpoint)
    assert event.files is None  # an ordinary shard: the index, not the files
    after_save = (torch.rand(2), random.random())

    daemon.publish(bus_url, daemon.restore(JOB, 1, manifest))
    torch.manual_seed(99)
    random.seed(99)
    with make_agent(generation=1) as agent:
        assert agent.load_files(agent.restore_target()) == folder.resolve()
        # the RNG streams of the save are back
        assert torch.equal(torch.rand(2), after_save[0])
        assert random.random() == after_save[1]
    assert not lifecycles(read_events(bus_url, JOB), "error")


def test_a_changed_file_is_reported_with_the_snapshot_and_the_folder_withheld(
    make_agent, bus_url, tmp_path: Path
):
    folder = framework_folder(tmp_path / "out")
    manifest = committed(make_agent, bus_url, folder)
    data = bytearray((folder / "optimizer.pt").read_bytes())
    data[5000] ^= 0x01
    (folder / "optimizer.pt").write_bytes(bytes(data))
    daemon.publish(bus_url, daemon.restore(JOB, 1, manifest))
    with (
        pytest.raises(ShardCorrupt, match=r"optimizer\.pt"),
        make_agent(generation=1) as agent,
    ):
        agent.load_files(agent.restore_target())
    (error,) = lifecycles(read_events(bus_url, JOB), "error")
    assert error.snapshot_id == manifest.snapshot_id
    assert error.message.startswith("ShardCorrupt: checkpoint file")


def test_an_ordinary_shard_is_not_an_index_of_files(make_agent, bus_url):
    with make_agent() as agent:
        agent.ready(0)
        agent.step(10)
        agent.checkpoint(10, {"w": torch.ones(2)}, cursor=CURSOR).result()
    manifest = daemon.committed_manifest(read_events(bus_url, JOB), JOB, world_size=1)
    assert manifest is not None
    daemon.publish(bus_url, daemon.restore(JOB, 1, manifest))
    with pytest.raises(ShardError, match="no index"), make_agent(generation=1) as agent:
        agent.load_files(agent.restore_target())
    (error,) = lifecycles(read_events(bus_url, JOB), "error")
    assert error.snapshot_id == manifest.snapshot_id
