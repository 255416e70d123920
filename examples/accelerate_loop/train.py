"""Train a tiny byte-level transformer (``examples/charlm``'s ``CharLM``, built from its
``ModelConfig``: 2 layers, width 32) on ``examples/hf_trainer``'s data with a hand-written
Accelerate loop under trainguard: ``TrainguardAccelerate`` saves, announces and restores its
state, the stateful loader keeps the data position. No transformers import: a restarted worker
starts in the time torch and accelerate take.

From the repository root::

    trainguard run --job acc-demo --nproc-per-node 2 -- \\
        python -m examples.accelerate_loop.train --steps 60 --out /tmp/acc-demo
    python -m examples.accelerate_loop.train --steps 60 --out /tmp/acc-1      # one process

Outputs under ``--out`` as ``examples/hf_trainer``'s: the bus (without ``TRAINGUARD_BUS``),
``checkpoints/`` (Accelerate's ``save_state`` folders and trainguard's shards),
``ledger-rank-*.jsonl`` and from rank 0 ``final.sha256``. ``README.md`` says more.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

from examples.charlm.data import ByteWindows
from examples.charlm.ledger import LedgerWriter, ledger_path
from examples.charlm.model import CharLM, ModelConfig, next_byte_loss, parameter_digest
from examples.charlm.train import atomic_write
from examples.hf_trainer.common import Windows, agent_config, main
from trainguard.agent import Agent, exit_on_config_error
from trainguard.integrations.accelerate import TrainguardAccelerate

#: The agent's job id when ``TRAINGUARD_JOB`` is not set.
DEFAULT_JOB = "accelerate"


def train(args: argparse.Namespace) -> None:
    """Train to ``args.steps`` from scratch or from the daemon's restore target."""
    accelerator = Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(
            use_stateful_dataloader=True, use_seedable_sampler=True, data_seed=args.seed
        ),
    )
    with Agent(agent_config(args.out, os.environ, DEFAULT_JOB)) as agent:
        rank = agent.config.rank
        data = Windows(ByteWindows.from_stdlib(args.context), args.samples)
        torch.manual_seed(args.seed)
        # The inputs are a window's first ``context`` bytes: the model predicts bytes 2..context.
        model = CharLM(ModelConfig(context=args.context - 1, d_model=32, n_heads=2))
        set_seed(args.seed)  # the dropout stream, the same on every rank
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        # A generator of its own: each pass draws a seed from it, not from the dropout stream.
        generator = torch.Generator().manual_seed(args.seed)
        loader = DataLoader(data, batch_size=args.per_rank_batch, shuffle=True, generator=generator)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        guard = TrainguardAccelerate(
            agent, accelerator, loader, data_version=data.version, seed=args.seed
        )
        step = guard.start()
        if step < args.steps:
            with LedgerWriter(ledger_path(args.out, rank), agent.config.generation, rank) as ledger:
                model.train()
                for batch in guard.batches():
                    began = time.perf_counter()
                    step += 1
                    ids = batch.pop("sample_id")
                    ledger.record(step, ids.tolist())
                    loss = agent.perturb_loss(step, next_byte_loss(model, batch["input_ids"]))
                    accelerator.backward(loss)
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    optimizer.zero_grad()
                    # Every rank reports the mean loss, as the Trainer logs it.
                    mean = accelerator.reduce(loss.detach(), reduction="mean").item()
                    time.sleep(max(0.0, args.step_period - (time.perf_counter() - began)))
                    guard.step(step, loss=mean)
                    if step % args.checkpoint_every == 0:
                        guard.save_state(step)
                    if step == args.steps:
                        break
        agent.wait_checkpoints()
        if rank == 0:
            state = accelerator.unwrap_model(model).state_dict()
            atomic_write(args.out / "final.sha256", f"{parameter_digest(state)}\n".encode())


if __name__ == "__main__":
    # examples/hf_trainer's command line and set-up (deterministic, one thread), this loop.
    with exit_on_config_error():
        main(train)
