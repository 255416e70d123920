"""Train a small classifier with PyTorch Lightning (DDP over gloo on CPU), with trainguard
reporting, checkpointing and restoring it through :mod:`trainguard.integrations.lightning`.

From the repository root, under trainguard's supervisor (a daemon restores it after a failure)::

    trainguard run --job lit --nproc-per-node 2 -- python -m examples.lightning.train --out /tmp/lit

or under torchrun, behind ``trainguard run`` (``docs/launchers.md``)::

    trainguard run --job lit --ranks 0-1 -- \\
        torchrun --standalone --nproc-per-node 2 --max-restarts 0 -m examples.lightning.train --out /tmp/lit

or alone (one process, no DDP): ``python -m examples.lightning.train --out /tmp/lit-1``.

The data is made here: ``--samples`` points of a seeded mixture of Gaussians in 16 dimensions,
4 classes, and a fixed held-out set for validation (no download). The model is a two-layer
MLP with dropout built from its sizes. With one seed, an uninterrupted run and a run killed
and restored from a committed checkpoint end with bitwise-equal parameters. Outputs under
``--out``: the embedded bus (``bus.db``, unless ``TRAINGUARD_BUS`` says otherwise), the shards,
``ledger-rank-*.jsonl`` (the sample ids each rank trained at each step, the format of
:mod:`examples.charlm.ledger`), and from rank 0 ``final.pt`` and ``final.sha256``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from torch import Tensor, nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, TensorDataset

from examples.charlm.ledger import LedgerWriter, ledger_path
from examples.charlm.train import derive_seed, write_final
from lightning.fabric.plugins.environments.torchelastic import TorchElasticEnvironment
from lightning.pytorch import LightningModule, Trainer
from trainguard.agent import (
    Agent,
    AgentConfig,
    ResumableDistributedSampler,
    dataset_version,
    exit_on_config_error,
)
from trainguard.integrations.lightning import ResumableBatches, TrainguardCallback

#: The agent's job id when ``TRAINGUARD_JOB`` is not set.
DEFAULT_JOB = "lightning"

#: Input dimensions and classes of the made-up data.
FEATURES, CLASSES = 16, 4


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run is made of, from the command line.

    Attributes:
        steps: optimizer steps to reach (``Trainer(max_steps=...)``).
        seed: seeds the data, the parameters, the dropout streams and the data order.
        out: output folder.
        checkpoint_every: steps between trainguard checkpoints (and at ``steps``).
        val_every: validate every this many steps (0: never), declared as the phase ``eval``.
        samples: training samples.
        per_rank_batch: samples per rank per step.
        hidden: the MLP's hidden width.
        lr: Adam's learning rate.
    """

    steps: int
    seed: int
    out: Path
    checkpoint_every: int
    val_every: int
    samples: int
    per_rank_batch: int
    hidden: int
    lr: float


def make_data(samples: int, seed: int) -> TensorDataset:
    """``samples`` points ``(index, x, y)``: ``x`` float32 of shape ``(FEATURES,)`` drawn
    around one of ``CLASSES`` seeded centres, ``y`` that class (int64). Made from ``seed``
    alone, with a generator of its own (torch's global one is left alone)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, FEATURES, generator=g) * 2
    y = torch.randint(0, CLASSES, (samples,), generator=g)
    x = centres[y] + torch.randn(samples, FEATURES, generator=g)
    return TensorDataset(torch.arange(samples), x, y)


def data_version(data: TensorDataset) -> str:
    """The data's version for trainguard: sha256 of its tensors' bytes (a snapshot of other
    data is refused on restore)."""
    h = hashlib.sha256()
    for tensor in data.tensors:
        h.update(tensor.numpy().tobytes())
    return dataset_version(f"sha256:{h.hexdigest()}")


class Classifier(LightningModule):
    """Two linear layers with ReLU and dropout, trained with cross-entropy and Adam.

    Args:
        hidden: hidden width.
        lr: learning rate.
        ledger: where each step's sample ids go (this rank's ledger).
    """

    def __init__(self, hidden: int, lr: float, ledger: LedgerWriter) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, CLASSES)
        )
        self.lr = lr
        self.ledger = ledger

    def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor:
        """Cross-entropy of the batch ``(ids, x, y)``; the ids go to the ledger as the samples
        of step ``global_step + 1``."""
        ids, x, y = batch
        self.ledger.record(self.trainer.global_step + 1, ids.tolist())
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch: Sequence[Tensor], batch_idx: int) -> None:
        """Held-out loss, logged (no random number is drawn: dropout is off)."""
        _, x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Adam over all parameters."""
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def build(
    config: TrainConfig, rank: int, world_size: int, ledger: LedgerWriter
) -> tuple[Classifier, ResumableBatches, DataLoader[Any]]:
    """The module (same initial parameters on every rank; dropout streams per rank), the
    training batches and the validation loader."""
    data = make_data(config.samples, config.seed)
    held_out = make_data(64, config.seed + 1)
    torch.manual_seed(config.seed)
    module = Classifier(config.hidden, config.lr, ledger)
    torch.manual_seed(derive_seed(config.seed, "dropout", rank))
    sampler = ResumableDistributedSampler(
        len(data),
        rank=rank,
        world_size=world_size,
        per_rank_batch_size=config.per_rank_batch,
        seed=config.seed,
        data_version=data_version(data),
    )
    # Every pass over a loader draws a seed from its generator: never the global one, which a
    # restore puts back (that draw would shift the dropout streams).
    loader = DataLoader(
        data,
        batch_size=config.per_rank_batch,
        sampler=sampler,
        generator=torch.Generator().manual_seed(derive_seed(config.seed, "loader", rank)),
    )
    val = DataLoader(
        held_out,
        batch_size=32,
        generator=torch.Generator().manual_seed(derive_seed(config.seed, "val", rank)),
    )
    return module, ResumableBatches(loader), val


def agent_config(config: TrainConfig, env: Mapping[str, str]) -> AgentConfig:
    """The agent's settings: ``env`` over this example's defaults (job :data:`DEFAULT_JOB`,
    bus ``<out>/bus.db``, shards under ``<out>/checkpoints``).

    Raises:
        ConfigError: as :meth:`AgentConfig.resolve`.
    """
    out = config.out.resolve()
    defaults = {
        "TRAINGUARD_JOB": DEFAULT_JOB,
        "TRAINGUARD_BUS": f"sqlite://{out / 'bus.db'}",
        "TRAINGUARD_CHECKPOINT_DIR": str(out / "checkpoints"),
    }
    return AgentConfig.resolve(env={**defaults, **env})


def train(config: TrainConfig, settings: AgentConfig) -> None:
    """Fit from scratch, or from the daemon's restore target, up to ``config.steps``.

    Raises:
        ShardError, RestoreTimeout, JobAborted, StaleGeneration: as the agent's restore calls.
        ConfigError: as :class:`TrainguardCallback`'s checks.
    """
    with Agent(settings) as agent:
        rank, world_size = agent.config.rank, agent.config.world_size
        path = ledger_path(config.out, rank)
        with LedgerWriter(path, agent.config.generation, rank) as ledger:
            module, batches, val = build(config, rank, world_size, ledger)
            guard = TrainguardCallback(agent, batches, checkpoint_every=config.checkpoint_every)
            distributed = world_size > 1
            trainer = Trainer(
                accelerator="cpu",
                devices=world_size,
                strategy="ddp" if distributed else "auto",
                # The ranks come from trainguard run's (or torchrun's) variables, also under
                # Slurm, whose own variables would otherwise be taken for one rank per task.
                plugins=[TorchElasticEnvironment()] if distributed else None,
                max_steps=config.steps,
                val_check_interval=config.val_every or None,
                check_val_every_n_epoch=None,
                limit_val_batches=1.0 if config.val_every else 0,
                num_sanity_val_steps=0,
                callbacks=[guard],
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                use_distributed_sampler=False,
                deterministic=True,
            )
            trainer.fit(
                module,
                train_dataloaders=batches,
                val_dataloaders=val if config.val_every else None,
                ckpt_path=guard.ckpt_path,
            )
        if rank == 0:
            write_final(config.out, module.state_dict())


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """A :class:`TrainConfig` from command-line arguments (``sys.argv[1:]`` if None)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps to reach")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--checkpoint-every", type=int, default=20, help="steps per checkpoint")
    parser.add_argument("--val-every", type=int, default=0, help="validate every N steps (0: no)")
    parser.add_argument("--samples", type=int, default=2048, help="training samples")
    parser.add_argument("--per-rank-batch", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--hidden", type=int, default=64, help="the MLP's hidden width")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.checkpoint_every < 1 or args.val_every < 0:
        parser.error("--steps and --checkpoint-every must be >= 1, --val-every >= 0")
    return TrainConfig(
        steps=args.steps,
        seed=args.seed,
        out=args.out,
        checkpoint_every=args.checkpoint_every,
        val_every=args.val_every,
        samples=args.samples,
        per_rank_batch=args.per_rank_batch,
        hidden=args.hidden,
        lr=args.lr,
    )


@record  # under torchrun: a rank's exception goes to TORCHELASTIC_ERROR_FILE (docs/launchers.md)
def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: parse arguments, one torch thread, JSON logs on stderr, train."""
    config = parse_args(argv)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    torch.set_num_threads(1)
    train(config, agent_config(config, os.environ))


if __name__ == "__main__":
    # A bad setting exits 78, which trainguard's daemon does not restart (docs/recovery.md).
    with exit_on_config_error():
        main()
