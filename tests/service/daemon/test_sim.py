"""``trainguard sim`` as users run it (a separate process) against the real daemon process: on
the embedded bus in simulated time with a few hundred ranks and faults of every kind, the
daemon SIGKILLed in the middle; on Kafka in real time at small scale (``docs/sim.md``).

Nothing here depends on the machine's speed: on the embedded bus the simulation waits for the
daemon at every round, so the simulated figures (goodput, restores, the time from a fault to
its restore) are the same on a loaded machine, only the wall time grows.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from trainguard.daemon.cli import app

CLI = [sys.executable, "-m", "trainguard.daemon.cli", "sim", "--format", "json"]


def _sim(tmp_path: Path, *options: str, timeout_s: float) -> dict[str, Any]:
    done = subprocess.run(
        [*CLI, "--run-dir", str(tmp_path / "run"), *options],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    data: dict[str, Any] = json.loads(done.stdout)
    return data


def _check_recovery(data: dict[str, Any], failures: int) -> None:
    """Every fault was restored exactly once and resumed; no command was acted on twice."""
    assert len(data["faults"]) == failures
    assert data["one_restore_per_fault"], data["faults"]
    assert all(f["restores"] == 1 and f["downtime_s"] is not None for f in data["faults"])
    assert data["commands"] == {"restore": failures, "resume": failures}
    assert data["commands_ignored"].get("duplicate", 0) == 0


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_embedded_bus_256_ranks_every_kind_and_a_daemon_sigkill(tmp_path: Path) -> None:
    """Batched heartbeats, as a large job would send them (the Kafka test below sends one
    record per rank): a quarter of the daemon's work for the same detection. One fault of
    each kind (the kinds take turns; ten faults are the 16,384-rank acceptance run's, in
    ``bench/RESULTS.md``), the daemon SIGKILLed between the third and the fourth."""
    data = _sim(
        tmp_path,
        "--ranks", "256",
        "--batch-heartbeats",
        "--mtbf", "300",
        "--checkpoint-cost", "0.25",
        "--restart-time", "10",
        "--failures", "5",
        "--kill-daemon-at", "700",
        "--seed", "3",
        timeout_s=1700,
    )  # fmt: skip
    _check_recovery(data, 5)
    assert sorted(f["kind"] for f in data["faults"]) == sorted(
        ["kill", "hang", "nan", "sdc", "node"]
    )
    # A kill is seen through its supervisor's report (50 ms after the death), a NaN through
    # the next heartbeat; hangs and lost nodes need their timeouts.
    for fault in data["faults"]:
        limit = {"kill": 0.1, "nan": 1.1, "sdc": 11.0, "hang": 15.0, "node": 15.0}
        assert fault["detection_s"] <= limit[fault["kind"]], fault
    # Goodput against the first-order model for the M this run realised.
    assert abs(data["goodput"] - data["model_goodput_realised_mtbf"]) < 0.01, data
    # The rounds that carried a checkpoint's shard records are a part of all rounds.
    lag, checkpoint_lag = data["lag_s"], data["checkpoint_lag_s"]
    assert checkpoint_lag["p50"] is not None, data
    assert checkpoint_lag["max"] <= lag["max"], data
    # The round the new daemon took on after the SIGKILL measures the restart: kept apart.
    assert data["restart_lag_s"]["max"] is not None, data
    # The daemon was killed once and was ready again, and wrote snapshots.
    runs = data["daemon_runs"]
    assert len(runs) == 2
    assert runs[0]["stats"] is None
    assert runs[1]["ready_s"] < 10
    log = (tmp_path / "run" / "daemon-0.log").read_text()
    assert "snapshots written" in log


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kafka_in_real_time_with_sending_behind_the_clock(
    tmp_path: Path, kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every send of the ranks' records takes longer than a step, as a 4,096-rank job's did
    on this machine: the loop runs behind the clock for the whole run, and must still hand
    each command to the ranks (it never read the resume after the first restore: the job
    stood still)."""
    from trainguard.daemon.sim._driver import _Runner

    send = _Runner._send

    async def slow_send(self: _Runner, emissions: list[Any], pending: list[Any]) -> None:
        await send(self, emissions, pending)
        if emissions:
            await asyncio.sleep(1.5)

    monkeypatch.setattr(_Runner, "_send", slow_send)
    result = CliRunner().invoke(app, [
        "sim", "--format", "json", "--run-dir", str(tmp_path / "run"),
        "--bus", f"kafka://{kafka_bootstrap}",
        "--ranks", "32",
        "--mtbf", "25",
        "--checkpoint-cost", "0.2",
        "--restart-time", "4",
        "--failures", "2",
        "--kinds", "kill,nan",
        "--seed", "1",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output[-3000:]
    data = json.loads(result.stdout)
    assert data["time"] == "real"
    _check_recovery(data, 2)
    assert data["lag_s"]["p50"] is not None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--mtbf", "-1", "--failures", "1"], "--mtbf must be a finite number of seconds > 0"),
        (["--mtbf", "nan", "--failures", "1"], "--mtbf must be a finite number of seconds > 0"),
        (["--checkpoint-cost", "-1", "--failures", "1"], "--checkpoint-cost must be"),
        (["--step-time", "0", "--failures", "1"], "--step-time must be"),
        (["--duration", "0"], "--duration must be"),
        (["--window", "-1", "--failures", "1"], "--window must be"),
        (["--kill-daemon-at", "-5", "--failures", "1"], "--kill-daemon-at must be"),
        (["--ranks-per-host", "9", "--failures", "1"], "--ranks-per-host (9) must not exceed"),
        (["--ranks", "0", "--failures", "1"], "--ranks must be at least 1, not 0"),
        (["--ranks-per-host", "0", "--failures", "1"], "--ranks-per-host must be at least 1"),
        (["--duration", "5", "--kill-daemon-at", "999"], "--kill-daemon-at (999) must come before"),
        (["--kinds", "", "--failures", "1"], "--kinds: no kind given"),
        (["--kinds", "kill,fire", "--failures", "1"], "--kinds: unknown fire"),
        (["--trace", "TRACE", "--failures", "3"], "give --trace FILE or --failures N, not both"),
    ],
)
def test_options_that_cannot_run_are_refused(
    tmp_path: Path, options: list[str], message: str
) -> None:
    """Refused with exit status 2 and the option's name before anything runs (seconds used to
    end in a traceback: a square root of a negative number, a division by zero; the others
    ran, or were ignored, silently)."""
    trace = tmp_path / "trace.txt"
    trace.write_text("10,kill\n")
    options = [str(trace) if o == "TRACE" else o for o in options]
    result = CliRunner().invoke(
        app, ["sim", "--ranks", "8", "--run-dir", str(tmp_path / "run"), *options]
    )
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "run").exists()


def test_a_node_fault_on_a_job_of_one_node_is_restored(tmp_path: Path) -> None:
    """Every rank gone at once: the simulation lets the daemon pulse while nothing is sent
    (it stood still before: the daemon saw a bus gap and held the restore)."""
    trace = tmp_path / "trace.txt"
    trace.write_text("20,node\n")
    data = _sim(
        tmp_path,
        "--ranks", "8",
        "--ranks-per-host", "8",
        "--mtbf", "60",
        "--restart-time", "10",
        "--trace", str(trace),
        timeout_s=300,
    )  # fmt: skip
    _check_recovery(data, 1)


def test_window_zero_makes_every_instant_a_round_of_its_own(tmp_path: Path) -> None:
    """``--window 0``: the lag of each instant's records, as at real-time pacing (a 1-s window
    merged a heartbeat instant with a checkpoint's shards half a second later into one
    burst); the default window merges an undisturbed stretch's instants."""
    options = ("--ranks", "8", "--mtbf", "100000", "--checkpoint-interval", "8", "--duration", "20")
    merged = _sim(tmp_path / "merged", *options, timeout_s=300)
    apart = _sim(tmp_path / "apart", *options, "--window", "0", timeout_s=300)
    # Heartbeats every second, so at least one instant each simulated second.
    assert apart["rounds"] >= apart["simulated_s"] >= 20, apart
    assert 2 * merged["rounds"] < apart["rounds"], (merged["rounds"], apart["rounds"])
    assert apart["checkpoint_lag_s"]["p50"] is not None, apart


def test_sigterm_ends_the_run_and_its_daemon_process(tmp_path: Path) -> None:
    run = tmp_path / "run"
    sim = subprocess.Popen(
        [*CLI, "--run-dir", str(run), "--ranks", "8", "--duration", "100000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not (run / "ready").exists():
            assert sim.poll() is None, sim.stderr.read() if sim.stderr else ""
            assert time.monotonic() < deadline, "the daemon never got ready"
            time.sleep(0.05)
        [daemon] = _children(sim.pid)
        sim.send_signal(signal.SIGTERM)
        assert sim.wait(timeout=90) != 0
        with pytest.raises(ProcessLookupError):
            os.kill(daemon, 0)
    finally:
        sim.kill()
        sim.wait()


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux ``/proc``)."""
    tasks = Path(f"/proc/{pid}/task")
    return [int(c) for t in tasks.iterdir() for c in (t / "children").read_text().split()]


def test_what_a_run_could_not_do_is_warned_of(tmp_path: Path) -> None:
    """An empty trace runs without faults and a --kill-daemon-at past the run's end kills
    nothing: both are said on stderr, and the run itself succeeds."""
    trace = tmp_path / "trace.txt"
    trace.write_text("# nothing yet\n")
    done = subprocess.run(
        [*CLI, "--run-dir", str(tmp_path / "run"), "--ranks", "8", "--mtbf", "20",
         "--trace", str(trace), "--kill-daemon-at", "100000"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "names no fault: the run has none" in done.stderr
    assert "--kill-daemon-at 100000: the run ended at simulated second" in done.stderr
    assert json.loads(done.stdout)["faults"] == []


def test_the_tables_fit_80_columns_and_say_where_the_model_fails(tmp_path: Path) -> None:
    """A hang in the first steps is judged by the 600-s start-up allowance: with M = 60 s the
    first-order model goes below 0, which the table says instead of printing it; no header
    or cell is cut at 80 columns."""
    trace = tmp_path / "trace.txt"
    trace.write_text("2,hang\n")
    done = subprocess.run(
        [sys.executable, "-m", "trainguard.daemon.cli", "sim", "--run-dir",
         str(tmp_path / "run"), "--ranks", "8", "--mtbf", "60", "--trace", str(trace)],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "COLUMNS": "80"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "…" not in done.stdout, done.stdout
    assert "first order fails" in done.stdout
    assert not re.search(r"-\d[\d.,]*%", done.stdout), "a negative goodput printed"


def test_a_dead_daemon_is_named_by_its_signal_with_whole_log_lines(tmp_path: Path) -> None:
    from trainguard.daemon.sim._driver import _Daemon

    lines = [f'{{"event": "line {i}", "level": "info"}}' for i in range(40)]
    (tmp_path / "daemon-0.log").write_text("\n".join(lines) + "\n")
    said = _Daemon(tmp_path / "daemon.toml", tmp_path, simulated=True)._died(-9)
    assert said.startswith("the daemon was killed by SIGKILL (its log: ")
    assert said.endswith("\n".join(f"  {line}" for line in lines[-5:]))
    assert "exited with status 3" in _Daemon(tmp_path, tmp_path, simulated=True)._died(3)
