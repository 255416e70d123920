"""``trainguard checkpoints list|show|lineage|compat|prune``: the checkpoint catalog, read
from the bus's ``manifests`` topic, and its retention (``docs/catalog.md``).

Every command also reads the ``audit`` topic, for the restores that abandoned snapshots
(:func:`trainguard.daemon.catalog._catalog.abandoned`), and checks each manifest's Ed25519 signature
when the daemon's public keys are found (:func:`_public_keys`): a manifest that is unsigned or
whose signature does not verify is left out of the catalog (as the agent's ``init_from``
refuses it) and named on stderr; without keys, the output says the signatures were not
checked.

Exit status: 0 done (``compat``: the snapshot can seed the job), 1 ``compat`` refuses or
``prune`` could not delete everything it meant to or left a job whose storage it could not
read, 2 a usage error, an unknown snapshot, unreadable keys, a malformed audit trail or an unreachable
bus.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import orjson
import typer

from trainguard.agent.bus import BusConfig, BusError
from trainguard.daemon.cli._options import (
    ConfigFile,
    ConfiguredBus,
    ConfiguredPrefix,
    given_path,
    os_failure,
)
from trainguard.daemon.cli._options import console as _console

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    from rich.console import Console

    from trainguard.agent.bus import Record
    from trainguard.agent.checkpoint import ManifestLog
    from trainguard.daemon.catalog import (
        Abandoned,
        BusCatalog,
        Catalog,
        Compat,
        DescendantJob,
        Lineage,
        RetentionPlan,
        Verdict,
    )
    from trainguard.daemon.service import DaemonConfig
    from trainguard.schemas import JSONValue, Manifest

__all__ = ["judge_init_from", "register"]


class OutputFormat(StrEnum):
    """How the commands print: text (rich) for people, one JSON document for tools."""

    text = "text"
    json = "json"


checkpoints_app = typer.Typer(
    help="The checkpoint catalog: every committed snapshot on the bus, its lineage across "
    "jobs, and whether it can seed a new job.",
    no_args_is_help=True,
)


def register(app: typer.Typer) -> None:
    """Add the ``checkpoints`` command group to ``app``."""
    app.add_typer(checkpoints_app, name="checkpoints")


Keys = Annotated[
    Path | None,
    typer.Option(
        "--keys",
        envvar="TRAINGUARD_KEYS",
        parser=given_path,
        help="Key directory whose daemon public keys (live and retired) check the manifests' "
        "signatures; default: the config file's \\[security] keys_dir, else "
        "~/.config/trainguard/keys if it holds a signing key, else the keys in "
        "TRAINGUARD_DAEMON_PUBLIC_KEYS, else none (signatures not checked).",
    ),
]
Format = Annotated[OutputFormat, typer.Option("--format", help="text (rich) or json (for tools).")]
Snapshot = Annotated[str, typer.Argument(metavar="SNAPSHOT", help="A snapshot id, JOB/gG/sS.")]


# -- commands --------------------------------------------------------------------------------


@checkpoints_app.command("list")
def list_(
    job: Annotated[str | None, typer.Option(help="Only this job's snapshots.")] = None,
    data_version: Annotated[
        str | None, typer.Option(help="Only snapshots of this data version (or a prefix of it).")
    ] = None,
    code_version: Annotated[
        str | None, typer.Option(help="Only snapshots of this code version (or a prefix of it).")
    ] = None,
    bus: ConfiguredBus = None,
    config: ConfigFile = None,
    topic_prefix: ConfiguredPrefix = None,
    keys: Keys = None,
    output: Format = OutputFormat.text,
) -> None:
    """List the committed snapshots, oldest commit first: id, parent, job, generation, step,
    world size, data version, code version, commit time (UTC), and whether a restore abandoned
    it; and whether their signatures were checked."""
    read = _read(bus, config, topic_prefix, keys)
    catalog = read.catalog
    rows = catalog.select(job=job, data_version=data_version, code_version=code_version)
    if output is OutputFormat.json:
        _echo_json([_summary(m, read) for m in rows])
        return
    console = _console()
    console.print(read.signatures, highlight=False, markup=False)
    if not rows:
        console.print(f"no committed snapshots{_filters(job, data_version, code_version)}")
        return
    from rich.table import Table

    table = Table(
        title=f"{len(rows)} committed snapshot(s){_filters(job, data_version, code_version)}",
        title_justify="left",
    )
    # Ids first: a terminal too narrow for the table crops its right-hand columns.
    cells = [
        (
            m.snapshot_id,
            m.parent or "-",
            m.job_id,
            str(m.generation),
            str(m.step),
            str(m.world_size),
            _short(m.data_version),
            _short(m.metadata.code_version) or "-",
            _when(m.ts),
            "abandoned" if m.snapshot_id in catalog.abandoned else "on it",
        )
        for m in rows
    ]
    names = ("snapshot", "parent", "job", "gen", "step", "world", "data version", "code")
    for i, name in enumerate((*names, "committed", "timeline")):
        keep = name in ("snapshot", "parent", "gen", "step", "world")
        width = max(len(name), *(len(row[i]) for row in cells)) if keep else None
        table.add_column(name, no_wrap=True, min_width=width)
    for row in cells:
        table.add_row(*row, style="dim" if row[-1] == "abandoned" else None)
    console.print(table)
    for m in rows:
        gone = catalog.abandoned.get(m.snapshot_id)
        if gone is not None:
            console.print(f"{m.snapshot_id} {gone.reason}", highlight=False, markup=False)


@checkpoints_app.command()
def show(
    snapshot: Snapshot,
    bus: ConfiguredBus = None,
    config: ConfigFile = None,
    topic_prefix: ConfiguredPrefix = None,
    keys: Keys = None,
    output: Format = OutputFormat.text,
) -> None:
    """Everything about one snapshot: shards with sizes, digests and URIs, data cursor,
    hyperparameters, topology, code version, parent; whether its signature was checked, and
    whether a restore abandoned it."""
    read = _read(bus, config, topic_prefix, keys)
    m = _known(read, snapshot)
    gone = read.catalog.abandoned.get(m.snapshot_id)
    if output is OutputFormat.json:
        _echo_json(
            {
                **_wire(m),
                "committed_at": _iso(m.ts),
                "signature": read.signature_state,
                "abandoned": None if gone is None else _abandoned_json(gone),
            }
        )
        return
    from rich.markup import escape
    from rich.table import Table

    console = _console()
    cursor = m.cursor
    for name, value in (
        ("snapshot", m.snapshot_id),
        ("job", m.job_id),
        ("generation", str(m.generation)),
        ("step", str(m.step)),
        ("committed", _when(m.ts)),
        ("world size", str(m.world_size)),
        ("data version", cursor.data_version),
        (
            "data cursor",
            f"seed {cursor.seed}, epoch {cursor.epoch}, offset {cursor.offset} samples "
            f"(taken at world size {cursor.world_size})",
        ),
        ("code version", m.metadata.code_version or "-"),
        ("parent", m.parent or "- (the job started from scratch)"),
        ("hyperparameters", _compact(m.metadata.hyperparameters)),
        ("topology", _compact(m.metadata.topology)),
        ("format", _format(m)),
        ("signature", f"{read.signature_state}: {read.signatures}"),
        ("timeline", "on it" if gone is None else gone.reason),
    ):
        console.print(f"[bold]{name:<16}[/bold]{escape(value)}")
    total = _bytes(sum(s.size_bytes for s in m.shards))
    shards = Table(title=f"{len(m.shards)} shard(s), {total}", title_justify="left")
    for name in ("rank", "size", "digest", "uri"):
        shards.add_column(name, overflow="fold", justify="right" if name == "size" else "left")
    for s in m.shards:
        shards.add_row(str(s.rank), _bytes(s.size_bytes), s.digest, s.uri)
        for f in s.files or ():
            shards.add_row("", _bytes(f.size_bytes), f.digest, f"  {f.name}")
    console.print(shards)


def _format(m: Manifest) -> str:
    """How the snapshot is stored (docs/checkpoints.md)."""
    if m.shards[0].files is None:
        return "torch.save, one file per rank (loads onto its own world size)"
    files = sum(len(s.files or ()) for s in m.shards)
    return f"DCP, {files} files in one folder (reshards onto any world size)"


@checkpoints_app.command()
def lineage(
    snapshot: Snapshot,
    bus: ConfiguredBus = None,
    config: ConfigFile = None,
    topic_prefix: ConfiguredPrefix = None,
    keys: Keys = None,
    output: Format = OutputFormat.text,
) -> None:
    """A snapshot's ancestry across jobs (the snapshot its job started from, and so on up)
    and the jobs started from it (and from theirs)."""
    read = _read(bus, config, topic_prefix, keys)
    _known(read, snapshot)
    found = read.catalog.lineage(snapshot)
    if output is OutputFormat.json:
        _echo_json(_lineage_json(snapshot, found, read))
        return
    _print_lineage(_console(), snapshot, found, read)


@checkpoints_app.command()
def compat(
    snapshot: Snapshot,
    world_size: Annotated[int | None, typer.Option(min=1, help="The new job's world size.")] = None,
    data_version: Annotated[
        str | None, typer.Option(help="The data version the new job reads.")
    ] = None,
    code_version: Annotated[str | None, typer.Option(help="The new job's code version.")] = None,
    hyperparameter: Annotated[
        list[str] | None,
        typer.Option(
            "--hyperparameter",
            "-p",
            metavar="KEY=VALUE",
            help="A hyperparameter of the new job (repeat; VALUE is JSON, else a string; KEY "
            "may be a dotted path such as model.d_model).",
        ),
    ] = None,
    allow_data_version_change: Annotated[
        bool, typer.Option(help="A different data version is intended: warn, do not refuse.")
    ] = False,
    exact: Annotated[
        bool,
        typer.Option(
            help="The new job must continue the run bitwise (as examples/charlm requires): "
            "refuse any world-size or hyperparameter change."
        ),
    ] = False,
    check_files: Annotated[
        bool,
        typer.Option(
            help="Check that the shards' files exist with their recorded sizes (as seen from "
            "this machine)."
        ),
    ] = True,
    verify: Annotated[
        bool, typer.Option(help="Also hash every shard file against its digest (reads them).")
    ] = False,
    bus: ConfiguredBus = None,
    config: ConfigFile = None,
    topic_prefix: ConfiguredPrefix = None,
    keys: Keys = None,
    output: Format = OutputFormat.text,
) -> None:
    """Can SNAPSHOT seed a new job with these settings? Prints every reason it cannot, and
    the differences it can live with; exits 0 when it can, 1 when it cannot. A snapshot whose
    manifest's signature does not verify, or that a restore abandoned, cannot."""
    from trainguard.daemon.catalog import Compat, SeedRequest
    from trainguard.daemon.catalog import compat as judge

    request = SeedRequest(
        world_size=world_size,
        data_version=data_version,
        code_version=code_version,
        hyperparameters=_hyperparameters(hyperparameter or []),
        allow_data_version_change=allow_data_version_change,
        exact=exact,
    )
    read = _read(bus, config, topic_prefix, keys)
    forged = read.refused.get(snapshot)
    if forged is not None and read.catalog.get(snapshot) is None:
        verdict = Compat(snapshot, (_unsigned_reason(forged),), ())
    else:
        manifest = _known(read, snapshot)
        problems = (
            _shard_problems(manifest, world_size, verify=verify) if check_files or verify else []
        )
        verdict = judge(manifest, request, problems, read.catalog.abandoned.get(snapshot))
        if read.keys is None:
            verdict = replace(verdict, warnings=(*verdict.warnings, read.signatures))
    if output is OutputFormat.json:
        _echo_json(
            {
                "snapshot_id": verdict.snapshot_id,
                "compatible": verdict.compatible,
                "refusals": list(verdict.refusals),
                "warnings": list(verdict.warnings),
            }
        )
    else:
        _print_compat(_console(), verdict)
    raise typer.Exit(0 if verdict.compatible else 1)


def judge_init_from(
    bus: BusConfig,
    snapshot_id: str,
    *,
    world_size: int | None,
    ranks: Collection[int],
    verify_keys: Mapping[str, Ed25519PublicKey] | None,
    timeout_s: float = 60.0,
) -> Compat:
    """What ``checkpoints compat SNAPSHOT --world-size N`` says of a snapshot a node's
    supervisor is to start its workers from (``trainguard run --init-from``), before any of them
    starts: the same rule (:func:`trainguard.daemon.catalog._catalog.compat`: world size, a restore
    that abandoned the snapshot) and the same file checks, limited to the shards of this node's
    ``ranks`` (the ones its workers would load).

    Args:
        bus: how to reach the bus.
        snapshot_id: the snapshot, ``JOB/gG/sS``.
        world_size: the new job's world size, or ``None`` when the supervisor does not know it
            (plain mode: the command starts its own ranks); then its highest rank in ``ranks``
            bounds it from below, which is checked when it exceeds the snapshot's world size.
        ranks: the global ranks this node hosts.
        verify_keys: the daemon's public keys: the manifest must carry a signature of one.
        timeout_s: seconds each bus read may take.

    Raises:
        ConfigError: no committed snapshot ``snapshot_id`` (or, with keys, none signed), or
            the audit trail of its job is malformed.
        RestoreTimeout: the bus could not be read in time.
    """
    from trainguard.agent import ConfigError
    from trainguard.agent.checkpoint import fetch_manifest
    from trainguard.daemon.catalog import SeedRequest
    from trainguard.daemon.catalog import compat as judge
    from trainguard.daemon.core import MalformedAudit

    manifest = fetch_manifest(bus, snapshot_id, timeout_s, verify_keys)
    if world_size is None and ranks and max(ranks) >= manifest.world_size:
        world_size = max(ranks) + 1
    try:
        gone = _abandoned_by(bus, manifest, timeout_s)
    except (MalformedAudit, KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"the audit trail of job {manifest.job_id!r} on {bus.url} is malformed: {exc!r}"
        ) from exc
    mine = [r for r in ranks if r < manifest.world_size]
    return judge(
        manifest,
        SeedRequest(world_size=world_size),
        _shard_problems(manifest, None, verify=False, ranks=mine),
        gone,
    )


def _abandoned_by(bus: BusConfig, manifest: Manifest, timeout_s: float) -> Abandoned | None:
    """The restore that abandoned ``manifest``, from its job's audit trail on the bus, or
    ``None``.

    Raises:
        RestoreTimeout: the bus could not be read within ``timeout_s`` seconds.
        MalformedAudit, KeyError, TypeError, ValueError: the audit trail is malformed.
    """
    from trainguard.agent import RestoreTimeout
    from trainguard.agent.bus import open_bus, partition_for
    from trainguard.daemon.catalog import abandoned
    from trainguard.daemon.core import entries_by_job
    from trainguard.daemon.forensics import read_audit, read_topic

    config = replace(bus, client_id=f"{bus.client_id}-audit", create=False)

    async def _read() -> list[Record]:
        async with open_bus(config) as connected:
            partition = partition_for(manifest.job_id, await connected.partitions("audit"))
            return [r async for r in read_topic(connected, "audit", {partition})]

    try:
        records = asyncio.run(asyncio.wait_for(_read(), timeout_s))
    except (BusError, TimeoutError) as exc:
        raise RestoreTimeout(
            f"could not read the audit trail of job {manifest.job_id!r} from {bus.url}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    entries = entries_by_job(records).get(manifest.job_id, [])
    return abandoned([manifest], {manifest.job_id: read_audit(entries)}).get(manifest.snapshot_id)


@checkpoints_app.command()
def prune(
    job: Annotated[str | None, typer.Option(help="Only this job's snapshots.")] = None,
    keep_last: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Snapshots kept per job, the newest of its timeline; default: the daemon's "
            "\\[machine] keep_snapshots.",
        ),
    ] = None,
    keep_every: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Also keep every snapshot whose step is a multiple (give it to every prune: "
            "a prune without it may delete them).",
        ),
    ] = None,
    delete_parents: Annotated[
        bool,
        typer.Option(
            help="Also delete snapshots other jobs started from, once those jobs have ended."
        ),
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print what would be deleted; delete nothing.")
    ] = False,
    bus: ConfiguredBus = None,
    config: ConfigFile = None,
    topic_prefix: ConfiguredPrefix = None,
    keys: Keys = None,
    output: Format = OutputFormat.text,
) -> None:
    """Delete the step folders of committed snapshots that are no longer needed, and the step
    folders of checkpoints that never committed and never will. Never deleted: a job's newest
    KEEP_LAST snapshots, a running job's possible restore targets, a restore's target while it
    is in progress, and the snapshots other jobs started from (docs/catalog.md, "Retention")."""
    from trainguard.daemon.catalog import RetentionPolicy, StorageUnreadable
    from trainguard.daemon.catalog import prune as prune_catalog

    read = _read(bus, config, topic_prefix, keys)
    policy = RetentionPolicy(
        keep_last=keep_last or read.keep_snapshots,
        keep_every_steps=keep_every,
        restore_targets=read.keep_snapshots,
        delete_parents=delete_parents,
    )
    if job is not None and not read.catalog.select(job=job):
        _fail(f"no committed snapshot of job {job!r} on {read.where}")
    try:
        # Every job: one whose storage cannot be read is left out and named, the others are
        # pruned (as the daemon's retention does). One job asked for: its storage must answer.
        pruned = prune_catalog(
            read.found,
            policy,
            jobs=None if job is None else {job},
            dry_run=dry_run,
            skip_unreadable=job is None,
        )
    except StorageUnreadable as exc:
        _fail(str(exc))
    plan, failures, unreadable = pruned.plan, pruned.failures, pruned.unreadable
    if output is OutputFormat.json:
        _echo_json(
            {
                "dry_run": dry_run,
                "verdicts": [
                    {
                        "name": v.name,
                        "job_id": v.job_id,
                        "generation": v.generation,
                        "step": v.step,
                        "action": _action(v, dry_run, failures),
                        "reasons": list(v.reasons),
                    }
                    for v in plan.verdicts
                ],
                "failures": [f"{name}: {why}" for name, why in failures.items()],
                "unreadable": dict(unreadable),
            }
        )
    else:
        _print_plan(plan, dry_run, failures)
    for unread, why in unreadable.items():
        typer.secho(
            f"error: checkpoints of job {unread!r} not pruned: storage unreadable: {why}",
            fg=typer.colors.RED,
            err=True,
        )
    if failures or unreadable:
        raise typer.Exit(1)


def _action(verdict: Verdict, dry_run: bool, failed: Mapping[str, str]) -> str:
    """``keep``, ``would delete``/``deleted``, ``failed`` (the deletion failed: stderr says
    why), or ``gone`` (its folder was already deleted); ``keep (files missing)`` for a kept
    snapshot whose folder or a shard file of it is not there."""
    if verdict.keep:
        return "keep" if verdict.complete else "keep (files missing)"
    if not verdict.present:
        return "gone"
    if dry_run:
        return "would delete"
    return "failed" if verdict.name in failed else "deleted"


def _print_plan(plan: RetentionPlan, dry_run: bool, failures: Mapping[str, str]) -> None:
    console = _console()
    if not plan.verdicts:
        console.print("nothing to prune: no committed snapshot or step folder found")
        return
    from rich.table import Table

    table = Table(title="retention" + (" (dry run: nothing deleted)" if dry_run else ""))
    for name in ("snapshot", "gen", "step", "action", "why"):
        table.add_column(name, no_wrap=name != "why")
    for v in plan.verdicts:
        table.add_row(
            v.name, str(v.generation), str(v.step), _action(v, dry_run, failures),
            "; ".join(v.reasons),
            style=None if v.keep else "dim",
        )  # fmt: skip
    console.print(table)
    count = len(plan.deleted) - (0 if dry_run else len(failures))
    verb = "would delete" if dry_run else "deleted"
    console.print(f"{verb} {count} of {len(plan.verdicts)} (snapshots and leftover folders)")
    for name, why in failures.items():
        typer.secho(f"error: could not delete {name}: {why}", fg=typer.colors.RED, err=True)


# -- reading ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Read:
    """What the commands read: the catalog, where from, and how its signatures were checked.

    Attributes:
        found: the catalog (with keys, of the manifests whose signature verifies), the jobs'
            audit trails, the manifests refused and the records skipped.
        where: the bus and topic prefix, for messages.
        keys: the daemon public keys the signatures were checked with, ``None``: unchecked.
        signatures: one line on how the signatures were checked (or why not).
        keep_snapshots: the daemon's ``[machine] keep_snapshots`` (restore targets per job).
    """

    found: BusCatalog
    where: str
    keys: Mapping[str, Ed25519PublicKey] | None
    signatures: str
    keep_snapshots: int

    @property
    def catalog(self) -> Catalog:
        """The catalog (with keys, of the manifests whose signature verifies)."""
        return self.found.catalog

    @property
    def refused(self) -> Mapping[str, str]:
        """Snapshot id -> why its manifest's signature does not verify (with keys)."""
        return self.found.unverified

    @property
    def signature_state(self) -> str:
        """``verified`` (a catalog snapshot's signature verified) or ``unchecked``."""
        return "unchecked" if self.keys is None else "verified"


def _read(bus: str | None, config: Path | None, prefix: str | None, keys: Path | None) -> _Read:
    """The catalog of the bus's ``manifests`` topic with the restores its ``audit`` topic
    records, the manifests' signatures checked when the daemon's public keys are found; exits
    2 on a bad config file, unreadable keys, a malformed audit trail or an unreachable bus."""
    from trainguard.agent.bus import open_bus
    from trainguard.agent.checkpoint import read_manifests
    from trainguard.daemon.catalog import BusCatalog, JobAuditMalformed
    from trainguard.daemon.core import MalformedAudit
    from trainguard.daemon.forensics import read_topic
    from trainguard.daemon.service import load_daemon_config

    try:
        settings = load_daemon_config(config, bus_url=bus)
    except OSError as exc:
        _fail(os_failure(exc, "read the config file", config))
    except ValueError as exc:
        _fail(str(exc))
    public, signatures = _public_keys(keys, settings)
    bus_config: BusConfig = replace(settings.bus, client_id="trainguard-checkpoints", create=False)
    if prefix is not None:
        bus_config = replace(bus_config, prefix=prefix)

    async def _from_bus() -> tuple[ManifestLog, list[Record]]:
        async with open_bus(bus_config) as connected:
            log = await asyncio.wait_for(read_manifests(connected, verify_keys=public), 120)
            audit = [r async for r in read_topic(connected, "audit")]
        return log, audit

    try:
        log, audit = asyncio.run(_from_bus())
    except (BusError, TimeoutError) as exc:
        _fail(f"cannot read the manifests and audit topics of {bus_config.url}: {exc}")
    skipped = log.invalid - len(log.unauthenticated)
    if skipped:
        typer.secho(
            f"warning: {skipped} record(s) of the manifests topic skipped "
            "(undecodable or inconsistent)",
            fg=typer.colors.YELLOW,
            err=True,
        )
    for snapshot_id, reason in sorted(log.unauthenticated.items()):
        typer.secho(
            f"warning: manifest of {snapshot_id} left out: {_unsigned_reason(reason)}",
            fg=typer.colors.YELLOW,
            err=True,
        )
    try:
        found = BusCatalog.of(log, audit)
    except MalformedAudit as exc:
        _fail(f"the audit trail on {bus_config.url} is malformed: {exc}")
    except JobAuditMalformed as exc:
        _fail(
            f"the audit trail of job {exc.job_id!r} on {bus_config.url} is malformed: {exc.cause!r}"
        )
    return _Read(
        found=found,
        where=f"{bus_config.url} (topic prefix {bus_config.prefix!r})",
        keys=public,
        signatures=signatures,
        keep_snapshots=settings.machine.keep_snapshots,
    )


def _public_keys(
    keys: Path | None, settings: DaemonConfig
) -> tuple[dict[str, Ed25519PublicKey] | None, str]:
    """The daemon's public keys that check the manifests' signatures, and a line saying so.

    Found as the daemon finds its keys (:func:`trainguard.daemon.service._security.load_keys`):
    ``--keys`` / ``TRAINGUARD_KEYS``, else ``[security] keys_dir``, else
    ``~/.config/trainguard/keys`` when it holds a current signing key; then, as agents get
    them, ``TRAINGUARD_DAEMON_PUBLIC_KEYS``. Only public key files are read. Retired keys
    count too: a manifest signed before a rotation stays the daemon's. ``(None, why not)``
    when none is found; exits 2 when a named directory holds none or a key file is malformed.
    """
    from trainguard.agent import ConfigError
    from trainguard.agent.keys import KeyStore, KeyStoreError, keys_dir, load_public_keys

    explicit = keys or settings.security.keys_dir
    try:
        store = KeyStore(keys_dir(explicit))
        if explicit is not None or store.current("signing") is not None:
            found = {**store.public_keys(retired=True), **store.public_keys()}
            if not found:
                _fail(f"{store.path} holds no daemon public key (trainguard keys init)")
            return found, (
                f"signatures checked with {len(found)} daemon public key(s) of {store.path}"
            )
        spec = os.environ.get("TRAINGUARD_DAEMON_PUBLIC_KEYS")
        if spec:
            found = load_public_keys(spec)
            return found, (
                f"signatures checked with {len(found)} daemon public key(s) of "
                "TRAINGUARD_DAEMON_PUBLIC_KEYS"
            )
    except (KeyStoreError, ConfigError) as exc:
        _fail(str(exc))
    return None, (
        "signatures not checked: no daemon public key found (--keys, TRAINGUARD_KEYS, "
        f"[security] keys_dir, {store.path} or TRAINGUARD_DAEMON_PUBLIC_KEYS)"
    )


def _unsigned_reason(reason: str) -> str:
    """Why a manifest is refused, from why its signature does not verify."""
    return f"its manifest is not signed by the daemon's keys ({reason})"


def _known(read: _Read, snapshot: str) -> Manifest:
    """The snapshot's manifest; exits 2 naming what the catalog holds of its job (or why its
    manifest was left out)."""
    manifest = read.catalog.get(snapshot)
    if manifest is not None:
        return manifest
    if snapshot in read.refused:
        _fail(f"snapshot {snapshot!r} on {read.where}: {_unsigned_reason(read.refused[snapshot])}")
    job = snapshot.partition("/")[0]
    same = [m.snapshot_id for m in read.catalog.select(job=job)]
    detail = (
        f"job {job!r} has {len(same)}, the newest {', '.join(same[-3:])}"
        if same
        else f"no snapshot of job {job!r}; {len(read.catalog.snapshots)} snapshot(s) of other jobs"
    )
    _fail(f"no committed snapshot {snapshot!r} on {read.where}: {detail}")


def _shard_problems(
    manifest: Manifest,
    world_size: int | None,
    *,
    verify: bool,
    ranks: Collection[int] | None = None,
) -> list[str]:
    """What is wrong with the shard files the new job's ranks would load (those of ranks
    below its world size, and among ``ranks`` if given): not a ``file://`` URI (the agent loads
    no other), missing, another size, or with ``verify`` another SHA-256. For a DCP snapshot,
    every file of the folder (:func:`trainguard.agent.checkpoint.dcp_problems`)."""
    from trainguard.agent import ShardError
    from trainguard.agent.checkpoint import dcp_problems, uri_to_path

    if manifest.shards[0].files is not None:
        # DCP: any rank may read any file (resharding), so all are checked.
        return dcp_problems(manifest.shards, verify=verify)
    problems: list[str] = []
    for shard in manifest.shards:
        if world_size is not None and shard.rank >= world_size:
            continue
        if ranks is not None and shard.rank not in ranks:
            continue
        what = f"shard of rank {shard.rank}"
        try:
            path = uri_to_path(shard.uri)
        except ShardError:
            problems.append(f"{what} is at {shard.uri}: the agent loads file:// shards only")
            continue
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{what} is missing: {path}")
            continue
        except OSError as exc:
            problems.append(f"{what} cannot be read ({exc.strerror or exc}): {path}")
            continue
        if size != shard.size_bytes:
            problems.append(
                f"{what} has {size} bytes, the manifest says {shard.size_bytes}: {path}"
            )
        elif verify:
            with path.open("rb") as file:
                actual = f"sha256:{hashlib.file_digest(file, 'sha256').hexdigest()}"
            if actual != shard.digest:
                problems.append(f"{what} has digest {actual}, the manifest says {shard.digest}")
    return problems


def _hyperparameters(pairs: Sequence[str]) -> dict[str, JSONValue]:
    """``["lr=0.001", "name=x"]`` -> ``{"lr": 0.001, "name": "x"}`` (JSON values, else
    strings); raises ``typer.BadParameter`` (exit 2) for an item without ``=``."""
    out: dict[str, JSONValue] = {}
    for pair in pairs:
        key, eq, raw = pair.partition("=")
        if not eq or not key:
            raise typer.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--hyperparameter")
        try:
            out[key] = orjson.loads(raw)
        except orjson.JSONDecodeError:
            out[key] = raw
    return out


# -- printing --------------------------------------------------------------------------------


def _fail(message: str) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _echo_json(value: Any) -> None:
    typer.echo(orjson.dumps(value, option=orjson.OPT_INDENT_2).decode())


def _wire(manifest: Manifest) -> dict[str, Any]:
    """The manifest's wire form (``docs/wire-contract.md``) as a dict."""
    from trainguard.schemas import encode

    wire: dict[str, Any] = orjson.loads(encode(manifest))
    return wire


def _summary(m: Manifest, read: _Read) -> dict[str, Any]:
    """One ``list`` row as JSON."""
    gone = read.catalog.abandoned.get(m.snapshot_id)
    return {
        "snapshot_id": m.snapshot_id,
        "job_id": m.job_id,
        "generation": m.generation,
        "step": m.step,
        "data_version": m.data_version,
        "code_version": m.metadata.code_version,
        "world_size": m.world_size,
        "committed_ns": m.ts,
        "committed_at": _iso(m.ts),
        "parent": m.parent,
        "signature": read.signature_state,
        "abandoned": None if gone is None else _abandoned_json(gone),
    }


def _abandoned_json(gone: Abandoned) -> dict[str, Any]:
    """How a restore abandoned a snapshot, as JSON."""
    return {
        "generation": gone.generation,
        "target": gone.target,
        "target_step": gone.target_step,
        "incident_id": gone.incident_id,
        "cause": gone.cause,
        "onset_after_step": gone.onset_after_step,
        "reason": gone.reason,
    }


def _iso(ts_ns: int) -> str:
    """``2026-11-30T11:53:25.038Z``: a commit time in UTC, milliseconds."""
    moment = datetime.fromtimestamp(ts_ns / 1e9, UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _when(ts_ns: int) -> str:
    """``2026-11-30 11:53:25Z``: a commit time in UTC, for tables."""
    return datetime.fromtimestamp(ts_ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _short(text: str, width: int = 16) -> str:
    """``text``, cut to ``width`` characters with an ellipsis (digests in tables)."""
    return text if len(text) <= width else text[: width - 1] + "…"


def _bytes(count: int) -> str:
    """``1,234,567 B (1.2 MiB)``; plain bytes below 1 KiB."""
    if count < 1024:
        return f"{count:,} B"
    units = ("KiB", "MiB", "GiB", "TiB")
    size, unit = count / 1024, 0
    while size >= 1024 and unit < len(units) - 1:
        size, unit = size / 1024, unit + 1
    return f"{count:,} B ({size:.1f} {units[unit]})"


def _compact(value: Mapping[str, JSONValue]) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode() if value else "-"


def _filters(job: str | None, data_version: str | None, code_version: str | None) -> str:
    named = [
        f"{name} {value}"
        for name, value in (("job", job), ("data version", data_version), ("code", code_version))
        if value is not None
    ]
    return f" ({', '.join(named)})" if named else ""


def _brief(m: Manifest) -> str:
    """``job charlm-a, gen 0, step 40, data sha256:…, committed …``."""
    return (
        f"job {m.job_id}, generation {m.generation}, step {m.step}, data "
        f"{_short(m.data_version)}, committed {_when(m.ts)}"
    )


def _print_lineage(console: Console, snapshot: str, found: Lineage, read: _Read) -> None:
    from rich.markup import escape
    from rich.tree import Tree

    console.print(f"[bold]lineage of {escape(snapshot)}[/bold]")
    for depth, ancestor in enumerate(found.ancestors):
        lead = "  " * depth + ("" if depth == 0 else "└─ started from ")
        m = ancestor.manifest
        detail = "not in the catalog (expired or on another bus)" if m is None else _brief(m)
        if ancestor.snapshot_id in read.catalog.abandoned:
            detail += " (abandoned by a restore)"
        console.print(f"{lead}[bold]{escape(ancestor.snapshot_id)}[/bold]  {escape(detail)}")
    last = found.ancestors[-1]
    pad = "  " * len(found.ancestors)
    if found.origin == "scratch" and last.manifest is not None:
        console.print(f"{pad}└─ job {escape(last.manifest.job_id)} started from scratch")
    elif found.origin == "loop":
        console.print(f"{pad}└─ (a loop: {escape(last.snapshot_id)} is its own ancestor)")
    if not found.descendants:
        console.print(f"no job started from {escape(snapshot)}")
        return
    tree = Tree(f"jobs started from {escape(snapshot)}")

    def grow(node: Tree, jobs: Sequence[DescendantJob]) -> None:
        for job in jobs:
            newest = job.snapshots[-1]
            branch = node.add(
                f"job [bold]{escape(job.job_id)}[/bold]: {len(job.snapshots)} snapshot(s), "
                f"newest {escape(newest.snapshot_id)} (step {newest.step})"
            )
            grow(branch, job.descendants)

    grow(tree, found.descendants)
    console.print(tree)


def _lineage_json(snapshot: str, found: Lineage, read: _Read) -> dict[str, Any]:
    def ancestor(snapshot_id: str, m: Manifest | None) -> dict[str, Any]:
        if m is None:
            return {"snapshot_id": snapshot_id, "in_catalog": False}
        return {**_summary(m, read), "in_catalog": True}

    def job(d: DescendantJob) -> dict[str, Any]:
        return {
            "job_id": d.job_id,
            "started_from": d.started_from,
            "snapshots": [m.snapshot_id for m in d.snapshots],
            "descendants": [job(x) for x in d.descendants],
        }

    return {
        "snapshot_id": snapshot,
        "ancestors": [ancestor(a.snapshot_id, a.manifest) for a in found.ancestors],
        "origin": found.origin,
        "descendants": [job(d) for d in found.descendants],
    }


def _print_compat(console: Console, verdict: Compat) -> None:
    from rich.markup import escape

    sid = escape(verdict.snapshot_id)
    if verdict.compatible:
        console.print(f"[green]compatible[/green]: {sid} can seed the new job")
    else:
        console.print(f"[red]incompatible[/red]: {sid} cannot seed the new job:")
    for reason in verdict.refusals:
        console.print(f"  [red]refused[/red]  {escape(reason)}")
    for note in verdict.warnings:
        console.print(f"  [yellow]warning[/yellow]  {escape(note)}")
