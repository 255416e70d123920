"""Issue 13: a supervisor waits for a bus that is away at its start instead of failing (a
replacement pod started during a broker outage must not fail the Kubernetes Job), logging the
outage, and a signal ends every wait on the bus at once, whatever the bus's own timeouts.

The broker here is a listener on loopback that accepts connections and never answers, as a
paused (SIGSTOPped) broker does, or a port nobody listens on, as a stopped one; the bus's
timeouts are an hour, so only the signal path can end a wait in time."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from tests.support.outage import until
from trainguard.agent.bus import DEFAULT_TOPICS, BusConfig
from trainguard.agent.supervisor._supervisor import EXIT_SIGNALLED, Supervisor, SupervisorConfig

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

HOUR_S = 3600.0

CLI = [sys.executable, "-m", "trainguard.daemon.cli"]


@pytest.fixture
async def silent_broker() -> AsyncIterator[tuple[str, list[asyncio.StreamWriter]]]:
    """``host:port`` of a listener that takes connections and answers nothing, and the
    connections it took."""
    taken: list[asyncio.StreamWriter] = []

    async def take(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        taken.append(writer)

    server = await asyncio.start_server(take, "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    try:
        yield f"{host}:{port}", taken
    finally:
        for writer in taken:
            writer.close()
        server.close()


def supervisor(tmp_path: Path, bootstrap: str, *, warn_every_s: float = 30.0) -> Supervisor:
    """A supervisor of a job whose worker would only exit, on a Kafka bus at ``bootstrap``
    whose connect and send timeouts are an hour."""
    bus = BusConfig(
        url=f"kafka://{bootstrap}",
        topics=DEFAULT_TOPICS,
        connect_timeout_s=HOUR_S,
        send_timeout_s=HOUR_S,
    )
    return Supervisor(
        SupervisorConfig(
            job_id="waiting-job",
            bus=bus,
            command=[sys.executable, "-c", "pass"],
            nproc_per_node=1,
            host="node-a",
            state_dir=tmp_path / "state",
            warn_every_s=warn_every_s,
        )
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_a_signal_ends_the_wait_for_a_broker_that_does_not_answer(
    tmp_path: Path, silent_broker: tuple[str, list[asyncio.StreamWriter]]
) -> None:
    """The old supervisor waited in its first connection for the connect timeout (here an
    hour), deaf to the signal."""
    bootstrap, taken = silent_broker
    stop = asyncio.Event()
    run = asyncio.ensure_future(supervisor(tmp_path, bootstrap).run(stop))
    await until(lambda: bool(taken), "the supervisor connecting")
    assert not run.done()
    stop.set()  # SIGTERM
    assert await asyncio.wait_for(run, 60.0) == EXIT_SIGNALLED


async def test_a_supervisor_started_while_the_broker_is_down_waits_for_it_saying_so(
    tmp_path: Path,
) -> None:
    """Nobody listens at the broker's address: the supervisor retries with back-off, logs the
    outage when it begins and again every ``warn_every_s``, starts nothing, and a signal ends
    the wait. The old one failed at once (``trainguard run`` exited 2)."""
    stop = asyncio.Event()
    bootstrap = f"127.0.0.1:{free_port()}"
    with capture_logs() as logs:
        run = asyncio.ensure_future(supervisor(tmp_path, bootstrap, warn_every_s=0.01).run(stop))

        def said(start: str) -> int:
            return sum(str(e["event"]).startswith(start) for e in logs)

        await until(lambda: run.done() or said("bus outage goes on") >= 2, "the outage logged")
        assert not run.done(), run.result() if not run.exception() else run.exception()
        stop.set()
        assert await asyncio.wait_for(run, 60.0) == EXIT_SIGNALLED
    [began] = [e for e in logs if str(e["event"]).startswith("bus outage: connecting")]
    assert began["log_level"] == "warning"
    assert began["job_id"] == "waiting-job"
    assert "Kafka" in began["error"]
    assert not [e for e in logs if e["event"] == "workers started"]


@pytest.mark.slow
@pytest.mark.parametrize("init_from", [False, True], ids=["plain", "init-from"])
def test_trainguard_run_waits_for_an_unreachable_broker_and_a_sigterm_ends_it(
    tmp_path: Path, init_from: bool
) -> None:
    """``trainguard run`` (with ``--init-from``, whose check reads the bus first, too) started
    while nobody listens at the broker's address: no exit 2 (the old one exited 2 at once),
    a warning naming the outage, and SIGTERM ends it with 143."""
    command = [
        *CLI, "run", "--job", "waiting-job", "--bus", f"kafka://127.0.0.1:{free_port()}",
        "--nproc-per-node", "1", "--daemon-timeout", "0", "--warn-every", "0.2",
        *(["--init-from", "seed-job/g0/s10"] if init_from else []),
        "--", sys.executable, "-c", "pass",
    ]  # fmt: skip
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    ) as proc:
        assert proc.stdout is not None
        lines: list[str] = []
        for line in proc.stdout:
            lines.append(line)
            if "bus outage goes on" in line:
                break
        assert proc.poll() is None, "".join(lines)
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    assert proc.returncode in (EXIT_SIGNALLED, -signal.SIGTERM), "".join(lines) + rest
    assert any("bus outage:" in line for line in lines)
    assert "workers started" not in "".join(lines) + rest
