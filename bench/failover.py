"""Failover benchmark (issue 13): how long a job goes without a deciding daemon when the
instance that owns it dies, and how long the daemon takes to catch up after a broker outage.

Usage (from the repository root)::

    python bench/failover.py [--rounds 10] [--session-timeout 6] [--outage 10]
                             [--kafka host:port] [--markdown] [--json FILE]

Setup: a Kafka broker (``--kafka``, or one started with ``deploy/kafka/kafka-dev``; the broker
part needs one started here, since it pauses it), two ``trainguard daemon`` instances in one
consumer group (``[bus] session_timeout_s`` = ``--session-timeout``, heartbeat interval a
third of it, as the Kafka adapter sets it) and one 2-rank ``examples/charlm`` job under
``trainguard run`` (0.1 s per step, a checkpoint every 20 steps, heartbeats every 0.5 s).

* **failover**, ``--rounds`` times: the instance that owns the job (the one whose audited
  decisions commit its snapshots) is SIGKILLed at t0, and at once a rank of the job; the
  figure is t0 to the append time of the restore the new owner issues. A new instance replaces
  the dead one before the next round. Interleaved with it, as many **baseline** rounds: a rank
  killed with both instances alive, t0 to the restore; the difference is what the failover
  costs. Target: failover p50 at most the session timeout + 2 s.
* **broker return**, ``--rounds`` times: the broker is SIGSTOPped for ``--outage`` seconds while
  the job trains; from its SIGCONT to the moment every instance says it is caught up
  (``/healthz`` 200, ``trainguard_consumer_lag_records`` 0 and, where the daemon has it,
  ``trainguard_bus_connected`` 1), polled every 0.1 s. A daemon whose health does not see the
  outage reports 0 here: read this figure with the ``/healthz`` answers counted during the
  outage (``not-ready polls``).

Times are this machine's wall clock; append times are the broker's (``LogAppendTime``, same
machine). Figures are printed, never asserted; the machine's load average is printed with them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

from trainguard.agent.bus import BusUnavailable
from trainguard.daemon.demo._harness import (
    charlm_command,
    charlm_env,
    follow_job,
    start_daemon,
    stop_process,
    supervise,
)
from trainguard.schemas import Restore

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # bench._broker and friends

from bench._broker import Broker, kafka_broker  # noqa: E402
from bench._summary import format_quantiles, machine_notes, quantiles  # noqa: E402

JOB = "failover-bench"
DEADLINE_S = 180.0
"""Longest wait for any condition: it only bounds a hang."""
SLACK_S = 2.0
"""Target: failover p50 at most the session timeout plus this."""
_T = TypeVar("_T")


def wait_until(what: str, condition: Callable[[], bool], timeout_s: float = DEADLINE_S) -> None:
    """Poll ``condition`` every 0.1 s; ``TimeoutError`` naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.1)


def workers() -> dict[tuple[int, int], int]:
    """``(rank, generation) -> pid`` of the job's workers (by the variables their supervisor
    set)."""
    found: dict[tuple[int, int], int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, KeyError, ValueError):
                raw = (entry / "environ").read_bytes().decode(errors="replace")
                env = dict(v.split("=", 1) for v in raw.split("\0") if "=" in v)
                if env.get("TRAINGUARD_JOB") == JOB and "RANK" in env:
                    found[int(env["RANK"]), int(env["TRAINGUARD_GENERATION"])] = int(entry.name)
    return found


def running_generation() -> int | None:
    """The newest generation both of whose ranks run, or ``None``."""
    running = workers()
    return max((g for r, g in running if r == 0 and (1, g) in running), default=None)


def scrape(url: str) -> dict[str, float] | None:
    """``/metrics`` of a daemon as ``{name{labels}: value}``, or ``None`` if it does not answer."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=2) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def healthz(url: str) -> int:
    """Status of ``/healthz`` (0: no answer)."""
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return 0


def total(metrics: dict[str, float], name: str) -> float | None:
    """Sum of every series of ``name`` (any labels), ``None`` if there is none."""
    values = [v for k, v in metrics.items() if k == name or k.startswith(name + "{")]
    return sum(values) if values else None


def retrying(read: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """``asyncio.run(read())``, again while the bus is unavailable: a broker just back from
    SIGSTOP can answer a new client's first metadata request without brokers
    (``NodeNotReadyError``)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            return asyncio.run(read())
        except BusUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class Bench:
    """The daemons, the job and the broker of one benchmark run."""

    def __init__(self, broker: Broker, work: Path, session_timeout_s: float) -> None:
        self.broker = broker
        self.work = work
        self.url = f"kafka://{broker.address}"
        self.prefix = f"fo-{uuid.uuid4().hex[:8]}."
        self.config = work / "daemon.toml"
        self.config.write_text(
            f"[bus]\nsession_timeout_s = {session_timeout_s}\n\n"
            f'[service]\ngroup_id = "{self.prefix}daemon"\nmetrics_port = 0\n\n'
            "[machine]\nmax_restore_cycles = 1000\n"  # a kill each round is no crash loop
        )
        self.daemons: dict[subprocess.Popen[bytes], str] = {}  # process -> metrics URL
        self.started = 0
        self.generation = 0
        self.supervisor: subprocess.Popen[bytes] | None = None

    def start_daemon(self) -> None:
        """Start an instance and wait for its metrics URL (from its log)."""
        self.started += 1
        log = self.work / f"daemon-{self.started}.log"
        proc = start_daemon(
            self.url, prefix=self.prefix, log_path=log, args=["--config", str(self.config)]
        )
        found: list[str] = []

        def listening() -> bool:
            for line in log.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    entry = json.loads(line)
                    if entry.get("event") == "metrics server listening":
                        found.append(str(entry["url"]))
                        return True
            return False

        wait_until(f"daemon {self.started} serves metrics", listening)
        self.daemons[proc] = found[0]

    def start_job(self) -> None:
        out = self.work / "run"
        self.supervisor = supervise(
            JOB,
            charlm_command(
                out, steps=1_000_000, checkpoint_every=20, seed=1, extra=["--step-sleep", "0.1"]
            ),
            bus_url=self.url,
            prefix=self.prefix,
            nproc_per_node=2,
            log_path=self.work / "supervisor.log",
            env=charlm_env(out, REPO),
        )

    def owner(self) -> subprocess.Popen[bytes]:
        """The instance that owns the job: the one that committed a snapshot of its current
        generation most recently (the ``daemon_id``, ``host-pid``, of the config entry of an
        audited ``committed`` decision of an input appended from now on: one every 2 s)."""
        running: list[int] = []

        def started() -> bool:
            generation = running_generation()
            running[:] = [] if generation is None else [generation]
            return bool(running) and running[0] >= self.generation

        wait_until(f"both ranks of generation {self.generation} or later run", started)
        # A later one: a restore this benchmark did not cause (after a broker outage).
        self.generation = running[0]
        since_ms = time.time_ns() // 1_000_000
        pid = retrying(lambda: self._committer(since_ms))
        for proc in self.daemons:
            if proc.pid == pid:
                return proc
        raise RuntimeError(f"the job's owner, pid {pid}, is none of the running instances")

    async def _committer(self, since_ms: int) -> int:
        configs: dict[str, str] = {}
        deadline = time.monotonic() + DEADLINE_S
        follow = follow_job(self.url, self.prefix, JOB)
        async with contextlib.aclosing(follow):
            async for batch in follow:
                for stamped in batch:
                    entry = stamped.message
                    if not isinstance(entry, dict):
                        continue
                    if entry.get("entry") == "config":
                        configs[entry["config_id"]] = entry["config"]["daemon_id"]
                    elif entry.get("at_ms", 0) >= since_ms:
                        committed = [
                            d["manifest"]["generation"]
                            for d in entry["decisions"]
                            if d["decision"] == "committed"
                            and d["manifest"]["generation"] >= self.generation
                        ]
                        if committed:  # a later generation: restored meanwhile
                            self.generation = max(committed)
                            return int(configs[entry["config_id"]].rpartition("-")[2])
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no commit of generation {self.generation}")
        raise AssertionError("follow_job() ended")

    def restore_time(self, generation: int) -> float:
        """Append time (s since the epoch) of the restore of ``generation``."""
        return retrying(lambda: self._restore_time(generation))

    async def _restore_time(self, generation: int) -> float:
        deadline = time.monotonic() + DEADLINE_S
        follow = follow_job(self.url, self.prefix, JOB)
        async with contextlib.aclosing(follow):
            async for batch in follow:
                for stamped in batch:
                    msg = stamped.message
                    if isinstance(msg, Restore) and msg.generation == generation:
                        return stamped.at_ms / 1000
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no restore of generation {generation}")
        raise AssertionError("follow_job() ended")

    def kill_rank(self) -> None:
        pid = workers().get((1, self.generation))
        if pid is None:
            raise RuntimeError(f"rank 1 of generation {self.generation} does not run")
        os.kill(pid, signal.SIGKILL)

    def failover_round(self, kill_owner: bool) -> float:
        """Seconds from the kill to the restore's append time."""
        owner = self.owner()
        t0 = time.time()
        if kill_owner:
            stop_process(owner, signal.SIGKILL)
            del self.daemons[owner]
        self.kill_rank()
        self.generation += 1
        at = self.restore_time(self.generation)
        if kill_owner:
            self.start_daemon()
        return at - t0

    def outage_round(self, outage_s: float) -> tuple[float, int]:
        """Seconds from SIGCONT to every instance caught up; ``/healthz`` polls not ready
        during the outage. (A restore the outage causes shows in the next round's
        generation: :meth:`owner`.)"""
        self.owner()
        assert self.broker.pid is not None
        os.kill(self.broker.pid, signal.SIGSTOP)
        not_ready = 0
        try:
            end = time.monotonic() + outage_s
            while time.monotonic() < end:
                not_ready += sum(healthz(url) != 200 for url in self.daemons.values())
                time.sleep(0.5)
        finally:
            os.kill(self.broker.pid, signal.SIGCONT)
        t0 = time.monotonic()

        def caught_up() -> bool:
            for url in self.daemons.values():
                metrics = scrape(url)
                if metrics is None or healthz(url) != 200:
                    return False
                if total(metrics, "trainguard_consumer_lag_records") not in (0.0, None):
                    return False
                if total(metrics, "trainguard_bus_connected") == 0.0:
                    return False
            return True

        wait_until("every instance caught up", caught_up)
        return time.monotonic() - t0, not_ready

    def close(self) -> None:
        if self.supervisor is not None:
            stop_process(self.supervisor, signal.SIGINT, timeout_s=20)
        for proc in self.daemons:
            stop_process(proc, signal.SIGKILL)


@contextlib.contextmanager
def bench(args: argparse.Namespace) -> Iterator[Bench]:
    with contextlib.ExitStack() as stack:
        if args.workdir is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="failover-")))
        else:
            work = args.workdir
            work.mkdir(parents=True, exist_ok=True)
        broker = stack.enter_context(kafka_broker(args.kafka, work / "kafka"))
        if broker is None:
            raise SystemExit("no Kafka broker")
        run = Bench(broker, work, args.session_timeout)
        try:
            yield run
        finally:
            run.close()


def row(name: str, values: list[float], target: str = "", verdict: str = "") -> list[str]:
    return [name, str(len(values)), *format_quantiles(values), target, verdict]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=10, help="rounds of each part (10)")
    parser.add_argument(
        "--session-timeout", type=float, default=6.0, help="daemon group session, s (6)"
    )
    parser.add_argument("--outage", type=float, default=10.0, help="broker SIGSTOP, s (10)")
    parser.add_argument("--kafka", metavar="HOST:PORT", help="use this broker (no outage part)")
    parser.add_argument(
        "--parts",
        type=lambda text: set(text.split(",")),
        default={"failover", "outage"},
        help="comma-separated parts to run: failover, outage (both)",
    )
    parser.add_argument(
        "--workdir", type=Path, help="keep the logs here (default: a temporary folder)"
    )
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)

    notes = machine_notes()
    failover: list[float] = []
    baseline: list[float] = []
    false_restores = 0
    caught_up: list[float] = []
    not_ready: list[int] = []
    with bench(args) as run:
        run.start_daemon()
        run.start_daemon()
        run.start_job()
        for i in range(args.rounds if "failover" in args.parts else 0):
            failover.append(run.failover_round(kill_owner=True))
            baseline.append(run.failover_round(kill_owner=False))
            print(
                f"round {i + 1}: failover {failover[-1]:.2f} s, baseline {baseline[-1]:.2f} s, "
                f"load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
        before_outages = run.generation
        if run.broker.pid is not None and "outage" in args.parts:
            for i in range(args.rounds):
                seconds, polls = run.outage_round(args.outage)
                caught_up.append(seconds)
                not_ready.append(polls)
                print(
                    f"outage {i + 1}: caught up {seconds:.2f} s after SIGCONT, {polls} "
                    f"not-ready /healthz polls during it, load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
        if caught_up:
            run.owner()  # the generation now: restores the outages caused
            false_restores = run.generation - before_outages
    notes.append(f"end: load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")

    limit = args.session_timeout + SLACK_S
    p50 = quantiles(failover)
    verdict = "" if p50 is None else ("PASS" if p50[0] <= limit else "FAIL")
    rows = [
        row(
            "failover: owner + rank SIGKILLed -> restore", failover, f"p50 <= {limit:g} s", verdict
        ),
        row("baseline: rank SIGKILLed -> restore", baseline),
        row(
            "failover - baseline (per round)",
            [f - b for f, b in zip(failover, baseline, strict=True)],
        ),
        row(f"broker SIGSTOP {args.outage:g} s: SIGCONT -> caught up", caught_up),
    ]
    header = ["measurement", "rounds", "p50 s", "p90 s", "max s", "target", "verdict"]
    settings = (
        f"consumer group: session_timeout_ms={int(args.session_timeout * 1000)}, "
        f"heartbeat_interval_ms={int(args.session_timeout * 1000) // 3}, 2 instances, "
        "6 partitions, aiokafka's default RoundRobinPartitionAssignor (eager rebalancing)"
    )
    outages = [
        f"not-ready /healthz polls per outage: {not_ready}",
        f"restores over the {len(caught_up)} outages (none caused by the benchmark): "
        f"{false_restores}",
    ]
    for note in [*notes, settings, *outages]:
        print(f"- {note}")
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|---|---:|---:|---:|---:|---|---|")
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        for r in rows:
            print("  ".join(f"{c:>10}" if i else f"{c:<52}" for i, c in enumerate(r)))
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "notes": notes,
                    "settings": settings,
                    "failover_s": failover,
                    "baseline_s": baseline,
                    "caught_up_s": caught_up,
                    "not_ready_polls": not_ready,
                    "restores_during_outages": false_restores,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
