"""The step file through which an agent tells its supervisor the last step it completed."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog

from trainguard.agent import Agent
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


def test_the_agent_records_each_step_and_the_step_it_starts_from(tmp_path: Path) -> None:
    path = tmp_path / "rank0.step"
    reset_step_file(path)
    with Agent(
        job_id="steps", bus_url=f"sqlite:///{tmp_path}/bus.db", checkpoint_dir=tmp_path,
        step_file=path,
    ) as agent:  # fmt: skip
        agent.ready(20)
        assert read_step_file(path) == 20
        for step in range(21, 26):
            agent.step(step, loss=1.0)
        assert read_step_file(path) == 25
        agent.step(26.0)  # type: ignore[arg-type]  # not an int: not recorded, no exception
        assert read_step_file(path) == 25
    assert read_step_file(path) == 25


def test_an_unusable_step_file_is_logged_and_training_goes_on(tmp_path: Path) -> None:
    with structlog.testing.capture_logs() as logs:
        agent = Agent(
            job_id="steps", bus_url=f"sqlite:///{tmp_path}/bus.db", checkpoint_dir=tmp_path,
            step_file=tmp_path / "missing",
        )  # fmt: skip
    with agent:
        agent.ready(0)
        agent.step(1)
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["step file not used"]
