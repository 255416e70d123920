"""Train a tiny GPT-2 (built from a config: nothing is downloaded) with the Hugging Face
``Trainer`` under trainguard: ``TrainguardCallback`` reports, checkpoints and restores it.

From the repository root::

    trainguard run --job hf-demo --nproc-per-node 2 -- \\
        python -m examples.hf_trainer.train --steps 60 --out /tmp/hf-demo
    python -m examples.hf_trainer.train --steps 60 --out /tmp/hf-1     # one process

The data are byte windows of the Python standard library's own source
(``examples.charlm.data``), the first ``--samples`` of them, so that a short job crosses
epochs. Outputs under ``--out``: the bus (without ``TRAINGUARD_BUS``), the ``Trainer``'s
checkpoints and trainguard's shards under ``checkpoints/``, ``ledger-rank-*.jsonl`` (the
samples of every step, :mod:`examples.charlm.ledger`) and from rank 0 ``final.sha256`` (the
digest of the final parameters). ``README.md`` says more.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog
import torch
from torch.utils.data import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from examples.charlm.data import ByteWindows
from examples.charlm.ledger import LedgerWriter, ledger_path
from examples.charlm.model import parameter_digest
from examples.charlm.train import atomic_write
from trainguard.agent import Agent, AgentConfig, exit_on_config_error
from trainguard.integrations.hf import TrainguardCallback

#: The agent's job id when ``TRAINGUARD_JOB`` is not set.
DEFAULT_JOB = "hf-trainer"


class Windows(Dataset[dict[str, torch.Tensor]]):
    """The first ``samples`` byte windows of ``data`` as the ``Trainer`` feeds a causal LM:
    ``input_ids`` = ``labels`` (the model shifts them), plus ``sample_id`` for the ledger."""

    def __init__(self, data: ByteWindows, samples: int) -> None:
        self.data = data
        self.samples = min(samples, len(data))
        self.version = f"{data.version}:{self.samples}"

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample_id, window = self.data[index]
        ids = window[:-1]
        return {"input_ids": ids, "labels": ids, "sample_id": torch.tensor(sample_id)}


class LedgerTrainer(Trainer):
    """The ``Trainer``, recording each training batch's sample ids in the ledger and passing
    the loss through ``agent.perturb_loss`` (the ``nan`` and ``spike`` faults of a rehearsal)."""

    def __init__(self, *args: Any, agent: Agent, ledger: LedgerWriter, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.agent = agent
        self.ledger = ledger

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        """The model's loss, after recording this step's sample ids (training only)."""
        ids = inputs.pop("sample_id")
        step = self.state.global_step + 1
        if model.training:
            self.ledger.record(step, ids.tolist())
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if model.training and isinstance(loss, torch.Tensor):
            return self.agent.perturb_loss(step, loss)
        return loss


class Pace(TrainerCallback):
    """Make each optimizer step last at least ``period`` seconds (numbers unchanged): a job
    of N steps lasts about N x period also on a loaded machine."""

    def __init__(self, period: float) -> None:
        self.period = period
        self.began = time.perf_counter()

    def on_step_begin(
        self, args: Any, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        self.began = time.perf_counter()

    def on_step_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        time.sleep(max(0.0, self.period - (time.perf_counter() - self.began)))


def agent_config(out: Path, env: Mapping[str, str]) -> AgentConfig:
    """The agent's settings: ``env`` over this example's defaults (job :data:`DEFAULT_JOB`,
    bus ``<out>/bus.db``, shards under ``<out>/checkpoints``).

    Raises:
        ConfigError: as :meth:`AgentConfig.resolve`.
    """
    out = out.resolve()
    defaults = {
        "TRAINGUARD_JOB": DEFAULT_JOB,
        "TRAINGUARD_BUS": f"sqlite://{out / 'bus.db'}",
        "TRAINGUARD_CHECKPOINT_DIR": str(out / "checkpoints"),
    }
    return AgentConfig.resolve(env={**defaults, **env})


def build_model(seed: int, context: int) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 over bytes (vocabulary 256, width 32, dropout 0.1), from ``seed``."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=256,
        n_positions=context,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def train(args: argparse.Namespace) -> None:
    """Train to ``args.steps`` from scratch or from the daemon's restore target."""
    with Agent(agent_config(args.out, os.environ)) as agent:
        rank = agent.config.rank
        data = Windows(ByteWindows.from_stdlib(args.context), args.samples)
        guard = TrainguardCallback(agent, data_version=data.version)
        training = TrainingArguments(
            output_dir=guard.output_dir,
            max_steps=args.steps,
            per_device_train_batch_size=args.per_rank_batch,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            save_strategy="steps",
            save_steps=args.checkpoint_every,
            logging_steps=1,
            logging_nan_inf_filter=False,
            remove_unused_columns=False,  # keep sample_id for the ledger
            seed=args.seed,
            data_seed=args.seed,
            use_cpu=True,
            # Under trainguard run or torchrun: DDP over gloo, as accelerate sets it up.
            ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
            dataloader_num_workers=0,
            report_to="none",
            disable_tqdm=True,
        )
        model = build_model(args.seed, args.context)
        callbacks: list[TrainerCallback] = [Pace(args.step_period)] if args.step_period else []
        with LedgerWriter(ledger_path(args.out, rank), agent.config.generation, rank) as ledger:
            trainer = LedgerTrainer(
                model=model,
                args=training,
                train_dataset=data,
                callbacks=[*callbacks, guard],
                agent=agent,
                ledger=ledger,
            )
            trainer.train(resume_from_checkpoint=guard.resume_from_checkpoint())
        if rank == 0:
            digest = parameter_digest(model.state_dict())
            atomic_write(args.out / "final.sha256", f"{digest}\n".encode())


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (``sys.argv[1:]`` if ``None``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps to reach")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps between saves")
    parser.add_argument("--per-rank-batch", type=int, default=4, help="samples per rank per step")
    parser.add_argument("--samples", type=int, default=200, help="dataset size (windows)")
    parser.add_argument("--context", type=int, default=32, help="tokens (bytes) per sample")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument(
        "--step-period",
        type=float,
        default=0.0,
        metavar="S",
        help="each step lasts at least S seconds (numbers unchanged)",
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.checkpoint_every < 1 or args.samples < 1:
        parser.error("--steps, --checkpoint-every and --samples must be >= 1")
    return args


def main(
    argv: Sequence[str] | None = None, train: Callable[[argparse.Namespace], None] = train
) -> None:
    """Entry point: deterministic torch on one thread, then ``train`` (this module's
    :func:`train`; ``examples/accelerate_loop`` passes its own)."""
    args = parse_args(argv)
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    # One thread per process: accelerate otherwise sets cores / local ranks when it is unset.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    train(args)


if __name__ == "__main__":
    # A bad setting exits 78, which trainguard run and the daemon do not restart.
    with exit_on_config_error():
        main()
