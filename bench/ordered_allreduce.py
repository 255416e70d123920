"""What ``trainguard.agent.ordered_allreduce`` costs a training step, against DDP's own
all-reduce, on ``examples/charlm`` (issue 12: bitwise restores beyond two ranks).

Usage (from the repository root)::

    python bench/ordered_allreduce.py [--world-sizes 2 3 4] [--rounds 3] [--steps 150]

For each world size, ``--rounds`` rounds of two runs of charlm through
``bench/charlm_variants.py`` without an agent (so that only the gradient averaging differs):
``no-agent`` (charlm as it is: DDP with the ordered hook: all-gather, then an element-wise sum in
rank order) and ``plain-ddp`` (DDP's own bucketed all-reduce), the order of the two swapped every
round so that a drift of the machine's load spreads over both. The ranks are started with
torchrun's variables by this script (no launcher beside them), one thread each. A run's figure
is charlm's own median step time (its ``finished`` log line, first step excluded), averaged
over the ranks; the cost is the median over rounds of ordered / plain - 1, with the rounds'
range as the noise, and the ratio of the two sides' best rounds. Figures are printed, never
asserted; the exit status is 0 unless a run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS_SCRIPT = REPO / "bench" / "charlm_variants.py"
SIDES = ("no-agent", "plain-ddp")
"""``no-agent`` is charlm with the ordered all-reduce; ``plain-ddp`` with DDP's own."""
RUN_TIMEOUT_S = 900


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run(side: str, world_size: int, steps: int, out: Path) -> float:
    """One charlm run of ``side`` on ``world_size`` ranks; its median step time (seconds,
    averaged over the ranks).

    Raises:
        RuntimeError: a rank failed (its log is in ``out``).
    """
    out.mkdir(parents=True)
    command = [sys.executable, str(VARIANTS_SCRIPT), side, "--", "--steps", str(steps)]
    command += ["--checkpoint-every", str(steps), "--out", str(out)]
    base = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TRAINGUARD_JOB": out.name,
        "TRAINGUARD_BUS": f"sqlite:///{out / 'bus.db'}",
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "OMP_NUM_THREADS": "1",
    }
    procs = []
    for rank in range(world_size):
        log = (out / f"rank-{rank}.log").open("wb")
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(subprocess.Popen(command, stdout=log, stderr=log, env=env, cwd=REPO))
    codes = [p.wait(RUN_TIMEOUT_S) for p in procs]
    if any(codes):
        raise RuntimeError(f"{side} on {world_size} ranks exited with {codes}; see {out}")
    medians = [
        json.loads(line)["step_seconds_median"]
        for rank in range(world_size)
        for line in (out / f"rank-{rank}.log").read_text().splitlines()
        if line.startswith("{") and '"finished"' in line
    ]
    return statistics.fmean(medians)


def main() -> None:
    """Measure and print the table (markdown)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="trainguard-bench-ordered-"))
    print(
        f"- date {time.strftime('%Y-%m-%dT%H:%M:%S%z')}, {os.cpu_count()} CPUs "
        f"({platform.processor() or platform.machine()}), load average at start "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {args.steps} steps per run"
    )
    print()
    print("| world size | round | ordered (ms) | plain DDP (ms) | cost % |\n|---|---|---|---|---|")
    summary: list[str] = []
    for size in args.world_sizes:
        times: dict[str, list[float]] = {side: [] for side in SIDES}
        for i in range(args.rounds):
            for side in SIDES if i % 2 == 0 else reversed(SIDES):
                times[side].append(run(side, size, args.steps, root / f"w{size}-r{i}-{side}"))
            ordered, plain = times["no-agent"][i], times["plain-ddp"][i]
            print(
                f"| {size} | {i + 1} | {ordered * 1e3:.2f} | {plain * 1e3:.2f} | "
                f"{(ordered / plain - 1) * 100:+.1f} |",
                flush=True,
            )
        ratios = [o / p - 1 for o, p in zip(times["no-agent"], times["plain-ddp"], strict=True)]
        best = min(times["no-agent"]) / min(times["plain-ddp"]) - 1
        summary.append(
            f"| {size} | {statistics.median(times['no-agent']) * 1e3:.2f} | "
            f"{statistics.median(times['plain-ddp']) * 1e3:.2f} | "
            f"{statistics.median(ratios) * 100:+.1f} ({min(ratios) * 100:+.1f} .. "
            f"{max(ratios) * 100:+.1f}) | {best * 100:+.1f} |"
        )
    print()
    print(
        "| world size | ordered, median (ms) | plain DDP, median (ms) | cost %, median (range) "
        "| cost %, best rounds |\n|---|---|---|---|---|"
    )
    print("\n".join(summary))
    print(
        f"\n- load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}; runs in {root}"
    )


if __name__ == "__main__":
    main()
