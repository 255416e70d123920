"""``trainguard snapshots list|show|verify``: the daemon's job-state snapshots on the bus
(:mod:`trainguard.daemon.service._snapshot_envelope`; ``docs/security.md``).

* ``list`` prints each job's latest snapshot header: partition, covered offset, the state's
  clock, key ids, size and, for one written in chunks, their number. Headers are shown as
  written, **unverified**.
* ``show JOB`` verifies and decrypts one job's snapshot with the keys its header names, read
  from the key directory (live or retired), and no other, then prints the state's summary.
* ``verify`` opens every snapshot with the daemon's live keys (what a starting daemon holds)
  and checks each partition's round is complete; exit status 1 names every bad snapshot and
  every partition a daemon would fold from the log instead.

Exit status 2 for an unreachable bus, an unknown job, or a missing or unreadable key.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import orjson
import typer

from trainguard.agent.bus import BusError
from trainguard.daemon.cli._options import ConfiguredBus, ConfiguredPrefix, given_path, os_failure

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from trainguard.agent.bus import BusConfig, Record
    from trainguard.agent.keys import KeyStore
    from trainguard.daemon.core import JobState
    from trainguard.daemon.service import DaemonConfig

__all__ = ["register"]

snapshots_app = typer.Typer(
    help="List, show (decrypted) and verify the daemon's signed, encrypted state snapshots.",
    no_args_is_help=True,
)


class OutputFormat(StrEnum):
    """How ``list`` and ``show`` print: text for people, JSON for tools."""

    text = "text"
    json = "json"


ConfigOption = Annotated[
    Path | None,
    typer.Option(
        parser=given_path,
        help="The daemon's TOML file: its \\[bus] table, and for verify its \\[machine] table "
        "(snapshots folded under other settings are reported).",
    ),
]
KeysOption = Annotated[
    Path | None,
    typer.Option(
        "--keys",
        envvar="TRAINGUARD_KEYS",
        parser=given_path,
        help="Key directory; default: the config file's \\[security] keys_dir, else "
        "~/.config/trainguard/keys.",
    ),
]
FormatOption = Annotated[OutputFormat, typer.Option("--format", help="text, or json (for tools).")]


def register(app: typer.Typer) -> None:
    """Add the ``snapshots`` command group to ``app``."""
    app.add_typer(snapshots_app, name="snapshots")


def _fail(message: str) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _settings(config: Path | None, bus: str | None, prefix: str | None) -> DaemonConfig:
    from trainguard.daemon.service import load_daemon_config

    try:
        settings = load_daemon_config(config, bus_url=bus)
    except OSError as exc:
        _fail(os_failure(exc, "read the config file", config))
    except ValueError as exc:
        _fail(str(exc))
    if prefix is not None:
        settings = replace(settings, bus=replace(settings.bus, prefix=prefix))
    return settings


def _latest(bus: BusConfig) -> dict[str, Record]:
    """Each job's latest record on ``snapshots``."""
    from trainguard.agent.bus import open_bus

    async def read() -> dict[str, Record]:
        async with open_bus(replace(bus, client_id="trainguard-snapshots", create=False)) as b:
            return await b.latest_per_key("snapshots")

    try:
        return asyncio.run(read())
    except BusError as exc:
        _fail(str(exc))


def _jobs(latest: dict[str, Record]) -> dict[str, Record]:
    """The records of ``latest`` under job keys (each job's snapshot or chunk head), without
    the chunks."""
    from trainguard.daemon.service import chunk_job

    return {key: record for key, record in latest.items() if chunk_job(key) is None}


def _chunks(latest: dict[str, Record], partition: int) -> dict[str, bytes]:
    """The chunk records of ``latest`` on ``partition``: chunk key -> value."""
    from trainguard.daemon.service import chunk_job

    return {
        key: record.value
        for key, record in latest.items()
        if record.partition == partition and record.value is not None and chunk_job(key)
    }


def _time(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


@snapshots_app.command("list")
def list_snapshots(
    bus: ConfiguredBus = None,
    config: ConfigOption = None,
    topic_prefix: ConfiguredPrefix = None,
    output_format: FormatOption = OutputFormat.text,
) -> None:
    """Each job's latest snapshot: partition, covered offset (the next record of events it has
    not folded), the state's clock, signing and data key ids, size (the whole snapshot's, for
    one written in chunks) and chunks (0: one record). Headers are unverified (use
    verify)."""
    from trainguard.daemon.service import SnapshotRefused, read_record_header

    settings = _settings(config, bus, topic_prefix)
    rows: list[dict[str, object]] = []
    for job, record in sorted(_jobs(_latest(settings.bus)).items()):
        value = record.value or b""
        row: dict[str, object] = {"job_id": job, "partition": record.partition, "bytes": len(value)}
        try:
            header, head = read_record_header(value)
        except SnapshotRefused as exc:
            row["error"] = str(exc)
        else:
            row |= {
                "offset": header.offset,
                "created": _time(header.created_ns),
                "signing_kid": header.signing_kid,
                "data_kid": header.data_kid,
                "round_jobs": header.round_jobs,
                "trainguard": header.trainguard,
                "format": header.format,
                "chunks": 0 if head is None else len(head.chunks),
            }
            if head is not None:
                row["bytes"] = head.size
        rows.append(row)
    if output_format is OutputFormat.json:
        typer.echo(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode())
        return
    if not rows:
        typer.echo(f"no snapshots on {settings.bus.url} (prefix {settings.bus.prefix!r})")
        return
    typer.echo(
        f"{'JOB':24} {'PART':>4} {'OFFSET':>9} {'CREATED':24} {'SIGNING KID':16} "
        f"{'DATA KID':16} {'BYTES':>9} {'CHUNKS':>6}"
    )
    for r in rows:
        if "error" in r:
            typer.echo(f"{r['job_id']:24} {r['partition']:>4} unreadable header: {r['error']}")
            continue
        typer.echo(
            f"{r['job_id']:24} {r['partition']:>4} {r['offset']:>9} {r['created']:24} "
            f"{r['signing_kid']:16} {r['data_kid']:16} {r['bytes']:>9} {r['chunks']:>6}"
        )


@snapshots_app.command("show")
def show(
    job: Annotated[
        str, typer.Argument(metavar="JOB", help="The job whose latest snapshot to open.")
    ],
    bus: ConfiguredBus = None,
    config: ConfigOption = None,
    topic_prefix: ConfiguredPrefix = None,
    keys: KeysOption = None,
    output_format: FormatOption = OutputFormat.text,
) -> None:
    """Verify and decrypt JOB's latest snapshot with the keys its header names (live or
    retired, from the key directory; no other key is read) and print the state's summary.
    Exits 1 when the snapshot is refused (the reason is printed)."""
    from trainguard.agent.keys import KeyStore, KeyStoreError, keys_dir
    from trainguard.daemon.service import SnapshotRefused, open_record, read_record_header

    settings = _settings(config, bus, topic_prefix)
    latest = _latest(settings.bus)
    record = _jobs(latest).get(job)
    if record is None or record.value is None:
        _fail(f"no snapshot of job {job!r} on {settings.bus.url}")
    try:
        header, _ = read_record_header(record.value)
    except SnapshotRefused as exc:
        typer.secho(f"refused: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    try:
        store = KeyStore(keys_dir(keys or settings.security.keys_dir))
        verify = _one_public_key(store, header.signing_kid)
        data = _one_data_key(store, header.data_kid)
    except KeyStoreError as exc:
        _fail(str(exc))
    try:
        header, state = open_record(
            record.value, _chunks(latest, record.partition), verify, data, job
        )
    except SnapshotRefused as exc:
        typer.secho(f"refused: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    summary = {
        "job_id": job,
        "partition": header.partition,
        "offset": header.offset,
        "created": _time(header.created_ns),
        "signing_kid": header.signing_kid,
        "data_kid": header.data_kid,
        "config_id": header.config_id,
        "trainguard": header.trainguard,
        **_state_summary(state),
    }
    if output_format is OutputFormat.json:
        typer.echo(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
        return
    for name, value in summary.items():
        if isinstance(value, dict) and value:
            typer.echo(name)
            for key, item in value.items():
                typer.echo(f"  {key:16} {item}")
        else:
            typer.echo(f"{name:18} {value if value not in (None, {}) else '-'}")


def _one_public_key(store: KeyStore, kid: str) -> dict[str, Ed25519PublicKey]:
    """The public key ``kid`` (live, else retired) as a one-entry map.

    Raises:
        KeyStoreError: the key directory has no such key.
    """
    from trainguard.agent.keys import KeyStoreError

    for retired in (False, True):
        found = store.public_keys(retired=retired).get(kid)
        if found is not None:
            return {kid: found}
    raise KeyStoreError(f"no signing key {kid} in {store.path} (live or retired)")


def _one_data_key(store: KeyStore, kid: str) -> dict[str, bytes]:
    """The data key ``kid`` (live, else retired) as a one-entry map; reads no other key.

    Raises:
        KeyStoreError: the key directory has no such key, or its file is unsafe.
    """
    from trainguard.agent.keys import KeyStoreError

    for retired in (False, True):
        if kid in store.kids("data", retired=retired):
            return {kid: store.secret_key("data", kid, retired=retired)}
    raise KeyStoreError(f"no data key {kid} in {store.path} (live or retired)")


def _state_summary(state: JobState) -> dict[str, object]:
    steps = [r.step for r in state.ranks.values() if r.step is not None]
    incident = state.incident
    return {
        "phase": state.phase,
        "generation": state.generation,
        "step": max(steps, default=None),
        "committed_step": state.committed[-1].step if state.committed else None,
        "world_size": state.world_size,
        "ranks": {
            str(r.rank): f"{r.status} step {r.step} on {r.host} (pid {r.pid})"
            for r in sorted(state.ranks.values(), key=lambda r: r.rank)
        },
        "incidents": state.incidents_opened,
        "open_incident": None
        if incident is None
        else f"{incident.incident_id} ({incident.cause}), attempt {incident.attempt}",
        "failure": state.failure,
    }


@snapshots_app.command("verify")
def verify(
    bus: ConfiguredBus = None,
    config: ConfigOption = None,
    topic_prefix: ConfiguredPrefix = None,
    keys: KeysOption = None,
) -> None:
    """Open every snapshot with the daemon's live keys and check each partition's latest round
    is complete, as a starting daemon does. Exits 1 naming every refused snapshot and every
    partition a daemon would rebuild from the log."""
    from trainguard.agent.keys import KeyStore, KeyStoreError, keys_dir
    from trainguard.daemon.service import (
        Fallback,
        SnapshotRefused,
        fold_config_id,
        open_record,
        plan_partition,
    )

    settings = _settings(config, bus, topic_prefix)
    fold = fold_config_id(settings.machine) if config is not None else None
    try:
        daemon_keys = KeyStore(keys_dir(keys or settings.security.keys_dir)).load_daemon_keys()
    except KeyStoreError as exc:
        _fail(str(exc))
    latest = _latest(settings.bus)
    jobs = _jobs(latest)
    bad: list[str] = []
    by_partition: dict[int, dict[str, bytes]] = {}
    for key, record in sorted(latest.items()):
        by_partition.setdefault(record.partition, {})[key] = record.value or b""
    for job, record in sorted(jobs.items()):
        chunks = _chunks(latest, record.partition)
        try:
            open_record(
                record.value or b"",
                chunks,
                daemon_keys.verify,
                daemon_keys.data,
                job,
                fold_config=fold,
            )
        except SnapshotRefused as exc:
            bad.append(f"job {job} (partition {record.partition}): {exc}")
    for partition, values in sorted(by_partition.items()):
        plan = plan_partition(partition, values, daemon_keys, fold_config=fold, committed=None)
        if isinstance(plan, Fallback) and plan.job is None:
            bad.append(f"partition {partition}: {plan.reason}: {plan.detail}")
    for line in bad:
        typer.secho(line, fg=typer.colors.RED)
    good = len(jobs) - sum(line.startswith("job ") for line in bad)
    typer.echo(f"{good} of {len(jobs)} snapshots verified, {len(by_partition)} partition(s)")
    if bad:
        raise typer.Exit(1)
