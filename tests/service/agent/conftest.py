"""Fixtures of the agent tests: agents on a real embedded bus in ``tmp_path``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.jobbus import JOB
from trainguard.agent import Agent, AgentConfig


@pytest.fixture
def bus_url(tmp_path: Path) -> str:
    """URL of a fresh embedded bus file in ``tmp_path``."""
    return f"sqlite://{tmp_path / 'bus.db'}"


@pytest.fixture
def make_agent(tmp_path: Path, bus_url: str) -> Callable[..., Agent]:
    """Builds unentered agents of job :data:`JOB` on ``bus_url``, checkpointing under
    ``tmp_path / "checkpoints"``, heartbeating every 50 ms; ``settings`` override any
    :class:`AgentConfig` field. The process environment is not read."""

    def make(**settings: Any) -> Agent:
        defaults: dict[str, Any] = {
            "job_id": JOB,
            "bus_url": bus_url,
            "checkpoint_dir": tmp_path / "checkpoints",
            "heartbeat_interval_s": 0.05,
            "host": "test-host",
        }
        return Agent(AgentConfig.resolve(env={}, **{**defaults, **settings}))

    return make
