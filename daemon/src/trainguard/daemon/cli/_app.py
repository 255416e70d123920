"""The ``trainguard`` command line (typer).

Each command imports what it needs when it runs, so ``trainguard --help`` stays fast and a
node that only supervises workers never imports the daemon's service code.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import replace
from importlib.metadata import version as _dist_version
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn, TypeVar

import typer

from trainguard.agent.bus import DEFAULT_BUS_URL, BusError
from trainguard.daemon.cli._options import (
    DEFAULT_PREFIX,
    BusOption,
    ConfigFile,
    ConfiguredBus,
    ConfiguredPrefix,
    PrefixOption,
    given_path,
    os_failure,
    other_prefixes,
)

if TYPE_CHECKING:
    from trainguard.agent.bus import BusConfig
    from trainguard.agent.supervisor import SupervisorConfig

__all__ = ["app", "main"]

_T = TypeVar("_T")

app = typer.Typer(
    name="trainguard",
    help="Fault recovery for distributed PyTorch training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bus_app = typer.Typer(help="Inspect the message bus.", no_args_is_help=True)
app.add_typer(bus_app, name="bus")


@app.command()
def version() -> None:
    """Print trainguard's version."""
    typer.echo(_dist_version("trainguard"))


@bus_app.command("check")
def bus_check(
    bus: ConfiguredBus = None,
    config: ConfigFile = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the bus.")] = 15.0,
    topic_prefix: ConfiguredPrefix = None,
) -> None:
    """Connect to the bus and print each topic's end offsets (on Kafka, creating missing
    topics first); name the other topic prefixes when this one holds no record.

    An embedded bus must exist already: a mistyped sqlite:/// path is an error, not a new
    file. Kafka TLS/SASL settings: the config file's \\[bus.security] table, overridden key by
    key by the TRAINGUARD_KAFKA_* variables (deploy/kafka/README.md).
    """
    from trainguard.agent.bus import open_bus
    from trainguard.daemon.service import load_daemon_config

    try:
        settings = load_daemon_config(config, bus_url=bus)
    except OSError as exc:
        _fail(os_failure(exc, "read the config file", config))
    except ValueError as exc:
        _fail(str(exc))
    bus_config = replace(
        settings.bus, connect_timeout_s=timeout, client_id="trainguard-check", create=False
    )
    if topic_prefix is not None:
        bus_config = replace(bus_config, prefix=topic_prefix)

    async def _check() -> None:
        records = 0
        async with open_bus(bus_config) as b:
            for spec in bus_config.topics:
                ends = await b.end_offsets(spec.name)
                total = sum(ends.values())
                records += total
                policy = "compact" if spec.compacted else "delete"
                typer.echo(f"{spec.name:12} {len(ends):3} partitions  {policy:7}  {total} records")
        if not records:
            hint = await other_prefixes(bus_config)
            typer.echo(f"no records under topic prefix {bus_config.prefix!r}; {hint}")

    try:
        asyncio.run(_check())
    except BusError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc


def _fail(message: str) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _parse_ranks(spec: str) -> tuple[int, ...]:
    """``"0-3,6"`` -> ``(0, 1, 2, 3, 6)``; raises ``typer.BadParameter``."""
    ranks: list[int] = []
    for part in filter(None, spec.split(",")):
        first, _, last = part.partition("-")
        try:
            ranks.extend(range(int(first), int(last or first) + 1))
        except ValueError as exc:
            raise typer.BadParameter(f"{part!r} is not N or N-M", param_hint="--ranks") from exc
    return tuple(ranks)


def _check_init_from(bus: BusConfig, snapshot_id: str, config: SupervisorConfig) -> None:
    """Refuse a ``--init-from`` snapshot the workers could not start from, before any starts,
    by the rule of ``trainguard checkpoints compat`` (world size, abandoned timeline, this
    node's shard files); print what it warns about. A snapshot the workers cannot load would
    otherwise surface as workers failing, restarted by the daemon until it gives up.

    Raises:
        ConfigError: the snapshot cannot seed the job (every reason named), or is unknown.
        RestoreTimeout: the bus could not be read.
    """
    from trainguard.agent import ConfigError
    from trainguard.daemon.cli._checkpoints import judge_init_from

    per_node = config.nproc_per_node
    world_size = None if per_node is None else config.nnodes * per_node
    verdict = judge_init_from(
        bus,
        snapshot_id,
        world_size=world_size,
        ranks=config.local_ranks(),
        verify_keys=config.keys.verify,
    )
    for note in verdict.warnings:
        typer.secho(f"warning: --init-from {snapshot_id}: {note}", fg=typer.colors.YELLOW, err=True)
    if not verdict.compatible:
        job = "this job" if world_size is None else f"this job of world size {world_size}"
        raise ConfigError(
            f"--init-from {snapshot_id} cannot seed {job} (the rule of trainguard checkpoints "
            f"compat): {'; '.join(verdict.refusals)}"
        )


def _check_init_from_patiently(bus: BusConfig, snapshot_id: str, config: SupervisorConfig) -> None:
    """:func:`_check_init_from`, waiting out a bus that cannot be read (an outage) as the
    supervisor waits for it (docs/operations.md, "Agents and supervisors during a bus outage"):
    retried after 0.1 s, doubling to 2 s, with a warning when the outage begins, every
    ``warn_every_s`` while it lasts, and an info line when it ends. No signal handler is
    installed yet: SIGTERM ends the wait at once (status 143), and so does SIGINT.

    Raises:
        ConfigError: the snapshot cannot seed the job (:func:`_check_init_from`).
        BusError: a bus that cannot work (not retriable).
    """
    import time

    import structlog

    from trainguard.agent import RestoreTimeout
    from trainguard.agent.supervisor import EXIT_SIGNALLED

    log = structlog.get_logger("trainguard.supervisor")
    what = f"checking the --init-from snapshot {snapshot_id}"
    began = warned = None
    pause_s = 0.1
    try:
        while True:
            try:
                _check_init_from(bus, snapshot_id, config)
            except (RestoreTimeout, BusError) as exc:
                if isinstance(exc, BusError) and not exc.retriable:
                    raise
                now = time.monotonic()
                if began is None or warned is None:
                    began = warned = now
                    log.warning(
                        f"bus outage: {what} failed; retrying until the bus answers",
                        job_id=config.job_id,
                        error=str(exc),
                    )
                elif now - warned >= config.warn_every_s:
                    warned = now
                    log.warning(
                        f"bus outage goes on: {what} still fails",
                        job_id=config.job_id,
                        waited_s=round(now - began, 1),
                        error=str(exc),
                    )
                time.sleep(pause_s)
                pause_s = min(2.0, 2 * pause_s)
                continue
            if began is not None:
                log.info(
                    f"bus outage over: {what} succeeded",
                    job_id=config.job_id,
                    waited_s=round(time.monotonic() - began, 1),
                )
            return
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_SIGNALLED) from None


async def _until_signalled(main: Callable[[asyncio.Event], Awaitable[_T]]) -> _T:
    """Run ``main(stop)``; SIGTERM and SIGINT set ``stop`` (``main`` then winds down)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return await main(stop)


@app.command()
def daemon(
    bus: ConfiguredBus = None,
    config: Annotated[
        Path | None,
        typer.Option(
            parser=given_path,
            help="TOML file with \\[bus], \\[machine], \\[service] and \\[security] tables; "
            "every key: deploy/daemon.example.toml.",
        ),
    ] = None,
    topic_prefix: ConfiguredPrefix = None,
    heartbeat_timeout: Annotated[
        float | None, typer.Option(help="Seconds of silence after which a rank is dead.")
    ] = None,
    restore_timeout: Annotated[
        float | None, typer.Option(help="Seconds for all ranks to acknowledge a restore.")
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            envvar="TRAINGUARD_METRICS_PORT",
            help="Port of /metrics and /healthz; 0: any free port (logged); -1: none; "
            "default: the config file's, else 9464.",
        ),
    ] = None,
    keys: Annotated[
        Path | None,
        typer.Option(
            envvar="TRAINGUARD_KEYS",
            parser=given_path,
            help="Key directory (trainguard keys init); default: the config file's \\[security] "
            "keys_dir, else ~/.config/trainguard/keys if initialised, else none (insecure).",
        ),
    ] = None,
    require_auth: Annotated[
        bool | None,
        typer.Option(
            "--require-auth/--no-require-auth",
            envvar="TRAINGUARD_REQUIRE_AUTH",
            help="Refuse to start without keys and refuse every unauthenticated event; "
            "default: the config file's, else off.",
        ),
    ] = None,
    standby: Annotated[
        bool,
        typer.Option(
            help="Embedded bus: wait for the daemon already serving the bus file to exit, then "
            "take over (without it a second daemon exits 2). Kafka: no effect (the consumer "
            "group moves a dead instance's jobs)."
        ),
    ] = False,
    console: Annotated[bool, typer.Option(help="Human-readable logs instead of JSON.")] = False,
) -> None:
    """Run the daemon: fold every job's events, detect failures, coordinate restores.

    Serves Prometheus metrics on /metrics and readiness on /healthz (docs/operations.md).
    Stops cleanly on SIGTERM or SIGINT (consumed positions committed; exit 0). A bus that
    cannot be reached, at the start or later, is waited for (not ready meanwhile), and a
    signal ends that wait at once; exit 2 only for a bad setting or a bus that cannot work
    (a malformed URL, credentials the broker refuses, topics it refuses to create). One daemon
    per embedded bus file: a second exits 2 naming the first, unless --standby.
    """
    from trainguard.agent.keys import KeyStoreError
    from trainguard.daemon.service import (
        DaemonService,
        HealthServer,
        configure_logging,
        load_daemon_config,
        load_keys,
    )

    machine = {
        k: v
        for k, v in {
            "heartbeat_timeout_s": heartbeat_timeout,
            "restore_timeout_s": restore_timeout,
        }.items()
        if v is not None
    }
    try:
        settings = load_daemon_config(
            config,
            bus_url=bus,
            machine=machine,
            security_overrides={"keys_dir": keys, "require_auth": require_auth},
            metrics_port=metrics_port,
        )
        daemon_keys = load_keys(settings.security)
    except OSError as exc:  # the key store words its own
        _fail(os_failure(exc, "read the config file", config))
    except (ValueError, KeyStoreError) as exc:
        _fail(str(exc))
    # After the settings: a daemon that cannot start says why in one line on stderr, and
    # leaves the process's logging as it found it.
    configure_logging(json=not console)
    if topic_prefix is not None:
        settings = replace(settings, bus=replace(settings.bus, prefix=topic_prefix))
    service = DaemonService(settings, keys=daemon_keys)
    with contextlib.ExitStack() as serving:
        if settings.metrics_port >= 0:
            server = HealthServer(
                service.metrics,
                service.not_ready_reason,
                host=settings.metrics_host,
                port=settings.metrics_port,
            )
            try:
                serving.enter_context(server)
            except OSError as exc:
                # Before the bus is opened: nothing was read or written.
                typer.secho(
                    f"error: {_unservable(settings.metrics_host, settings.metrics_port, exc)}",
                    fg=typer.colors.RED,
                    err=True,
                )
                raise typer.Exit(2) from exc
        if daemon_keys is None:
            import structlog

            structlog.get_logger("trainguard.daemon").warning(
                "no keys: commands and manifests unsigned, events unauthenticated, no "
                "snapshots (insecure; trainguard keys init, docs/security.md)"
            )
        try:
            asyncio.run(_until_signalled(functools.partial(service.run, standby=standby)))
        except BusError as exc:
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(2) from exc


def _unservable(host: str, port: int, exc: OSError) -> str:
    """Why ``/metrics`` and ``/healthz`` cannot be served on ``host:port``, and the settings
    that serve them without that port."""
    untouched = "The daemon did not start; the bus was not touched."
    if exc.errno != errno.EADDRINUSE:
        return (
            f"cannot serve /metrics and /healthz on {host}:{port}: {exc.strerror or exc}. "
            "Check [service] metrics_host, or give --metrics-port -1 (no /metrics and /healthz). "
            f"{untouched}"
        )
    return (
        f"port {port} on {host} is taken by another process (a second daemon, or another "
        "exporter: OpenTelemetry's Prometheus exporter defaults to 9464 too). Give another "
        "port with --metrics-port, TRAINGUARD_METRICS_PORT or [service] metrics_port, or a "
        "value that needs no free port: 0 (any free port, logged as 'metrics server "
        f"listening') or -1 (no /metrics and /healthz). {untouched}"
    )


@app.command(context_settings={"allow_interspersed_args": False})
def run(
    command: Annotated[
        list[str], typer.Argument(metavar="COMMAND", help="The worker command, after --.")
    ],
    job: Annotated[str, typer.Option(envvar="TRAINGUARD_JOB", help="The job's name.")],
    bus: BusOption = DEFAULT_BUS_URL,
    nproc_per_node: Annotated[
        int | None,
        typer.Option(
            help="Start this many local ranks (torchrun-style env); else run COMMAND once."
        ),
    ] = None,
    nnodes: Annotated[int, typer.Option(help="Number of nodes.")] = 1,
    node_rank: Annotated[int, typer.Option(help="This node's index.")] = 0,
    master_addr: Annotated[
        str, typer.Option(help="Rendezvous host (rank 0's node).")
    ] = "127.0.0.1",
    master_port: Annotated[
        int | None, typer.Option(help="Rendezvous port; default: a free port per generation.")
    ] = None,
    ranks: Annotated[
        str, typer.Option(help="Plain mode: the ranks COMMAND hosts, e.g. 0-7 (for exit reports).")
    ] = "",
    grace: Annotated[float, typer.Option(help="Seconds between SIGTERM and SIGKILL.")] = 10.0,
    topic_prefix: PrefixOption = DEFAULT_PREFIX,
    init_from: Annotated[
        str | None,
        typer.Option(
            help="Start the job from this committed snapshot of another job (JOB/gG/sS; "
            "checked on the bus first, passed to the workers as TRAINGUARD_INIT_FROM)."
        ),
    ] = None,
    continue_job: Annotated[
        bool,
        typer.Option(
            "--continue",
            help="Continue a job that was stopped (trainguard stop, a signal) or failed, from "
            "its latest committed snapshot; give it on every node. Without it such a job is "
            "refused. A running job is joined either way (by a supervisor restarted after "
            "this node's previous one died: one supervisor per job and node, a second exits 2).",
        ),
    ] = False,
    daemon_timeout: Annotated[
        float,
        typer.Option(
            help="Warn when no daemon has read the job's events for this many seconds; also the "
            "longest wait, once the workers finished, for the daemon to find the whole job "
            "finished, every node's ranks (0: no daemon expected: never warn, exit at once)."
        ),
    ] = 30.0,
    warn_every: Annotated[
        float, typer.Option(help="Seconds between two such warnings while it lasts.")
    ] = 30.0,
    daemon_group: Annotated[
        str | None,
        typer.Option(
            help="The daemon's consumer group (for that check); default '<topic prefix>daemon'."
        ),
    ] = None,
    stop_timeout: Annotated[
        float,
        typer.Option(
            help="On SIGTERM/Ctrl-C, seconds until exit (plus about 2 s to close connections): "
            "stop the workers, deliver the stop request and exit reports, await the daemon's "
            "confirmation; what the bus has not taken by then stays in this node's spool."
        ),
    ] = 20.0,
    batch_heartbeats: Annotated[
        float,
        typer.Option(
            envvar="TRAINGUARD_BATCH_HEARTBEATS",
            help="Send this node's heartbeats as one heartbeat-batch record every this many "
            "seconds (the workers hand theirs to the supervisor); 0: each rank sends its own.",
        ),
    ] = 0.0,
    warm: Annotated[
        bool,
        typer.Option(
            help="Keep a warm spare per local rank (--nproc-per-node) and restart ranks from "
            "their spares, cold when none is ready; COMMAND must call "
            "trainguard.agent.await_handoff() (docs/warm-restarts.md)."
        ),
    ] = False,
    console: Annotated[bool, typer.Option(help="Human-readable logs instead of JSON.")] = False,
) -> None:
    """Supervise this node's workers: start COMMAND, report exits, restart on restore orders.

    SIGTERM or Ctrl-C stops the whole job (every node's workers) as 'stopped', like
    `trainguard stop JOB`; once this node's workers all finished (waiting for the daemon to
    judge the finish) it only ends the wait, unless the daemon holds a restore. Exit status:
    0 finished, 3 failed (aborted), 4 stopped, 143 signalled without the daemon's
    confirmation, 2 refused or a bad setting (docs/operations.md). Kafka TLS/SASL settings
    come from the TRAINGUARD_KAFKA_* variables, which the workers inherit. Example:
    trainguard run --job j1 --nproc-per-node 2 -- python train.py
    """
    from trainguard.agent import AgentError
    from trainguard.agent.bus import BusConfig, load_kafka_security
    from trainguard.agent.keys import agent_keys_from_env
    from trainguard.agent.supervisor import Supervisor, SupervisorConfig
    from trainguard.daemon.service import configure_logging

    configure_logging(json=not console)
    try:
        security = load_kafka_security()
    except ValueError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    bus_config = BusConfig(
        url=bus, prefix=topic_prefix, client_id=f"supervisor-{node_rank}", security=security
    )
    try:
        # TRAINGUARD_DAEMON_PUBLIC_KEYS and TRAINGUARD_EVENT_KEY (docs/security.md); the
        # workers inherit them.
        keys = agent_keys_from_env(os.environ)
        config = SupervisorConfig(
            job_id=job,
            bus=bus_config,
            command=command,
            nproc_per_node=nproc_per_node,
            nnodes=nnodes,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=master_port,
            ranks=_parse_ranks(ranks),
            grace_s=grace,
            keys=keys,
            continue_job=continue_job,
            daemon_group=daemon_group,
            daemon_timeout_s=daemon_timeout,
            warn_every_s=warn_every,
            stop_timeout_s=stop_timeout,
            heartbeat_batch_s=batch_heartbeats,
            warm=warm,
        )
        if init_from is not None:
            _check_init_from_patiently(bus_config, init_from, config)
            config = replace(config, env={"TRAINGUARD_INIT_FROM": init_from})
        code = asyncio.run(_until_signalled(Supervisor(config).run))
    except (AgentError, BusError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    raise typer.Exit(code)


@app.command()
def demo(
    bus: Annotated[
        str | None,
        typer.Option(help="Bus URL; default: an embedded bus in the work folder (no server)."),
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="Seed of the kill step; default: random.")
    ] = None,
    steps: Annotated[
        int,
        typer.Option(
            help="Training steps (at least 46: the kill step is drawn from 25 to steps - 21)."
        ),
    ] = 240,
    workdir: Annotated[
        Path | None, typer.Option(help="Work folder; default: a fresh temporary folder.")
    ] = None,
    cache_dir: Annotated[
        Path | None,
        typer.Option(
            help="Where reference runs are cached (the few most recently used are kept); "
            "default: ~/.cache/trainguard/demo ($XDG_CACHE_HOME for ~/.cache when set)."
        ),
    ] = None,
    fault: Annotated[
        str | None,
        typer.Option(
            help="Inject these faults instead of the SIGKILL, e.g. 'nan@step=120,rank=1', "
            "'hang@step=100,rank=0' or 'spike@step=90,factor=10' (TRAINGUARD_FAULTS syntax: "
            "kill, exit, hang, slow (factor=), nan, spike (factor=), bitflip, "
            "stall-checkpoint; ';' between faults)."
        ),
    ] = None,
    step_sleep: Annotated[
        float,
        typer.Option(
            help="Seconds each training step sleeps, so that hang and loss detectors have "
            "samples before the fault (try 0.1 with --fault)."
        ),
    ] = 0.0,
) -> None:
    """Train a real 2-rank job, SIGKILL rank 1 at a random step (or inject --fault), and watch
    trainguard recover.

    Exits 0 when the job recovered exactly: final parameters bitwise equal to an uninterrupted
    run (one that skipped the same batches, if a restore skipped some), no sample skipped or
    repeated, and for the default SIGKILL exactly one restore.
    """
    from trainguard.agent import ConfigError
    from trainguard.daemon.demo import DemoOptions, run_demo

    try:
        options = DemoOptions(
            bus=bus, seed=seed, steps=steps, workdir=workdir, fault=fault, step_sleep=step_sleep
        )
        if cache_dir is not None:
            options = replace(options, cache=cache_dir)
        ok = run_demo(options)
    except OSError as exc:  # a work or cache folder that cannot be made, no examples/charlm
        _fail(os_failure(exc, "use"))
    except (RuntimeError, BusError, ConfigError) as exc:
        _fail(str(exc))
    raise typer.Exit(0 if ok else 1)


from trainguard.daemon.cli._status import register as _register_status  # noqa: E402

_register_status(app)

from trainguard.daemon.cli._checkpoints import register as _register_checkpoints  # noqa: E402

_register_checkpoints(app)

from trainguard.daemon.cli._report import register as _register_report  # noqa: E402

_register_report(app)

from trainguard.daemon.cli._replay import register as _register_replay  # noqa: E402

_register_replay(app)

from trainguard.daemon.cli._keys import register as _register_keys  # noqa: E402

_register_keys(app)

from trainguard.daemon.cli._snapshots import register as _register_snapshots  # noqa: E402

_register_snapshots(app)

from trainguard.daemon.cli._stop import register as _register_stop  # noqa: E402

_register_stop(app)

from trainguard.daemon.cli._sim import register as _register_sim  # noqa: E402

_register_sim(app)


def main() -> None:
    """Entry point of the ``trainguard`` console script."""
    app()


if __name__ == "__main__":
    main()
