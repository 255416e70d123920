"""deploy/systemd/trainguard-daemon.service: ``systemd-analyze verify`` accepts it, its
``trainguard daemon`` command line parses, and a refused daemon (exit 2) is not restarted."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.service.deploy.support import DEPLOY, parse_cli

UNIT = DEPLOY / "systemd" / "trainguard-daemon.service"
REFUSED = 2
"""`trainguard daemon`'s exit status for a bad setting, a bus that cannot work or another daemon
serving the embedded bus file (daemon/cli.py, typer.Exit(2)); tests/service/daemon/test_embedded_lock.py
and tests/service/daemon/test_bus_wait.py run it. A bus that is away is waited for, never an exit."""


def unit() -> dict[str, dict[str, list[str]]]:
    """Section -> key -> values (systemd keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = defaultdict(list)
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), defaultdict(list))
            continue
        key, _, value = line.partition("=")
        current[key].append(value)
    return sections


def test_the_daemon_command_line_parses() -> None:
    [exec_start] = unit()["Service"]["ExecStart"]
    argv = shlex.split(exec_start)
    assert Path(argv[0]).name == "trainguard"
    assert argv[1] == "daemon"
    options = parse_cli("daemon", argv[2:])
    assert options["config"] is not None


def test_failures_restart_but_a_refusal_does_not() -> None:
    service = unit()["Service"]
    assert service["Restart"] == ["on-failure"]
    assert str(REFUSED) in " ".join(service["RestartPreventExitStatus"]).split()
    assert service["User"] != ["root"]
    assert service["NoNewPrivileges"] == ["yes"]
    assert service["ProtectSystem"] == ["strict"]
    assert unit()["Unit"]["StartLimitBurst"]  # no restart loop without end


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    """``verify`` also checks that ExecStart's program exists: the copy verified names this
    environment's ``trainguard`` instead of /opt/trainguard's, and is otherwise the same."""
    trainguard = Path(sys.executable).parent / "trainguard"
    assert trainguard.exists()
    copy = tmp_path / UNIT.name
    copy.write_text(UNIT.read_text().replace("/opt/trainguard/bin/trainguard", str(trainguard)))
    done = subprocess.run(
        ["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr  # warnings too (an unknown key, a misplaced one)
