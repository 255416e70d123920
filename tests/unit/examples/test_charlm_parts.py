"""Fast, in-process tests of the charlm example's parts: data, ledger, pacing. The example
trained for real: ``tests/scenarios/test_charlm_in_process.py`` and
``tests/scenarios/test_charlm_runs.py``."""

from __future__ import annotations

import pytest

from examples.charlm.data import ByteWindows
from examples.charlm.ledger import (
    LedgerError,
    LedgerRecord,
    LedgerWriter,
    compare_ledgers,
    effective_samples,
    read_ledger,
)
from examples.charlm.train import parse_args, remaining_period

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


def test_a_step_of_accumulated_batches_is_all_its_records_and_a_repeated_record_counts():
    # Gradient accumulation: one record per batch of the step (the HF Trainer's example).
    accumulated = [LedgerRecord(0, 1, 0, (1, 2)), LedgerRecord(0, 1, 0, (3, 4))]
    assert effective_samples(accumulated, world_size=1) == {1: {0: (1, 2, 3, 4)}}
    reference = [LedgerRecord(0, 1, 0, (1, 2, 3, 4))]
    assert compare_ledgers(accumulated, reference, world_size=1).exact
    repeated = [*accumulated, LedgerRecord(0, 1, 0, (3, 4))]
    assert dict(compare_ledgers(repeated, reference, world_size=1).extra) == {
        (1, 0, 3): 1,
        (1, 0, 4): 1,
    }


# --- pacing ----------------------------------------------------------------------------------


def test_a_step_sleeps_only_what_its_compute_left_of_the_period():
    assert remaining_period(0.5, began=10.0, now=10.2) == pytest.approx(0.3)
    assert remaining_period(0.5, began=10.0, now=10.7) == 0.0  # slow compute: no extra sleep
    assert remaining_period(0.0, began=10.0, now=10.0) == 0.0  # no period: never sleeps


def test_step_period_option():
    config, _ = parse_args(["--out", "x", "--step-period", "0.25"])
    assert config.step_period == 0.25
    assert parse_args(["--out", "x"])[0].step_period == 0.0
    with pytest.raises(SystemExit):
        parse_args(["--out", "x", "--step-period", "-1"])
