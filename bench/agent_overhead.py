"""Agent overhead benchmark (issue 3): what trainguard's agent costs a training step, and how
long an asynchronous checkpoint stalls the training thread next to a plain ``torch.save``.

Usage (from the repository root)::

    python bench/agent_overhead.py [--rounds 4] [--steps 200] [--kafka host:port | --no-kafka]
                                   [--markdown] [--json FILE]   # --help lists the rest

The job is ``examples/charlm`` with 2 ranks (DDP over gloo, CPU; this script starts the two
processes with torchrun's variables itself, so no launcher runs beside them), through
``bench/charlm_variants.py``, which swaps the agent without changing charlm:

1. **Step time, A/B.** ``--rounds`` rounds of one run per side: the real agent (``timed``) on
   the embedded SQLite bus, the real agent on Kafka (``--kafka``, or a broker started with
   ``deploy/kafka/kafka-dev``), and without the agent (``no-agent``: a null agent, no thread, no
   events). The agent heartbeats every second (its default) to a bus nobody reads, as a worker
   whose daemon is elsewhere would, and follows the job's commands. Checkpoints only at the
   last step, after the timed steps, so every side runs the same training steps. The order of
   the sides rotates every round so that a drift of the machine's load spreads over all of
   them. A run's figure is charlm's own median step time (``finished`` log line; first step
   excluded), averaged over the ranks; a side's overhead is the median over rounds of its step
   time / the same round's without-agent step time - 1, with the rounds' range as the noise,
   and, as in ``bus_throughput.py``, the ratio of the sides' best rounds (the runs least
   disturbed by other jobs on the machine).
2. **Step time, accounted.** The A/B difference of a cost this small drowns in the noise of a
   shared 2-core machine, so the "with" runs also measure the agent directly: the wall time of
   every ``agent.step`` call on the training thread, and the CPU time of the agent's background
   threads (event loop and bus threads, checkpoint writer excluded) over the training loop.
   Accounted overhead = (mean ``step`` call + background CPU per step) / median step time;
   counting the background CPU in full assumes it takes its core from training, which holds
   here (two ranks on two cores).
3. **Checkpoint stall.** One run per model size, ``timed --compare-save``, a checkpoint every
   ``--stall-every`` steps: the training thread's time inside ``agent.checkpoint(...,
   blocking=False)`` (host copy of the state and RNG capture; writing, hashing and fsync happen
   in the background) against a plain ``torch.save`` of the same state into the same folder
   (the same disk), and the same with the ``fsync`` that makes it durable as the agent's
   shards are. Sizes: charlm's default (d_model 64, 2 layers, ~1.5 MB shards) and a bigger one
   (d_model 256, 4 layers, ~39 MB shards). Target: stall <= 30% of the plain save (medians).

Figures are printed, never asserted; the exit status is 0 unless a run fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from trainguard.agent.bus import BusConfig, open_bus

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # bench._broker

from bench._broker import Broker, kafka_broker  # noqa: E402
from bench._report import Report, print_report  # noqa: E402

VARIANTS_SCRIPT = REPO / "bench" / "charlm_variants.py"
WORLD_SIZE = 2
RUN_TIMEOUT_S = 600.0
STALL_TARGET = 0.30
"""Target: checkpoint stall / plain ``torch.save``, medians."""
OVERHEAD_TARGET = 0.01
"""Target: agent overhead / step time."""
SIZES: dict[str, list[str]] = {
    "default (d_model 64, 2 layers)": [],
    "bigger (d_model 256, 4 layers)": ["--d-model", "256", "--layers", "4"],
}
"""Model sizes of the stall measurement: label -> extra charlm arguments."""
KAFKA_PREFIX = f"overhead-{uuid.uuid4().hex[:8]}."
"""Topic prefix of this invocation's Kafka runs (one job id per run)."""
WITHOUT = "without agent"
"""The A/B runs' baseline side."""
BACKGROUND_EXCLUDED = "trainguard-ckpt"
"""Thread-name prefix of the checkpoint writer, left out of the per-step background CPU."""


class RunFailed(RuntimeError):
    """A benchmark run exited with an error status."""


@dataclass
class Run:
    """One 2-rank run of a variant.

    Attributes:
        variant: ``timed`` or ``no-agent``.
        job: the job id the agent ran under.
        step_s: charlm's median step time per rank, seconds.
        reports: the ``timed`` variant's per-rank reports (see ``TimedAgent``).
        wall_s: start to exit of both ranks, seconds.
        broker_cpu_s: CPU time the Kafka broker used meanwhile, when it runs on this machine.
    """

    variant: str
    job: str = ""
    step_s: list[float] = field(default_factory=list)
    reports: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    broker_cpu_s: float | None = None

    @property
    def median_step_s(self) -> float:
        """The ranks' median step times, averaged."""
        return statistics.fmean(self.step_s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def create_topics(broker: Broker, prefix: str) -> None:
    """Create trainguard's topics under ``prefix`` on ``broker`` (what every agent does when
    they are missing), so that no measured run pays for it."""
    config = BusConfig(url=f"kafka://{broker.address}", prefix=prefix, client_id="bench")

    async def open_and_close() -> None:
        async with open_bus(config):
            pass

    asyncio.run(open_and_close())


def run_variant(
    variant: str,
    out: Path,
    charlm_args: Sequence[str],
    *options: str,
    broker: Broker | None = None,
) -> Run:
    """Run ``bench/charlm_variants.py variant`` on ``WORLD_SIZE`` ranks writing to ``out``; the
    agent's bus is Kafka at ``broker`` (topics under :data:`KAFKA_PREFIX`, created
    beforehand), or the embedded bus ``out/bus.db``. The job id is ``out``'s name. The
    shards are deleted afterwards; logs, reports and the bus stay in ``out``.

    Raises:
        RunFailed: a rank exited with a non-zero status (its log is in ``out``).
    """
    out.mkdir(parents=True, exist_ok=True)
    report = out / "report"
    command = [sys.executable, str(VARIANTS_SCRIPT), variant]
    if variant == "timed":
        command += ["--report", str(report), *options]
    command += ["--", *charlm_args, "--out", str(out)]
    port = _free_port()
    base = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TRAINGUARD_JOB": out.name,
        "TRAINGUARD_BUS": f"kafka://{broker.address}" if broker else f"sqlite:///{out / 'bus.db'}",
        "TRAINGUARD_TOPIC_PREFIX": KAFKA_PREFIX,
        "TRAINGUARD_CHECKPOINT_DIR": str(out / "checkpoints"),
        "WORLD_SIZE": str(WORLD_SIZE),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
    began = time.monotonic()
    broker_began = broker.cpu_s() if broker else None
    procs = []
    for rank in range(WORLD_SIZE):
        log = (out / f"rank-{rank}.log").open("wb")
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(subprocess.Popen(command, stdout=log, stderr=log, env=env, cwd=REPO))
    codes = [p.wait(RUN_TIMEOUT_S) for p in procs]
    run = Run(variant, job=out.name, wall_s=time.monotonic() - began)
    broker_ended = broker.cpu_s() if broker else None
    if broker_began is not None and broker_ended is not None:
        run.broker_cpu_s = broker_ended - broker_began
    if any(codes):
        raise RunFailed(f"{variant} exited with {codes}; see {out}/rank-*.log")
    for rank in range(WORLD_SIZE):
        for line in (out / f"rank-{rank}.log").read_text().splitlines():
            if line.startswith("{") and '"finished"' in line:
                run.step_s.append(json.loads(line)["step_seconds_median"])
        if variant == "timed":
            run.reports.append(json.loads((report / f"rank-{rank}.json").read_text()))
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # up to 1 GB of shards a run
    return run


def _background_cpu_s(report: dict[str, Any]) -> float:
    """Seconds of agent background CPU over the training loop (checkpoint writer excluded)."""
    return float(
        sum(
            seconds
            for name, seconds in report["background_cpu_s"].items()
            if not name.startswith(BACKGROUND_EXCLUDED)
        )
    )


def background_cpu_per_step(report: dict[str, Any]) -> float:
    """Seconds of agent background CPU per step (checkpoint writer excluded) in one rank."""
    return _background_cpu_s(report) / max(int(report["steps"]), 1)


def background_share(report: dict[str, Any]) -> float:
    """Agent background CPU (checkpoint writer excluded) / training-loop wall time."""
    return _background_cpu_s(report) / float(report["loop_wall_s"])


def overhead_tables(rounds: list[dict[str, Run]], report: Report) -> dict[str, float]:
    """Add the A/B and the accounted tables for ``rounds`` (one run per side, by side name);
    return the headline figures."""
    sides = [name for name in rounds[0] if name != WITHOUT]
    ratios = {
        side: [r[side].median_step_s / r[WITHOUT].median_step_s - 1 for r in rounds]
        for side in sides
    }
    rows = [
        [
            str(i + 1),
            *[f"{r[name].median_step_s * 1e3:.2f}" for name in [*sides, WITHOUT]],
            *[f"{ratios[side][i] * 100:+.2f}" for side in sides],
        ]
        for i, r in enumerate(rounds)
    ]
    rows.append(
        [
            "median",
            *[
                f"{statistics.median(r[name].median_step_s for r in rounds) * 1e3:.2f}"
                for name in [*sides, WITHOUT]
            ],
            *[
                f"{statistics.median(ratios[side]) * 100:+.2f} "
                f"({min(ratios[side]) * 100:+.1f} .. {max(ratios[side]) * 100:+.1f})"
                for side in sides
            ],
        ]
    )
    best = {name: min(r[name].median_step_s for r in rounds) for name in [*sides, WITHOUT]}
    rows.append(
        [
            "best round",
            *[f"{best[name] * 1e3:.2f}" for name in [*sides, WITHOUT]],
            *[f"{(best[side] / best[WITHOUT] - 1) * 100:+.2f}" for side in sides],
        ]
    )
    report.tables.append(
        (
            f"Step time, A/B (charlm's median step per run, ms; {WORLD_SIZE} ranks; "
            "order rotated every round)",
            ["round", *sides, WITHOUT, *[f"overhead %, {side}" for side in sides]],
            rows,
        )
    )
    headline: dict[str, float] = {}
    columns: list[list[str]] = []
    for side in sides:
        reports = [rep for r in rounds for rep in r[side].reports]
        call_us = statistics.fmean(rep["step_call"]["mean_us"] for rep in reports)
        call_p99_us = max(rep["step_call"]["p99_us"] for rep in reports)
        bg_us = statistics.fmean(background_cpu_per_step(rep) for rep in reports) * 1e6
        bg_share = statistics.fmean(background_share(rep) for rep in reports)
        step_us = statistics.median(r[side].median_step_s for r in rounds) * 1e6
        accounted = (call_us + bg_us) / step_us
        headline[f"ab {side}"] = statistics.median(ratios[side])
        headline[f"ab best rounds {side}"] = best[side] / best[WITHOUT] - 1
        headline[f"accounted {side}"] = accounted
        broker = [cpu / r[side].wall_s for r in rounds if (cpu := r[side].broker_cpu_s)]
        columns.append(
            [
                f"{statistics.fmean(broker) * 100:.1f} %" if broker else "-",
                f"{call_us:.2f} ({call_p99_us:.1f})",
                f"{bg_share * 100:.3f} %",
                f"{bg_us:.1f}",
                f"{step_us:.0f}",
                f"{accounted * 100:.3f} %",
                "PASS" if accounted < OVERHEAD_TARGET else "FAIL",
            ]
        )
        threads: dict[str, list[float]] = {}
        for rep, job in zip(
            reports, [j for r in rounds for j in [r[side].job] * WORLD_SIZE], strict=True
        ):
            for name, seconds in rep["background_cpu_s"].items():
                # The event loop's thread is named after the job; one row for all runs.
                label = name.removesuffix(f"-{job}")
                threads.setdefault(label, []).append(seconds / rep["loop_wall_s"])
        report.notes.append(
            f"{side}: background CPU share of a core by thread: "
            + ", ".join(
                f"{name} {statistics.fmean(v) * 100:.3f}%" for name, v in sorted(threads.items())
            )
        )
    labels = [
        "broker CPU during the run, share of one core (same machine)",
        "agent.step() call, mean (max p99) us",
        "background CPU, share of one core",
        "background CPU per step, us",
        "median step time, us",
        "accounted overhead",
        "verdict",
    ]
    report.tables.append(
        (
            f"Step time, accounted (per rank and step; target < {OVERHEAD_TARGET:.0%})",
            ["figure", *sides],
            [[label, *[col[i] for col in columns]] for i, label in enumerate(labels)],
        )
    )
    return headline


def stall_table(runs: dict[str, Run], report: Report) -> dict[str, float]:
    """Add the checkpoint stall table for ``runs`` (label -> ``timed --compare-save`` run);
    return stall / plain save per label."""
    rows = []
    ratios: dict[str, float] = {}
    for label, run in runs.items():
        checkpoints = [c for r in run.reports for c in r["checkpoints"]]
        stall = statistics.median(c["stall_s"] for c in checkpoints)
        write = statistics.median(c["write_s"] for c in checkpoints)
        plain = statistics.median(c["plain_save_s"] for c in checkpoints)
        durable = statistics.median(c["plain_save_s"] + c["plain_fsync_s"] for c in checkpoints)
        size = statistics.median(c.get("bytes", 0) for c in checkpoints)
        ratios[label] = stall / plain
        rows.append(
            [
                label,
                f"{size / 1e6:.1f}",
                str(len(checkpoints)),
                f"{stall * 1e3:.1f} (max {max(c['stall_s'] for c in checkpoints) * 1e3:.1f})",
                f"{write * 1e3:.1f}",
                f"{plain * 1e3:.1f}",
                f"{durable * 1e3:.1f}",
                f"{stall / plain * 100:.0f} %",
                f"{stall / durable * 100:.0f} %",
                "PASS" if stall / plain <= STALL_TARGET else "FAIL",
            ]
        )
    report.tables.append(
        (
            f"Checkpoint stall vs synchronous save (medians, ms; target stall <= "
            f"{STALL_TARGET:.0%} of torch.save)",
            [
                "model",
                "shard MB",
                "checkpoints",
                "stall (async call)",
                "background write",
                "torch.save",
                "torch.save + fsync",
                "stall / save",
                "stall / save+fsync",
                "verdict",
            ],
            rows,
        )
    )
    return ratios


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=4, help="A/B rounds (one run per side)")
    parser.add_argument("--kafka", help="Kafka bootstrap host:port (default: start kafka-dev)")
    parser.add_argument("--no-kafka", action="store_true", help="measure the agent on SQLite only")
    parser.add_argument("--steps", type=int, default=200, help="steps per A/B run")
    parser.add_argument("--stall-steps", type=int, default=60, help="steps per stall run")
    parser.add_argument("--stall-every", type=int, default=5, help="checkpoint interval, steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, help="keep runs here (default: a temp folder)")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    parser.add_argument("--json", type=Path, help="write the raw figures here")
    args = parser.parse_args(argv)
    console = Console(width=160)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="trainguard-bench-overhead-"))
    say = console.print
    report = Report()
    report.notes.append(
        f"date {datetime.now().astimezone().isoformat(timespec='seconds')}, "
        f"{os.cpu_count()} CPUs, load average at start {_load()}"
    )
    common = ["--seed", str(args.seed)]
    ab_args = [*common, "--steps", str(args.steps), "--checkpoint-every", str(args.steps)]
    rounds: list[dict[str, Run]] = []
    stall_runs: dict[str, Run] = {}
    try:
        with (
            nullcontext(None) if args.no_kafka else kafka_broker(args.kafka, workdir / "kafka")
        ) as broker:
            sides: dict[str, tuple[str, Broker | None]] = {"SQLite": ("timed", None)}
            if broker is None:
                report.notes.append("no Kafka broker: agent measured on the embedded bus only")
            else:
                create_topics(broker, KAFKA_PREFIX)
                sides["Kafka"] = ("timed", broker)
            sides[WITHOUT] = ("no-agent", None)
            names = list(sides)
            for i in range(args.rounds):
                rotation = names[i % len(names) :] + names[: i % len(names)]
                runs: dict[str, Run] = {}
                for name in rotation:
                    variant, on = sides[name]
                    say(f"[dim]round {i + 1}/{args.rounds}: {name}…[/dim]")
                    out = workdir / f"ab-{i}-{name.replace(' ', '-')}"
                    runs[name] = run_variant(variant, out, ab_args, broker=on)
                rounds.append({name: runs[name] for name in names})
        for j, (label, extra) in enumerate(SIZES.items()):
            say(f"[dim]checkpoint stall, {label}…[/dim]")
            stall_runs[label] = run_variant(
                "timed",
                workdir / f"stall-{j}",
                [
                    *common,
                    "--steps",
                    str(args.stall_steps),
                    "--checkpoint-every",
                    str(args.stall_every),
                    *extra,
                ],
                "--compare-save",
            )
    except RunFailed as exc:
        console.print(f"[red]{exc}")
        return 1
    headline = overhead_tables(rounds, report)
    headline.update({f"stall/save {k}": v for k, v in stall_table(stall_runs, report).items()})
    report.notes.append(f"load average at end {_load()}; runs in {workdir}")
    print_report(report, args.markdown, console)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "headline": headline,
                    "rounds": [{k: vars(v) for k, v in r.items()} for r in rounds],
                    "stall": {k: vars(v) for k, v in stall_runs.items()},
                },
                indent=1,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
