"""AgentConfig's default bus across processes: parties started in different folders, neither
naming a bus, meet on the same one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_every_party_started_anywhere_defaults_to_the_same_bus(tmp_path: Path) -> None:
    """A daemon started in one folder and a supervisor (or a worker's agent) in another meet
    on the same bus when neither names one."""
    code = (
        "from trainguard.agent import AgentConfig; from trainguard.daemon.service._settings import "
        "load_daemon_config; print(AgentConfig.resolve(env={}, job_id='j').bus_url, "
        "load_daemon_config(None).bus.url)"
    )
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    env.pop("TRAINGUARD_BUS", None)
    urls = set()
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        done = subprocess.run(
            [sys.executable, "-P", "-c", code],
            cwd=tmp_path / folder,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        urls.update(done.stdout.split())
    assert urls == {f"sqlite://{tmp_path}/state/trainguard/bus.db"}
