"""Train the byte-level transformer with DistributedDataParallel on CPU (gloo), deterministically,
with trainguard's agent checkpointing and restoring it.

From the repository root::

    torchrun --standalone --nproc-per-node 2 -m examples.charlm.train --steps 200 --out /tmp/charlm
    python -m examples.charlm.train --steps 200 --out /tmp/charlm-1   # world size 1, no DDP

Rank and world size come from torchrun's ``RANK`` / ``WORLD_SIZE`` (and ``MASTER_ADDR`` /
``MASTER_PORT`` for the gloo rendezvous); without them the script runs alone. The agent reads
its settings from the ``TRAINGUARD_*`` variables (trainguard's supervisor sets them; see
:class:`trainguard.agent.AgentConfig`), with this example's defaults: job ``charlm``, the
embedded bus ``<out>/bus.db``, shards under ``<out>/checkpoints``. No daemon is needed to train:
the agent just publishes to the bus. A process of generation g > 0 (``TRAINGUARD_GENERATION``)
resumes from the target of the daemon's restore command of g.

With one seed, two uninterrupted runs end with bitwise-equal parameters, and so does a run that is
killed and restored from a committed checkpoint, or restored in process (the daemon's
``in_process`` restores: :class:`trainguard.agent.RestoreRequested` is caught at a step boundary
and the snapshot reloaded without exiting). Outputs under ``--out``: the bus, the shards,
``ledger-rank-*.jsonl`` (see :mod:`examples.charlm.ledger`), and from rank 0 ``final.pt`` (the
model's state dict) and ``final.sha256`` (:func:`examples.charlm.model.parameter_digest` of it).
Logs are JSON lines on stderr.
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import io
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from trainguard.agent import (
    Agent,
    AgentConfig,
    RestoreRequested,
    ResumableDistributedSampler,
    Snapshot,
    await_handoff,
    exit_on_config_error,
    ordered_allreduce,
    wait_for_store,
)
from trainguard.schemas import Checkpoint, StepRange

from .data import ByteWindows
from .ledger import LedgerWriter, ledger_path
from .model import CharLM, ModelConfig, next_byte_loss, parameter_digest

#: Gradient-norm clipping threshold (L2 over all parameters).
MAX_GRAD_NORM = 1.0

#: The agent's job id when ``TRAINGUARD_JOB`` is not set.
DEFAULT_JOB = "charlm"


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run is made of, built once from the command line.

    Attributes:
        steps: optimizer steps to reach (a restored run continues to this step).
        seed: seeds parameters, dropout streams and the data order.
        out: output folder (bus, checkpoints, ledgers, final parameters).
        checkpoint_every: checkpoint every this many steps, and always at ``steps``.
        blocking_checkpoints: write shards on the training thread instead of in the background.
        per_rank_batch: samples per rank per step.
        lr: AdamW learning rate.
        threads: torch intra-op threads per process.
        model: the model shape.
        step_sleep: seconds each step sleeps after its update, to pace the job like a bigger
            one (rehearsals of detectors that learn the step time); the numbers are unchanged.
        step_period: each step lasts at least this many seconds: after its update (and
            ``step_sleep``) it sleeps only what is left of the period, so that the job's
            length stays the same on a loaded machine as long as a step's compute fits in it
            (tests that need a job to outlast a scenario); the numbers are unchanged.
        eval_every: evaluate every this many steps (0: never), declared as the phase ``eval``.
        eval_seconds: an evaluation lasts at least this long (it sleeps the rest): simulates
            a long one. Evaluating draws no random numbers, so the numbers are unchanged.
        skip: train as if a restore had asked to skip the batches of these steps (an
            uninterrupted reference for a run restored after a loss spike), or ``None``.
        sync: average gradients over the ranks (DDP); ``False`` trains an independent replica
            per rank on its share of the data, without a process group, so that ranks
            progress at their own pace (straggler rehearsals).
        pg_timeout: seconds a gloo collective waits for the other ranks before it fails
            (``init_process_group``'s ``timeout``), or ``None`` for torch's default
            (``torch.distributed.constants.default_pg_timeout``, 30 minutes in torch 2.13).
    """

    steps: int
    seed: int
    out: Path
    checkpoint_every: int
    blocking_checkpoints: bool
    per_rank_batch: int
    lr: float
    threads: int
    model: ModelConfig
    step_sleep: float = 0.0
    step_period: float = 0.0
    eval_every: int = 0
    eval_seconds: float = 0.0
    skip: StepRange | None = None
    sync: bool = True
    pg_timeout: float | None = None

    def hyperparameters(self) -> dict[str, Any]:
        """The settings a restored run must share with its checkpoint to stay bitwise exact
        (recorded in every checkpoint's metadata)."""
        return {
            "seed": self.seed,
            "per_rank_batch": self.per_rank_batch,
            "lr": self.lr,
            "model": asdict(self.model),
            "sync": self.sync,
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


def agent_config(
    config: TrainConfig, env: Mapping[str, str], faults: str | None = None
) -> AgentConfig:
    """The agent's settings: ``env`` (``TRAINGUARD_*``, ``RANK``, ``WORLD_SIZE``) over this
    example's defaults (job :data:`DEFAULT_JOB`, bus ``<out>/bus.db``, shards under
    ``<out>/checkpoints``, in-process restores on: :func:`train` catches
    ``RestoreRequested``); ``faults``, when given, over ``TRAINGUARD_FAULTS``.

    Raises:
        ConfigError: as :meth:`AgentConfig.resolve`.
    """
    out = config.out.resolve()
    defaults = {
        "TRAINGUARD_JOB": DEFAULT_JOB,
        "TRAINGUARD_BUS": f"sqlite://{out / 'bus.db'}",
        "TRAINGUARD_CHECKPOINT_DIR": str(out / "checkpoints"),
        "TRAINGUARD_IN_PROCESS_RESTORE": "1",
    }
    return AgentConfig.resolve(
        env={**defaults, **env}, faults=faults, hyperparameters=config.hyperparameters()
    )


def build_run(config: TrainConfig, rank: int, world_size: int) -> Run:
    """Build data, model (initialized from ``config.seed``), optimizer, sampler and loader.

    Every rank initializes the same parameters; afterwards torch's generator is reseeded per
    rank so dropout masks differ between ranks but are reproducible. DDP averages the gradients
    with :func:`trainguard.agent.ordered_allreduce`: in rank order, whatever its bucket layout,
    which a restarted process rebuilds (bitwise restores at any world size:
    ``docs/bitwise.md``).
    """
    data = ByteWindows.from_stdlib(config.model.context)
    torch.manual_seed(config.seed)
    model = CharLM(config.model)
    torch.manual_seed(derive_seed(config.seed, "dropout", rank))
    random.seed(derive_seed(config.seed, "python", rank))
    wrapped: nn.Module = (
        ordered_allreduce(DistributedDataParallel(model)) if dist.is_initialized() else model
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    sampler = ResumableDistributedSampler(
        len(data),
        rank=rank,
        world_size=world_size,
        per_rank_batch_size=config.per_rank_batch,
        seed=config.seed,
        data_version=data.version,
    )
    # Every iter(loader) draws a base seed (for workers; unused here) from the loader's generator,
    # by default torch's global one. A restored run starts its first pass after the RNG restore,
    # where the uninterrupted run drew before step 1: that draw would shift the dropout stream.
    # A generator of its own keeps the loader off the global stream.
    loader = DataLoader(
        data,
        batch_size=config.per_rank_batch,
        sampler=sampler,
        num_workers=0,
        generator=torch.Generator().manual_seed(derive_seed(config.seed, "loader", rank)),
    )
    return Run(model, wrapped, optimizer, sampler, loader, data)


def warm_up(config: TrainConfig) -> None:
    """Pay before the hand-off point what a new worker's first steps would pay after it, on a
    throwaway model: torch's lazy imports (``torch.optim.AdamW``'s constructor imports
    ``torch._dynamo``, 2 s of a worker's start here), autograd's first backward pass, and
    ``torch.save``/``torch.load``'s first use. Draws from torch's global generator, which
    :func:`build_run` reseeds: the numbers of the run are unchanged."""
    model = CharLM(config.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    windows = torch.zeros(1, config.model.context + 1, dtype=torch.long)
    next_byte_loss(model, windows).backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    torch.load(buffer, weights_only=True)


def capture_state(run: Run) -> dict[str, Any]:
    """This rank's state after a step, but the RNG streams and the data cursor, which the
    agent's ``checkpoint`` adds."""
    return {"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict()}


def restore(agent: Agent, run: Run, config: TrainConfig, target: Snapshot) -> int:
    """Load ``target`` into ``run`` (the agent verifies the shard and restores the RNG
    streams); return its step.

    Raises:
        ValueError: the snapshot was taken with other hyperparameters, world size or dataset
            (resuming would not reproduce the uninterrupted run), or beyond ``config.steps``.
        ShardError: as :meth:`Agent.load`.
    """
    world_size = agent.config.world_size
    if target.metadata.hyperparameters != config.hyperparameters():
        raise ValueError(
            f"snapshot {target.snapshot_id} has hyperparameters "
            f"{target.metadata.hyperparameters}, this run {config.hyperparameters()}"
        )
    if target.world_size != world_size:
        raise ValueError(f"snapshot {target.snapshot_id} has world size {target.world_size}")
    if target.step > config.steps:
        raise ValueError(f"snapshot step {target.step} is beyond --steps {config.steps}")
    # Checks the data version (DataVersionMismatch) before anything is loaded; the sampler
    # counts the batches it hands out from here on.
    run.sampler.load_state_dict(target.cursor)
    state = agent.load(target)
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    return target.step


def batches(
    loader: DataLoader[tuple[int, torch.Tensor]],
) -> Iterator[tuple[list[int], torch.Tensor]]:
    """Yield ``(sample ids, windows)`` endlessly, one per step.

    Each pass over the loader ends where the sampler's epoch ends and the next continues from
    the sampler's cursor, so a restored cursor or a skip takes effect here; the sampler counts
    what it handed out across passes (``sampler.cursor``).
    """
    while True:
        for ids, windows in loader:
            yield ids.tolist(), windows


def train_step(run: Run, windows: torch.Tensor, agent: Agent, step: int) -> float:
    """Run forward, backward (DDP all-reduces gradients) and the update of ``step``; return the
    loss in nats per byte.

    ``windows`` is this rank's batch, int64 of shape ``(per_rank_batch, context + 1)``. The loss
    passes through ``agent.perturb_loss`` before it is differentiated, so that the ``nan`` and
    ``spike`` faults change the gradients and parameters too.
    """
    run.optimizer.zero_grad(set_to_none=True)
    loss = agent.perturb_loss(step, next_byte_loss(run.wrapped, windows))
    loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
    torch.nn.utils.clip_grad_norm_(run.model.parameters(), MAX_GRAD_NORM)
    run.optimizer.step()
    return loss.item()


def evaluate(agent: Agent, run: Run, config: TrainConfig) -> float:
    """The model's loss on a fixed held-out batch (the dataset's last ``per_rank_batch``
    windows), in the declared phase ``eval``, lasting at least ``config.eval_seconds``.

    Dropout is off and no gradient is kept: no random number is drawn and nothing the training
    depends on changes.
    """
    agent.phase("eval")
    began = time.monotonic()
    last = len(run.data)
    windows = torch.stack([run.data[i][1] for i in range(last - config.per_rank_batch, last)])
    run.model.eval()
    with torch.no_grad():
        loss = next_byte_loss(run.model, windows).item()
    run.model.train()
    time.sleep(max(0.0, config.eval_seconds - (time.monotonic() - began)))
    agent.phase("train")
    return loss


def remaining_period(period_s: float, began: float, now: float) -> float:
    """Seconds a step that began at ``began`` and stands at ``now`` (both
    ``time.perf_counter()``, seconds) still sleeps to last ``period_s`` seconds: never
    negative, so a step whose compute took longer than the period is not slowed further."""
    return max(0.0, period_s - (now - began))


def reload(agent: Agent, run: Run, config: TrainConfig, request: RestoreRequested) -> Run:
    """Reload in process for ``request``: the target snapshot into ``run`` (or a fresh run,
    initialized from the seed, when the restore starts from scratch); acknowledge and wait for
    the daemon's ``resume``. Returns the run to go on with, standing at ``request.step``.

    Raises:
        ValueError, ShardError: as :func:`restore`.
        RestoreTimeout, JobAborted, StaleGeneration: as :meth:`Agent.ready`.
    """
    if request.target is None:
        run = build_run(config, agent.config.rank, agent.config.world_size)
    else:
        restore(agent, run, config, request.target)
    if request.skip is not None:
        run.sampler.skip(request.skip, restored_step=request.step)
    agent.ready(request.step, cursor=run.sampler.cursor)
    return run


def train(config: TrainConfig, settings: AgentConfig) -> None:
    """Train from scratch, or from the agent's restore target, up to ``config.steps``;
    reload in process whenever the daemon asks (:class:`RestoreRequested`).

    Raises:
        ValueError: as :func:`restore`.
        ShardError, RestoreTimeout, JobAborted, StaleGeneration: as the agent's restore calls.
    """
    with Agent(settings) as agent:
        rank, world_size = agent.config.rank, agent.config.world_size
        log = structlog.get_logger().bind(rank=rank, world_size=world_size)
        run = build_run(config, rank, world_size)
        step = 0
        target = agent.restore_target()
        if target is not None:
            step = restore(agent, run, config, target)
            log.info("restored", step=step, snapshot_id=target.snapshot_id)
        skip = agent.skip if agent.skip is not None else config.skip
        # Never train the batches of these steps (docs/wire-contract.md); a snapshot past
        # their start holds a cursor that skipped them already.
        if skip is not None and skip.from_step > step:
            run.sampler.skip(skip, restored_step=step)
        agent.ready(step, cursor=run.sampler.cursor)
        log.info("started", step=step, dataset_version=run.data.version, samples=len(run.data))
        durations: list[float] = []
        loss = float("nan")
        generation = agent.config.generation
        with LedgerWriter(ledger_path(config.out, rank), generation, rank) as ledger:
            data = batches(run.loader)
            if config.sync:  # replicas are bitwise equal only when gradients are averaged
                agent.watch(run.model)
            while step < config.steps:
                step += 1
                began = time.perf_counter()
                ids, windows = next(data)
                loss = train_step(run, windows, agent, step)
                time.sleep(config.step_sleep)
                time.sleep(remaining_period(config.step_period, began, time.perf_counter()))
                ledger.record(step, ids)
                try:
                    agent.step(step, loss=loss, samples=len(ids))
                except RestoreRequested as request:
                    log.warning("restore_requested", step=step, detail=str(request))
                    run = reload(agent, run, config, request)
                    step = request.step
                    ledger.generation = agent.config.generation
                    data = batches(run.loader)
                    if config.sync:
                        agent.watch(run.model)
                    log.info("reloaded", step=step, generation=ledger.generation)
                    continue
                durations.append(time.perf_counter() - began)
                if config.eval_every and step % config.eval_every == 0:
                    log.info("eval", step=step, loss=evaluate(agent, run, config))
                if step % config.checkpoint_every == 0 or step == config.steps:
                    saved = agent.checkpoint(
                        step,
                        capture_state(run),
                        cursor=run.sampler.cursor,
                        blocking=config.blocking_checkpoints,
                    )
                    saved.add_done_callback(functools.partial(log_checkpoint, log, step))
        if rank == 0:
            write_final(config.out, run.model.state_dict())
        log.info(
            "finished",
            step=config.steps,
            loss=loss,
            steps_run=len(durations),
            step_seconds_mean=statistics.fmean(durations[1:]) if len(durations) > 1 else None,
            step_seconds_median=statistics.median(durations[1:]) if len(durations) > 1 else None,
        )


def log_checkpoint(log: Any, step: int, done: Future[Checkpoint]) -> None:
    """Log the outcome of the checkpoint of ``step`` (runs on the thread that finished it)."""
    error = done.exception()
    if error is not None:
        log.error("checkpoint_failed", step=step, error=str(error))
        return
    event = done.result()
    files = None if event.files is None else len(event.files)
    log.info("checkpoint", step=step, bytes=event.size_bytes, digest=event.digest, files=files)


def write_final(out: Path, state: Mapping[str, torch.Tensor]) -> None:
    """Write ``final.pt`` (the state dict) and ``final.sha256`` (its parameter digest), each
    atomically (:func:`atomic_write`)."""
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    atomic_write(out / "final.pt", buffer.getvalue())
    atomic_write(out / "final.sha256", f"{parameter_digest(state)}\n".encode())


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably: temporary file, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    tmp.replace(path)


def parse_args(argv: Sequence[str] | None = None) -> tuple[TrainConfig, str | None]:
    """Build a :class:`TrainConfig` and the ``--faults`` spec (or ``None``) from command-line
    arguments (``sys.argv[1:]`` if None)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps to reach")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument(
        "--checkpoint-every", type=int, default=10, help="steps between checkpoints"
    )
    parser.add_argument(
        "--blocking-checkpoints",
        action="store_true",
        help="write shards on the training thread (default: in the background)",
    )
    parser.add_argument("--per-rank-batch", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument(
        "--faults", help="fault injection, e.g. kill@step=20,rank=1 (sets TRAINGUARD_FAULTS)"
    )
    parser.add_argument(
        "--step-sleep",
        type=float,
        default=0.0,
        help="seconds each step sleeps, to pace the job like a bigger one (numbers unchanged)",
    )
    parser.add_argument(
        "--step-period",
        type=float,
        default=0.0,
        metavar="S",
        help="each step lasts at least S seconds, sleeping only the rest (numbers unchanged)",
    )
    parser.add_argument(
        "--eval-every", type=int, default=0, help="evaluate every N steps (phase eval; 0: never)"
    )
    parser.add_argument(
        "--eval-seconds", type=float, default=0.0, help="an evaluation lasts at least S seconds"
    )
    parser.add_argument(
        "--skip-steps",
        type=_step_range,
        help="A-B: skip the batches of steps A..B as a restore would (a reference run)",
    )
    parser.add_argument(
        "--no-sync",
        dest="sync",
        action="store_false",
        help="independent replica per rank: no process group, no gradient averaging",
    )
    parser.add_argument(
        "--pg-timeout",
        type=float,
        metavar="SECONDS",
        help="a gloo collective fails after waiting this long (default: torch's, 30 min)",
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
    if min(args.step_sleep, args.step_period, args.eval_every, args.eval_seconds) < 0:
        parser.error("--step-sleep, --step-period, --eval-every and --eval-seconds must be >= 0")
    if args.pg_timeout is not None and args.pg_timeout <= 0:
        parser.error("--pg-timeout must be > 0")
    config = TrainConfig(
        steps=args.steps,
        seed=args.seed,
        out=args.out,
        checkpoint_every=args.checkpoint_every,
        blocking_checkpoints=args.blocking_checkpoints,
        per_rank_batch=args.per_rank_batch,
        lr=args.lr,
        threads=args.threads,
        step_sleep=args.step_sleep,
        step_period=args.step_period,
        eval_every=args.eval_every,
        eval_seconds=args.eval_seconds,
        skip=args.skip_steps,
        sync=args.sync,
        pg_timeout=args.pg_timeout,
        model=ModelConfig(
            context=args.context,
            d_model=args.d_model,
            n_layers=args.layers,
            n_heads=args.heads,
            dropout=args.dropout,
        ),
    )
    return config, args.faults


def _step_range(text: str) -> StepRange:
    """``"A-B"`` -> ``StepRange(from_step=A, to_step=B)``, ``1 <= A <= B``.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    first, _, last = text.partition("-")
    try:
        steps = StepRange(from_step=int(first), to_step=int(last))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not A-B") from None
    if not 1 <= steps.from_step <= steps.to_step:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= A <= B")
    return steps


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: parse arguments, make torch deterministic, wait at the hand-off point
    (a warm spare of ``trainguard run --warm`` waits there for its rank), join the process
    group, train."""
    config, faults = parse_args(argv)
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
    # What torch.use_deterministic_algorithms(True) does, less its import of torch._inductor
    # to set a flag of the compiler, which this job never uses: that import took 1.5-2 s of
    # every worker's start here (4.1 s against 2.1-2.6 s for `import torch` alone), paid again
    # by every restarted worker.
    torch._C._set_deterministic_algorithms(True)
    warm_up(config)
    # Everything above is the same in every generation; from here on the rank's generation,
    # rendezvous port and files are read (docs/warm-restarts.md).
    await_handoff()
    settings = agent_config(config, os.environ, faults)
    if "WORLD_SIZE" in os.environ and config.sync:
        wait_for_store()
        if config.pg_timeout is None:
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo", timeout=timedelta(seconds=config.pg_timeout))
    try:
        train(config, settings)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Every file and connection of the run is closed by now. The interpreter's final garbage
    # collections over torch's million objects took 1.1 s of every worker's exit here; frozen
    # objects are left out of them (0.2 s).
    gc.freeze()


if __name__ == "__main__":
    # A bad setting exits 78, which trainguard run's daemon does not restart (docs/recovery.md).
    with exit_on_config_error():
        main()
