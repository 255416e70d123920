"""The pulse rule (:class:`trainguard.daemon.service._pulse.Pulse`): a quiet live job gets a tick per
``pulse_s``, a busy or ended job none. The service writing them into the log:
``tests/service/daemon/test_pulse_service.py``."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from msgspec import structs

from trainguard.daemon import new_job
from trainguard.daemon.core._state import JobPhase
from trainguard.daemon.service._pulse import Pulse
from trainguard.daemon.service._settings import load_daemon_config

PULSE_S = 1.0
STEP_S = 0.25  # how often the service looks (exact in binary, so the counts below are exact)


def looks(pulse: Pulse, clocks: list[int], *, phase: JobPhase = "running") -> list[float]:
    """Look at one job every :data:`STEP_S` while its state's clock takes the values
    ``clocks`` in turn, writing a tick whenever one is due; the times of the ticks."""
    ticks: list[float] = []
    for i, clock in enumerate(clocks):
        state = structs.replace(new_job("j"), phase=phase, clock_ns=clock)
        now = i * STEP_S
        if pulse.due("j", state, now):
            pulse.ticked("j", state, now)
            ticks.append(now)
    return ticks


def test_a_quiet_job_gets_one_tick_per_pulse() -> None:
    # 10 s of looks at a job whose clock never moves: a tick at 1, 2, ..., 10 s.
    ticks = looks(Pulse(PULSE_S), [5] * 41)
    assert ticks == [float(s) for s in range(1, 11)]


def test_a_tick_folded_counts_as_activity_and_is_not_followed_by_another_within_a_pulse() -> None:
    clocks = [5] * 5 + [6] * 36  # the tick written at 1.0 s is folded at 1.25 s
    ticks = looks(Pulse(PULSE_S), clocks)
    assert ticks[:2] == [1.0, 2.25]
    assert all(b - a >= PULSE_S for a, b in itertools.pairwise(ticks))


def test_a_busy_job_gets_none() -> None:
    # Its clock moves at least once a pulse (an input every 0.75 s).
    clocks = [i // 3 for i in range(41)]
    assert looks(Pulse(PULSE_S), clocks) == []


def test_an_ended_job_gets_none_and_is_forgotten() -> None:
    pulse = Pulse(PULSE_S)
    phases: tuple[JobPhase, ...] = ("finished", "failed", "stopped")
    for phase in phases:
        assert looks(pulse, [5] * 41, phase=phase) == []
    assert pulse.due("j", structs.replace(new_job("j"), phase="running"), 100.0) is False


def test_jobs_no_longer_held_are_forgotten() -> None:
    pulse = Pulse(PULSE_S)
    for job in ("a", "b", "c"):
        assert not pulse.due(job, new_job(job), 0.0)
    pulse.keep({"c": None})
    # "a" is looked at as new again (no tick at once), "c" is still remembered.
    assert not pulse.due("a", new_job("a"), 5.0)
    assert pulse.due("c", new_job("c"), 5.0)


def test_pulse_s_is_checked_against_the_bus_gap() -> None:
    config = load_daemon_config(None)
    with pytest.raises(ValueError, match="pulse_s must be a finite number of seconds > 0"):
        dataclasses.replace(config, pulse_s=0)
    with pytest.raises(
        ValueError, match=r"2 \* pulse_s \+ poll_s \+ commit_interval_s must be below bus_gap_s"
    ):
        dataclasses.replace(config, pulse_s=2.5)
    with pytest.raises(ValueError, match="probe_interval_s"):
        dataclasses.replace(config, probe_interval_s=-1.0)
    with pytest.raises(ValueError, match="probe_timeout_s"):
        dataclasses.replace(config, probe_timeout_s=math.inf)
    with pytest.raises(ValueError, match="max_lag_records"):
        dataclasses.replace(config, max_lag_records=0)
    assert (config.pulse_s, config.max_lag_records) == (1.0, 10_000)
