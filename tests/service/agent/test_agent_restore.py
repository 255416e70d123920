"""The restore protocol of a restarted process, against a real embedded bus: the ``restore``
command of its generation names the target; ``load`` verifies the shard and puts back the RNG
streams; ``ready`` acknowledges and waits for ``resume``. Commands are published by hand, as
the daemon would."""

from __future__ import annotations

import random
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import structlog
import torch

from tests.support import jobbus as daemon
from tests.support.jobbus import JOB, lifecycles, read_events
from trainguard.agent import (
    Agent,
    AgentError,
    JobAborted,
    RestoreTimeout,
    ShardCorrupt,
    ShardMissing,
    StaleGeneration,
)
from trainguard.agent.checkpoint import store_manifest
from trainguard.agent.checkpoint._shards import uri_to_path
from trainguard.schemas import (
    MANIFEST_DIR,
    DataCursor,
    Manifest,
    sha256_digest,
    snapshot_ref,
    split_manifest,
)

CURSOR = DataCursor(data_version="v1", seed=5, epoch=0, offset=80, world_size=1)


@dataclass(frozen=True)
class Saved:
    """A committed snapshot of step 10 and the random numbers drawn right after saving it."""

    manifest: Manifest
    torch_draw: torch.Tensor
    python_draw: float
    numpy_draw: np.ndarray


@pytest.fixture
def saved(make_agent: Callable[..., Agent], bus_url: str) -> Saved:
    """Generation 0 trains to step 10 and checkpoints it; the manifest is built from its
    checkpoint event."""
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    with make_agent() as agent:
        agent.ready(0)
        agent.step(10)
        agent.checkpoint(10, {"w": torch.arange(3.0), "extra": {"n": 4}}, cursor=CURSOR)
        draws = (torch.rand(3), random.random(), np.random.rand(3))
    manifest = daemon.committed_manifest(read_events(bus_url, JOB), JOB, world_size=1)
    assert manifest is not None
    return Saved(manifest, *draws)


def scramble_rng() -> None:
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)


def test_generation_zero_starts_fresh_without_waiting(make_agent, bus_url):
    with make_agent() as agent:
        assert agent.restore_target() is None
        agent.ready(0)
    assert not lifecycles(read_events(bus_url, JOB), "restored")


def test_restore_verifies_the_shard_and_puts_back_every_rng_stream(make_agent, bus_url, saved):
    daemon.publish(bus_url, daemon.restore(JOB, 1, saved.manifest))
    scramble_rng()
    with make_agent(generation=1) as agent:
        target = agent.restore_target()
        assert target is not None
        assert target.manifest() == saved.manifest
        state = agent.load(target)
        assert torch.rand(3).equal(saved.torch_draw)
        assert random.random() == saved.python_draw
        assert np.array_equal(np.random.rand(3), saved.numpy_draw)
        assert set(state) == {"w", "extra"}  # what was given to checkpoint(), no more
        assert torch.equal(state["w"], torch.arange(3.0))
        assert state["extra"] == {"n": 4}


def test_a_restore_without_a_target_means_start_from_scratch(make_agent, bus_url):
    daemon.publish(bus_url, daemon.restore(JOB, 1, None))
    with make_agent(generation=1) as agent:
        assert agent.restore_target() is None


def test_older_generations_are_ignored_while_waiting(make_agent, bus_url, saved):
    with make_agent(generation=2) as agent:
        daemon.publish(bus_url, daemon.restore(JOB, 1, None))
        later = daemon.restore(JOB, 2, saved.manifest)
        threading.Timer(0.3, daemon.publish, (bus_url, later)).start()
        target = agent.restore_target(timeout_s=10.0)
        assert target is not None
        assert target.manifest() == saved.manifest
        # At least once: a command published while the link connects may be read twice.
        assert agent.stats.commands_ignored >= 1


def test_ready_acknowledges_and_waits_for_resume(make_agent, bus_url, saved):
    daemon.publish(bus_url, daemon.restore(JOB, 1, saved.manifest))
    with make_agent(generation=1) as agent:
        target = agent.restore_target()
        assert target is not None
        agent.load(target)
        helper = daemon.after_acks(bus_url, 1, range(1), daemon.resume(JOB, 1, step=10))
        agent.ready(10, cursor=target.cursor)
        helper.join()
        agent.step(11)
    (restored,) = lifecycles(read_events(bus_url, JOB), "restored")
    assert (restored.generation, restored.step, restored.rank) == (1, 10, 0)
    assert restored.cursor == CURSOR
    assert restored.snapshot_id == saved.manifest.snapshot_id == f"{JOB}/g0/s10"


@pytest.mark.parametrize(
    ("command", "error", "match"),
    [
        (daemon.abort(JOB, 1, "too many restores"), JobAborted, "too many restores"),
        (daemon.restore(JOB, 2, None), StaleGeneration, "generation 2 already"),
    ],
)
def test_the_daemon_can_end_the_wait_for_resume(make_agent, bus_url, saved, command, error, match):
    daemon.publish(bus_url, daemon.restore(JOB, 1, saved.manifest))
    helper = daemon.after_acks(bus_url, 1, range(1), command)

    def restart() -> None:
        with make_agent(generation=1) as agent:
            agent.restore_target()
            agent.ready(10)  # without the cursor: warned, and never resumed by a daemon

    with structlog.testing.capture_logs() as logs, pytest.raises(error, match=match):
        restart()
    helper.join()
    [warned] = [e for e in logs if e["event"].startswith("restore acknowledged without")]
    assert (warned["log_level"], warned["step"]) == ("warning", 10)
    # The daemon's own orders are not reported back to it as errors.
    assert not lifecycles(read_events(bus_url, JOB), "error")


def test_missing_commands_time_out(make_agent, bus_url):
    with make_agent(generation=1, restore_timeout_s=0.2, resume_timeout_s=0.2) as agent:
        with pytest.raises(RestoreTimeout, match="restore command of generation 1"):
            agent.restore_target()
        with pytest.raises(RestoreTimeout, match="resume command of generation 1"):
            agent.ready(0)


def test_a_corrupt_shard_is_reported_and_never_deserialized(
    make_agent, bus_url, saved, monkeypatch: pytest.MonkeyPatch
):
    path = uri_to_path(saved.manifest.shards[0].uri)
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    daemon.publish(bus_url, daemon.restore(JOB, 1, saved.manifest))

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.load must not see an unverified shard")

    monkeypatch.setattr(torch, "load", no_load)
    with pytest.raises(ShardCorrupt), make_agent(generation=1) as agent:
        agent.load(agent.restore_target())
    (error,) = lifecycles(read_events(bus_url, JOB), "error")  # reported once, not again on exit
    assert (error.generation, error.step) == (1, 10)
    assert error.snapshot_id == saved.manifest.snapshot_id
    assert error.message.startswith("ShardCorrupt: shard file://")


def test_a_manifest_without_this_ranks_shard_is_reported(make_agent, bus_url, saved):
    daemon.publish(bus_url, daemon.restore(JOB, 1, saved.manifest))
    with (
        pytest.raises(ShardMissing, match="no shard for rank 1"),
        make_agent(generation=1, rank=1, world_size=2) as agent,
    ):
        agent.load(agent.restore_target())
    (error,) = lifecycles(read_events(bus_url, JOB), "error")
    assert error.snapshot_id == saved.manifest.snapshot_id


def test_restore_calls_need_an_entered_agent(make_agent, saved):
    agent = make_agent(generation=1)
    for call in (agent.restore_target, lambda: agent.load(saved.manifest), lambda: agent.ready(0)):
        with pytest.raises(AgentError, match="inside 'with Agent"):
            call()


# -- the target's manifest: named by digest, stored beside the checkpoint -----------------------


def manifest_dir(saved: Saved) -> Path:
    """The ``trainguard/`` folder holding the stored manifest of ``saved``'s snapshot."""
    return uri_to_path(saved.manifest.shards[0].uri).parent / MANIFEST_DIR


def test_the_command_names_the_stored_manifest_by_digest(make_agent, bus_url, saved):
    command = daemon.restore(JOB, 1, saved.manifest)
    assert command.target == snapshot_ref(saved.manifest)
    head = manifest_dir(saved) / "manifest.json"
    assert command.target is not None
    assert sha256_digest(head.read_bytes()) == command.target.manifest_digest
    assert sorted(p.name for p in manifest_dir(saved).iterdir()) == [
        "manifest.json",
        "part-00000.json",
    ]


def refused_restore(make_agent, bus_url, error: type[Exception], match: str) -> str:
    """Start generation 1, whose ``restore_target`` must raise ``error``; return the message of
    the lifecycle error it reported (naming the snapshot, so the daemon restores an older
    one), having checked that ``torch.load`` never ran."""
    with pytest.MonkeyPatch.context() as patch, make_agent(generation=1) as agent:
        patch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load ran"))
        with pytest.raises(error, match=match):
            agent.restore_target()
    (reported,) = lifecycles(read_events(bus_url, JOB), "error")
    assert (reported.generation, reported.step) == (1, 10)
    assert reported.snapshot_id == f"{JOB}/g0/s10"
    return reported.message or ""


def test_a_forged_head_is_refused_before_it_is_decoded(make_agent, bus_url, saved):
    daemon.publish(bus_url, daemon.restore(JOB, 1, saved.manifest))
    head = manifest_dir(saved) / "manifest.json"
    forged = head.read_bytes().replace(b'"step":10', b'"step":11')
    assert forged != head.read_bytes()
    head.write_bytes(forged)
    message = refused_restore(make_agent, bus_url, ShardCorrupt, r"manifest of .* has digest")
    assert message.startswith("ShardCorrupt: manifest of")


def test_a_head_replaced_by_a_huge_file_is_refused_without_reading_it_whole(
    make_agent, bus_url, saved, monkeypatch
):
    """A head grown to 64 MiB (a sparse file: anyone who can write to storage): each rank
    reads no more than the largest head can be, then refuses it by its digest (it read the
    whole file first: a large enough one ended every rank out of memory, and the snapshot
    was never reported bad)."""
    daemon.publish(bus_url, daemon.restore(JOB, 1, saved.manifest))
    head = manifest_dir(saved) / "manifest.json"
    with head.open("r+b") as f:
        f.truncate(64 << 20)
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail(f"read whole: {self}"))
    refused_restore(make_agent, bus_url, ShardCorrupt, r"manifest of .* has digest")


def test_a_stale_head_at_the_snapshots_place_is_refused(make_agent, bus_url, saved):
    """The command names one manifest; the folder holds another of the same snapshot (written
    later, or left by an earlier commit): its digest is not the one named."""
    daemon.publish(bus_url, daemon.restore(JOB, 1, saved.manifest))
    store_manifest(split_manifest(replace(saved.manifest, ts=saved.manifest.ts + 1)))
    refused_restore(make_agent, bus_url, ShardCorrupt, "has digest")


def test_a_part_swapped_in_from_another_snapshot_is_refused(make_agent, bus_url, saved):
    other = replace(
        saved.manifest,
        shards=(replace(saved.manifest.shards[0], digest="sha256:" + "0" * 64),),
    )
    daemon.publish(bus_url, daemon.restore(JOB, 1, saved.manifest))
    swapped = split_manifest(other).parts[0]
    (manifest_dir(saved) / "part-00000.json").write_bytes(swapped)
    with make_agent(generation=1) as agent:
        target = agent.restore_target()  # the head is right: only the part is wrong
        assert target is not None
        with pytest.raises(ShardCorrupt, match=r"manifest part .* has digest"):
            agent.load(target)
    (reported,) = lifecycles(read_events(bus_url, JOB), "error")
    assert reported.snapshot_id == saved.manifest.snapshot_id


def test_without_a_stored_head_the_whole_manifest_on_the_bus_is_used(make_agent, bus_url, saved):
    daemon.publish(bus_url, daemon.restore(JOB, 1, saved.manifest))
    shutil.rmtree(manifest_dir(saved))
    daemon.publish(bus_url, replace(saved.manifest, ts=1))  # another manifest: not taken
    daemon.publish(bus_url, saved.manifest)
    with make_agent(generation=1) as agent:
        target = agent.restore_target()
        assert target is not None
        assert target.manifest() == saved.manifest
        assert torch.equal(agent.load(target)["w"], torch.arange(3.0))


def test_a_bus_manifest_that_is_not_the_named_one_is_refused(make_agent, bus_url, saved):
    daemon.publish(bus_url, daemon.restore(JOB, 1, saved.manifest))
    shutil.rmtree(manifest_dir(saved))
    daemon.publish(bus_url, replace(saved.manifest, ts=1))
    refused_restore(make_agent, bus_url, ShardCorrupt, "on the bus is not the one")


def test_a_manifest_found_nowhere_is_reported_missing(make_agent, bus_url, saved):
    daemon.publish(bus_url, daemon.restore(JOB, 1, saved.manifest))
    shutil.rmtree(manifest_dir(saved))
    message = refused_restore(make_agent, bus_url, ShardMissing, "does not exist")
    assert "manifest.json" in message
