"""Issue 13: the daemon waits out a bus it cannot reach, at its start and when the bus fails
under its loop, instead of exiting (a daemon started before its broker, as at boot or in
Kubernetes, exited 2, which systemd and the Kubernetes policies take for a refusal and never
restart). It says so on ``/healthz`` meanwhile, a signal ends the wait at once with the clean
exit code (0), and it serves again from scratch, as a new instance would. Only a bus that
cannot work exits 2.

The Kafka cases without a broker run here: a port nobody listens on (a stopped broker), and a
listener that never answers (a paused one) behind a connect timeout of an hour, so only the
signal can end that wait in time. Those with a real broker stopped or paused are in
``test_bus_outage.py``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import socket
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import orjson
import pytest
import structlog.testing

from tests.support.buses import BusFactory
from tests.support.health import serving
from tests.support.http_get import http_get
from tests.support.service_support import JobEvents, daemon_config, eventually, publish, running
from trainguard.agent.bus import DEFAULT_TOPICS
from trainguard.daemon import DaemonService
from trainguard.daemon.demo._harness import start_daemon, stop_process

pytestmark = pytest.mark.timeout(180)

_T = TypeVar("_T")

CLEAN_STOP = 0
"""``trainguard daemon``'s exit status after SIGTERM or SIGINT (daemon/cli.py: ``daemon()``
returns)."""

REFUSED = 2
"""``trainguard daemon``'s exit status for a bad setting or a bus that cannot work."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def silent_listener() -> Iterator[int]:
    """The port of a listener that never accepts: the kernel completes each connection and
    nothing ever answers, as with a broker paused by SIGSTOP."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield s.getsockname()[1]


def events(log: Path) -> list[dict[str, Any]]:
    out = []
    for line in log.read_bytes().splitlines():
        with contextlib.suppress(orjson.JSONDecodeError):
            out.append(orjson.loads(line))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("broker", ["stopped", "paused"])
def test_a_daemon_waits_for_a_bus_it_cannot_reach_and_sigterm_ends_the_wait(
    tmp_path: Path, broker: str
) -> None:
    """The old daemon exited 2 at once on a refused connection, and with a paused broker said
    ``no partition of events assigned`` and stayed deaf to SIGTERM for the connect timeout."""
    config = tmp_path / "daemon.toml"
    config.write_text(
        "[bus]\nconnect_timeout_s = 3600.0\nsend_timeout_s = 3600.0\n"
        "[service]\nwarn_every_s = 0.2\nprobe_timeout_s = 0.5\n"
    )
    log = tmp_path / "daemon.log"
    with contextlib.ExitStack() as stack:
        port = stack.enter_context(silent_listener()) if broker == "paused" else free_port()
        proc = start_daemon(
            f"kafka://127.0.0.1:{port}", prefix="w.", log_path=log, args=["--config", str(config)]
        )
        stack.callback(stop_process, proc, signal.SIGKILL)

        def logged(event: str) -> dict[str, Any] | None:
            found = [e for e in events(log) if str(e.get("event", "")).startswith(event)]
            return found[0] if found else None

        def until(check: Callable[[], _T | None], what: str) -> _T:
            deadline = time.monotonic() + 120
            while True:
                # Alive first: an exit (the old daemon's 2) is the failure to report.
                exited = proc.poll()
                assert exited is None, f"exited {exited} before {what}:\n{log.read_text()}"
                got = check()
                if got:
                    return got
                assert time.monotonic() < deadline, f"no {what}:\n{log.read_text()}"
                time.sleep(0.05)

        listening = until(lambda: logged("metrics server listening"), "metrics server")

        def not_ready() -> str | None:
            status, body = http_get(f"{listening['url']}/healthz")
            assert status == 503, (status, body)
            return body if "cannot reach the bus" in body else None

        body = until(not_ready, "'cannot reach the bus' on /healthz")
        assert body.startswith("not ready: cannot reach the bus for "), body
        if broker == "stopped":  # refused at once: retried, and said so every warn_every_s
            until(lambda: logged("bus outage goes on: reaching the bus still fails"), "retries")
        signalled = time.monotonic()
        code = stop_process(proc, signal.SIGTERM, timeout_s=60)
        took = time.monotonic() - signalled
    assert code == CLEAN_STOP, log.read_text()
    # Promptly: the wait ends at once (1 s grace for the call in flight), whatever the bus's
    # timeouts (an hour); the rest is the interpreter's exit on a loaded machine.
    assert took < 30, took
    said = events(log)
    assert any(e["event"] == "daemon stopped while waiting for the bus" for e in said)
    if broker == "stopped":
        [began] = [e for e in said if str(e["event"]).startswith("bus outage: reaching the bus")]
        assert began["level"] == "warning"
        assert began["bus"] == f"kafka://127.0.0.1:{port}"
        assert "ConnectionRefusedError" in str(began["error"])


def test_a_bus_that_cannot_work_still_exits_2(tmp_path: Path) -> None:
    """A file that is no embedded bus is not retriable: exit 2, no outage waited for."""
    bus = tmp_path / "bus.db"
    bus.write_bytes(b"not a database" * 512)
    log = tmp_path / "daemon.log"
    proc = start_daemon(f"sqlite://{bus}", prefix="w.", log_path=log, args=["--metrics-port", "-1"])
    try:
        code = proc.wait(120)
    finally:
        stop_process(proc, signal.SIGKILL)
    output = log.read_text()
    assert code == REFUSED, output
    assert "error: opening the bus file" in output
    assert "file is not a database" in output
    assert "bus outage" not in output


@pytest.mark.anyio
async def test_a_bus_failing_under_the_loop_is_waited_for_and_served_again_from_scratch(
    tmp_path: Path,
) -> None:
    """The embedded bus's file held locked by another process for longer than the bus's
    send timeout: the daemon's consumer-group heartbeat fails (``BusUnavailable``), which
    ended the old daemon's loop (exit 2). Now it drops what it held, waits for the file,
    says so on ``/healthz``, and serves again: the job rebuilt from the log, new events
    folded."""
    factory = BusFactory("sqlite", f"sqlite://{tmp_path / 'bus.db'}", "t.")
    config = daemon_config(factory)
    config = dataclasses.replace(
        config,
        bus=dataclasses.replace(config.bus, send_timeout_s=0.5, session_timeout_s=1.5),
        warn_every_s=0.2,
        probe_interval_s=0.2,
    )
    job = JobEvents("held-job")
    service = DaemonService(config)
    with structlog.testing.capture_logs() as logs:
        async with factory.open(topics=DEFAULT_TOPICS) as bus:
            await publish(bus, job.started(0), job.started(1), job.beat(0, 1, 3))
        async with serving(service) as server, running(service):

            async def folded(step: int) -> bool:
                state = service.jobs.get(job.job_id)
                return service.ready.is_set() and state is not None and state.ranks[0].step == step

            await eventually(lambda: folded(3), 60)
            holder = sqlite3.connect(tmp_path / "bus.db", timeout=30, check_same_thread=False)
            try:
                await asyncio.to_thread(holder.execute, "BEGIN IMMEDIATE")

                async def waiting() -> str | None:
                    status, body = await asyncio.to_thread(http_get, f"{server.url}/healthz")
                    said = any(str(e["event"]).startswith("bus outage: reaching") for e in logs)
                    return (
                        body if status == 503 and said and "cannot reach the bus" in body else None
                    )

                body = await eventually(waiting, 60)
                assert body.startswith("not ready: cannot reach the bus for "), body
                assert service.jobs == {}, "nothing held over from before the failure"
            finally:
                await asyncio.to_thread(holder.rollback)
                holder.close()
            await eventually(lambda: folded(3), 60)  # rebuilt from the log
            async with factory.open(topics=DEFAULT_TOPICS) as bus:
                await publish(bus, job.beat(0, 2, 4))
            await eventually(lambda: folded(4), 60)
    [began] = [e for e in logs if str(e["event"]).startswith("bus outage: reaching the bus")]
    assert began["log_level"] == "warning"
    assert "BusUnavailable" in began["error"]
    assert any(str(e["event"]).startswith("bus outage over") for e in logs)
    assert sum(e["event"] == "daemon started" for e in logs) == 2
