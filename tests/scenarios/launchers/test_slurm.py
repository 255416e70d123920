"""The Slurm recipe ``deploy/slurm/trainguard.sbatch``: its shell syntax, its ``#SBATCH``
directives, and what it does on a 2-node allocation, run with stand-ins for ``srun``,
``scontrol`` and ``trainguard`` (no Slurm here): one ``trainguard run`` per node with that
node's rank and the allocation's first host as master, the options ``trainguard run`` has,
and a requeue exactly for the exit statuses that are not trainguard's own ends."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.scenarios.harness import REPO
from trainguard.agent.supervisor._supervisor import EXIT_ABORTED, EXIT_STOPPED

SCRIPT = REPO / "deploy" / "slurm" / "trainguard.sbatch"

REFUSED = 2
"""``trainguard run``'s status for a refused job or a bad setting (docs/operations.md)."""

SRUN = """#!/usr/bin/env bash
# srun stand-in: run the command once per node, as that node's task, in parallel; the
# highest status wins (srun's rule for a step's exit code).
echo "srun $*" >> "$LOG"
while [[ $1 == --* ]]; do shift; done
status=0
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node "$@" || { s=$?; ((s > status)) && status=$s; }
done
exit $status
"""

SCONTROL = """#!/usr/bin/env bash
echo "scontrol $*" >> "$LOG"
if [[ $1 == show && $2 == hostnames ]]; then
    printf 'node-a\\nnode-b\\n'
fi
"""

TRAINGUARD = """#!/usr/bin/env bash
echo "trainguard $*" >> "$LOG"
exit "$FAKE_STATUS"
"""


SRUN_ONE_NODE = """#!/usr/bin/env bash
# srun stand-in for one node that forwards SIGTERM to its task, as srun does.
echo "srun $*" >> "$LOG"
while [[ $1 == --* ]]; do shift; done
SLURM_NODEID=0 SLURM_PROCID=0 "$@" &
task=$!
trap 'kill -TERM $task' TERM
wait $task
wait $task
"""

TRAINGUARD_UNTIL_TERM = """#!/usr/bin/env bash
# trainguard run stand-in that trains until SIGTERM, then ends the job stopped (status 4).
echo "trainguard $*" >> "$LOG"
trap 'echo "trainguard stopped" >> "$LOG"; exit 4' TERM
while true; do sleep 0.05; done
"""


def _fake_bin(tmp_path: Path, srun: str = SRUN, trainguard: str = TRAINGUARD) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", srun), ("scontrol", SCONTROL), ("trainguard", trainguard)):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(0o755)
    return bin_dir


def _fake_slurm(tmp_path: Path, status: int, restarts: int = 0) -> tuple[int, list[str]]:
    """Run the recipe on a fake 2-node allocation whose ``trainguard run`` exits ``status``;
    its exit status and the commands it ran (``srun``, ``scontrol``, ``trainguard``)."""
    bin_dir = _fake_bin(tmp_path)
    log = tmp_path / f"calls-{status}-{restarts}.log"
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "LOG": str(log),
        "FAKE_STATUS": str(status),
        "TRAINGUARD_BUS": "kafka://broker:9092",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_NNODES": "2",
        "SLURM_RESTART_COUNT": str(restarts),
        "NPROC_PER_NODE": "4",
    }
    done = subprocess.run(
        ["bash", str(SCRIPT), "python", "train.py", "--out", "/shared/x y"],
        env=env,
        capture_output=True,
        timeout=60,
    )
    return done.returncode, log.read_text().splitlines()


def test_the_recipe_is_valid_bash_with_the_directives_it_relies_on() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=60)
    text = SCRIPT.read_text()
    directives = re.findall(r"^#SBATCH (\S+)", text, flags=re.MULTILINE)
    assert "--requeue" in directives
    assert "--ntasks-per-node=1" in directives
    assert "--open-mode=append" in directives  # a requeued job's log goes on in the same file
    assert "--signal=B:USR1@120" in directives  # the time limit's warning, to requeue
    assert re.search(r"^srun --ntasks-per-node=1 ", text, flags=re.MULTILINE)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed: syntax and directives checked only")
    subprocess.run(["shellcheck", "--shell=bash", str(SCRIPT)], check=True, timeout=60)


def test_every_node_runs_one_supervisor_with_its_rank_and_the_allocation_s_master(
    tmp_path: Path,
) -> None:
    status, calls = _fake_slurm(tmp_path, 0)

    assert status == 0
    runs = [c for c in calls if c.startswith("trainguard ")]
    expected = (
        "trainguard run --job slurm-4242 --bus kafka://broker:9092 --nnodes 2 --node-rank {n} "
        "--nproc-per-node 4 --master-addr node-a --master-port 29500 --grace 5 -- python "
        "train.py --out /shared/x y"
    )
    assert runs == [expected.format(n=0), expected.format(n=1)]
    assert not [c for c in calls if c.startswith("scontrol requeue")]


def test_the_options_it_passes_are_trainguard_run_s() -> None:
    help_text = subprocess.run(
        [sys.executable, "-P", "-m", "trainguard.daemon.cli", "run", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "COLUMNS": "200"},
    ).stdout
    line = SCRIPT.read_text().split("exec trainguard run", 1)[1].split("--", 1)[0]
    used = set(re.findall(r"--[a-z-]+", line)) | {"--continue"}
    assert used
    for option in sorted(used):
        assert option in help_text, f"trainguard run has no option {option}"


@pytest.mark.parametrize(
    ("status", "requeued"),
    [
        (REFUSED, False),
        (EXIT_ABORTED, False),  # the daemon failed the job: a crash loop, nothing to restore
        (EXIT_STOPPED, False),
        (1, True),  # a supervisor that crashed
        (143, True),  # signalled before the daemon confirmed the stop
    ],
)
def test_only_exits_that_are_not_trainguard_s_own_end_are_requeued(
    tmp_path: Path, status: int, requeued: bool
) -> None:
    code, calls = _fake_slurm(tmp_path, status)

    assert code == status
    assert ("scontrol requeue 4242" in calls) == requeued


def test_a_requeued_job_asks_to_continue(tmp_path: Path) -> None:
    _, calls = _fake_slurm(tmp_path, 0, restarts=1)

    runs = [c for c in calls if c.startswith("trainguard ")]
    assert len(runs) == 2
    assert all(" --grace 5 --continue -- python " in c for c in runs)


def test_the_time_limit_s_warning_stops_the_job_and_requeues_it(tmp_path: Path) -> None:
    """Slurm's USR1 two minutes before the time limit (``--signal=B:USR1@120``): the recipe
    stops its step (each supervisor then stops the job: status 4, which otherwise means "ended
    for good") and requeues it; the requeued run continues (``--continue``). It used to end
    the job for good at every time limit."""
    bin_dir = _fake_bin(tmp_path, SRUN_ONE_NODE, TRAINGUARD_UNTIL_TERM)
    log = tmp_path / "calls.log"
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "LOG": str(log),
        "TRAINGUARD_BUS": "kafka://broker:9092",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node-a",
        "SLURM_NNODES": "1",
    }
    script = subprocess.Popen(
        ["bash", str(SCRIPT), "python", "train.py"], env=env, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 30
        while not (log.exists() and "trainguard run" in log.read_text()):
            assert time.monotonic() < deadline, "trainguard run never started"
            time.sleep(0.05)
        script.send_signal(signal.SIGUSR1)
        assert script.wait(timeout=30) == EXIT_STOPPED
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(script.pid, signal.SIGKILL)  # the stand-ins too, should the step hang
        script.wait()
    calls = log.read_text().splitlines()
    assert "trainguard stopped" in calls
    assert calls[-1] == "scontrol requeue 4242"
