"""The ``trainguard`` command line as users run it: separate processes, real signals."""

from __future__ import annotations

import json
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
COMMANDS = {
    "version", "daemon", "run", "demo", "status", "report", "replay", "export", "import", "stop",
    "bus", "checkpoints", "keys", "snapshots", "sim",
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


def usage_lines() -> dict[str, str]:
    """Each command's (and sub-command's) usage line, from its ``--help``."""
    runner = CliRunner()
    groups = {"bus": ["check"], "checkpoints": ["list", "show", "lineage", "compat", "prune"],
              "keys": ["init", "job", "rotate", "show", "retire"],
              "snapshots": ["list", "show", "verify"]}  # fmt: skip
    found: dict[str, str] = {}
    for command in sorted(COMMANDS):
        for sub in groups.get(command, [""]):
            args = [command, sub] if sub else [command]
            out = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "200"}).output
            [line] = [line for line in out.splitlines() if "Usage:" in line]
            found[" ".join(args)] = line.split(" ".join(args), 1)[1].strip()
    return found


def test_usage_lines_bracket_each_argument_once_and_name_it_in_capitals() -> None:
    """An optional argument shows as ``[JOB]`` (typer adds the brackets: a metavar with its
    own showed ``[[JOB]]``), a required one as ``{JOB}``, named as the help text names it."""
    usage = usage_lines()
    assert usage["status"] == "[OPTIONS] [JOB]"
    assert usage["replay"] == "[OPTIONS] {JOB}"
    assert usage["run"] == "[OPTIONS] {COMMAND}..."
    for command, line in usage.items():
        assert "[[" not in line, (command, line)
        assert "{{" not in line, (command, line)
        arguments = line.removeprefix("[OPTIONS]").split()
        assert all(a.strip("[]{}.").isupper() for a in arguments), (command, line)


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


@pytest.mark.parametrize(
    ("fault", "said"),
    [
        ("nan@step=5", "missing rank"),
        # The last step, 60, can be faulted (a NaN in the last heartbeat interval), not 61.
        ("nan@step=61,rank=1", "the job ends at step 60"),
    ],
)
def test_a_bad_demo_fault_is_a_clear_error_before_anything_starts(
    tmp_path: Path, fault: str, said: str
) -> None:
    done = subprocess.run(
        [*CLI, "demo", "--steps", "60", "--fault", fault, "--workdir", str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert fault.split(",")[0] in done.stderr, done.stderr
    assert said in done.stderr, done.stderr
    assert not (tmp_path / "work").exists()  # nothing was started


def options_of(command: list[str]) -> dict[str, str]:
    """The options ``trainguard COMMAND --help`` lists, each with its help text."""
    out = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "300"}).output
    found = re.finditer(r"^│ (--[a-z-]+)(?: +-\w)? +(?:<[^>]*> +)?(.*?) *│$", out, re.MULTILINE)
    return {m.group(1): m.group(2) for m in found}


def test_config_and_format_mean_the_same_on_every_command() -> None:
    """``--config`` is the daemon's TOML file on each command that has it (replay's what-if
    file was ``--config`` too, and read no bus settings); ``--format`` offers ``text`` (status
    offered ``table``) and a machine-readable form."""
    commands = [
        ["daemon"], ["status"], ["report"], ["replay"], ["stop"], ["bus", "check"],
        ["checkpoints", "list"], ["checkpoints", "prune"], ["keys", "show"],
        ["snapshots", "list"], ["snapshots", "verify"],
    ]  # fmt: skip
    for command in commands:
        options = options_of(command)
        if "--config" in options:
            assert "TOML file" in options["--config"], (command, options["--config"])
            assert "\\[bus]" in options["--config"] or "[bus]" in options["--config"], command
        if "--format" in options:
            assert options["--format"].startswith("text"), (command, options["--format"])
    assert "--config" not in options_of(["replay"])
    assert "--what-if" in options_of(["replay"])
    result = CliRunner().invoke(app, ["status", "--format", "table"])
    assert result.exit_code == 2
