"""Train the byte-level transformer with DistributedDataParallel on CPU (gloo), deterministically.

From the repository root::

    torchrun --standalone --nproc-per-node 2 -m examples.charlm.train --steps 200 --out /tmp/charlm
    python -m examples.charlm.train --steps 200 --out /tmp/charlm-1   # world size 1, no DDP

Rank and world size come from torchrun's ``RANK`` / ``WORLD_SIZE`` (and ``MASTER_ADDR`` /
``MASTER_PORT`` for the gloo rendezvous); without them the script runs alone.

With one seed, two uninterrupted runs end with bitwise-equal parameters, and so does a run that is
stopped (or killed) and restarted with ``--resume-from <out>/checkpoints --generation <g + 1>``.
Outputs under ``--out``: ``checkpoints/step-*/rank-*.pt``, ``ledger-rank-*.jsonl`` (see
:mod:`examples.charlm.ledger`), and from rank 0 ``final.pt`` (the model's state dict) and
``final.sha256`` (:func:`examples.charlm.model.parameter_digest` of it). Logs are JSON lines on
stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from trainguard.agent._sampler import ResumableDistributedSampler

from .checkpoint import (
    SavedShard,
    atomic_write,
    latest_complete_step,
    load_checkpoint,
    save_checkpoint,
)
from .data import ByteWindows
from .ledger import LedgerWriter, ledger_path
from .model import CharLM, ModelConfig, next_byte_loss, parameter_digest

#: Gradient-norm clipping threshold (L2 over all parameters).
MAX_GRAD_NORM = 1.0


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the job: its rank and the number of ranks."""

    rank: int
    world_size: int

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Topology:
        """Read torchrun's ``RANK`` and ``WORLD_SIZE``; both absent means a lone process (0 of 1).

        Raises:
            ValueError: if only one of them is set, or one is not an integer.
        """
        if "RANK" not in env and "WORLD_SIZE" not in env:
            return cls(rank=0, world_size=1)
        return cls(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]))


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run is made of, built once from the command line.

    Attributes:
        steps: optimizer steps to reach (a resumed run continues to this step).
        seed: seeds parameters, dropout streams and the data order.
        out: output folder (checkpoints, ledgers, final parameters).
        checkpoint_every: save a checkpoint every this many steps, and always at ``steps``.
        per_rank_batch: samples per rank per step.
        lr: AdamW learning rate.
        generation: restart generation written into ledger records and checkpoints.
        resume_from: checkpoint root to resume from (its newest step with every rank's shard).
        kill_at: fault injection ``(rank, step)``: that rank SIGKILLs itself at that step, after
            the backward pass (gradients all-reduced) and before the optimizer update.
        threads: torch intra-op threads per process.
        model: the model shape.
    """

    steps: int
    seed: int
    out: Path
    checkpoint_every: int
    per_rank_batch: int
    lr: float
    generation: int
    resume_from: Path | None
    kill_at: tuple[int, int] | None
    threads: int
    model: ModelConfig

    def hyperparameters(self) -> dict[str, Any]:
        """Return the settings a resumed run must share with its checkpoint to stay bitwise exact."""
        return {
            "seed": self.seed,
            "per_rank_batch": self.per_rank_batch,
            "lr": self.lr,
            "model": asdict(self.model),
        }


@dataclass
class Run:
    """The live training objects of one process."""

    model: CharLM
    wrapped: nn.Module
    optimizer: torch.optim.Optimizer
    sampler: ResumableDistributedSampler
    loader: DataLoader[tuple[int, torch.Tensor]]
    data: ByteWindows


def derive_seed(seed: int, *labels: object) -> int:
    """Return a 63-bit seed for the random stream named by ``labels`` under the run seed ``seed``.

    Hashing (sha256 of ``repr((seed, *labels))``) keeps streams independent: ``seed + rank``
    would make seed 1 / rank 0 equal to seed 0 / rank 1.
    """
    digest = hashlib.sha256(repr((seed, *labels)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def build_run(config: TrainConfig, topology: Topology) -> Run:
    """Build data, model (initialized from ``config.seed``), optimizer, sampler and loader.

    Every rank initializes the same parameters; afterwards torch's generator is reseeded per
    rank so dropout masks differ between ranks but are reproducible. The loader has no worker
    processes, so the sampler's cursor is exactly the position of the trained batches.
    """
    data = ByteWindows.from_stdlib(config.model.context)
    torch.manual_seed(config.seed)
    model = CharLM(config.model)
    torch.manual_seed(derive_seed(config.seed, "dropout", topology.rank))
    random.seed(derive_seed(config.seed, "python", topology.rank))
    wrapped: nn.Module = DistributedDataParallel(model) if dist.is_initialized() else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    sampler = ResumableDistributedSampler(
        len(data),
        rank=topology.rank,
        world_size=topology.world_size,
        per_rank_batch_size=config.per_rank_batch,
        seed=config.seed,
        data_version=data.version,
    )
    # Every iter(loader) draws a base seed (for workers; unused here) from the loader's generator,
    # by default torch's global one. A resumed run starts its first pass after the RNG restore,
    # where the uninterrupted run drew before step 1: that draw would shift the dropout stream.
    # A generator of its own keeps the loader off the global stream.
    loader = DataLoader(
        data,
        batch_size=config.per_rank_batch,
        sampler=sampler,
        num_workers=0,
        generator=torch.Generator().manual_seed(derive_seed(config.seed, "loader", topology.rank)),
    )
    return Run(model, wrapped, optimizer, sampler, loader, data)


def capture_state(run: Run, config: TrainConfig, topology: Topology, step: int) -> dict[str, Any]:
    """Return what determines the rest of the run after ``step`` on this rank, but the RNG states.

    The checkpoint writer adds those (as the trainguard agent's ``checkpoint`` does).
    """
    return {
        "step": step,
        "generation": config.generation,
        "rank": topology.rank,
        "world_size": topology.world_size,
        "dataset_version": run.data.version,
        "hyperparameters": config.hyperparameters(),
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "cursor": run.sampler.state_dict(),
    }


def apply_state(run: Run, config: TrainConfig, topology: Topology, state: dict[str, Any]) -> int:
    """Put ``state`` from :func:`capture_state` into ``run``; return the step it was taken at.

    Raises:
        ValueError: if the state belongs to another dataset version, world size or
            hyperparameters (resuming would not reproduce the uninterrupted run).
    """
    expected = {
        "dataset_version": run.data.version,
        "world_size": topology.world_size,
        "hyperparameters": config.hyperparameters(),
    }
    for key, value in expected.items():
        if state[key] != value:
            raise ValueError(f"checkpoint {key} {state[key]!r} differs from this run's {value!r}")
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.sampler.load_state_dict(state["cursor"])
    step: int = state["step"]
    return step


def batches(
    loader: DataLoader[tuple[int, torch.Tensor]],
) -> Iterator[tuple[list[int], torch.Tensor]]:
    """Yield ``(sample ids, windows)`` batches endlessly, one per step, pass after pass.

    Each pass over the loader ends where the sampler's epoch ends and the next continues from
    the sampler's cursor, so a restored cursor takes effect here.
    """
    while True:
        for ids, windows in loader:
            yield ids.tolist(), windows


def train_step(run: Run, windows: torch.Tensor, *, kill_now: bool) -> float:
    """Run forward, backward (DDP all-reduces gradients) and the update; return the loss (nats/byte).

    ``windows`` is this rank's batch, int64 of shape ``(per_rank_batch, context + 1)``.
    """
    run.optimizer.zero_grad(set_to_none=True)
    loss = next_byte_loss(run.wrapped, windows)
    loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
    if kill_now:
        os.kill(os.getpid(), signal.SIGKILL)
    torch.nn.utils.clip_grad_norm_(run.model.parameters(), MAX_GRAD_NORM)
    run.optimizer.step()
    return loss.item()


def train(config: TrainConfig, topology: Topology) -> None:
    """Train from scratch or from ``config.resume_from`` up to ``config.steps``; write outputs.

    Raises:
        FileNotFoundError: as :func:`restore`.
        ValueError: as :func:`apply_state`, or if the checkpoint is beyond ``config.steps``.
    """
    log = structlog.get_logger().bind(
        rank=topology.rank, world_size=topology.world_size, generation=config.generation
    )
    run = build_run(config, topology)
    checkpoints = config.out / "checkpoints"
    start = 0
    if config.resume_from is not None:
        start = restore(run, config, topology, config.resume_from)
        log.info("resumed", step=start, source=str(config.resume_from))
        if start > config.steps:
            raise ValueError(f"checkpoint step {start} is beyond --steps {config.steps}")
    log.info("started", step=start, dataset_version=run.data.version, samples=len(run.data))
    durations: list[float] = []
    loss = float("nan")
    with LedgerWriter(
        ledger_path(config.out, topology.rank), config.generation, topology.rank
    ) as ledger:
        data = batches(run.loader)
        for step in range(start + 1, config.steps + 1):
            began = time.perf_counter()
            ids, windows = next(data)
            loss = train_step(run, windows, kill_now=config.kill_at == (topology.rank, step))
            ledger.record(step, ids)
            durations.append(time.perf_counter() - began)
            # Step boundary: the trainguard agent's step(...) call goes here.
            if step % config.checkpoint_every == 0 or step == config.steps:
                shard = checkpoint(run, config, topology, checkpoints, step)
                log.info("checkpoint", step=step, loss=loss, bytes=shard.size, sha256=shard.sha256)
    if topology.rank == 0:
        write_final(config.out, run.model)
    log.info(
        "finished",
        step=config.steps,
        loss=loss,
        steps_run=len(durations),
        step_seconds_mean=statistics.fmean(durations[1:]) if len(durations) > 1 else None,
        step_seconds_median=statistics.median(durations[1:]) if len(durations) > 1 else None,
    )


def restore(run: Run, config: TrainConfig, topology: Topology, root: Path) -> int:
    """Restore hook: load the newest complete step under ``root`` into ``run``; return that step.

    The trainguard agent's ``restore_target`` / ``load`` replace the lookup and the load.

    Raises:
        FileNotFoundError: if ``root`` holds no step with every rank's shard.
        ValueError: as :func:`apply_state`.
    """
    found = latest_complete_step(root, topology.world_size)
    if found is None:
        raise FileNotFoundError(f"no complete checkpoint under {root}")
    return apply_state(run, config, topology, load_checkpoint(root, found, topology.rank))


def checkpoint(
    run: Run, config: TrainConfig, topology: Topology, root: Path, step: int
) -> SavedShard:
    """Checkpoint hook: save this rank's state after ``step`` (the agent's checkpoint call goes here)."""
    return save_checkpoint(root, step, topology.rank, capture_state(run, config, topology, step))


def write_final(out: Path, model: nn.Module) -> None:
    """Write ``final.pt`` (the state dict) and ``final.sha256`` (its parameter digest) atomically."""
    state = model.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    atomic_write(out / "final.pt", buffer.getvalue())
    atomic_write(out / "final.sha256", f"{parameter_digest(state)}\n".encode())


def _rank_step(text: str) -> tuple[int, int]:
    rank, sep, step = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected RANK:STEP, got {text!r}")
    return int(rank), int(step)


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """Build a :class:`TrainConfig` from command-line arguments (``sys.argv[1:]`` if None)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps to reach")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument(
        "--checkpoint-every", type=int, default=10, help="steps between checkpoints"
    )
    parser.add_argument("--per-rank-batch", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--generation", type=int, default=0, help="restart generation (fencing)")
    parser.add_argument("--resume-from", type=Path, help="checkpoint root to resume from")
    parser.add_argument(
        "--kill-at", type=_rank_step, metavar="RANK:STEP", help="fault injection: SIGKILL there"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--context", type=int, default=ModelConfig.context, help="bytes per sample")
    parser.add_argument("--d-model", type=int, default=ModelConfig.d_model)
    parser.add_argument("--layers", type=int, default=ModelConfig.n_layers)
    parser.add_argument("--heads", type=int, default=ModelConfig.n_heads)
    parser.add_argument("--dropout", type=float, default=ModelConfig.dropout)
    args = parser.parse_args(argv)
    if args.steps < 0 or args.checkpoint_every < 1:
        parser.error("--steps must be >= 0 and --checkpoint-every >= 1")
    return TrainConfig(
        steps=args.steps,
        seed=args.seed,
        out=args.out,
        checkpoint_every=args.checkpoint_every,
        per_rank_batch=args.per_rank_batch,
        lr=args.lr,
        generation=args.generation,
        resume_from=args.resume_from,
        kill_at=args.kill_at,
        threads=args.threads,
        model=ModelConfig(
            context=args.context,
            d_model=args.d_model,
            n_layers=args.layers,
            n_heads=args.heads,
            dropout=args.dropout,
        ),
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: parse arguments, make torch deterministic, join the process group, train."""
    config = parse_args(argv)
    topology = Topology.from_env(os.environ)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    torch.set_num_threads(config.threads)
    torch.set_num_interop_threads(1)
    torch.use_deterministic_algorithms(True)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    try:
        train(config, topology)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
