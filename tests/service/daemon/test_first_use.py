"""First use of the command line: a clone in the working folder, a mistyped bus path or topic
prefix. The demo's reference-run cache: ``tests/unit/daemon/test_demo_cache.py``."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainguard.agent.bus import DEFAULT_TOPICS, BusConfig, open_bus
from trainguard.daemon.cli import app
from trainguard.daemon.demo._harness import charlm_env, stop_process, supervise

REPO = Path(__file__).resolve().parents[3]


pytestmark = pytest.mark.timeout(120)


def invoke(*args: str) -> tuple[int, str]:
    """Run ``trainguard ARGS`` in this process; its exit code and its output (stdout and
    stderr)."""
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


def make_bus(url: str, prefix: str, records: int) -> None:
    """Create the embedded bus at ``url`` with ``prefix``'s topics and ``records`` events."""

    async def write() -> None:
        async with open_bus(BusConfig(url=url, prefix=prefix, topics=DEFAULT_TOPICS)) as bus:
            for i in range(records):
                await bus.publish("events", "job", f"{i}".encode())

    asyncio.run(write())


def test_our_processes_ignore_a_clone_in_the_working_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run from a clone's parent folder, ``trainguard/`` (no ``__init__.py``) must not join
    the ``trainguard`` namespace package, in the supervisor nor in charlm's workers."""
    for part in ("agent", "daemon", "schemas"):
        (tmp_path / "trainguard" / part).mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    worker = [sys.executable, "-c", "from trainguard.agent import Agent"]
    sup = supervise(
        "j",
        worker,
        bus_url=f"sqlite://{tmp_path / 'bus.db'}",
        prefix="t.",
        nproc_per_node=1,
        log_path=tmp_path / "supervisor.log",
        env=charlm_env(tmp_path / "out", REPO),
    )
    try:
        # A worker that fails waits for a daemon's decision: time out rather than hang.
        code = sup.wait(60)
    finally:
        stop_process(sup)
    assert code == 0, (tmp_path / "supervisor.log").read_text()[-2000:]


@pytest.mark.parametrize(
    "command",
    [
        ["status"],
        ["status", "j"],
        ["report", "j"],
        ["replay", "j"],
        ["export", "j", "--output", "out.jsonl.gz"],
        ["checkpoints", "list"],
        ["snapshots", "list"],
        ["snapshots", "show", "j"],
        ["snapshots", "verify"],
        ["bus", "check"],
        ["stop", "j"],
    ],
)
def test_a_read_of_a_missing_embedded_bus_creates_nothing(
    command: list[str], tmp_path: Path
) -> None:
    if command[-1] == "verify":  # needs the daemon's keys before it reads the bus
        keys = tmp_path / "keys"
        assert invoke("keys", "init", "--keys", str(keys))[0] == 0
        command = [*command, "--keys", str(keys)]
    path = tmp_path / "typo" / "bus.db"
    code, output = invoke(*command, "--bus", f"sqlite://{path}")
    assert code == 2, output
    assert f"no embedded bus at {path}" in " ".join(output.split())
    assert not (tmp_path / "typo").exists()


def test_bus_check_takes_a_topic_prefix_and_names_the_others(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path / 'bus.db'}"
    make_bus(url, "trainguard.", records=3)
    make_bus(url, "empty.", records=0)

    code, output = invoke("bus", "check", "--bus", url, "--topic-prefix", "trainguard.")
    assert code == 0, output
    assert "3 records" in output
    assert "no records" not in output

    code, output = invoke("bus", "check", "--bus", url, "--topic-prefix", "empty.")
    assert code == 0, output
    assert "no records under topic prefix 'empty.'; found topics under 'trainguard.'" in output

    code, output = invoke("bus", "check", "--bus", url, "--topic-prefix", "typo.")
    assert code == 2
    assert "found topics under 'empty.', 'trainguard.'" in " ".join(output.split())
    assert not any(name.startswith("typo.") for name in topic_names(url))


def test_status_without_jobs_names_the_prefixes_that_have_topics(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path / 'bus.db'}"
    make_bus(url, "trainguard.", records=0)
    make_bus(url, "demo-1.", records=1)

    code, output = invoke("status", "--bus", url)
    assert code == 0, output
    assert "no jobs" in output
    assert "found topics under 'demo-1.'" in " ".join(output.split())

    code, output = invoke("status", "--bus", url, "--topic-prefix", "typo.")
    assert code == 2
    assert "found topics under 'demo-1.', 'trainguard.'" in " ".join(output.split())


def topic_names(url: str) -> frozenset[str]:
    async def names() -> frozenset[str]:
        async with open_bus(BusConfig(url=url, create=False)) as bus:
            return await bus.topic_names()

    return asyncio.run(names())


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["status", "--config", "{missing}"], "cannot read the config file {missing}: "),
        (["bus", "check", "--config", "{missing}"], "cannot read the config file {missing}: "),
        (
            ["checkpoints", "list", "--config", "{missing}"],
            "cannot read the config file {missing}: ",
        ),
        (["snapshots", "list", "--config", "{missing}"], "cannot read the config file {missing}: "),
        (["stop", "j", "--config", "{missing}"], "cannot read the config file {missing}: "),
        (["daemon", "--config", "{missing}"], "cannot read the config file {missing}: "),
        (["report", "j", "--config", "{missing}"], "cannot read the config file {missing}: "),
        (["report", "j", "--file", "{missing}"], "cannot read the export file {missing}: "),
        (["replay", "j", "--file", "{missing}"], "cannot read the export file {missing}: "),
        (["import", "{missing}"], "cannot read the export file {missing}: "),
        (["keys", "show", "--keys", "{file}"], "cannot use the key directory {file}: "),
    ],
)
def test_a_file_that_cannot_be_read_is_one_line_naming_it_and_why(
    command: list[str], message: str, tmp_path: Path
) -> None:
    """Not Python's ``[Errno 2] No such file or directory: 'x'``: what the file is for, its
    path as given, and the system's reason; exit status 2 (bad input)."""
    missing, file = tmp_path / "missing.toml", tmp_path / "a-file"
    file.write_text("")
    paths = {"missing": str(missing), "file": str(file)}
    args = [arg.format(**paths) for arg in command]
    bus = [] if args[0] == "keys" else ["--bus", f"sqlite://{tmp_path / 'bus.db'}"]
    code, output = invoke(*args, *bus)
    assert code == 2, output
    [line] = output.splitlines()
    assert line.startswith("error: " + message.format(**paths)), line
    assert "Errno" not in line
    assert not (tmp_path / "bus.db").exists()


def test_a_file_that_cannot_be_written_is_one_line_naming_it_and_why(tmp_path: Path) -> None:
    record = REPO / "tests/service/daemon/data/charlm-demo-5296f9b.tgjsonl.gz"
    url = f"sqlite://{tmp_path / 'bus.db'}"
    assert invoke("import", str(record), "--bus", url)[0] == 0
    out = tmp_path / "no-such-folder" / "job.tgjsonl.gz"
    code, output = invoke("export", "charlm-demo", "--bus", url, "-o", str(out))
    assert code == 2, output
    assert output.splitlines() == [
        f"error: cannot write {out}: No such file or directory ({out}.tmp)"
    ]
    html = tmp_path / "no-such-folder" / "report.html"
    code, output = invoke("report", "charlm-demo", "--bus", url, "--html", str(html))
    assert code == 2, output
    assert output.splitlines() == [
        f"error: cannot write the HTML report {html}: No such file or directory"
    ]
