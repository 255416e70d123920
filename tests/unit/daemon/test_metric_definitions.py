"""The daemon's metric definitions on their own: detection latency, the classes of decoding
errors, the lag gauge of revoked partitions, separate registries, the metrics port setting.
Scraped over real HTTP from a running service in ``tests/service/daemon/test_metrics.py``."""

from __future__ import annotations

import dataclasses
import time

import pytest

from tests.support.service_support import JobEvents
from trainguard.daemon import IncidentOpened, Observed, Tick, decide, new_job
from trainguard.daemon.service._metrics import (
    DaemonMetrics,
    detection_latency_s,
    schema_error_class,
)
from trainguard.daemon.service._settings import load_daemon_config
from trainguard.schemas import Event, MessageTooLarge, NotJSON, SchemaViolation, UnexpectedMessage

JOB = "svc-job"
EVENTS = JobEvents(JOB)
started, beat, killed = EVENTS.started, EVENTS.beat, EVENTS.killed


def test_detection_latency_is_the_detectors_measure_or_the_silence_before_the_evidence() -> None:
    config = load_daemon_config(None).machine
    state = new_job(JOB)
    t0 = time.time_ns()  # the events carry the sender clock of now
    events: list[Event] = [started(0), started(1), beat(0, 1, 5), beat(1, 1, 5)]
    for i, event in enumerate(events):
        state, _ = decide(state, Observed(t0 + i * 10**8, i, event), config)
    kill_at = t0 + 3 * 10**9
    after, decisions = decide(state, Observed(kill_at, 9, killed(1)), config)
    [opened] = [d for d in decisions if isinstance(d, IncidentOpened)]
    # Rank 1 was last heard at t0 + 0.3 s, the supervisor reported its death at t0 + 3 s.
    assert detection_latency_s(state, opened, after.clock_ns) == pytest.approx(2.7)

    silent_at = t0 + 11 * 10**9  # beyond the 10 s heartbeat timeout
    for at in range(t0 + 10**9, silent_at, 10**9):  # the daemon's pulse: the job is quiet
        state, _ = decide(state, Tick(at), config)
    after, decisions = decide(state, Tick(silent_at), config)
    [opened] = [d for d in decisions if isinstance(d, IncidentOpened)]
    assert opened.cause == "heartbeat_timeout"
    assert detection_latency_s(state, opened, after.clock_ns) == opened.measures["silent_s"]


def test_decoding_errors_map_to_a_bounded_set_of_classes() -> None:
    assert schema_error_class(MessageTooLarge(None, "x")) == "oversized"
    assert schema_error_class(NotJSON(None, "x")) == "undecodable"
    assert schema_error_class(UnexpectedMessage("schema", "x")) == "unexpected_type"
    assert schema_error_class(SchemaViolation("step", "x")) == "schema_violation"


def test_revoked_partitions_leave_the_lag_gauge_and_registries_are_separate() -> None:
    first, second = DaemonMetrics(), DaemonMetrics()
    first.observe_lag({0: 5, 1: 0})
    first.observe_assignment(2, [new_job("a")])
    first.observe_lag({1: 2})
    first.observe_assignment(1, [])
    first.follow_readiness(lambda: "rebuilding")
    values = {
        (s.name, tuple(s.labels.items())): s.value
        for family in first.registry.collect()
        for s in family.samples
    }
    assert values[("trainguard_consumer_lag_records", (("partition", "1"),))] == 2
    assert ("trainguard_consumer_lag_records", (("partition", "0"),)) not in values
    assert values[("trainguard_jobs", (("phase", "starting"),))] == 0
    assert values[("trainguard_partitions_assigned", ())] == 1
    assert values[("trainguard_ready", ())] == 0
    assert second.registry.get_sample_value("trainguard_ready") == 0
    assert (
        second.registry.get_sample_value("trainguard_consumer_lag_records", {"partition": "1"})
        is None
    )


def test_the_metrics_port_is_checked() -> None:
    with pytest.raises(ValueError, match="metrics_port"):
        dataclasses.replace(load_daemon_config(None), metrics_port=70000)
    assert load_daemon_config(None, metrics_port=0).metrics_port == 0
