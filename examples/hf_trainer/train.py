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
import time
from typing import Any

import torch
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
from examples.hf_trainer.common import Windows, agent_config, main
from trainguard.agent import Agent, exit_on_config_error
from trainguard.integrations.hf import TrainguardCallback

#: The agent's job id when ``TRAINGUARD_JOB`` is not set.
DEFAULT_JOB = "hf-trainer"


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
    with Agent(agent_config(args.out, os.environ, DEFAULT_JOB)) as agent:
        rank = agent.config.rank
        data = Windows(ByteWindows.from_stdlib(args.context), args.samples)
        guard = TrainguardCallback(agent, data_version=data.version)
        training = TrainingArguments(
            output_dir=guard.output_dir,
            max_steps=args.steps,
            per_device_train_batch_size=args.per_rank_batch,
            gradient_accumulation_steps=args.grad_accum,
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


if __name__ == "__main__":
    # A bad setting exits 78, which trainguard run and the daemon do not restart.
    with exit_on_config_error():
        main(train, accumulation=True)
