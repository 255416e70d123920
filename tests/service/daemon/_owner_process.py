"""A daemon instance in a process of its own, for tests/service/daemon/test_service_instances.py:
a process can be paused for real (SIGSTOP), which a task in the test's process cannot.

    python tests/service/daemon/_owner_process.py URL PREFIX GROUP SESSION_S FLAG

Runs a :class:`DaemonService` until SIGTERM. Once the file ``FLAG`` exists and the daemon has
sent a command, it deletes the file and stops its own process (SIGSTOP) right after acting,
before its transaction commits: a pause at the worst moment, at a known place.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from trainguard.agent.bus import DEFAULT_TOPICS, Bus, BusConfig
from trainguard.daemon import DaemonService, MachineConfig
from trainguard.daemon.service._settings import DaemonConfig


class StopsItself(DaemonService):
    """Stops its process once ``flag`` exists and a command was sent (see the module)."""

    flag: Path

    async def _write_due_ticks(self, bus: Bus) -> None:
        if self.counters["commands"] and self.flag.exists():
            self.flag.unlink()
            os.kill(os.getpid(), signal.SIGSTOP)
        await super()._write_due_ticks(bus)


async def main(url: str, prefix: str, group: str, session_s: float, flag: str) -> None:
    config = DaemonConfig(
        bus=BusConfig(
            url=url,
            prefix=prefix,
            topics=DEFAULT_TOPICS,
            session_timeout_s=session_s,
            connect_timeout_s=30.0,
            send_timeout_s=30.0,
        ),
        machine=MachineConfig(
            daemon_id="paused", restore_timeout_s=600.0, heartbeat_timeout_s=600.0
        ),
        group_id=group,
        poll_s=0.02,
    )
    service = StopsItself(config)
    service.flag = Path(flag)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await service.run(stop)


if __name__ == "__main__":
    url, prefix, group, session_s, flag = sys.argv[1:]
    asyncio.run(main(url, prefix, group, float(session_s), flag))
