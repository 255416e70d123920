"""What ``examples/hf_trainer`` and ``examples/accelerate_loop`` share, without importing
either framework (a restarted worker of the Accelerate loop does not pay for importing
transformers): the data, the agent's settings, the command line and the deterministic set-up.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import structlog
import torch
from torch.utils.data import Dataset

from examples.charlm.data import ByteWindows
from trainguard.agent import AgentConfig


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


def agent_config(out: Path, env: Mapping[str, str], job: str) -> AgentConfig:
    """The agent's settings: ``env`` over the examples' defaults (job ``job``, bus
    ``<out>/bus.db``, shards under ``<out>/checkpoints``).

    Raises:
        ConfigError: as :meth:`AgentConfig.resolve`.
    """
    out = out.resolve()
    defaults = {
        "TRAINGUARD_JOB": job,
        "TRAINGUARD_BUS": f"sqlite://{out / 'bus.db'}",
        "TRAINGUARD_CHECKPOINT_DIR": str(out / "checkpoints"),
    }
    return AgentConfig.resolve(env={**defaults, **env})


def parse_args(
    argv: Sequence[str] | None = None, *, accumulation: bool = False
) -> argparse.Namespace:
    """The command line (``sys.argv[1:]`` if ``None``); ``accumulation`` adds
    ``--grad-accum`` (the ``Trainer``'s ``gradient_accumulation_steps``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps to reach")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps between saves")
    parser.add_argument("--per-rank-batch", type=int, default=4, help="samples per rank per batch")
    if accumulation:
        parser.add_argument(
            "--grad-accum",
            type=int,
            default=1,
            metavar="N",
            help="batches per rank per optimizer step (gradient accumulation)",
        )
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
    if accumulation and args.grad_accum < 1:
        parser.error("--grad-accum must be >= 1")
    return args


def main(
    train: Callable[[argparse.Namespace], None],
    argv: Sequence[str] | None = None,
    *,
    accumulation: bool = False,
) -> None:
    """Entry point of both examples: parse ``argv`` (``accumulation``: as
    :func:`parse_args`), make torch deterministic on one thread, then ``train(args)``."""
    args = parse_args(argv, accumulation=accumulation)
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    # One thread per process: accelerate otherwise sets cores / local ranks when it is unset.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    train(args)
