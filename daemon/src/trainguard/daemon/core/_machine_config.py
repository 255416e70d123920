"""Configuration of the per-job state machine (:mod:`trainguard.daemon.core._machine`).

Built once at the edge (the daemon's configuration loader); the machine only reads it. The
detectors' thresholds, their defaults and the reasoning behind them are in
``docs/detection.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import get_args

from trainguard.daemon.core._window import CHUNK
from trainguard.schemas import Phase, RestoreMode

RULES_VERSION = 1
"""The version of the state machine's rules, recorded with each configuration in the audit
trail (``rules`` of a config entry). Bump it with every change that makes
:func:`~trainguard.daemon.core._machine.decide` decide differently on some sequence of inputs
(a new rule, a changed threshold's meaning, a decision that moved), so that a replay of a trail
recorded under other rules says why it may differ (``docs/forensics.md``, "Replaying a trail of
another build"). Trails recorded before rules versions were recorded (before 2026-12-05) carry
none."""

_NS_PER_S = 1_000_000_000
_MAX_S = 1e9
"""Longest duration, seconds (about 31 years): a deadline (a time since the epoch in
nanoseconds, about 1.8e18 today, plus a duration) then stays within a signed 64-bit integer,
and ``1e308`` seconds does not overflow the conversion to nanoseconds."""


def _to_ns(name: str, seconds: float) -> int:
    """Convert a positive, finite duration in seconds to whole nanoseconds.

    Raises:
        ValueError: ``seconds`` is not a number in (0, 1e9].
    """
    if not 0 < seconds <= _MAX_S:  # also refuses nan
        raise ValueError(
            f"{name} must be a number of seconds > 0 and <= {_MAX_S:g}, got {seconds!r}"
        )
    return round(seconds * _NS_PER_S)


@dataclass(frozen=True, slots=True, kw_only=True)
class MachineConfig:
    """Thresholds and identity the state machine decides with.

    Identity and restore coordination:
        daemon_id: identity the daemon signs its commands with (``Restore.daemon_id`` ...).
        startup_timeout_s: seconds from the start of generation 0 within which every rank of
            the world size must have sent an event.
        restore_timeout_s: seconds from issuing a ``restore`` within which every rank must
            acknowledge it with ``lifecycle restored``; past it the restore is retried.
        max_restore_attempts: restores tried per incident (the first one included) before the
            job is aborted and ``failed``.
        restore_mode: the ``mode`` of the first restore of an incident in which every process
            is alive and responsive (non-finite loss, loss spike, checksum mismatch):
            ``restart`` (supervisors restart the processes) or ``in_process`` (agents reload
            at step ``at_step`` without exiting). Every other restore, and every retry,
            restarts.
        in_process_margin_steps: least number of steps between the highest step any rank
            reported and the ``at_step`` of an in-process restore.
        in_process_lead_s: seconds the ranks should keep training before ``at_step``, so the
            command reaches them first: the margin is at least this time divided by the job's
            median step time.
        keep_snapshots: committed snapshots kept as restore targets, newest first; older ones
            are forgotten (their files are not touched).
        max_restore_cycles: crash-loop guard: restores in a row that led to no progress (see
            ``crash_loop_progress_steps``) after which the next incident fails the job
            instead of restoring it again.
        crash_loop_progress_steps: an incident shows progress when the highest step the job
            ever reached grew by at least this many steps since the first incident of the
            current run of incidents without progress (the job got further than before, not
            just back to where it failed).
        allow_restart_from_scratch: when no committed snapshot of the job can be restored
            (each failed verification, or was written after the incident's onset), restart
            it from its initial state instead of failing it. Off by default: that restart
            discards every step trained (``docs/recovery.md``).

    Dead ranks and stalls:
        heartbeat_timeout_s: seconds without any event from a rank of the current generation
            after which the rank counts as dead. Agents heartbeat well inside this interval,
            also while they wait for ``resume`` after a restore.
        heartbeat_interval_s: the agents' heartbeat interval, seconds
            (``TRAINGUARD_HEARTBEAT_INTERVAL``). The daemon sees a step's end only when the
            next heartbeat reports it, up to one interval late, so every progress deadline
            allows one interval more than the progress timeout.
        progress_quantile: the quantile ``q`` of the job's recent step times the progress
            timeout derives from, ``0 < q <= 1``.
        progress_factor: safety factor applied to that quantile, > 0.
        progress_floor_s: least progress timeout, seconds; must exceed a few heartbeat
            intervals, since the daemon sees a step advance only when a heartbeat reports it.
        progress_ceiling_s: greatest progress timeout, seconds.
        progress_window: step times kept (samples, a multiple of 8).
        progress_min_samples: step times needed before the adaptive timeout applies; until
            then the start-up allowance does.
        startup_steps: the first steps a rank runs after (re)starting in a generation: a stall
            during them is judged by the start-up allowance instead of the adaptive timeout,
            and their step times are not sampled (compilation, cache warm-up).
        startup_allowance_s: progress timeout during the start-up steps, seconds.
        phase_init_s, phase_checkpoint_s, phase_eval_s, phase_data_s: limit of one declared
            phase (time since a rank was first seen in it), seconds. While any rank is in a
            declared phase within its limit, no rank counts as stalled (the others may wait
            for it in a collective).
        straggler_factor: a rank whose smoothed step time exceeds this multiple of the job's
            median step time is reported as a straggler (not restored), > 1.
        straggler_alpha: smoothing weight of a rank's step-time average (exponentially
            weighted), ``0 < alpha <= 1``.
        straggler_min_reports: step times a rank must have reported before it can be called a
            straggler.

    Divergence:
        loss_window: loss samples kept (a multiple of 8).
        loss_min_samples: loss samples needed before spikes are looked for.
        loss_spike_z: least robust z-score ``(loss - median) / (1.4826 * MAD)`` at or above
            which a loss sample opens a spike; the threshold is raised further for a window
            of few samples (``loss_spike_false_alarm``).
        loss_spike_false_alarm: per-sample probability, in [1e-12, 1e-2], with which a loss
            with normal noise around a level loss may open a spike: a window of ``n``
            samples raises the threshold to the robust z-score that a normal sample reaches
            that rarely against the median and MAD of ``n`` others
            (:func:`~trainguard.daemon.core._window.robust_z_critical`; ``docs/detection.md``).
        loss_spike_min_rise: a spike must also exceed the median by this fraction of
            ``|median|`` (guards against a near-zero MAD).
        loss_spike_return_z: a later sample below this z-score ends the spike as a blip
            (reported, not restored).
        loss_spike_persist: samples (the first included) a spike must last without returning
            before it becomes an incident, unless it is healing (its latest sample rose above
            the median by less than half as much as its peak did).
        loss_spike_heal_samples: samples a healing spike may last without returning (below
            ``loss_spike_return_z``) before it is an incident anyway, >= ``loss_spike_persist``.
        model_parallel_size: ranks ``r`` and ``r'`` hold replicas of the same parameters, whose
            checksums must agree, iff ``r % model_parallel_size == r' % model_parallel_size``
            (data parallelism outermost, as torch ``DeviceMesh(("dp", ...))`` and Megatron-LM
            number ranks); 1 for pure data parallelism.
        max_step_lag: ranks further apart than this many steps are an incident.
        max_clock_skew_s: an event whose sender time ``ts`` is more than this many seconds
            ahead of its bus append time is rejected (a sender with a broken clock, or a forged
            event claiming a far-future time).
        allow_data_version_change: restore across a change of the data version (a target
            written on another dataset version than the one the job runs now) instead of
            refusing it and failing the job.

    Outages (``docs/detection.md``, "Bus outages"):
        bus_gap_s: a job's consecutive inputs (its events and the daemon's ticks, which the
            daemon writes for every quiet job at least every ``pulse_s``) further apart than
            this many seconds of bus time mean the bus or the daemon was away: time stops
            across the gap, so no silence or progress timeout counts it. It must exceed twice
            the daemon's pulse plus its poll, and stay below every timeout it protects
            (``heartbeat_timeout_s``, ``progress_floor_s + heartbeat_interval_s``,
            ``startup_allowance_s``, the phase limits, ``startup_timeout_s``,
            ``restore_timeout_s``).
        outage_settle_s: seconds after a gap during which a failure opens its incident but
            holds its restore (>= 0; 0: no hold): the checkpoints the ranks made during the
            outage arrive after it in a burst and commit first, so the restore targets them.

    Cuts in flight (``docs/recovery.md``, "A checkpoint in flight is waited for"):
        cut_settle_s: at most this many seconds of bus time a restore for exited ranks waits
            when they had reported their shards of a step that other ranks' shards have not
            completed yet (>= 0; 0: no wait): those shards are written or in flight, and the
            step commits and becomes the target; issued at once when it commits, or can no
            longer (every rank that lacks a shard of it exited too).

    The ``*_ns`` attributes hold the durations in nanoseconds, computed once.

    Raises:
        ValueError: an empty ``daemon_id``, an unknown ``restore_mode``, a duration not in (0, 1e9] seconds, a count
            below its minimum, a probability or factor out of range, a window that is not a
            multiple of 8, a spike false-alarm rate out of [1e-12, 1e-2], a progress floor
            above its ceiling, a heal limit below the spike
            persistence, a heartbeat interval not below the heartbeat timeout, a bus gap not
            below every timeout it protects, or a negative or non-finite settle time.
    """

    daemon_id: str
    heartbeat_timeout_s: float = 10.0
    heartbeat_interval_s: float = 1.0
    startup_timeout_s: float = 120.0
    restore_timeout_s: float = 120.0
    max_restore_attempts: int = 3
    restore_mode: RestoreMode = "restart"
    in_process_margin_steps: int = 2
    in_process_lead_s: float = 5.0
    keep_snapshots: int = 8
    max_restore_cycles: int = 3
    crash_loop_progress_steps: int = 10
    allow_restart_from_scratch: bool = False
    progress_quantile: float = 0.99
    progress_factor: float = 3.0
    progress_floor_s: float = 5.0
    progress_ceiling_s: float = 1800.0
    progress_window: int = 256
    progress_min_samples: int = 8
    startup_steps: int = 5
    startup_allowance_s: float = 600.0
    phase_init_s: float = 1200.0
    phase_checkpoint_s: float = 900.0
    phase_eval_s: float = 1800.0
    phase_data_s: float = 600.0
    straggler_factor: float = 2.0
    straggler_alpha: float = 0.1
    straggler_min_reports: int = 10
    loss_window: int = 32
    loss_min_samples: int = 16
    loss_spike_z: float = 6.0
    loss_spike_false_alarm: float = 1e-7
    loss_spike_min_rise: float = 0.1
    loss_spike_return_z: float = 3.0
    loss_spike_persist: int = 4
    loss_spike_heal_samples: int = 16
    model_parallel_size: int = 1
    max_step_lag: int = 100
    max_clock_skew_s: float = 300.0
    allow_data_version_change: bool = False
    bus_gap_s: float = 5.0
    outage_settle_s: float = 5.0
    cut_settle_s: float = 5.0
    heartbeat_timeout_ns: int = field(init=False, repr=False, compare=False)
    heartbeat_interval_ns: int = field(init=False, repr=False, compare=False)
    startup_timeout_ns: int = field(init=False, repr=False, compare=False)
    restore_timeout_ns: int = field(init=False, repr=False, compare=False)
    progress_floor_ns: int = field(init=False, repr=False, compare=False)
    progress_ceiling_ns: int = field(init=False, repr=False, compare=False)
    startup_allowance_ns: int = field(init=False, repr=False, compare=False)
    max_clock_skew_ns: int = field(init=False, repr=False, compare=False)
    bus_gap_ns: int = field(init=False, repr=False, compare=False)
    outage_settle_ns: int = field(init=False, repr=False, compare=False)
    cut_settle_ns: int = field(init=False, repr=False, compare=False)
    phase_limits_ns: Mapping[Phase, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.daemon_id:
            raise ValueError("daemon_id must not be empty")
        if self.restore_mode not in get_args(RestoreMode):
            raise ValueError(
                f"restore_mode must be one of {get_args(RestoreMode)}, got {self.restore_mode!r}"
            )
        _at_least(self, 1, "max_restore_attempts", "keep_snapshots", "max_restore_cycles")
        _at_least(self, 1, "progress_min_samples", "straggler_min_reports", "loss_min_samples")
        _at_least(self, 1, "loss_spike_persist", "model_parallel_size", "max_step_lag")
        _at_least(self, 0, "in_process_margin_steps", "crash_loop_progress_steps")
        _at_least(self, 0, "startup_steps")
        for name in ("progress_window", "loss_window"):
            size = getattr(self, name)
            if size < CHUNK or size % CHUNK:
                raise ValueError(f"{name} must be a positive multiple of {CHUNK}, got {size}")
        for name in ("progress_quantile", "straggler_alpha"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")
        for name in ("progress_factor", "loss_spike_z", "loss_spike_return_z"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not (math.isfinite(self.loss_spike_min_rise) and self.loss_spike_min_rise >= 0):
            raise ValueError(f"loss_spike_min_rise must be >= 0, got {self.loss_spike_min_rise!r}")
        if not 1e-12 <= self.loss_spike_false_alarm <= 1e-2:  # also refuses nan
            raise ValueError(
                "loss_spike_false_alarm must be a probability in [1e-12, 1e-2], got "
                f"{self.loss_spike_false_alarm!r}"
            )
        if not (math.isfinite(self.straggler_factor) and self.straggler_factor > 1):
            raise ValueError(f"straggler_factor must be > 1, got {self.straggler_factor!r}")
        if self.loss_spike_return_z > self.loss_spike_z:
            raise ValueError("loss_spike_return_z must not exceed loss_spike_z")
        if self.loss_spike_heal_samples < self.loss_spike_persist:
            raise ValueError("loss_spike_heal_samples must not be below loss_spike_persist")
        _to_ns("in_process_lead_s", self.in_process_lead_s)
        # Frozen dataclass: derived fields are set once here, the documented way around frozen.
        for name in (
            "heartbeat_timeout",
            "heartbeat_interval",
            "startup_timeout",
            "restore_timeout",
            "progress_floor",
            "progress_ceiling",
            "startup_allowance",
            "max_clock_skew",
            "bus_gap",
        ):
            seconds = f"{name}_s"
            object.__setattr__(self, f"{name}_ns", _to_ns(seconds, getattr(self, seconds)))
        if self.heartbeat_interval_ns >= self.heartbeat_timeout_ns:
            raise ValueError("heartbeat_interval_s must be below heartbeat_timeout_s")
        if self.progress_floor_ns > self.progress_ceiling_ns:
            raise ValueError("progress_floor_s must not exceed progress_ceiling_s")
        limits: dict[Phase, int] = {
            phase: _to_ns(f"phase_{phase}_s", getattr(self, f"phase_{phase}_s"))
            for phase in ("init", "checkpoint", "eval", "data")
        }
        object.__setattr__(self, "phase_limits_ns", limits)
        for name in ("outage_settle_s", "cut_settle_s"):
            settle = getattr(self, name)
            if not (math.isfinite(settle) and 0 <= settle <= _MAX_S):
                raise ValueError(
                    f"{name} must be a number of seconds >= 0 and <= {_MAX_S:g}, got {settle!r}"
                )
            object.__setattr__(self, f"{name[:-2]}_ns", round(settle * _NS_PER_S))
        _check_bus_gap(self, limits)


def _check_bus_gap(config: MachineConfig, limits: Mapping[Phase, int]) -> None:
    """Check that ``bus_gap_s`` undercuts every timeout a bus outage could otherwise trip: a
    gap up to ``bus_gap_s`` is not bridged, so each of them must allow more.

    Raises:
        ValueError: naming the first timeout ``bus_gap_s`` does not stay below.
    """
    protected: list[tuple[str, int]] = [
        ("heartbeat_timeout_s", config.heartbeat_timeout_ns),
        # A stall deadline allows the progress timeout plus one heartbeat interval.
        (
            "progress_floor_s + heartbeat_interval_s",
            config.progress_floor_ns + config.heartbeat_interval_ns,
        ),
        ("startup_allowance_s", config.startup_allowance_ns),
        *((f"phase_{phase}_s", ns) for phase, ns in limits.items()),
        ("startup_timeout_s", config.startup_timeout_ns),
        ("restore_timeout_s", config.restore_timeout_ns),
    ]
    for name, limit in protected:
        if config.bus_gap_ns >= limit:
            raise ValueError(
                f"bus_gap_s ({config.bus_gap_s:g}) must be below {name} ({limit / _NS_PER_S:g} "
                f"s): an outage shorter than bus_gap_s is not recognised as one, and would trip "
                f"that timeout"
            )


def _at_least(config: MachineConfig, least: int, *names: str) -> None:
    """Check that the int fields ``names`` of ``config`` are ``>= least``.

    Raises:
        ValueError: one is smaller.
    """
    for name in names:
        value = getattr(config, name)
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
