"""The ``init_from`` setting of a job started from another job's snapshot: it comes from the
environment, and a bad one is a configuration error. Jobs started from a snapshot on a real
bus are tested in ``tests/service/agent/test_init_from.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.agent import AgentConfig, ConfigError
from trainguard.schemas import DataCursor

A, B = "job-a", "job-b"
CURSOR = DataCursor(data_version="v1", seed=5, epoch=0, offset=80, world_size=1)


def test_the_setting_comes_from_the_environment(tmp_path: Path) -> None:
    env = {"TRAINGUARD_JOB": B, "TRAINGUARD_INIT_FROM": f"{A}/g0/s10"}
    config = AgentConfig.resolve(env=env, bus_url=f"sqlite://{tmp_path / 'bus.db'}")
    assert config.init_from == f"{A}/g0/s10"
    assert config.checkpoint_template(step=1, cursor=CURSOR, pid=1).parent == f"{A}/g0/s10"


@pytest.mark.parametrize(
    ("value", "words"),
    [(f"{B}/g0/s10", "is a snapshot of this job"), ("job-a:10", "parent")],
)
def test_a_bad_setting_is_a_config_error(tmp_path: Path, value: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        AgentConfig.resolve(env={}, job_id=B, init_from=value)
