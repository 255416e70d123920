"""The integrations' pure parts: the data cursor of a step, which rank an RNG file belongs
to; and the agent's digests and checks of a framework's checkpoint files."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.agent import ShardCorrupt, ShardError, ShardMissing, digest_files
from trainguard.agent.checkpoint._files import files_index, index_files, verify_files
from trainguard.integrations._folder import rank_of
from trainguard.integrations._position import StepPosition

POSITION = StepPosition(data_version="v1", seed=7, steps_per_epoch=25, global_batch=8, world_size=2)


@pytest.mark.parametrize(
    ("step", "epoch", "offset"), [(0, 0, 0), (1, 0, 8), (24, 0, 192), (25, 1, 0), (60, 2, 80)]
)
def test_a_steps_cursor_counts_whole_epochs_and_the_samples_of_the_epochs_steps(
    step: int, epoch: int, offset: int
) -> None:
    cursor = POSITION.cursor(step)
    assert (cursor.epoch, cursor.offset) == (epoch, offset)
    assert (cursor.data_version, cursor.seed, cursor.world_size) == ("v1", 7, 2)


def test_a_position_refuses_empty_epochs_batches_and_negative_steps() -> None:
    with pytest.raises(ValueError, match="steps_per_epoch"):
        StepPosition(data_version="v", seed=0, steps_per_epoch=0, global_batch=8, world_size=1)
    with pytest.raises(ValueError, match="global_batch"):
        StepPosition(data_version="v", seed=0, steps_per_epoch=1, global_batch=0, world_size=1)
    with pytest.raises(ValueError, match="negative"):
        POSITION.cursor(-1)


@pytest.mark.parametrize(
    ("name", "rank"),
    [
        ("rng_state_0.pth", 0),
        ("rng_state_12.pth", 12),
        ("random_states_3.pkl", 3),
        ("rng_state.pth", None),
        ("model.safetensors", None),
        ("optimizer.pt", None),
        ("rng_state_1.pth.tmp", None),
    ],
)
def test_only_per_rank_rng_files_belong_to_a_rank(name: str, rank: int | None) -> None:
    assert rank_of(name) == rank


def test_files_verify_as_digested_and_a_changed_byte_or_a_missing_file_is_caught(
    tmp_path: Path,
) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"weights" * 100)
    (tmp_path / "optimizer.pt").write_bytes(b"moments" * 50)
    files = digest_files(tmp_path, ["optimizer.pt", "model.safetensors"])
    assert [f.name for f in files] == ["model.safetensors", "optimizer.pt"]
    assert files[0].size_bytes == 700
    folder, read_back = index_files(files_index(tmp_path, files), "shard")
    assert (folder, read_back) == (tmp_path.resolve(), files)
    verify_files(folder, read_back)

    data = bytearray((tmp_path / "optimizer.pt").read_bytes())
    data[10] ^= 1
    (tmp_path / "optimizer.pt").write_bytes(bytes(data))
    with pytest.raises(ShardCorrupt, match=r"optimizer\.pt"):
        verify_files(folder, read_back)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ShardMissing, match=r"model\.safetensors"):
        verify_files(folder, read_back)


@pytest.mark.parametrize("index", [None, {"folder": "/x"}, {"folder": "/x", "files": [["a"]]}])
def test_a_shard_without_a_proper_index_is_an_error(index: object) -> None:
    with pytest.raises(ShardError, match="no index"):
        index_files(index, "snapshot j/g0/s10")
