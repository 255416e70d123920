"""``trainguard daemon`` serves /healthz and /metrics: a real process, real HTTP."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support.http_get import http_get

CLI = [sys.executable, "-m", "trainguard.daemon.cli"]

pytestmark = pytest.mark.timeout(120)


def listening_url(log: Path, proc: subprocess.Popen[bytes], timeout_s: float = 30) -> str:
    """The URL the daemon logged in ``metrics server listening``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            entry = json.loads(line)
            if entry["event"] == "metrics server listening":
                return str(entry["url"])
        assert proc.poll() is None, log.read_text()
        time.sleep(0.05)
    raise AssertionError(f"no 'metrics server listening' in {log.read_text()}")


def test_the_daemon_serves_health_and_metrics_on_the_port_it_picked(tmp_path: Path) -> None:
    log = tmp_path / "daemon.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*CLI, "daemon", "--bus", f"sqlite://{tmp_path / 'bus.db'}", "--metrics-port", "0"],
            stderr=out,
        )
    try:
        url = listening_url(log, proc)
        deadline = time.monotonic() + 30
        statuses = []
        while time.monotonic() < deadline:
            status, body = http_get(f"{url}/healthz")
            statuses.append(status)
            if status == 200:
                assert body == "ready\n"
                break
            assert status == 503, body
            assert body.startswith("not ready: ")
            time.sleep(0.05)
        assert statuses[-1] == 200, statuses
        status, text = http_get(f"{url}/metrics")
        assert status == 200
        assert "# TYPE trainguard_incidents_total counter" in text
        assert 'trainguard_restores_total{cause="exited",mode="restart"} 0.0' in text
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{url}/healthz", timeout=5)


def test_a_taken_metrics_port_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                *CLI,
                "daemon",
                "--bus",
                f"sqlite://{tmp_path / 'bus.db'}",
                "--metrics-port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    assert f"port {port} on 127.0.0.1 is taken by another process" in done.stderr
    assert "0 (any free port" in done.stderr
    assert "-1 (no /metrics" in done.stderr
    assert "Traceback" not in done.stderr
    assert "no keys" not in done.stderr  # the error alone, before any other start-up line
    assert not (tmp_path / "bus.db").exists()  # the bus was not touched
