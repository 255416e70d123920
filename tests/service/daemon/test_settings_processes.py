"""The daemon's settings as the commands read them, in processes of their own: a bad value is
printed and the command exits 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    "command",
    [["daemon"], ["status"], ["report", "job"], ["bus", "check"], ["snapshots", "list"]],
)
def test_the_commands_print_a_bad_value_and_exit_2(tmp_path: Path, command: list[str]) -> None:
    path = tmp_path / "d.toml"
    path.write_text('[machine]\nheartbeat_timeout_s = "10"\n')
    # A process of its own: `daemon` configures logging onto the stderr it runs with, which
    # CliRunner would close under every later test of this process.
    done = subprocess.run(
        [sys.executable, "-m", "trainguard.daemon.cli", *command, "--config", str(path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "[machine] heartbeat_timeout_s: expected a number of seconds" in done.stderr
