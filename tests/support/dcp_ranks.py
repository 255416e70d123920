"""Ranks of an FSDP2 job (gloo, CPU) that save a DCP snapshot through trainguard's storage layer
and load it onto another world size, for ``tests/service/agent/test_dcp_checkpoints.py``.

Run with ``torch.multiprocessing.spawn``; each rank reports through files in ``root``:
``files<rank>.json`` (what it wrote), ``reference.pt`` (rank 0: the full model and optimizer
state after saving) and ``loaded-<tag>.pt`` (rank 0: the full state after loading).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FileStore  # dist.FileStore, as the stubs know it
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import async_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from trainguard.agent.checkpoint._dcp import load_dcp, storage_writer
from trainguard.agent.checkpoint._shards import HostStager
from trainguard.agent.checkpoint._snapshot import Snapshot
from trainguard.schemas import DataCursor, Manifest, Shard, StoredFile, files_digest

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def exit_after(rank: int, fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn(rank, *args)``, then end the process at once (``os._exit(0)``) once it returned.

    An exception still reaches ``torch.multiprocessing.spawn`` as usual. Skipping interpreter
    finalization avoids an abort that is torch's, not trainguard's: now and then a gloo rank whose
    collective failed (a DCP load that raised on every rank) dies in teardown with "terminate
    called without an active exception" (SIGABRT) after it wrote its outcome and destroyed its
    groups (gloo's worker threads against interpreter finalization, pytorch#179291).
    """
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _group(root: Path, name: str, rank: int, world_size: int) -> None:
    """A gloo default group over a fresh file store (a stale one would name dead peers)."""
    store = FileStore(str(root / f"store-{name}"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)


def _model(world_size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same small MLP on every world size, sharded by FSDP2 per layer and at the root."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16), torch.nn.Linear(16, 5)
    )
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": get_model_state_dict(model, options=FULL),
        "optim": get_optimizer_state_dict(model, optimizer, options=FULL),
    }


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 16)).square().mean().backward()
    optimizer.step()


def save_rank(rank: int, world_size: int, root: str, uri: str) -> None:
    """Train one step on rank-specific data, save the snapshot at ``uri`` asynchronously as
    the agent does (staged by :class:`HostStager`, written on DCP's thread over a group of its
    own), train on while it is written, record the files and (rank 0) the state at the save."""
    where = Path(root)
    _group(where, "save", rank, world_size)
    try:
        model, optimizer = _model(world_size)
        torch.manual_seed(1 + rank)
        _train_step(model, optimizer)
        full = _full(model, optimizer)
        if rank == 0:
            torch.save(full, where / "reference.pt")
        model_state, optim_state = get_state_dict(model, optimizer)
        write = storage_writer(uri)
        trained = threading.Event()  # the write starts only once training changed the state
        write_data = write.writer.write_data

        def write_later(plan: Any, planner: Any) -> Any:
            trained.wait()
            return write_data(plan, planner)

        write.writer.write_data = write_later  # type: ignore[method-assign]
        upload = async_save(
            {"model": model_state, "optim": optim_state},
            storage_writer=write.writer,
            process_group=dist.new_group(backend="gloo"),
            async_stager=cast(AsyncStager, HostStager()),
        )
        _train_step(model, optimizer)  # changes every tensor the save holds a copy of
        trained.set()
        cast("Future[object]", upload).result()
        write.write_sidecar(rank, {"rank": rank})
        listed = [[f.name, f.size_bytes, f.digest] for f in write.files()]
        (where / f"files{rank}.json").write_text(json.dumps(listed))
    finally:
        dist.destroy_process_group()


def shards_of(root: Path, uri: str, world_size: int) -> tuple[Shard, ...]:
    """The shards a manifest of the saved snapshot lists (from the ranks' ``files*.json``)."""
    shards = []
    for rank in range(world_size):
        listed = json.loads((root / f"files{rank}.json").read_text())
        files = tuple(StoredFile(name=n, size_bytes=s, digest=d) for n, s, d in listed)
        size = sum(f.size_bytes for f in files)
        shards.append(
            Shard(rank=rank, uri=uri, size_bytes=size, digest=files_digest(files), files=files)
        )
    return tuple(shards)


def snapshot_of(shards: tuple[Shard, ...]) -> Snapshot:
    """A snapshot whose manifest lists ``shards`` (ranks 0..n-1; the other fields made up)."""
    return Snapshot.of(
        Manifest(
            job_id="dcp",
            snapshot_id="dcp/g0/s1",
            generation=0,
            ts=0,
            step=1,
            world_size=len(shards),
            shards=shards,
            cursor=DataCursor(data_version="v", seed=0, epoch=0, offset=0, world_size=len(shards)),
        )
    )


def load_rank(rank: int, world_size: int, root: str, uri: str, saved_by: int, tag: str) -> None:
    """Load the snapshot onto ``world_size`` ranks; rank 0 writes the full state it got, and
    every rank what it found of its own agent state (or its error)."""
    where = Path(root)
    _group(where, f"load-{tag}", rank, world_size)
    try:
        model, optimizer = _model(world_size)
        model_state, optim_state = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_state, "optim": optim_state}
        outcome: dict[str, Any]
        try:
            own = load_dcp(
                snapshot_of(shards_of(where, uri, saved_by)),
                state,
                rank,
                process_group=dist.group.WORLD,
            )
        except Exception as exc:
            outcome = {"error": type(exc).__name__, "message": str(exc)}
        else:
            outcome = {"own": own}
            set_state_dict(
                model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state
            )
            full = _full(model, optimizer)
            if rank == 0:
                torch.save(full, where / f"loaded-{tag}.pt")
        (where / f"outcome-{tag}-{rank}.json").write_text(json.dumps(outcome))
    finally:
        dist.destroy_process_group()
