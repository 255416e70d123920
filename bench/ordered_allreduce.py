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
range as the noise, and the ratio of the two sides' best rounds.

On a shared 2-core machine running 3 or 4 ranks, step times swing by tens of percent from run
to run, more than the difference looked for. So the script also times the averaging itself, in
one set of processes per world size, ``--comm-iterations`` times each, interleaved (the order
swapped every iteration, a barrier before each): DDP's default hook (divide, then
``all_reduce``) and ``average_in_rank_order`` (what the ordered hook does: all-gather, then the
sum in rank order), on a float32 bucket of charlm's parameter count (one bucket: DDP's first
bucket holds up to 1 MiB). The difference of the medians is the ordered hook's cost per step.
Figures are printed, never asserted; the exit status is 0 unless a run fails.
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
    averaged over the ranks). A run whose rendezvous port was taken in the meantime (the port
    is free when chosen, not reserved) is run again on another port, up to 3 times.

    Raises:
        RuntimeError: a rank failed (its log is in ``out``).
    """
    for attempt in range(3):
        try:
            return _run_once(side, world_size, steps, out / f"attempt-{attempt}")
        except _PortTaken:
            continue
    raise RuntimeError(f"{side} on {world_size} ranks: no free rendezvous port; see {out}")


class _PortTaken(Exception):
    """Rank 0 could not listen on the rendezvous port."""


def _run_once(side: str, world_size: int, steps: int, out: Path) -> float:
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
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() for p in procs):  # a rank failed: the others would wait for it
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
    codes = [p.wait() for p in procs]
    if any(codes):
        if "EADDRINUSE" in (out / "rank-0.log").read_text():
            raise _PortTaken
        raise RuntimeError(f"{side} on {world_size} ranks exited with {codes}; see {out}")
    medians = [
        json.loads(line)["step_seconds_median"]
        for rank in range(world_size)
        for line in (out / f"rank-{rank}.log").read_text().splitlines()
        if line.startswith("{") and '"finished"' in line
    ]
    return statistics.fmean(medians)


def _comm_worker(rank: int, world: int, port: int, numel: int, iterations: int, out: str) -> None:
    """Time both averagings of one bucket on ``world`` ranks; rank 0 writes the medians (s)."""
    import torch
    import torch.distributed as dist

    from trainguard.agent._ddp import average_in_rank_order

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    grads = torch.randn(numel, generator=torch.Generator().manual_seed(rank))

    def plain() -> None:
        bucket = grads.div(world)  # DDP's default hook: divide, then all_reduce
        dist.all_reduce(bucket)

    def ordered() -> None:
        average_in_rank_order(grads).wait()

    took: dict[str, list[float]] = {"plain": [], "ordered": []}
    for i in range(iterations):
        pair = [("plain", plain), ("ordered", ordered)]
        for name, average in pair if i % 2 == 0 else reversed(pair):
            dist.barrier()
            began = time.perf_counter()
            average()
            took[name].append(time.perf_counter() - began)
    if rank == 0:
        Path(out).write_text(json.dumps({k: statistics.median(v) for k, v in took.items()}))
    dist.destroy_process_group()


def comm(world_size: int, numel: int, iterations: int, out: Path) -> dict[str, float]:
    """Median seconds of DDP's default averaging and of the ordered one, on ``world_size``
    ranks (processes of their own); rank 0's figures."""
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [
        spawn.Process(target=_comm_worker, args=(r, world_size, port, numel, iterations, str(out)))
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(RUN_TIMEOUT_S)
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"the communication timing on {world_size} ranks failed")
    medians: dict[str, float] = json.loads(out.read_text())
    return medians


def charlm_parameters() -> int:
    """Number of parameters of charlm's default model (its gradient bucket, in elements)."""
    sys.path.insert(0, str(REPO))
    from examples.charlm.model import CharLM, ModelConfig

    return sum(p.numel() for p in CharLM(ModelConfig()).parameters())


def main() -> None:
    """Measure and print the table (markdown)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--comm-iterations", type=int, default=300)
    args = parser.parse_args()
    numel = charlm_parameters()
    root = Path(tempfile.mkdtemp(prefix="trainguard-bench-ordered-"))
    print(
        f"- date {time.strftime('%Y-%m-%dT%H:%M:%S%z')}, {os.cpu_count()} CPUs "
        f"({platform.processor() or platform.machine()}), load average at start "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {args.steps} steps per run"
    )
    print()
    print("| world size | round | ordered (ms) | plain DDP (ms) | cost % |\n|---|---|---|---|---|")
    summary: list[str] = []
    plain_step: dict[int, float] = {}
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
        plain_step[size] = statistics.median(times["plain-ddp"])
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
        "\n| world size | DDP's averaging (us) | ordered (us) | cost per step (us) | % of the "
        "plain step |\n|---|---|---|---|---|"
    )
    for size in args.world_sizes:
        took = comm(size, numel, args.comm_iterations, root / f"comm-w{size}.json")
        cost = took["ordered"] - took["plain"]
        print(
            f"| {size} | {took['plain'] * 1e6:.0f} | {took['ordered'] * 1e6:.0f} | "
            f"{cost * 1e6:+.0f} | {cost / plain_step[size] * 100:+.2f} |",
            flush=True,
        )
    print(f"\n- bucket: {numel:,} float32 gradients ({numel * 4 / 2**20:.2f} MiB)")
    print(
        f"\n- load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}; runs in {root}"
    )


if __name__ == "__main__":
    main()
