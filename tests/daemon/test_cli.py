"""The ``trainguard`` command line as users run it: separate processes, real signals."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainguard.daemon.cli import app

CLI = [sys.executable, "-m", "trainguard.daemon.cli"]
REPO = Path(__file__).resolve().parents[2]


COMMANDS = {
    "version", "daemon", "run", "demo", "status", "report", "replay", "export", "import", "stop",
    "bus", "checkpoints", "keys", "snapshots",
}  # fmt: skip


def test_help_lists_exactly_the_commands_and_each_one_has_help() -> None:
    runner = CliRunner()
    out = runner.invoke(app, ["--help"], env={"COLUMNS": "200"}).output
    listed = {m.group(1) for m in re.finditer(r"^│ ([a-z]+) {2,}\S", out, re.MULTILINE)}
    assert listed == COMMANDS, out
    for command in sorted(COMMANDS):
        result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (command, result.output)
        assert f" {command} " in result.output.split("\n", 3)[1], result.output


def test_daemon_logs_json_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [*CLI, "daemon", "--bus", f"sqlite://{tmp_path / 'bus.db'}", "--metrics-port", "0"],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    lines = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        lines.append(json.loads(line))  # every line is one JSON object
        if lines[-1]["event"] == "daemon ready":
            break
    else:
        proc.kill()
        pytest.fail(f"no 'daemon ready' in {lines}")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    tail = [json.loads(line) for line in proc.stderr.read().splitlines()]
    assert tail[-1]["event"] == "daemon stopped"


def test_an_unreachable_kafka_is_a_clear_error_not_a_hang() -> None:
    began = time.monotonic()
    done = subprocess.run(
        [*CLI, "bus", "check", "--bus", "kafka://127.0.0.1:9", "--timeout", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "Kafka at 127.0.0.1:9" in done.stderr
    assert time.monotonic() - began < 30


def test_a_bad_bus_url_is_a_clear_error() -> None:
    done = subprocess.run(
        [*CLI, "bus", "check", "--bus", "redis://x"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "scheme must be sqlite or kafka" in done.stderr


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One reference-run cache for the demo tests of this module: they train the same job
    uninterrupted (seed 3, 120 steps), which is worth doing once."""
    return tmp_path_factory.mktemp("demo-cache")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_demo_recovers_exactly(tmp_path: Path, demo_cache: Path) -> None:
    """The README's first command: one restore, bitwise-equal parameters, exact ledger."""
    done = subprocess.run(
        [
            *CLI,
            "demo",
            "--seed",
            "3",
            "--steps",
            "120",
            "--workdir",
            str(tmp_path / "work"),
            "--cache-dir",
            str(demo_cache),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "COLUMNS": "200"},
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "bitwise equal" in done.stdout
    assert "exact: nothing skipped, nothing repeated" in done.stdout


def test_a_bad_demo_fault_is_a_clear_error_before_anything_starts(tmp_path: Path) -> None:
    done = subprocess.run(
        [*CLI, "demo", "--fault", "nan@step=5", "--workdir", str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "nan@step=5" in done.stderr, done.stderr
    assert "missing rank" in done.stderr, done.stderr
    assert not (tmp_path / "work").exists()  # nothing was started


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_demo_rehearses_a_nan_restored_in_process(tmp_path: Path, demo_cache: Path) -> None:
    """``trainguard demo --fault``: a NaN loss on rank 1 is detected and restored in process,
    and the job still ends bitwise equal to the uninterrupted run."""
    done = subprocess.run(
        [
            *CLI,
            "demo",
            "--seed",
            "3",
            "--steps",
            "120",
            "--fault",
            "nan@step=50,rank=1",
            "--step-sleep",
            "0.1",
            "--workdir",
            str(tmp_path / "work"),
            "--cache-dir",
            str(demo_cache),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "COLUMNS": "200"},
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "nan_loss" in done.stdout
    assert "in process at step" in done.stdout
    assert "bitwise equal" in done.stdout
