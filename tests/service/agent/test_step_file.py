"""The step file through which an agent tells its supervisor the last step it completed, as a
real agent writes it. The file format on its own: ``tests/unit/agent/test_step_file_format.py``."""

from __future__ import annotations

from pathlib import Path

import structlog

from trainguard.agent import Agent
from trainguard.agent.checkpoint._step_file import read_step_file, reset_step_file


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
