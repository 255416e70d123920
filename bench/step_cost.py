"""Cost of one ``Agent.step`` call in a tight loop (no training, no faults, no watched model).

Usage (from the repository root)::

    python bench/step_cost.py [--steps 200000] [--rounds 5]

Prints the best and median microseconds per call over ``--rounds`` rounds of ``--steps``
calls on an embedded bus in a temporary folder: wall time (``time.perf_counter``; includes the
agent's background thread holding the GIL, and any time the process waits for a core), and the
calling thread's CPU time (``time.thread_time``; what the calls themselves cost, which the
load of a shared machine barely moves). Also prints the CPU time the agent's background
threads spent meanwhile (process CPU less the calling thread's), as a share of one core over
the rounds' wall time: their GIL holds are the rest of the wall time per call on an idle
machine. To compare with another commit, run this file with
that commit's three ``src`` folders first on ``sys.path`` (see bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from trainguard.agent import Agent


def main() -> None:
    """Measure and print the per-call cost of ``Agent.step`` (microseconds)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    folder = tempfile.mkdtemp()
    with Agent(
        job_id="bench", bus_url=f"sqlite:///{folder}/bus.db", checkpoint_dir=folder, rank=0,
        world_size=1,
    ) as agent:  # fmt: skip
        agent.ready(0)
        per_call: list[float] = []
        cpu_per_call: list[float] = []
        began_all = (time.perf_counter(), time.process_time(), time.thread_time())
        for r in range(args.rounds):
            began, cpu_began = time.perf_counter(), time.thread_time()
            for i in range(1, args.steps + 1):
                agent.step(r * args.steps + i, loss=1.0, samples=8)
            per_call.append((time.perf_counter() - began) / args.steps * 1e6)
            cpu_per_call.append((time.thread_time() - cpu_began) / args.steps * 1e6)
        wall_s = time.perf_counter() - began_all[0]
        own_s = time.thread_time() - began_all[2]
        background = (time.process_time() - began_all[1] - own_s) / wall_s
    print(
        f"agent.step: best {min(per_call):.3f} us, median {statistics.median(per_call):.3f} us "
        f"per call; CPU of the calling thread: best {min(cpu_per_call):.3f} us, median "
        f"{statistics.median(cpu_per_call):.3f} us; background threads {background:.2%} of a core "
        f"({args.rounds} x {args.steps:,} calls)"
    )


if __name__ == "__main__":
    main()
