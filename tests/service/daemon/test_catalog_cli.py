"""``trainguard checkpoints`` as users run it (separate processes) over an embedded bus whose
``manifests`` topic holds synthetic committed snapshots with real shard files; and
``trainguard run --init-from`` refusing an unknown snapshot before it starts anything."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tests.support.machine_scenarios import DAEMON, T0, S, Sim, config
from tests.support.machine_scenarios import JOB as SIM_JOB
from tests.support.manifests import manifest
from trainguard.agent.bus import BusConfig, open_bus
from trainguard.agent.keys._keystore import KeyStore, public_key_id
from trainguard.daemon.admin._keys import KeyAdmin
from trainguard.daemon.core._audit_entry import config_entry, config_id, decision_entry, input_id
from trainguard.daemon.core._decisions import Committed
from trainguard.daemon.core._inputs import Observed
from trainguard.daemon.core._machine import decide
from trainguard.daemon.core._state import new_job
from trainguard.schemas import JSONValue, Manifest, Shard, encode, sign

CLI = [sys.executable, "-m", "trainguard.daemon.cli"]


def with_files(m: Manifest, root: Path) -> Manifest:
    """``m`` with each shard written to a real file under ``root`` (size and digest true)."""
    shards = []
    for shard in m.shards:
        path = root / m.snapshot_id / f"rank{shard.rank}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        data = f"{m.snapshot_id} rank {shard.rank}".encode() * 50
        path.write_bytes(data)
        shards.append(
            Shard(
                rank=shard.rank,
                uri=path.as_uri(),
                size_bytes=len(data),
                digest=f"sha256:{hashlib.sha256(data).hexdigest()}",
            )
        )
    return dataclasses.replace(m, shards=tuple(shards))


@pytest.fixture(scope="module")
def catalog_bus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A bus with job ``pre`` (two snapshots) and job ``tune`` started from ``pre/g0/s40``."""
    root = tmp_path_factory.mktemp("catalog")
    url = f"sqlite://{root / 'bus.db'}"
    manifests = [
        with_files(manifest("pre", 20, at=1), root),
        with_files(manifest("pre", 40, at=2), root),
        with_files(
            manifest("tune", 60, parent="pre/g0/s40", at=5, hyper={"lr": 0.001}, code="77aa00"),
            root,
        ),
    ]

    async def _publish() -> None:
        async with open_bus(BusConfig(url=url)) as bus:
            for m in manifests:
                await bus.publish("manifests", m.job_id, encode(m))

    asyncio.run(_publish())
    # A lost shard: the catalog still lists the snapshot, compat refuses it.
    (root / "pre/g0/s20/rank1.pt").unlink()
    return url


def checkpoints(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``trainguard checkpoints ARGS`` on ``url``, with no daemon key to be found but those
    ``--keys`` names (a home folder without any, no key variables)."""
    home = Path(url.removeprefix("sqlite://")).parent / "home"
    env = {k: v for k, v in os.environ.items() if k not in _KEY_VARIABLES}
    return subprocess.run(
        [*CLI, "checkpoints", *args, "--bus", url],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "HOME": str(home), "COLUMNS": "250"},  # rich wraps at the width it is given
    )


_KEY_VARIABLES = ("TRAINGUARD_KEYS", "TRAINGUARD_DAEMON_PUBLIC_KEYS")


def as_json(done: subprocess.CompletedProcess[str]) -> Any:
    assert done.returncode in (0, 1), done.stderr
    return json.loads(done.stdout)


def test_list_shows_every_snapshot_with_its_parent(catalog_bus: str) -> None:
    done = checkpoints(catalog_bus, "list")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    (tune,) = [line for line in lines if "tune/g0/s60" in line]
    for column in ("tune", "60", "sha256:dddddddd…", "77aa00", "pre/g0/s40", "Z"):
        assert column in tune
    rows = as_json(checkpoints(catalog_bus, "list", "--format", "json"))
    assert [(r["snapshot_id"], r["parent"]) for r in rows] == [
        ("pre/g0/s20", None),
        ("pre/g0/s40", None),
        ("tune/g0/s60", "pre/g0/s40"),
    ]
    assert rows[0]["world_size"] == 2
    assert rows[0]["committed_at"].endswith("Z")
    only = as_json(checkpoints(catalog_bus, "list", "--code-version", "77", "--format", "json"))
    assert [r["snapshot_id"] for r in only] == ["tune/g0/s60"]


@pytest.mark.parametrize("columns", ["50", None])
def test_list_says_which_snapshots_are_on_the_timeline_and_keeps_every_id(
    catalog_bus: str, columns: str | None
) -> None:
    """The timeline column says ``on it`` (it was empty but for abandoned snapshots); piped
    without ``COLUMNS`` the table is not cropped at rich's 80 columns; in a narrow terminal the
    right-hand columns go, never a snapshot id."""
    home = Path(catalog_bus.removeprefix("sqlite://")).parent / "home"
    env = {k: v for k, v in os.environ.items() if k not in (*_KEY_VARIABLES, "COLUMNS")}
    done = subprocess.run(
        [*CLI, "checkpoints", "list", "--bus", catalog_bus],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "HOME": str(home), **({} if columns is None else {"COLUMNS": columns})},
    )
    assert done.returncode == 0, done.stderr
    for snapshot in ("pre/g0/s20", "pre/g0/s40", "tune/g0/s60"):
        [row] = [line for line in done.stdout.splitlines() if line.startswith(f"│ {snapshot} ")]
        if columns is None:
            assert row.rstrip().endswith("│ on it    │"), row
            assert "2025-" in row, row


def test_show_prints_shards_cursor_hyperparameters_and_topology(catalog_bus: str) -> None:
    done = checkpoints(catalog_bus, "show", "tune/g0/s60")
    assert done.returncode == 0, done.stderr
    for text in ('{"lr":0.001}', "offset 960 samples", '{"world_size":2}', "pre/g0/s40"):
        assert text in done.stdout
    wire = as_json(checkpoints(catalog_bus, "show", "tune/g0/s60", "--format", "json"))
    assert wire["schema"] == Manifest.SCHEMA
    assert wire["parent"] == "pre/g0/s40"
    assert [s["rank"] for s in wire["shards"]] == [0, 1]
    assert wire["shards"][1]["digest"].startswith("sha256:")
    assert wire["shards"][1]["digest"] in done.stdout


def test_lineage_names_the_parent_and_the_descendants(catalog_bus: str) -> None:
    done = checkpoints(catalog_bus, "lineage", "tune/g0/s60")
    assert done.returncode == 0, done.stderr
    assert "started from pre/g0/s40" in done.stdout
    assert "job pre started from scratch" in done.stdout
    found = as_json(checkpoints(catalog_bus, "lineage", "pre/g0/s40", "--format", "json"))
    assert [a["snapshot_id"] for a in found["ancestors"]] == ["pre/g0/s40"]
    assert found["origin"] == "scratch"
    assert [(d["job_id"], d["snapshots"]) for d in found["descendants"]] == [
        ("tune", ["tune/g0/s60"])
    ]


def test_compat_exits_0_when_compatible_and_1_with_every_reason(catalog_bus: str) -> None:
    ok = checkpoints(catalog_bus, "compat", "pre/g0/s40", "--world-size", "2", "--verify")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "compatible" in ok.stdout
    refused = checkpoints(
        catalog_bus,
        "compat",
        "pre/g0/s20",
        "--data-version",
        "other",
        "--hyperparameter",
        "model.d_model=128",
        "--format",
        "json",
    )
    assert refused.returncode == 1
    verdict = json.loads(refused.stdout)
    assert verdict["compatible"] is False
    data, shard = verdict["refusals"]
    assert "data version 'other' differs" in data
    assert shard.startswith("shard of rank 1 is missing")
    hyper, unchecked = verdict["warnings"]
    assert hyper == "hyperparameter model.d_model: snapshot 64, new job 128"
    assert unchecked.startswith("signatures not checked: no daemon public key found")
    # Rank 1 would not load anything on world size 1: its lost shard does not matter then.
    shrunk = checkpoints(catalog_bus, "compat", "pre/g0/s20", "--world-size", "1")
    assert shrunk.returncode == 0, shrunk.stdout


def test_an_unknown_snapshot_or_a_bad_option_exits_2(catalog_bus: str) -> None:
    for command in ("show", "lineage", "compat"):
        done = checkpoints(catalog_bus, command, "pre/g0/s99")
        assert done.returncode == 2
        assert "no committed snapshot 'pre/g0/s99'" in done.stderr
        assert "job 'pre' has 2, the newest pre/g0/s20, pre/g0/s40" in done.stderr
    bad = checkpoints(catalog_bus, "compat", "pre/g0/s40", "--hyperparameter", "lr")
    assert bad.returncode == 2
    assert "not KEY=VALUE" in bad.stderr


def test_run_refuses_an_unknown_init_from_before_starting_workers(
    catalog_bus: str, tmp_path: Path
) -> None:
    marker = tmp_path / "started"
    done = subprocess.run(
        [
            *CLI,
            "run",
            "--job",
            "next",
            "--bus",
            catalog_bus,
            "--init-from",
            "pre/g0/s99",
            "--",
            sys.executable,
            "-c",
            f"open({str(marker)!r}, 'w')",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "no committed snapshot 'pre/g0/s99'" in done.stderr
    assert not marker.exists()


def run_init_from(
    url: str, snapshot: str, marker: Path, *options: str
) -> subprocess.CompletedProcess[str]:
    """``trainguard run --job next --init-from SNAPSHOT OPTIONS -- <create marker>`` on
    ``url``, with no daemon key to be found (as :func:`checkpoints`)."""
    env = {k: v for k, v in os.environ.items() if k not in _KEY_VARIABLES}
    return subprocess.run(
        [
            *CLI,
            "run",
            "--job",
            "next",
            "--bus",
            url,
            "--init-from",
            snapshot,
            *options,
            "--",
            sys.executable,
            "-c",
            f"open({str(marker)!r}, 'w')",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.mark.parametrize(
    ("options", "beyond"),
    [
        (("--nproc-per-node", "4"), "world size 4: ranks 2..3 would find no shard"),
        (("--nproc-per-node", "3"), "world size 3: rank 2 would find no shard"),
        # Two nodes of 2: the second node's ranks 2-3 have no shard either.
        (
            (
                "--nproc-per-node",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--master-port",
                "29999",
            ),
            "world size 4: ranks 2..3 would find no shard",
        ),
        # Plain mode: the command starts its ranks itself; the ranks it hosts bound the size.
        (("--ranks", "0-2"), "world size 3: rank 2 would find no shard"),
    ],
)
def test_run_refuses_an_init_from_its_world_size_cannot_load_before_starting_workers(
    catalog_bus: str, tmp_path: Path, options: tuple[str, ...], beyond: str
) -> None:
    marker = tmp_path / "started"
    done = run_init_from(catalog_bus, "pre/g0/s40", marker, *options)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--init-from pre/g0/s40 cannot seed this job" in done.stderr
    assert beyond in done.stderr
    assert "of world size 2" in done.stderr  # the snapshot's, as compat words it
    assert not marker.exists()


def test_run_refuses_an_init_from_whose_shard_file_this_node_would_load_is_missing(
    catalog_bus: str, tmp_path: Path
) -> None:
    marker = tmp_path / "started"
    done = run_init_from(catalog_bus, "pre/g0/s20", marker, "--nproc-per-node", "2")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "shard of rank 1 is missing" in done.stderr
    assert not marker.exists()


def test_run_starts_from_an_init_from_it_can_load_and_passes_on_a_warning(
    catalog_bus: str, tmp_path: Path
) -> None:
    """World size 1 from a 2-rank data-parallel snapshot: compat warns, the job starts (no
    daemon is needed for generation 0; the worker's exit ends the supervisor)."""
    marker = tmp_path / "started"
    done = run_init_from(catalog_bus, "pre/g0/s40", marker, "--nproc-per-node", "1")
    assert "warning: --init-from pre/g0/s40: world size 1 < 2" in done.stderr
    assert marker.exists(), done.stderr


# -- signatures and abandoned snapshots -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RolledBack:
    """A bus holding job ``job`` as a daemon with keys recorded it: commits at steps 10, 20 and
    30 of generation 0, then a checksum mismatch with its onset after step 20 and a restore to
    step 20 (so step 30 is abandoned); plus three manifests the daemon did not sign."""

    url: str
    keys: Path


FORGED = ("job/g1/s90", "job/g1/s91", "job/g1/s95")
"""Manifests signed by another key, under the daemon's key id by another key, and unsigned."""


@pytest.fixture(scope="module")
def rolled_back(tmp_path_factory: pytest.TempPathFactory) -> RolledBack:
    root = tmp_path_factory.mktemp("rolled-back")
    admin = KeyAdmin(root / "keys")
    admin.init([])
    keys = KeyStore(admin.path).load_daemon_keys()
    sim, cfg = Sim(), config()
    inputs = [*sim.start(T0), *sim.train(range(36), start=T0 + S)]
    inputs += [sim.checksum(r, 20, T0 + 37 * S) for r in range(4)]
    inputs += [sim.checksum(r, 35, T0 + 38 * S, odd=r == 3) for r in range(4)]
    # What the daemon writes (DaemonService._act): its config entry, then one entry per input
    # that decided something, and each committed manifest, signed.
    audit: list[dict[str, Any]] = [config_entry(SIM_JOB, cfg)]
    manifests: list[Manifest] = []
    state = new_job(SIM_JOB)
    for offset, item in enumerate(inputs):
        state, decisions = decide(state, item, cfg)
        if not decisions:
            continue
        manifests += [d.manifest for d in decisions if isinstance(d, Committed)]
        identity: dict[str, JSONValue] = (
            input_id(item.event)
            if isinstance(item, Observed)
            else {"type": "tick", "daemon_id": DAEMON, "seq": offset}
        )
        audit.append(
            decision_entry(
                SIM_JOB,
                partition=0,
                offset=offset,
                at_ms=item.at_ns // 1_000_000,
                identity=identity,
                config=config_id(cfg),
                decisions=decisions,
            )
        )
    stranger = Ed25519PrivateKey.generate()
    values = [encode(sign(m, keys.signing_kid, keys.signing)) for m in manifests]
    values += [
        encode(
            sign(
                manifest(SIM_JOB, 90, generation=1), public_key_id(stranger.public_key()), stranger
            )
        ),
        encode(sign(manifest(SIM_JOB, 91, generation=1), keys.signing_kid, stranger)),
        encode(manifest(SIM_JOB, 95, generation=1)),
    ]
    url = f"sqlite://{root / 'bus.db'}"

    async def _publish() -> None:
        async with open_bus(BusConfig(url=url)) as bus:
            for value in values:
                await bus.publish("manifests", SIM_JOB, value)
            for entry in audit:
                await bus.publish("audit", SIM_JOB, orjson.dumps(entry))

    asyncio.run(_publish())
    return RolledBack(url, admin.path)


def test_with_the_daemons_keys_manifests_it_did_not_sign_are_left_out_and_named(
    rolled_back: RolledBack,
) -> None:
    keys = ("--keys", str(rolled_back.keys))
    listed = checkpoints(rolled_back.url, "list", *keys, "--format", "json")
    rows = as_json(listed)
    assert [(r["snapshot_id"], r["signature"]) for r in rows] == [
        ("job/g0/s10", "verified"),
        ("job/g0/s20", "verified"),
        ("job/g0/s30", "verified"),
    ]
    for snapshot in FORGED:
        assert f"manifest of {snapshot} left out: its manifest is not signed" in listed.stderr
    text = checkpoints(rolled_back.url, "list", *keys)
    assert f"signatures checked with 1 daemon public key(s) of {rolled_back.keys}" in text.stdout
    for snapshot in FORGED:
        refused = checkpoints(rolled_back.url, "compat", snapshot, "--no-check-files", *keys)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "refused  its manifest is not signed by the daemon's keys" in refused.stdout
        shown = checkpoints(rolled_back.url, "show", snapshot, *keys)
        assert shown.returncode == 2
        assert "is not signed by the daemon's keys" in shown.stderr


def test_without_keys_every_manifest_is_listed_and_said_unchecked(
    rolled_back: RolledBack,
) -> None:
    rows = as_json(checkpoints(rolled_back.url, "list", "--format", "json"))
    assert len(rows) == 6
    assert {r["signature"] for r in rows} == {"unchecked"}
    assert "signatures not checked" in checkpoints(rolled_back.url, "list").stdout
    judged = as_json(
        checkpoints(rolled_back.url, "compat", "job/g1/s90", "--no-check-files", "--format", "json")
    )
    assert judged["compatible"] is True
    [warning] = judged["warnings"]
    assert warning.startswith("signatures not checked")


def test_a_snapshot_a_restore_rolled_back_is_abandoned_and_refused(
    rolled_back: RolledBack,
) -> None:
    keys = ("--keys", str(rolled_back.keys))
    rows = as_json(checkpoints(rolled_back.url, "list", *keys, "--format", "json"))
    gone = {r["snapshot_id"]: r["abandoned"] for r in rows}
    assert gone["job/g0/s10"] is None
    assert gone["job/g0/s20"] is None
    dropped = gone["job/g0/s30"]
    assert (dropped["generation"], dropped["target"], dropped["cause"]) == (
        1,
        "job/g0/s20",
        "checksum_mismatch",
    )
    assert dropped["onset_after_step"] == 20
    shown = checkpoints(rolled_back.url, "show", "job/g0/s30", *keys)
    assert shown.returncode == 0, shown.stderr
    assert "abandoned: the restore of generation 1 to job/g0/s20 (step 20)" in shown.stdout
    refused = as_json(
        checkpoints(
            rolled_back.url, "compat", "job/g0/s30", "--no-check-files", *keys, "--format", "json"
        )
    )
    assert refused["compatible"] is False
    assert refused["refusals"] == [dropped["reason"]]
    kept = checkpoints(rolled_back.url, "compat", "job/g0/s20", "--no-check-files", *keys)
    assert kept.returncode == 0, kept.stdout + kept.stderr


def test_run_refuses_an_init_from_a_restore_abandoned(
    rolled_back: RolledBack, tmp_path: Path
) -> None:
    marker = tmp_path / "started"
    done = run_init_from(rolled_back.url, "job/g0/s30", marker, "--nproc-per-node", "4")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "abandoned: the restore of generation 1 to job/g0/s20 (step 20)" in done.stderr
    assert not marker.exists()
