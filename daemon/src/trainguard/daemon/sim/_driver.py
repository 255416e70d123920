"""The simulation's shell: the model's ranks on a real bus, the real daemon as a process of its
own, and the measurements.

**The daemon** runs as ``python -m trainguard.daemon.sim._daemon_process`` (the service
``trainguard daemon`` runs, with keys: commands signed, events MACed, state snapshots written)
on a bus of its own: a fresh embedded bus file in the run folder, or a fresh topic prefix on
the Kafka broker given.

**Simulated time on the embedded bus.** The simulator owns the bus file's append clock
(:meth:`~trainguard.agent.bus.SQLiteBus.set_append_clock`), and the daemon process takes its
own clock and pulse clock from it, so every record (the ranks', and the daemon's ticks,
commands and audit entries) carries simulated time, and the state machine, which decides on
bus times only, lives in simulated time. The simulator moves the clock in *rounds*: it appends
the ranks' records of one or more instants with their own times and the clock moved to the last
one in the same transaction, then waits until the daemon's group has committed the position
past everything on the job's partition (its own ticks included), reads the commands that
committed with it and hands them to the model at the clock's time. Time moves on only then: a
daemon slower than simulated time holds the simulation back instead of falling behind it, and
every command carries the time of the round whose records decided it. While the job runs
undisturbed, one round covers up to ``window_s`` of simulated time (no command is due then);
from a fault until training resumes, one round covers one instant, and while every rank is
silent (restarting), rounds without records step the clock by the daemon's ``pulse_s`` so that
its pulse ticks keep the job's inputs dense, as they would in real time.

**On Kafka** the broker stamps records itself (``LogAppendTime``), so the simulation runs in
real time: the model's time is the wall time since the start, records are sent when their
time comes, commands are handed to the model at their append time. Choose the durations
accordingly (seconds, not hours).

**Measurements**: goodput against the Young-Daly model (:mod:`._results`), the daemon's lag
(wall seconds from a round's records being appended to the daemon's committed position passing
them: a round of several instants counts them as arriving at once, which real time would
spread out; with ``window_s`` 0 each instant is a round and its lag is what a daemon keeping
real-time pace would show for that instant's records), its CPU seconds per record folded and
its peak memory (from the process itself), and per fault the time to its restore command and to
the resume, and the number of restores. Optionally the daemon is SIGKILLed in the middle
(``kill_daemon_at_s``) and a new one started: the time until it is ready again is measured (the
lag of what was appended meanwhile is kept apart: it measures the restart), and every command
is counted, so that a decision made twice would show (as a duplicate command, or a second
restore for one fault).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from trainguard.agent.bus import (
    Bus,
    BusConfig,
    Consumer,
    SQLiteBus,
    TopicPartition,
    open_bus,
    parse_bus_url,
    partition_for,
)
from trainguard.agent.keys import CommandGate, KeyStore
from trainguard.daemon.admin import KeyAdmin
from trainguard.daemon.sim._model import Emission, Fault, JobModel, Shards, SimParams
from trainguard.daemon.sim._wire import Wire
from trainguard.schemas import Abort, Restore, Resume

__all__ = ["DaemonRun", "Measured", "SimConfig", "SimFailed", "run_simulation"]

_MS = 1000
_SESSION_TIMEOUT_S = 6.0
"""The daemon's group session (``[bus] session_timeout_s``): a SIGKILLed daemon's partitions
move to its successor this long after the kill."""


class SimFailed(RuntimeError):
    """The simulation could not run to its end: the daemon did not start or died, or it did
    not catch up within ``SimConfig.stall_timeout_s``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    """A simulation run.

    Attributes:
        params: the simulated job.
        faults: the faults to inject (training time, :mod:`._failures`).
        horizon_s: the run ends when the job has trained this long (training time).
        bus_url: ``sqlite:///...`` (simulated time; the file must not exist yet) or
            ``kafka://host:port`` (real time).
        run_dir: where the daemon's config, keys, logs and statistics go, and the step
            folders (``checkpoints/``) the daemon stores committed manifests in (created).
        job_id: the simulated job's id.
        prefix: topic prefix (and so consumer group) on the bus.
        window_s: embedded bus: longest simulated time one round covers while the job runs
            undisturbed, seconds; 0: one instant a round (a round's lag counts its instants as
            appended at once, module docstring).
        kill_daemon_at_s: SIGKILL the daemon once the simulation reaches this time (simulated
            seconds since the start) and start a new one; ``None``: never.
        pulse_s: the daemon's ``pulse_s`` (``[service]``), seconds.
        machine: ``[machine]`` settings of the daemon (``MachineConfig`` fields) over the
            simulator's defaults.
        service: ``[service]`` settings of the daemon (``DaemonConfig`` fields) over the
            simulator's defaults.
        stall_timeout_s: wall seconds the simulator waits for the daemon to catch up with one
            round (or to start) before it gives up.
    """

    params: SimParams
    faults: tuple[Fault, ...]
    horizon_s: float
    bus_url: str
    run_dir: Path
    job_id: str = "sim"
    prefix: str = "trainguard."
    window_s: float = 10.0
    kill_daemon_at_s: float | None = None
    pulse_s: float = 1.0
    machine: dict[str, object] = field(default_factory=dict)
    service: dict[str, object] = field(default_factory=dict)
    stall_timeout_s: float = 120.0


@dataclass(slots=True)
class DaemonRun:
    """One daemon process of the run: its pid, the wall seconds from its start to ready, and
    its statistics (``None`` when it was killed: a killed process writes none)."""

    pid: int
    ready_s: float | None = None
    stats: dict[str, float] | None = None


@dataclass(slots=True)
class Measured:
    """What a run measured besides the model's accounting.

    Attributes:
        model: the job model after the run (its ``accounting``).
        realtime: whether the run was in real time (Kafka).
        wall_s: wall seconds the run took.
        records: records the simulated ranks sent.
        heartbeats: heartbeats the simulated ranks sent (a batch counts its entries).
        batches: ``heartbeat-batch`` records among ``records``.
        rounds: rounds of the simulated clock (embedded bus).
        lag_s: per round (embedded) or per batch (Kafka), wall seconds from its records being
            appended to the daemon's committed position passing them.
        checkpoint_lag_s: embedded bus: the lags of ``lag_s`` whose round carried the shard
            records of a checkpoint (one per rank, in one instant: the bursts of the fold).
        restart_lag_s: the lags of the rounds (batches) appended from a daemon's SIGKILL until
            its successor caught up after the dead one's partitions moved to it
            (``_Runner._kill_daemon``): they measure the restart, whose readiness ``daemons``
            gives, and are not in ``lag_s``.
        daemons: every daemon process of the run, in order.
        ignored: commands the ranks' gate did not act on, by reason (``duplicate``:
            re-sent or re-read with the same content).
        commands: commands acted on, by type.
    """

    model: JobModel
    realtime: bool
    wall_s: float = 0.0
    records: int = 0
    heartbeats: int = 0
    batches: int = 0
    rounds: int = 0
    lag_s: list[float] = field(default_factory=list)
    checkpoint_lag_s: list[float] = field(default_factory=list)
    restart_lag_s: list[float] = field(default_factory=list)
    daemons: list[DaemonRun] = field(default_factory=list)
    ignored: dict[str, int] = field(default_factory=dict)
    commands: dict[str, int] = field(default_factory=dict)


# -- set-up ----------------------------------------------------------------------------------


def _daemon_settings(config: SimConfig, keys_dir: Path) -> str:
    """The daemon's TOML config for the run."""
    kind, _ = parse_bus_url(config.bus_url)
    machine: dict[str, object] = {
        "daemon_id": "sim-daemon",
        "heartbeat_interval_s": config.params.heartbeat_s,
        # A failure before the first commit restarts the job from its initial state.
        "allow_restart_from_scratch": True,
        **config.machine,
    }
    service: dict[str, object] = {
        "metrics_port": -1,
        "snapshot_interval_s": 5.0,
        "pulse_s": config.pulse_s,
        # In simulated time a commit per poll keeps the rounds short.
        **({"commit_interval_s": 0.0, "poll_s": 0.02} if kind == "sqlite" else {}),
        **config.service,
    }
    bus: dict[str, object] = {
        "url": config.bus_url,
        "prefix": config.prefix,
        "session_timeout_s": _SESSION_TIMEOUT_S,
        **({"idle_poll_s": 0.002} if kind == "sqlite" else {}),
    }
    lines = []
    for table, values in (("bus", bus), ("machine", machine), ("service", service)):
        lines.append(f"[{table}]")
        lines += [f"{k} = {_toml(v)}" for k, v in values.items()]
    lines += ["[security]", f"keys_dir = {_toml(str(keys_dir))}", "require_auth = true"]
    return "\n".join(lines) + "\n"


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return orjson.dumps(str(value)).decode()  # a JSON string is a TOML basic string


class _Daemon:
    """The daemon processes of one run (module docstring)."""

    def __init__(self, config_path: Path, run_dir: Path, simulated: bool) -> None:
        self._config = config_path
        self._dir = run_dir
        self._simulated = simulated
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs: list[DaemonRun] = []

    def start(self) -> None:
        (self._dir / "ready").unlink(missing_ok=True)
        command = [
            sys.executable,
            "-m",
            "trainguard.daemon.sim._daemon_process",
            str(self._config),
            str(self._dir),
        ]
        if self._simulated:
            command.append("--simulated-clock")
        log = (self._dir / f"daemon-{len(self.runs)}.log").open("ab")
        with log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=log, env=os.environ.copy(), start_new_session=True
            )
        self.runs.append(DaemonRun(self.proc.pid))

    async def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        ready = self._dir / "ready"
        while not ready.exists():
            if self.proc is not None and self.proc.poll() is not None:
                raise SimFailed(self._died(self.proc.returncode))
            if time.monotonic() > deadline:
                raise SimFailed(f"the daemon was not ready within {timeout_s:g} s")
            await asyncio.sleep(0.01)
        self.runs[-1].ready_s = float(ready.read_text())

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise SimFailed(self._died(self.proc.returncode))

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        stats = self._dir / f"stats-{proc.pid}.json"
        if stats.exists():
            self.runs[-1].stats = orjson.loads(stats.read_bytes())

    def _died(self, returncode: int) -> str:
        """What to say of a daemon process that ended with ``returncode``: how (the signal's
        name, or the exit status) and the last lines of its log, whole."""
        how = (
            f"was killed by {signal.Signals(-returncode).name}"
            if returncode < 0
            else f"exited with status {returncode}"
        )
        logs = sorted(self._dir.glob("daemon-*.log"), key=lambda p: p.stat().st_mtime)
        lines = logs[-1].read_text(errors="replace").splitlines()[-5:] if logs else []
        tail = "".join(f"\n  {line}" for line in lines)
        where = f" (its log: {logs[-1]})" if logs else ""
        return f"the daemon {how}{where}{':' if tail else ''}{tail}"


@contextlib.contextmanager
def _daemon(config_path: Path, run_dir: Path, simulated: bool) -> Iterator[_Daemon]:
    daemon = _Daemon(config_path, run_dir, simulated)
    try:
        yield daemon
    finally:
        daemon.stop()


# -- the run ---------------------------------------------------------------------------------


def run_simulation(config: SimConfig) -> Measured:
    """Run ``config``'s simulation (module docstring) and return what it measured.

    Raises:
        SimFailed: the daemon did not start, died, or fell behind by more than
            ``stall_timeout_s``.
        BusError: the bus failed.
        FileExistsError: the embedded bus file exists already (a simulation needs a fresh
            one: it moves the file's clock).
    """
    config.run_dir.mkdir(parents=True, exist_ok=True)
    kind, location = parse_bus_url(config.bus_url)
    simulated = kind == "sqlite"
    if simulated and Path(location).exists():
        raise FileExistsError(f"{location}: a simulation needs a fresh bus file")
    keys_dir = config.run_dir / "keys"
    KeyAdmin(keys_dir).init([config.job_id])
    store = KeyStore(keys_dir)
    kid = store.current("event", config.job_id)
    assert kid is not None  # made by init
    event_key = (kid, store.secret_key("event", kid, config.job_id))
    settings = config.run_dir / "daemon.toml"
    settings.write_text(_daemon_settings(config, keys_dir))
    gate = CommandGate(config.job_id, 0, store.public_keys())
    model = JobModel(config.params, config.faults, config.horizon_s)
    measured = Measured(model, realtime=not simulated)
    wire = Wire(
        config.job_id, config.params, model.host_of, event_key, config.run_dir / "checkpoints"
    )
    began = time.monotonic()
    with _daemon(settings, config.run_dir, simulated) as daemon:
        asyncio.run(_run(config, model, wire, gate, daemon, measured))
    measured.daemons = daemon.runs
    measured.heartbeats, measured.batches = wire.heartbeats, wire.batches
    measured.wall_s = time.monotonic() - began
    measured.ignored = {str(reason): count for reason, count in gate.ignored.items()}
    return measured


async def _run(
    config: SimConfig,
    model: JobModel,
    wire: Wire,
    gate: CommandGate,
    daemon: _Daemon,
    measured: Measured,
) -> None:
    bus_config = BusConfig(url=config.bus_url, prefix=config.prefix, idle_poll_s=0.002)
    async with open_bus(bus_config) as bus:
        await _Runner(config, bus, model, wire, gate, daemon, measured).run()


class _Runner:
    """One run's loop (module docstring)."""

    def __init__(
        self,
        config: SimConfig,
        bus: Bus,
        model: JobModel,
        wire: Wire,
        gate: CommandGate,
        daemon: _Daemon,
        measured: Measured,
    ) -> None:
        self.c = config
        self.bus = bus
        self.model = model
        self.wire = wire
        self.gate = gate
        self.daemon = daemon
        self.m = measured
        self.group = f"{config.prefix}daemon"
        self.t0_ms = 0
        self.partition = 0
        self.commands: Consumer | None = None
        self.command_tp = TopicPartition("commands", 0)
        self.pulse_ms = round(config.pulse_s * _MS)
        self.kill_at_ms = (
            None if config.kill_daemon_at_s is None else round(config.kill_daemon_at_s * _MS)
        )
        # After a SIGKILL: when the dead daemon's group session expires (monotonic seconds);
        # what is appended until the daemon caught up after that measures the restart.
        self.restart_until: float | None = None

    async def run(self) -> None:
        partitions = await self.bus.partitions("events")
        self.partition = partition_for(self.c.job_id, partitions)
        command_partition = partition_for(self.c.job_id, await self.bus.partitions("commands"))
        self.command_tp = TopicPartition("commands", command_partition)
        self.commands = await self.bus.assign({self.command_tp: 0})
        try:
            if isinstance(self.bus, SQLiteBus):
                self.t0_ms = time.time_ns() // 1_000_000
                await self.bus.set_append_clock(self.t0_ms)
                self.daemon.start()
                await self.daemon.wait_ready(self.c.stall_timeout_s)
                await self._simulated(self.bus)
            else:
                self.daemon.start()
                await self.daemon.wait_ready(self.c.stall_timeout_s)
                self.t0_ms = time.time_ns() // 1_000_000
                await self._realtime()
        finally:
            await self.commands.close()

    # -- embedded bus: simulated time ------------------------------------------------------

    async def _simulated(self, bus: SQLiteBus) -> None:
        model = self.model
        now = 0  # model ms the clock stands at
        last_input = 0  # model ms of the job's latest record (a pulse comes pulse_s after)
        while not model.ended:
            nxt = model.next_ms()
            if nxt is None:
                break
            if model.silent and nxt > last_input + self.pulse_ms:
                # Nothing is sent: let the daemon pulse, as it would in real time.
                # One ms past the pulse: the daemon's pulse rule compares float seconds.
                now = last_input + self.pulse_ms + 1
                model.advance(now)
                await self._round(bus, [], now, expect_tick=True)
                last_input = now
                continue
            batch: list[tuple[int, bytes]] = []
            checkpoint = False
            until = nxt
            window_end = nxt + round(self.c.window_s * _MS)
            disturbed = model.disturbed
            while True:
                emitted = model.advance(until)
                checkpoint = checkpoint or any(isinstance(e, Shards) for e in emitted)
                batch += self._encode(emitted)
                now = until
                nxt = model.next_ms()
                if disturbed or model.disturbed or model.ended or nxt is None:
                    break
                if nxt >= window_end or nxt > until + self.pulse_ms:
                    break
                until = nxt
            if batch:
                last_input = now
            await self._round(bus, batch, now, expect_tick=False, checkpoint=checkpoint)
            if self.kill_at_ms is not None and now >= self.kill_at_ms:
                await self._kill_daemon()
        if not model.ended:
            model.finish(now)

    async def _round(
        self,
        bus: SQLiteBus,
        batch: list[tuple[int, bytes]],
        now: int,
        *,
        expect_tick: bool,
        checkpoint: bool = False,
    ) -> None:
        """Append ``batch`` (model ms, value) with the clock moved to ``now``; wait for the
        daemon to commit past it; hand the commands to the model. ``checkpoint``: the batch
        holds a checkpoint's shard records (its lag is also kept apart)."""
        key = self.c.job_id
        records = [(key, value, self.t0_ms + at) for at, value in batch]
        before = await self._end()
        await bus.import_records("events", records, clock_ms=self.t0_ms + now)
        appended = time.monotonic()
        self.m.records += len(records)
        self.m.rounds += 1
        await self._caught_up(before + len(records), expect_tick)
        if records:
            lag = time.monotonic() - appended
            if self.restart_until is not None:
                if appended > self.restart_until:
                    self.restart_until = None  # caught up after the rebalance
                self.m.restart_lag_s.append(lag)
            else:
                self.m.lag_s.append(lag)
                if checkpoint:
                    self.m.checkpoint_lag_s.append(lag)
        released = await self._take_commands()
        assert not released, "a round runs the model to its end before its commands"

    async def _end(self) -> int:
        ends = await self.bus.end_offsets("events")
        return ends.get(TopicPartition("events", self.partition), 0)

    async def _caught_up(self, end: int, expect_tick: bool) -> None:
        """Wait until the daemon's group has committed the position past the job's partition
        end (at least ``end``; its own ticks move the end on); with ``expect_tick``, until a
        record of the daemon's followed (its pulse), or a few of its polls passed."""
        deadline = time.monotonic() + self.c.stall_timeout_s
        patience = time.monotonic() + 2.0
        tp = TopicPartition("events", self.partition)
        while True:
            positions = await self.bus.group_positions(self.group, "events")
            current = await self._end()
            committed = positions.get(tp, 0)
            tick_seen = not expect_tick or current > end or time.monotonic() > patience
            if committed >= current >= end and tick_seen:
                return
            self.daemon.check_alive()
            if time.monotonic() > deadline:
                raise SimFailed(
                    f"the daemon did not catch up within {self.c.stall_timeout_s:g} s "
                    f"(committed {committed}, end {current})"
                )
            await asyncio.sleep(0.002)

    async def _take_commands(self, wait_s: float = 0.0) -> list[Emission]:
        """Hand the commands on the bus that the ranks' gate admits to the model, at their
        append times: in simulated time every command committed so far (the model must not
        send another record before it has them), in real time what arrives within
        ``wait_s``.

        Returns what the ranks sent up to a command's time that the model had not run yet
        (real time, when the loop runs behind the clock; nothing in simulated time, whose
        rounds run the model to their end first): the caller sends it."""
        assert self.commands is not None
        released: list[Emission] = []
        records = await self.commands.getmany(timeout_s=wait_s, max_records=1000)
        if not self.m.realtime:
            ends = await self.bus.end_offsets("commands")
            while await self.commands.position(self.command_tp) < ends[self.command_tp]:
                records += await self.commands.getmany(timeout_s=0.01, max_records=1000)
        for record in records:
            if record.value is None:
                continue
            verdict = self.gate.admit(record.value)
            if isinstance(verdict, Restore | Resume | Abort):
                name = type(verdict).__name__.lower()
                self.m.commands[name] = self.m.commands.get(name, 0) + 1
                at = max(record.timestamp_ms - self.t0_ms, 0)
                released += self.model.advance(at)
                self.model.command(at, verdict)
        return released

    async def _kill_daemon(self) -> None:
        """SIGKILL the daemon and start a new one; wait until it is ready.

        The new daemon's group holds the dead one's partitions until its session expires
        (``_SESSION_TIMEOUT_S``); the rebalance then hands them over and it rebuilds their
        jobs. What is appended until it caught up after that measures the restart
        (``Measured.restart_lag_s``): the rounds appended before the expiry and the first one
        after it (embedded bus), the batches committed until it caught up after it (Kafka)."""
        self.kill_at_ms = None
        self.restart_until = time.monotonic() + _SESSION_TIMEOUT_S
        self.daemon.kill()
        self.daemon.start()
        await self.daemon.wait_ready(self.c.stall_timeout_s)

    def _encode(self, emissions: list[Emission]) -> list[tuple[int, bytes]]:
        for e in emissions:
            if isinstance(e, Shards):
                # The step folder a checkpoint would leave, where the daemon stores the
                # manifest when the step commits (the shards are not written).
                self.wire.step_folder(e.generation, e.step).mkdir(parents=True, exist_ok=True)
        return [(e.at_ms, value) for e in emissions for value in self.wire.encode(e)]

    # -- Kafka: real time ------------------------------------------------------------------

    async def _realtime(self) -> None:
        model = self.model
        assert self.commands is not None
        pending: list[tuple[int, float]] = []  # (end offset after a batch, wall time sent)
        while not model.ended:
            nxt = model.next_ms()
            if nxt is None:
                break
            now = self._now_ms()
            if nxt > now:
                await self._send(await self._take_commands(min((nxt - now) / _MS, 0.05)), pending)
                self._measure_lag(pending, await self._committed())
                continue
            # Commands first, also when sending runs behind the clock (a large job): a rank
            # obeys a command as soon as it arrives, not after the backlog.
            await self._send(await self._take_commands(), pending)
            await self._send(model.advance(now), pending)
            self.daemon.check_alive()
            if self.kill_at_ms is not None and now >= self.kill_at_ms:
                await self._kill_daemon()
        if not model.ended:
            model.finish(self._now_ms())

    async def _send(self, emissions: list[Emission], pending: list[tuple[int, float]]) -> None:
        """Send ``emissions`` on ``events`` and note the partition's end for the lag."""
        batch = self._encode(emissions)
        if batch:
            futures = [await self.bus.send("events", self.c.job_id, v) for _, v in batch]
            await asyncio.gather(*futures)
            pending.append((await self._end(), time.monotonic()))
            self.m.records += len(batch)

    def _now_ms(self) -> int:
        return time.time_ns() // 1_000_000 - self.t0_ms

    async def _committed(self) -> int:
        positions = await self.bus.group_positions(self.group, "events")
        return positions.get(TopicPartition("events", self.partition), 0)

    def _measure_lag(self, pending: list[tuple[int, float]], committed: int) -> None:
        """Note the lags of the batches ``committed`` passed: the restart's while one is on
        (those sent before the SIGKILL that the dead daemon never committed among them)."""
        lags = self.m.lag_s if self.restart_until is None else self.m.restart_lag_s
        while pending and pending[0][0] <= committed:
            lags.append(time.monotonic() - pending.pop(0)[1])
        if not pending and self.restart_until is not None and time.monotonic() > self.restart_until:
            self.restart_until = None  # caught up after the rebalance
