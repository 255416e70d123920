"""Integration overhead benchmark (issue 17): what trainguard's Hugging Face ``Trainer``
callback and its Accelerate wrapper cost a training step, against the same framework loop
without them, in the same process and run.

Usage (from the repository root)::

    python bench/integration_overhead.py [--rounds 5] [--steps 200] [--markdown]

The job is the tiny GPT-2 of ``examples/hf_trainer`` (one process, CPU, one thread, no DDP: a
launcher and a second rank would add noise, not cost: the callback does the same per rank).
Each round trains ``--steps`` steps per side, the order of the sides rotated every round:

* **Trainer**: ``Trainer.train`` with ``logging_steps=1`` and ``logging_nan_inf_filter=False``
  (what the callback asks for; both sides), no saves, with and without
  ``TrainguardCallback``. Step time = median interval between consecutive ``on_step_end``
  calls of a timing callback placed last (it spans the whole cycle: the step, its log, the
  trainguard hooks).
* **Accelerate**: the loop of ``examples/accelerate_loop`` (its ``CharLM``, a stateful loader),
  with and without
  ``TrainguardAccelerate.step`` (``agent.step`` and its loss), no saves; step time = median of
  the loop's step intervals.

The agents send heartbeats every second to an embedded bus in a temporary folder nobody
reads. A side's overhead is the median over rounds of (with / without - 1), with the rounds'
range. Because a difference this small drowns in a loaded machine's noise, the "with" sides
also account the integration directly: the wall time inside its per-step hooks
(``on_step_end`` + ``on_log``, or ``step``) per step / the median step time. Target: under 1%.
Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # examples

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from accelerate import Accelerator, DataLoaderConfiguration  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import (  # noqa: E402
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from examples.charlm.data import ByteWindows  # noqa: E402
from examples.charlm.model import CharLM, ModelConfig, next_byte_loss  # noqa: E402
from examples.hf_trainer.common import Windows  # noqa: E402
from examples.hf_trainer.train import build_model  # noqa: E402
from trainguard.agent import Agent, AgentConfig  # noqa: E402
from trainguard.integrations.accelerate import TrainguardAccelerate  # noqa: E402
from trainguard.integrations.hf import TrainguardCallback  # noqa: E402

TARGET = 0.01
"""Target: the integration's cost / step time."""


class StepClock(TrainerCallback):
    """Timestamps of every ``on_step_end`` (placed last: after every other callback)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self.ends.append(time.perf_counter())


class TimedCallback(TrainguardCallback):
    """``TrainguardCallback`` with the wall time of its per-step hooks summed, seconds."""

    spent = 0.0

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        began = time.perf_counter()
        super().on_step_end(*args, **kwargs)
        self.spent += time.perf_counter() - began

    def on_log(self, *args: Any, **kwargs: Any) -> None:
        began = time.perf_counter()
        super().on_log(*args, **kwargs)
        self.spent += time.perf_counter() - began


def agent_for(root: Path, job: str) -> Agent:
    """A rank-0 agent of world size 1 on an embedded bus under ``root``."""
    env = {
        "TRAINGUARD_JOB": job,
        "TRAINGUARD_BUS": f"sqlite://{root / 'bus.db'}",
        "TRAINGUARD_CHECKPOINT_DIR": str(root / "checkpoints"),
    }
    return Agent(AgentConfig.resolve(env=env))


def trainer_side(
    root: Path, data: Windows, steps: int, guard: bool, job: str
) -> tuple[float, float]:
    """One ``Trainer`` run: (median step time s, integration time per step s)."""
    clock = StepClock()
    with agent_for(root, job) as agent:
        callback = TimedCallback(agent, data_version=data.version) if guard else None
        args = TrainingArguments(
            output_dir=callback.output_dir if callback else str(root / job),
            max_steps=steps,
            per_device_train_batch_size=4,
            logging_steps=1,
            logging_nan_inf_filter=False,
            save_strategy="no",
            remove_unused_columns=False,
            use_cpu=True,
            report_to="none",
            disable_tqdm=True,
            log_level="error",
        )
        callbacks: list[TrainerCallback] = [callback] if callback else []

        class Plain(Trainer):
            def compute_loss(self, model: Any, inputs: Any, *a: Any, **k: Any) -> Any:
                inputs.pop("sample_id")
                return super().compute_loss(model, inputs, *a, **k)

        trainer = Plain(
            model=build_model(0, 32), args=args, train_dataset=data, callbacks=[*callbacks, clock]
        )
        trainer.remove_callback(PrinterCallback)  # a line per log: noise, not cost
        trainer.train()
    step = statistics.median(b - a for a, b in itertools.pairwise(clock.ends))
    return step, (callback.spent / steps if callback else 0.0)


def accelerate_side(
    root: Path, data: Windows, steps: int, guard: bool, job: str
) -> tuple[float, float]:
    """One Accelerate loop: (median step time s, integration time per step s)."""
    accelerator = Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(
            use_stateful_dataloader=True, use_seedable_sampler=True, data_seed=0
        ),
    )
    model = CharLM(ModelConfig(context=31, d_model=32, n_heads=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(
        data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    spent = 0.0
    ends: list[float] = []
    with agent_for(root, job) as agent:
        wrapper = TrainguardAccelerate(
            agent, accelerator, loader, data_version=data.version, seed=0
        )
        wrapper.start()
        for step, batch in enumerate(wrapper.batches(), start=1):
            loss = next_byte_loss(model, batch["input_ids"])
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            value = accelerator.reduce(loss.detach(), reduction="mean").item()
            if guard:
                began = time.perf_counter()
                wrapper.step(step, loss=value)
                spent += time.perf_counter() - began
            ends.append(time.perf_counter())
            if step == steps:
                break
    median = statistics.median(b - a for a, b in itertools.pairwise(ends))
    return median, spent / steps


def measure(
    name: str,
    side: Callable[[Path, Windows, int, bool, str], tuple[float, float]],
    data: Windows,
    rounds: int,
    steps: int,
    root: Path,
) -> list[tuple[float, float, float]]:
    """``rounds`` rounds of (with, without) in rotating order: (with s, without s, accounted s)."""
    out = []
    for r in range(rounds):
        results: dict[bool, tuple[float, float]] = {}
        for guard in (True, False) if r % 2 == 0 else (False, True):
            results[guard] = side(root, data, steps, guard, f"{name}-{r}-{int(guard)}")
        out.append((results[True][0], results[False][0], results[True][1]))
        print(
            f"{name} round {r + 1}: with {results[True][0] * 1e3:.2f} ms, without "
            f"{results[False][0] * 1e3:.2f} ms, hooks {results[True][1] * 1e6:.1f} us/step",
            file=sys.stderr,
        )
    return out


def main() -> None:
    """Run both frameworks' rounds and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = Windows(ByteWindows.from_stdlib(32), 4000)
    load = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="tg-integration-") as tmp:
        for name, side in (("Trainer", trainer_side), ("Accelerate", accelerate_side)):
            runs = measure(name, side, data, args.rounds, args.steps, Path(tmp))
            ab = [w / wo - 1 for w, wo, _ in runs]
            accounted = [a / w for w, _, a in runs]
            rows.append((name, runs, ab, accounted))
    sep = "|" if args.markdown else " "
    print(f"load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    print(
        f"{sep} framework {sep} step with, ms {sep} step without, ms {sep} A/B overhead % "
        f"(median, range) {sep} hooks, us/step {sep} accounted % {sep} target {sep}"
    )
    if args.markdown:
        print("|---|---|---|---|---|---|---|")
    for name, runs, ab, accounted in rows:
        with_ms = statistics.median(w for w, _, _ in runs) * 1e3
        without_ms = statistics.median(wo for _, wo, _ in runs) * 1e3
        hooks_us = statistics.median(a for _, _, a in runs) * 1e6
        share = statistics.median(accounted)
        print(
            f"{sep} {name} {sep} {with_ms:.2f} {sep} {without_ms:.2f} {sep} "
            f"{statistics.median(ab) * 100:+.2f} ({min(ab) * 100:+.2f} .. {max(ab) * 100:+.2f}) "
            f"{sep} {hooks_us:.1f} {sep} {share * 100:.3f} {sep} "
            f"{'met' if share < TARGET else 'NOT met'} (< {TARGET:.0%}) {sep}"
        )


if __name__ == "__main__":
    main()
