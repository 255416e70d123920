"""Lightning callback overhead (issue 17): what :class:`trainguard.integrations.lightning.
TrainguardCallback` costs a Lightning training step, against Lightning's loop without it, in
the same run.

Usage (from the repository root)::

    python bench/lightning_overhead.py [--rounds 5] [--steps 300] [--hidden 256] [--batch 64]

One process, one CPU thread, ``examples/lightning``'s classifier and made-up data (its
``build``), Lightning's loop with ``max_steps``; the same ``ResumableBatches`` on both sides,
so the data path is the same and only the callback differs:

1. **A/B.** ``--rounds`` rounds of two fits, with and without the callback (the order
   alternates every round); a fit's figure is its median step time (wall time between
   consecutive ``on_train_batch_end`` of a probe callback that both sides carry; the first 10
   steps excluded). Overhead = median over rounds of with / without - 1; the rounds' range is
   the noise.
2. **Accounted.** The A/B difference of a cost this small drowns in the noise of a shared
   machine, so the "with" fits also time the callback's per-step hooks directly
   (``on_before_backward`` and ``on_train_batch_end``, on the training thread) and the CPU time
   of the agent's background threads (heartbeats to an embedded bus nobody reads) over the fit:
   accounted overhead = (median hooks of a step + the parameter checksum's median / its
   interval ``checksum_every`` + background CPU per step) / the "without" median step. Medians,
   because a loaded machine's preemptions land in a short timed region as often as anywhere
   (the mean is printed too). Checkpoints are left out (one, at the last step, untimed): their cost is the agent's
   (``bench/agent_overhead.py``, "checkpoint stall").

Figures are printed, never asserted. Target: under 1% of the step time.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from examples.charlm.ledger import LedgerWriter
from examples.lightning.train import TrainConfig, build
from trainguard.agent import Agent, AgentConfig
from trainguard.integrations.lightning import TrainguardCallback


class StepClock(Callback):
    """Wall time (``time.perf_counter``, seconds) at every ``on_train_batch_end``."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        """Record the time."""
        self.times.append(time.perf_counter())

    def median_step_s(self) -> float:
        """Median time between consecutive steps, the first 10 left out (warm-up)."""
        return statistics.median(b - a for a, b in itertools.pairwise(self.times[10:]))


class TimedCallback(TrainguardCallback):
    """The callback, with the wall time of its per-step hooks kept per step, seconds
    (checkpoints excluded)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hook_s: list[float] = []  # steps without a parameter checksum
        self.checksum_s: list[float] = []  # steps with one (every checksum_every)
        self._before = 0.0

    def on_before_backward(self, *args: Any) -> None:
        """The real hook, timed."""
        began = time.perf_counter()
        super().on_before_backward(*args)
        self._before = time.perf_counter() - began

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        """The real hook, timed, less the checkpoint it may take."""
        began = time.perf_counter()
        self._checkpoint_s = 0.0
        super().on_train_batch_end(trainer, *args)
        took = self._before + time.perf_counter() - began - self._checkpoint_s
        every = self.agent.config.checksum_every
        checksum = every > 0 and trainer.global_step % every == 0
        (self.checksum_s if checksum else self.hook_s).append(took)

    def _checkpoint(self, trainer: Trainer, step: int) -> None:
        began = time.perf_counter()
        super()._checkpoint(trainer, step)
        self._checkpoint_s = time.perf_counter() - began


def background_cpu_s() -> float:
    """CPU time (user + system, seconds) of this process's threads but the calling one."""
    me = threading.get_native_id()
    total = 0.0
    for task in Path("/proc/self/task").iterdir():
        if int(task.name) == me:
            continue
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def fit(
    config: TrainConfig, guarded: bool, work: Path
) -> tuple[float, list[float], list[float], float]:
    """One fit; its median step time, and (with the callback) the hooks' seconds of each step
    without and with a parameter checksum, and the background threads' CPU seconds per step
    (none and 0 without)."""
    clock = StepClock()
    with LedgerWriter(work / "ledger.jsonl", 0, 0) as ledger:
        module: LightningModule
        module, batches, _ = build(config, 0, 1, ledger)
        callbacks: list[Callback] = [clock]
        agent = None
        if guarded:
            settings = AgentConfig.resolve(
                env={
                    "TRAINGUARD_JOB": f"bench-{time.monotonic_ns()}",
                    "TRAINGUARD_BUS": f"sqlite://{work / 'bus.db'}",
                    "TRAINGUARD_CHECKPOINT_DIR": str(work / "checkpoints"),
                }
            )
            agent = Agent(settings).__enter__()
            guard = TimedCallback(agent, batches, checkpoint_every=config.steps + 1)
            callbacks.insert(0, guard)
        trainer = Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=config.steps,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
        )
        cpu0 = background_cpu_s()
        trainer.fit(module, train_dataloaders=batches)
        cpu = background_cpu_s() - cpu0
        if agent is not None:
            agent.__exit__(None, None, None)
            return clock.median_step_s(), guard.hook_s, guard.checksum_s, cpu / config.steps
    return clock.median_step_s(), [], [], 0.0


def main() -> None:
    """Run the rounds and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--hidden", type=int, default=256, help="the MLP's hidden width")
    parser.add_argument("--batch", type=int, default=64, help="samples per step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = TrainConfig(
        steps=args.steps,
        seed=0,
        out=Path("."),
        checkpoint_every=args.steps,
        val_every=0,
        samples=8192,
        per_rank_batch=args.batch,
        hidden=args.hidden,
        lr=1e-3,
    )
    with_s: list[float] = []
    without_s: list[float] = []
    hooks: list[float] = []  # every step's without a checksum, all rounds
    checksums: list[float] = []  # the steps with one
    background: list[float] = []
    with tempfile.TemporaryDirectory(prefix="lightning-overhead-") as tmp:
        for n in range(args.rounds):
            for guarded in (n % 2 == 0, n % 2 == 1):
                work = Path(tmp) / f"r{n}-{int(guarded)}"
                work.mkdir()
                step_s, hook_s, checksum_s, cpu_s = fit(config, guarded, work)
                (with_s if guarded else without_s).append(step_s)
                if guarded:
                    hooks.extend(hook_s)
                    checksums.extend(checksum_s)
                    background.append(cpu_s)
    ratios = [w / wo - 1 for w, wo in zip(with_s, without_s, strict=True)]
    base = statistics.median(without_s)
    hook, cpu = statistics.median(hooks), statistics.median(background)
    every = AgentConfig.resolve(env={"TRAINGUARD_JOB": "x"}).checksum_every
    checksum = statistics.median(checksums) / every if checksums else 0.0
    load = os.getloadavg()[0]
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, load {load:.2f}")
    print(
        f"steps {args.steps}, rounds {args.rounds}, hidden {args.hidden}, batch {args.batch}: "
        f"median step without {base * 1e3:.3f} ms, with {statistics.median(with_s) * 1e3:.3f} ms"
    )
    print(
        f"A/B overhead: median {statistics.median(ratios):+.2%} "
        f"(rounds {min(ratios):+.2%} .. {max(ratios):+.2%})"
    )
    print(
        f"accounted (medians): hooks {hook * 1e6:.1f} us/step (mean {statistics.fmean(hooks) * 1e6:.1f}"
        f"), parameter checksum {checksum * 1e6:.1f} us/step (every {every} steps), background "
        f"CPU {cpu * 1e6:.1f} us/step: {(hook + checksum + cpu) / base:.2%} of the step"
    )


if __name__ == "__main__":
    main()
