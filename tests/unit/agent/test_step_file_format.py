"""The step file through which an agent tells its supervisor the last step it completed: what
is recorded is read back, and a missing or foreign file holds no step. Agents writing it are
tested in ``tests/service/agent/test_step_file.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.agent.checkpoint._step_file import StepRecorder, read_step_file, reset_step_file


def test_a_recorded_step_is_read_back_and_a_reset_file_holds_none(tmp_path: Path) -> None:
    path = tmp_path / "rank0.step"
    reset_step_file(path)
    assert read_step_file(path) is None
    recorder = StepRecorder(path)
    recorder.record(12)
    recorder.record(2**62)
    assert read_step_file(path) == 2**62  # visible at once: the mapping is shared
    recorder.close()
    recorder.close()
    recorder.record(3)  # closed: a no-op
    assert read_step_file(path) == 2**62
    reset_step_file(path)
    assert read_step_file(path) is None


def test_a_missing_or_foreign_file_holds_no_step(tmp_path: Path) -> None:
    assert read_step_file(tmp_path / "missing") is None
    foreign = tmp_path / "foreign"
    foreign.write_bytes(b"12")
    assert read_step_file(foreign) is None
    with pytest.raises(ValueError, match="not a step file"):
        StepRecorder(foreign)
