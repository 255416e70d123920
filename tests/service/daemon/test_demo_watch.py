"""``trainguard demo`` watching its job: it stops, saying why, when its own daemon dies (before,
it waited for a job nobody would restore, printing nothing)."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from trainguard.agent.bus import sqlite_url
from trainguard.daemon.demo._demo import DaemonDied, _watch
from trainguard.daemon.demo._harness import stop_process

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


def _python(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


async def test_the_watch_ends_when_the_daemon_dies_before_the_supervisor(tmp_path: Path) -> None:
    supervisor = _python("import time; time.sleep(120)")
    daemon = _python("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    console = Console(file=io.StringIO())
    try:
        with pytest.raises(DaemonDied, match=r"daemon exited \(signal 9\)"):
            await _watch(sqlite_url(tmp_path / "bus.db"), "t.", 10, supervisor, daemon, console)
        assert supervisor.poll() is None  # the caller stops it
    finally:
        stop_process(supervisor)
        stop_process(daemon)


async def test_the_watch_ends_quietly_when_the_supervisor_ends_first(tmp_path: Path) -> None:
    supervisor = _python("pass")
    daemon = _python("import time; time.sleep(120)")
    console = Console(file=io.StringIO())
    try:
        supervisor.wait()
        sent = await _watch(sqlite_url(tmp_path / "bus.db"), "t.", 10, supervisor, daemon, console)
        assert sent == {}
    finally:
        stop_process(daemon)
