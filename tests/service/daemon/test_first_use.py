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
