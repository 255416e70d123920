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

import pytest

from tests.daemon.test_catalog import manifest
from trainguard.agent.bus import BusConfig, open_bus
from trainguard.schemas import Manifest, Shard, encode

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
    return subprocess.run(
        [*CLI, "checkpoints", *args, "--bus", url],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "250"},  # rich wraps at the width it is given
    )


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
    assert verdict["warnings"] == ["hyperparameter model.d_model: snapshot 64, new job 128"]
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
