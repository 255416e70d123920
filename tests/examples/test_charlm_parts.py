"""Fast, in-process tests of the charlm example's data, ledger and checkpoints."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import pytest
import torch

from examples.charlm.checkpoint import latest_complete_step, load_checkpoint, save_checkpoint
from examples.charlm.data import ByteWindows
from examples.charlm.ledger import (
    LedgerError,
    LedgerRecord,
    LedgerWriter,
    compare_ledgers,
    effective_samples,
    read_ledger,
)

# --- data ------------------------------------------------------------------------------------


def test_windows_are_slices_of_the_concatenated_files(tmp_path):
    (tmp_path / "b.py").write_bytes(b"hijklmnop")
    (tmp_path / "a.py").write_bytes(b"abcdefg")
    data = ByteWindows.from_files(tmp_path, [tmp_path / "b.py", tmp_path / "a.py"], context=4)
    assert len(data) == 3  # 16 bytes: windows start at 0, 4, 8; the one at 12 lacks a target
    assert [m.path for m in data.manifest] == ["a.py", "b.py"]  # manifest order, not given order
    index, window = data[2]
    assert (index, window.tolist()) == (2, list(b"ijklm"))
    assert data[0][1].tolist() == list(b"abcde")
    with pytest.raises(IndexError):
        data[3]


def test_dataset_version_follows_content(tmp_path):
    (tmp_path / "a.py").write_bytes(b"x = 1\n" * 10)
    before = ByteWindows.from_files(tmp_path, [tmp_path / "a.py"], context=4).version
    (tmp_path / "a.py").write_bytes(b"x = 2\n" * 10)
    after = ByteWindows.from_files(tmp_path, [tmp_path / "a.py"], context=4).version
    assert before != after


def test_stdlib_corpus_is_nonempty_and_versioned():
    data = ByteWindows.from_stdlib(context=64)
    assert len(data) > 10_000
    assert data.version.startswith("sha256:")


# --- ledger ----------------------------------------------------------------------------------


def records(
    generation: int, steps: list[int], world_size: int = 2, shift: int = 0
) -> list[LedgerRecord]:
    return [
        LedgerRecord(generation, step, rank, (100 * step + 10 * rank + shift,))
        for step in steps
        for rank in range(world_size)
    ]


def test_reader_skips_a_torn_last_line_and_writer_cuts_it(tmp_path):
    path = tmp_path / "ledger-rank-0.jsonl"
    with LedgerWriter(path, generation=0, rank=0) as writer:
        writer.record(1, [5, 6])
    with path.open("a") as file:
        file.write('{"generation": 0, "step": 2, "rank": 0, "samp')  # killed mid-write
    assert read_ledger([path]) == [LedgerRecord(0, 1, 0, (5, 6))]
    with LedgerWriter(path, generation=1, rank=0) as writer:
        writer.record(2, [7])
    assert read_ledger([path]) == [LedgerRecord(0, 1, 0, (5, 6)), LedgerRecord(1, 2, 0, (7,))]


def test_reader_rejects_a_corrupt_line_in_the_middle(tmp_path):
    path = tmp_path / "ledger.jsonl"
    path.write_text('{"generation": 0, "step": 1, "rank": 0, "samples": [1]}\nnot json\n')
    with pytest.raises(LedgerError, match=":2:"):
        read_ledger([path])


def test_effective_samples_take_the_latest_generation_that_completed_each_step():
    # Generation 0 completed steps 1-3 and step 4 on rank 0 only; generation 1 restored to 2.
    gen0 = [*records(0, [1, 2, 3]), LedgerRecord(0, 4, 0, (999,))]
    gen1 = records(1, [3, 4, 5], shift=1)
    effective = effective_samples(gen0 + gen1, world_size=2)
    assert sorted(effective) == [1, 2, 3, 4, 5]
    assert effective[2] == {0: (200,), 1: (210,)}
    assert effective[3] == {0: (301,), 1: (311,)}
    assert effective[4] == {0: (401,), 1: (411,)}


def test_compare_ledgers_finds_skipped_and_repeated_samples():
    reference = records(0, [1, 2, 3])
    assert compare_ledgers(reversed(reference), reference, world_size=2).exact
    skipped = [*records(0, [1, 2]), *records(1, [3], shift=1)]
    comparison = compare_ledgers(skipped, reference, world_size=2)
    assert not comparison.exact
    assert set(comparison.missing) == {(3, 0, 300), (3, 1, 310)}
    assert set(comparison.extra) == {(3, 0, 301), (3, 1, 311)}
    repeated = [
        *records(0, [1, 2]),
        LedgerRecord(0, 3, 0, (300, 300)),
        LedgerRecord(0, 3, 1, (310,)),
    ]
    assert dict(compare_ledgers(repeated, reference, world_size=2).extra) == {(3, 0, 300): 1}


def test_one_generation_cannot_record_a_step_twice_differently():
    with pytest.raises(LedgerError, match="two sample lists"):
        effective_samples([LedgerRecord(0, 1, 0, (1,)), LedgerRecord(0, 1, 0, (2,))], world_size=1)


# --- checkpoints -----------------------------------------------------------------------------


def test_checkpoint_round_trip_restores_tensors_and_rng_streams(tmp_path):
    weights = torch.arange(6.0).reshape(2, 3)
    torch.manual_seed(1)
    random.seed(2)
    shard = save_checkpoint(tmp_path, 3, 1, {"w": weights})
    assert shard.size == shard.path.stat().st_size
    expected = (torch.rand(3), random.random())
    torch.manual_seed(99)
    random.seed(99)
    loaded = load_checkpoint(tmp_path, 3, 1)
    assert torch.equal(loaded["w"], weights)
    after = (torch.rand(3), random.random())
    assert torch.equal(after[0], expected[0])
    assert after[1] == expected[1]


def test_checkpoint_load_refuses_arbitrary_objects(tmp_path):
    target = tmp_path / "step-00000001" / "rank-0.pt"
    target.parent.mkdir()
    torch.save({"path": Path("/")}, target)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_checkpoint(tmp_path, 1, 0)


def test_latest_complete_step_needs_every_rank(tmp_path: Path):
    assert latest_complete_step(tmp_path / "missing", world_size=2) is None
    for step, ranks in {5: [0, 1], 10: [0, 1], 15: [0]}.items():
        for rank in ranks:
            save_checkpoint(tmp_path, step, rank, {"step": step})
    (tmp_path / "step-00000015" / ".rank-1.pt.123.tmp").write_bytes(b"torn")
    (tmp_path / "step-20").mkdir()
    assert latest_complete_step(tmp_path, world_size=2) == 10
    assert latest_complete_step(tmp_path, world_size=1) == 15
