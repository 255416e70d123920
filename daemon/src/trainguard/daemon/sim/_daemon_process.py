"""The daemon of a simulation, as a process of its own: the real service
(:class:`~trainguard.daemon.service.DaemonService`) on the simulation's bus, so that its CPU
time and memory are its own and it can be killed like a production daemon.

``python -m trainguard.daemon.sim._daemon_process CONFIG RUN_DIR [--simulated-clock]`` loads
the daemon's settings from the TOML file ``CONFIG`` (``trainguard daemon --config`` reads the
same), serves until SIGTERM or SIGINT, and writes into ``RUN_DIR``: ``ready`` once the service
has rebuilt its partitions (its content: the wall time from the process's start to then, in
seconds), and ``stats-<pid>.json`` when it stops cleanly (CPU seconds, peak RSS, records folded,
commands and ticks written). With ``--simulated-clock`` (embedded bus only), the service's
clock and pulse clock are the bus file's simulated append clock
(:class:`~trainguard.agent.bus.AppendClock`), which the simulator moves: the daemon then lives
in simulated time, and so do the ticks it writes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import orjson

from trainguard.agent.bus import AppendClock, parse_bus_url
from trainguard.daemon.service import (
    DaemonService,
    configure_logging,
    load_daemon_config,
    load_keys,
)

__all__ = ["main"]


async def _serve(service: DaemonService, run_dir: Path, began: float) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def announce() -> None:
        await service.ready.wait()
        path = run_dir / "ready"
        path.with_suffix(".tmp").write_text(f"{time.monotonic() - began:.3f}\n")
        path.with_suffix(".tmp").replace(path)

    announcing = asyncio.ensure_future(announce())
    try:
        await service.run(stop)
    finally:
        announcing.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the simulation's daemon (module docstring); returns the exit status (0)."""
    began = time.monotonic()
    parser = argparse.ArgumentParser(prog="trainguard.daemon.sim._daemon_process")
    parser.add_argument("config", type=Path)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--simulated-clock", action="store_true")
    args = parser.parse_args(argv)
    settings = load_daemon_config(args.config)
    configure_logging(json=True)
    if args.simulated_clock:
        _, path = parse_bus_url(settings.bus.url)
        clock = AppendClock(path)
        service = DaemonService(
            settings, clock=clock.ns, pulse_clock=clock.seconds, keys=load_keys(settings.security)
        )
    else:
        service = DaemonService(settings, keys=load_keys(settings.security))
    asyncio.run(_serve(service, args.run_dir, began))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    stats = {
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "max_rss_bytes": usage.ru_maxrss * 1024,  # Linux reports KiB
        **service.counters,
    }
    (args.run_dir / f"stats-{os.getpid()}.json").write_bytes(orjson.dumps(stats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
