"""A Kafka broker for a benchmark: the one given, or a dev broker started for the run."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KAFKA_DEV", "Broker", "kafka_broker"]

KAFKA_DEV = Path(__file__).resolve().parent.parent / "deploy" / "kafka" / "kafka-dev"
START_TIMEOUT_S = 300.0
"""``kafka-dev start``, a cold Maven fetch of the broker's jars included."""
STOP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Broker:
    """A reachable broker.

    Attributes:
        address: ``host:port``.
        pid: the broker's process on this machine when the benchmark started it, else ``None``.
    """

    address: str
    pid: int | None = None

    def cpu_s(self) -> float | None:
        """CPU time (user + system, seconds) the broker process has used so far, from
        ``/proc/<pid>/stat`` (fields 14 and 15, in clock ticks); ``None`` if unknown."""
        if self.pid is None:
            return None
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        # After the ")" ending the command name, utime and stime are the 12th and 13th fields.
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def kafka_broker(given: str | None, run_dir: Path) -> Iterator[Broker | None]:
    """Yield ``given`` (``host:port``) if set; else start a broker with ``kafka-dev start
    --port 0 --dir run_dir``, yield it and stop it on exit. Yields ``None`` (with the reason on
    stderr) when the broker does not start, e.g. without Java or Maven."""
    if given is not None:
        yield Broker(given)
        return
    try:
        started = subprocess.run(
            [sys.executable, str(KAFKA_DEV), "start", "--port", "0", "--dir", str(run_dir)],
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S,
            check=True,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        print(f"kafka-dev did not start: {exc}", file=sys.stderr)
        yield None
        return
    pid_file = run_dir / "kafka.pid"
    try:
        yield Broker(
            started.stdout.strip().splitlines()[-1],
            int(pid_file.read_text()) if pid_file.is_file() else None,
        )
    finally:
        subprocess.run(
            [sys.executable, str(KAFKA_DEV), "stop", "--dir", str(run_dir)],
            capture_output=True,
            timeout=STOP_TIMEOUT_S,
            check=False,
        )
