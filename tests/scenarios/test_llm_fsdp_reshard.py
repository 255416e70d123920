"""Resharding on restore with real processes (issue 15, item 2 and its "Done when" bullet): the
``examples/llm_fsdp`` job (FSDP2, AdamW, asynchronous DCP checkpoints, ``StatefulDataLoader``
with a worker process) trains on 2 ranks under a daemon to step :data:`SAVED`, where its last
checkpoint commits; then a new job starts from that snapshot with ``trainguard run --init-from``
on 1 rank, and another on 4, each training on to step :data:`END`.

For each new world size:

* ``trainguard checkpoints compat SNAPSHOT --world-size N`` accepts the snapshot with a warning
  that it is resharded, and ``run --init-from`` starts the job with that warning;
* the state the new job loaded equals the saved one, tensor by tensor, bit for bit: the example's
  ``--dump-state`` writes the full (unsharded) model and optimizer state from rank 0 at the end of
  the source job (after step :data:`SAVED`, the state its last checkpoint saved) and right after
  the new job's restore, keyed by parameter names on any world size;
* the data order is exact: the source job's samples, step by step and rank by rank (its ledger),
  followed by the new job's, are the global sampler order from its start, with nothing skipped or
  repeated although a step now takes ``N * per_rank_batch`` samples;
* the new job commits its own snapshot of step :data:`END`, on ``N`` ranks, with the source
  snapshot as its parent, and the daemon never restores it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.charlm.data import ByteWindows
from examples.charlm.ledger import ledger_path, read_ledger
from examples.llm_fsdp.model import LLMConfig
from tests.scenarios.harness import Shape
from tests.scenarios.test_llm_fsdp import LLMRun
from tests.support.buses import BusFactory
from trainguard.agent.data._cursor import GlobalOrder
from trainguard.daemon.demo._harness import read_job_record
from trainguard.schemas import Manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

#: The source job's last step: its last checkpoint, the snapshot the new jobs start from.
SAVED = 20
#: The step the new jobs train to.
END = 30
EVERY = 10
SEED = 11
#: The example's default ``--per-rank-batch`` (a hyperparameter its restore requires unchanged).
PER_RANK_BATCH = 8
SOURCE_JOB = "llm-reshard-source"
PREFIX = "reshard."
CLI = [sys.executable, "-m", "trainguard.daemon.cli"]


@dataclass(frozen=True)
class Source:
    """The finished 2-rank source job: its bus, output folder and committed last snapshot."""

    bus: BusFactory
    out: Path
    snapshot: Manifest


def _settled(run: LLMRun, step: int, timeout_s: float = 90.0) -> Manifest:
    """The manifest of ``step`` of ``run``'s job once the daemon has committed it and seen the
    job finish (the supervisor may exit before the daemon has read the last events).

    Raises:
        AssertionError: not within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        record = asyncio.run(read_job_record(run.bus.url, run.bus.prefix, run.job))
        manifests = [
            m.message
            for m in record.manifests
            if isinstance(m.message, Manifest) and m.message.step == step
        ]
        finished = any(
            d["decision"] == "transition" and d["new"] == "finished" for d in record.decisions()
        )
        if manifests and finished:
            return manifests[0]
        assert time.monotonic() < deadline, (
            f"step {step} committed: {bool(manifests)}, job finished: {finished} {run.describe()}"
        )
        time.sleep(0.5)


def _run_to_end(run: LLMRun, step: int, run_args: tuple[str, ...] = ()) -> Manifest:
    """Start ``run``'s daemon and job (``--dump-state``), wait for the supervisor to exit 0 and
    the daemon to commit ``step`` and see the job finish; stop the daemon; return the manifest
    of ``step``."""
    run.start_daemon()
    run.start_job(extra=["--dump-state"], run_args=run_args)
    assert run.supervisor is not None
    try:
        code = run.supervisor.wait(240)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the job did not end within 240 s {run.describe()}") from None
    assert code == 0, f"supervisor exit status {code} {run.describe()}"
    manifest = _settled(run, step)
    assert run.finish() == 0
    return manifest


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Source]:
    """The 2-rank job of ``examples/llm_fsdp`` from scratch to step :data:`SAVED` under a
    daemon, on a SQLite bus of its own that the new jobs share."""
    workdir = tmp_path_factory.mktemp("llm-reshard-source")
    bus = BusFactory("sqlite", f"sqlite://{workdir / 'bus.db'}", PREFIX)
    shape = Shape(steps=SAVED, checkpoint_every=EVERY, seed=SEED, world_size=2)
    run = LLMRun(bus, workdir, shape, workdir, job=SOURCE_JOB)
    try:
        snapshot = _run_to_end(run, SAVED)
        record = run.record()  # replays the job's decisions
        assert not record.restores(), run.describe()
        yield Source(bus, run.out, snapshot)
    finally:
        run.close()


def _checkpoints(bus: BusFactory, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "checkpoints", *args, "--bus", bus.url, "--topic-prefix", bus.prefix],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "250"},
    )


@pytest.mark.parametrize("world_size", [1, 4])
def test_a_dcp_snapshot_of_2_ranks_restores_onto_another_world_size_exactly(
    source: Source, tmp_path: Path, world_size: int
) -> None:
    snapshot = source.snapshot
    assert (snapshot.world_size, snapshot.step) == (2, SAVED)
    names = {f.name for s in snapshot.shards for f in s.files or ()}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= names, names

    # (c) compat accepts the DCP snapshot on the new world size, with a warning.
    judged = _checkpoints(
        source.bus,
        "compat",
        snapshot.snapshot_id,
        "--world-size",
        str(world_size),
        "--verify",
        "--format",
        "json",
    )
    assert judged.returncode == 0, judged.stdout + judged.stderr
    verdict = json.loads(judged.stdout)
    assert verdict["compatible"] is True, verdict
    assert verdict["refusals"] == [], verdict
    resharded = f"world size {world_size} != 2: this DCP snapshot is resharded onto rank"
    assert any(w.startswith(resharded) for w in verdict["warnings"]), verdict

    job = f"llm-reshard-to{world_size}"
    shape = Shape(steps=END, checkpoint_every=EVERY, seed=SEED, world_size=world_size)
    run = LLMRun(source.bus, tmp_path, shape, source.out, job=job)
    run.context = f"{SOURCE_JOB} on 2 ranks to step {SAVED}, then {job} on {world_size}"
    try:
        committed = _run_to_end(run, END, ("--init-from", snapshot.snapshot_id))
        record = run.record()  # replays the job's decisions
    finally:
        run.close()
    log = (tmp_path / "supervisor.log").read_text()
    assert f"warning: --init-from {snapshot.snapshot_id}: {resharded}" in log, run.describe()
    assert not record.restores(), run.describe()
    assert (committed.world_size, committed.parent) == (world_size, snapshot.snapshot_id)
    written = {f.name for s in committed.shards for f in s.files or ()}
    assert {f"__{r}_0.distcp" for r in range(world_size)} <= written, run.describe()

    # (a) The loaded state is the saved one, every model and optimizer tensor bit for bit.
    saved = _load(source.out / "final-state.pt")
    loaded = _load(run.out / "restored-state.pt")
    steps = {float(s["step"]) for s in saved["optim"]["state"].values()}
    assert steps == {float(SAVED)}, f"AdamW steps {steps} in the saved state {run.describe()}"
    differences = _differences(saved, loaded)
    assert not differences, f"loaded != saved: {differences[:5]} {run.describe()}"
    trained = _load(run.out / "final-state.pt")
    assert _differences(saved["model"], trained["model"]), f"did not train {run.describe()}"

    # (b) The data order continues the global order exactly: the source's samples step by step,
    # rank by rank, then the new job's, are the sampler's stream from its start.
    data = ByteWindows.from_stdlib(LLMConfig.context)
    order = GlobalOrder(len(data), SEED, data.version)
    assert order.position(snapshot.cursor) == SAVED * 2 * PER_RANK_BATCH, snapshot.cursor
    before = _global_sequence(source.out, 2, range(1, SAVED + 1))
    after = _global_sequence(run.out, world_size, range(SAVED + 1, END + 1))
    expected = list(order.samples(order.start(), len(before) + len(after)))
    assert len(after) == (END - SAVED) * world_size * PER_RANK_BATCH
    first = _first_difference(before + after, expected)
    assert before + after == expected, (
        f"data order not exact: first difference at sample {first} of {len(expected)} "
        f"({len(before)} before the snapshot) {run.describe()}"
    )
    assert order.position(committed.cursor) == len(expected), committed.cursor


def _load(path: Path) -> dict[str, Any]:
    """A state written by the example's ``--dump-state``."""
    assert path.is_file(), f"no {path}"
    state: dict[str, Any] = torch.load(path, weights_only=True)
    return state


def _differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where the nested states ``a`` and ``b`` differ (tensors: dtype, shape and every bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and (a.dtype, a.shape) == (b.dtype, b.shape)
            and torch.equal(a, b)
        )
        return [] if same else [where]
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            return [f"{where} keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return [f"{where} lengths {len(a)} != {len(b)}"]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in _differences(x, y, f"{where}[{i}]")
        ]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _global_sequence(out: Path, world_size: int, steps: range) -> list[int]:
    """The samples a job trained, flattened in global order: step by step, rank by rank (each
    step's global batch is the ranks' contiguous slices in rank order). Each step of ``steps``
    must have been trained once by every rank, in one generation."""
    records = read_ledger(ledger_path(out, r) for r in range(world_size))
    assert {r.generation for r in records} == {0}, out
    trained = sorted((r.step, r.rank) for r in records)
    assert trained == [(s, r) for s in steps for r in range(world_size)], out
    by_key = {(r.step, r.rank): r.samples for r in records}
    for samples in by_key.values():
        assert len(samples) == PER_RANK_BATCH, out
    return [i for key in trained for i in by_key[key]]


def _first_difference(a: list[int], b: list[int]) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter length if one is a prefix)."""
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))
