"""Train a small decoder-only transformer with FSDP2 on CPU (gloo), deterministically, with
DCP checkpoints written and restored through trainguard's agent.

Under trainguard's supervisor, from the repository root::

    trainguard run --job llm --nproc-per-node 2 -- python -m examples.llm_fsdp.train \\
        --steps 60 --out /tmp/llm
    torchrun --standalone --nproc-per-node 2 -m examples.llm_fsdp.train --out /tmp/llm
    python -m examples.llm_fsdp.train --out /tmp/llm-1   # one rank: a process group of one

What it is made of, as a real LLM job would be:

* the model (:mod:`examples.llm_fsdp.model`) sharded with FSDP2: ``fully_shard`` on every
  block, then on the root, over a 1-D CPU ``DeviceMesh`` of all ranks (gloo);
* AdamW, gradient clipping over the sharded gradients;
* torchdata's ``StatefulDataLoader`` with a worker process and prefetching, over trainguard's
  ``ResumableDistributedSampler`` (the data and the sample ids are
  :class:`examples.charlm.data.ByteWindows`');
* ``torch.distributed.checkpoint`` (DCP) checkpoints through the agent, asynchronous by
  default: this example sets ``TRAINGUARD_CHECKPOINT_FORMAT=dcp`` unless the environment says
  otherwise. The state is ``get_state_dict(model, optimizer)`` (sharded, DTensors) plus this
  rank's loader state under a key of its own rank; a restore fills the same state dict in
  place (``agent.load(target, state=...)``, every file verified against its digest first) and
  hands it to ``set_state_dict``.

Outputs under ``--out``: the bus (``bus.db``, when trainguard's supervisor does not name
another), the checkpoints (``checkpoints/``, or ``TRAINGUARD_CHECKPOINT_URI``),
``ledger-rank-*.jsonl`` (:mod:`examples.charlm.ledger`: the sample ids each rank trained at
each step), and from rank 0 ``final.pt`` (the full, unsharded state dict) and ``final.sha256``
(:func:`examples.charlm.model.parameter_digest` of it); with ``--dump-state``, also from rank 0
the full model and optimizer state right after a restore (``restored-state.pt``) and at the end
(``final-state.pt``). With one seed, an uninterrupted run and a run killed and restored from a
committed checkpoint end with bitwise-equal parameters (``README.md`` says why). Logs are JSON
lines on stderr.
"""

from __future__ import annotations

import argparse
import functools
import gc
import io
import os
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
from torch._C._distributed_c10d import HashStore
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchdata.stateful_dataloader import StatefulDataLoader

from examples.charlm.data import ByteWindows
from examples.charlm.ledger import LedgerWriter, ledger_path
from examples.charlm.model import next_byte_loss
from examples.charlm.train import atomic_write, derive_seed, log_checkpoint, write_final
from trainguard.agent import (
    Agent,
    AgentConfig,
    LoaderState,
    ResumableDistributedSampler,
    Snapshot,
    exit_on_config_error,
)

from .model import LLMConfig, TinyLLM

#: Gradient-norm clipping threshold (L2 over all parameters, all shards).
MAX_GRAD_NORM = 1.0

#: The agent's job id when ``TRAINGUARD_JOB`` is not set.
DEFAULT_JOB = "llm-fsdp"


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run is made of, built once from the command line.

    Attributes:
        steps: optimizer steps to reach (a restored run continues to this step).
        seed: seeds the parameters and the data order.
        out: output folder (bus, checkpoints, ledgers, final parameters).
        checkpoint_every: checkpoint every this many steps, and always at ``steps``.
        blocking_checkpoints: ``dcp.save`` on the training thread instead of
            ``dcp.async_save``.
        per_rank_batch: samples per rank per step.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        workers: the data loader's worker processes (>= 1).
        threads: torch intra-op threads per process.
        step_period: each step lasts at least this many seconds (it sleeps the rest), to pace
            the job like a bigger one; the numbers are unchanged.
        model: the model shape.
        dump_state: rank 0 also writes the full (unsharded) model and optimizer state right
            after a restore (``restored-state.pt``) and at the end (``final-state.pt``): what
            a test compares to check that a restore, on any world size, loaded what was saved.
    """

    steps: int
    seed: int
    out: Path
    checkpoint_every: int
    blocking_checkpoints: bool
    per_rank_batch: int
    lr: float
    weight_decay: float
    workers: int
    threads: int
    step_period: float
    model: LLMConfig
    dump_state: bool = False

    def hyperparameters(self) -> dict[str, Any]:
        """The settings a restored run must share with its checkpoint to stay bitwise exact
        (recorded in every checkpoint's metadata)."""
        return {
            "seed": self.seed,
            "per_rank_batch": self.per_rank_batch,
            "lr": self.lr,
            "weight_decay": self.weight_decay,
            "model": asdict(self.model),
        }


@dataclass
class Run:
    """The live training objects of one process."""

    model: TinyLLM  # sharded in place by fully_shard: its parameters are DTensors
    optimizer: torch.optim.Optimizer
    sampler: ResumableDistributedSampler
    loader: StatefulDataLoader
    position: LoaderState
    data: ByteWindows


def agent_config(config: TrainConfig, env: Mapping[str, str]) -> AgentConfig:
    """The agent's settings: ``env`` (``TRAINGUARD_*``, ``RANK``, ``WORLD_SIZE``) over this
    example's defaults: job :data:`DEFAULT_JOB`, bus ``<out>/bus.db``, checkpoints in the
    ``dcp`` format under ``<out>/checkpoints``.

    Raises:
        ConfigError: as :meth:`AgentConfig.resolve`.
    """
    out = config.out.resolve()
    defaults = {
        "TRAINGUARD_JOB": DEFAULT_JOB,
        "TRAINGUARD_BUS": f"sqlite://{out / 'bus.db'}",
        "TRAINGUARD_CHECKPOINT_DIR": str(out / "checkpoints"),
        "TRAINGUARD_CHECKPOINT_FORMAT": "dcp",
    }
    return AgentConfig.resolve(env={**defaults, **env}, hyperparameters=config.hyperparameters())


def shard(model: TinyLLM, world_size: int) -> None:
    """Shard ``model`` in place with FSDP2 over all ranks: each block is a unit of its own
    (its parameters all-gathered just before its forward and backward, freed after), the root
    holds the embedding, the final norm and the head."""
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def build_run(config: TrainConfig, rank: int, world_size: int) -> Run:
    """Build data, model (initialized from ``config.seed`` on every rank, then sharded),
    optimizer, sampler and loader."""
    data = ByteWindows.from_stdlib(config.model.context)
    torch.manual_seed(config.seed)
    model = TinyLLM(config.model)
    shard(model, world_size)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay
    )
    sampler = ResumableDistributedSampler(
        len(data),
        rank=rank,
        world_size=world_size,
        per_rank_batch_size=config.per_rank_batch,
        seed=config.seed,
        data_version=data.version,
    )
    # The loader draws its workers' base seed from a generator of its own, not from torch's
    # global one (charlm/train.py says why); the workers only slice the corpus anyway.
    loader = StatefulDataLoader(
        data,
        batch_size=config.per_rank_batch,
        sampler=sampler,
        num_workers=config.workers,
        prefetch_factor=2,
        generator=torch.Generator().manual_seed(derive_seed(config.seed, "loader", rank)),
    )
    position = LoaderState(loader, rank=rank, world_size=world_size)
    return Run(model, optimizer, sampler, loader, position, data)


def loader_key(rank: int) -> str:
    """The key of ``rank``'s loader state under ``"loader"`` in the checkpoint."""
    return f"rank{rank:05d}"


def capture_state(run: Run, rank: int) -> dict[str, Any]:
    """What a checkpoint holds: the sharded model and optimizer states and this rank's loader
    state.

    Each rank's loader state is its own (which batches its workers had handed out), so it goes
    under a key of its rank: DCP would keep one copy of a non-tensor value that every rank
    saves under the same key. It is stored as one ``torch.save`` blob, so that DCP keeps it as
    one item and a restore asks for it by that one key, whatever its nested layout.
    """
    model, optimizer = get_state_dict(run.model, run.optimizer)
    blob = io.BytesIO()
    torch.save(run.position.state_dict(), blob)
    return {"model": model, "optim": optimizer, "loader": {loader_key(rank): blob.getvalue()}}


def restore(agent: Agent, run: Run, config: TrainConfig, target: Snapshot) -> int:
    """Load ``target`` into ``run`` and return its step. Every rank calls it together.

    The model and optimizer states are resharded by DCP onto this world size. The loader
    resumes from this rank's saved state when the snapshot has one (same world size), else
    from the snapshot's data cursor (a global sample offset, any world size).

    Raises:
        ValueError: the snapshot was taken with other hyperparameters or beyond
            ``config.steps``.
        ShardError: as :meth:`Agent.load` (a file that fails its digest: nothing of it was
            deserialized; the daemon then restores an older snapshot).
    """
    rank = agent.config.rank
    if target.metadata.hyperparameters != config.hyperparameters():
        raise ValueError(
            f"snapshot {target.snapshot_id} has hyperparameters "
            f"{target.metadata.hyperparameters}, this run {config.hyperparameters()}"
        )
    if target.step > config.steps:
        raise ValueError(f"snapshot step {target.step} is beyond --steps {config.steps}")
    model, optimizer = get_state_dict(run.model, run.optimizer)
    state: dict[str, Any] = {"model": model, "optim": optimizer}
    own_loader = rank < target.world_size and target.world_size == agent.config.world_size
    if own_loader:
        state["loader"] = {loader_key(rank): b""}
    agent.load(target, state=state)  # verified, then loaded in place; RNG states restored
    set_state_dict(
        run.model,
        run.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )
    if own_loader:
        saved = torch.load(io.BytesIO(state["loader"][loader_key(rank)]), weights_only=True)
        run.position.load_state_dict(saved)
    else:
        run.position.load_state_dict(target.cursor)
    return target.step


def dump_full_state(run: Run, rank: int, path: Path) -> None:
    """Write the full (unsharded) model and optimizer state dicts, keyed by parameter names
    (as ``get_state_dict`` keys them on any world size), to ``path`` from rank 0:
    ``{"model": ..., "optim": ...}``. Collective: every rank sends its shards."""
    model, optimizer = get_state_dict(
        run.model,
        run.optimizer,
        options=StateDictOptions(full_state_dict=True, cpu_offload=True),
    )
    if rank == 0:
        buffer = io.BytesIO()
        torch.save({"model": model, "optim": optimizer}, buffer)
        atomic_write(path, buffer.getvalue())


def batches(loader: StatefulDataLoader) -> Iterator[tuple[list[int], torch.Tensor]]:
    """Yield ``(sample ids, windows)`` endlessly, one per step, pass after pass."""
    while True:
        for ids, windows in loader:
            yield ids.tolist(), windows


def train_step(run: Run, windows: torch.Tensor, agent: Agent, step: int) -> float:
    """Forward, backward (FSDP2 reduce-scatters the gradients), clipping and the AdamW update of
    ``step``; return the loss in nats per byte (this rank's batch)."""
    run.optimizer.zero_grad(set_to_none=True)
    loss = agent.perturb_loss(step, next_byte_loss(run.model, windows))
    loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
    torch.nn.utils.clip_grad_norm_(run.model.parameters(), MAX_GRAD_NORM)
    run.optimizer.step()
    return loss.item()


def train(config: TrainConfig, settings: AgentConfig) -> None:
    """Train from scratch, or from the agent's restore target, up to ``config.steps``.

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
            if config.dump_state:
                dump_full_state(run, rank, config.out / "restored-state.pt")
        if agent.skip is not None and agent.skip.from_step > step:
            run.sampler.skip(agent.skip, restored_step=step)
        agent.ready(step, cursor=run.position.cursor)
        log.info("started", step=step, dataset_version=run.data.version, samples=len(run.data))
        durations: list[float] = []
        loss = float("nan")
        with LedgerWriter(ledger_path(config.out, rank), agent.config.generation, rank) as ledger:
            data = batches(run.loader)
            while step < config.steps:
                step += 1
                began = time.perf_counter()
                ids, windows = next(data)
                loss = train_step(run, windows, agent, step)
                time.sleep(max(0.0, config.step_period - (time.perf_counter() - began)))
                ledger.record(step, ids)
                agent.step(step, loss=loss, samples=len(ids))
                durations.append(time.perf_counter() - began)
                if step % config.checkpoint_every == 0 or step == config.steps:
                    saved = agent.checkpoint(
                        step,
                        capture_state(run, rank),
                        cursor=run.position.cursor,
                        blocking=config.blocking_checkpoints,
                    )
                    saved.add_done_callback(functools.partial(log_checkpoint, log, step))
            agent.wait_checkpoints()
        if config.dump_state:  # the state of the last step, which the last checkpoint saved
            dump_full_state(run, rank, config.out / "final-state.pt")
        # Collective: every rank sends its shards, rank 0 receives the whole model.
        full = get_model_state_dict(
            run.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank == 0:
            write_final(config.out, {k: v for k, v in full.items() if isinstance(v, torch.Tensor)})
        log.info(
            "finished",
            step=config.steps,
            loss=loss,
            steps_run=len(durations),
            step_seconds_median=statistics.median(durations) if durations else None,
        )


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """Build a :class:`TrainConfig` from command-line arguments (``sys.argv[1:]`` if None)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps to reach")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps between them")
    parser.add_argument(
        "--blocking-checkpoints",
        action="store_true",
        help="dcp.save on the training thread (default: dcp.async_save)",
    )
    parser.add_argument("--per-rank-batch", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    parser.add_argument("--workers", type=int, default=1, help="data loader worker processes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument(
        "--step-period",
        type=float,
        default=0.0,
        metavar="S",
        help="each step lasts at least S seconds, sleeping the rest (numbers unchanged)",
    )
    parser.add_argument(
        "--dump-state",
        action="store_true",
        help="rank 0 writes the full model and optimizer state after a restore "
        "(restored-state.pt) and at the end (final-state.pt)",
    )
    parser.add_argument("--context", type=int, default=LLMConfig.context, help="bytes per sample")
    parser.add_argument("--d-model", type=int, default=LLMConfig.d_model)
    parser.add_argument("--layers", type=int, default=LLMConfig.n_layers)
    parser.add_argument("--heads", type=int, default=LLMConfig.n_heads)
    parser.add_argument("--mlp-hidden", type=int, default=LLMConfig.mlp_hidden)
    args = parser.parse_args(argv)
    if args.steps < 0 or args.checkpoint_every < 1 or args.workers < 1:
        parser.error("--steps must be >= 0, --checkpoint-every and --workers >= 1")
    if args.step_period < 0:
        parser.error("--step-period must be >= 0")
    return TrainConfig(
        steps=args.steps,
        seed=args.seed,
        out=args.out,
        checkpoint_every=args.checkpoint_every,
        blocking_checkpoints=args.blocking_checkpoints,
        per_rank_batch=args.per_rank_batch,
        lr=args.lr,
        weight_decay=args.weight_decay,
        workers=args.workers,
        threads=args.threads,
        step_period=args.step_period,
        dump_state=args.dump_state,
        model=LLMConfig(
            context=args.context,
            d_model=args.d_model,
            n_layers=args.layers,
            n_heads=args.heads,
            mlp_hidden=args.mlp_hidden,
        ),
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: parse arguments, make torch deterministic, join the process group (alone
    when no launcher set ``WORLD_SIZE``), train."""
    config = parse_args(argv)
    settings = agent_config(config, os.environ)
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
    # torch.use_deterministic_algorithms(True) without its import of torch._inductor (see
    # examples/charlm/train.py).
    torch._C._set_deterministic_algorithms(True)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    else:  # FSDP2 needs a process group, even of one
        dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        train(config, settings)
    finally:
        dist.destroy_process_group()
    gc.freeze()  # see examples/charlm/train.py: a faster exit


if __name__ == "__main__":
    # A bad setting exits 78, which trainguard run's daemon does not restart (docs/recovery.md).
    with exit_on_config_error():
        main()
