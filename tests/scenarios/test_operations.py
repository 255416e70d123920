"""Live operations during a real charlm job (issue 5, "Done when"): ``/healthz`` of
``trainguard daemon`` turns ready after start-up, and ``/metrics`` scraped before and after a
worker's death shows the incident and restore counters moving."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.scenarios.harness import JobRun, assert_exact
from trainguard.schemas import Resume

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, text = _get(f"{url}/metrics")
    assert status == 200, text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_health_turns_ready_and_the_counters_move_with_a_recovery(job_run: JobRun) -> None:
    faults = "kill@step=40,rank=1"
    job_run.context = faults
    job_run.start_daemon()
    url = job_run.metrics_url()
    deadline = time.monotonic() + 60
    while (health := _get(f"{url}/healthz"))[0] != 200:
        assert health[0] == 503, f"{health} {job_run.describe()}"
        assert time.monotonic() < deadline, f"never ready: {health} {job_run.describe()}"
        time.sleep(0.1)
    assert health == (200, "ready\n")
    before = _scrape(url)
    exited = {"cause": "exited"}
    assert _value(before, "trainguard_incidents_total", **exited) == 0
    assert _value(before, "trainguard_restores_total", **exited, mode="restart") == 0

    job_run.start_job(faults)
    job_run.wait_for("the resume", lambda m: isinstance(m, Resume))
    # The daemon counts a command once the bus has acknowledged it, which a reader of the bus
    # (as wait_for is) can see a moment earlier: give the counter that moment.
    deadline = time.monotonic() + 10
    while _value(after := _scrape(url), "trainguard_commands_total", type="resume") < 1:
        assert time.monotonic() < deadline, f"resume never counted {job_run.describe()}"
        time.sleep(0.05)
    assert _value(after, "trainguard_incidents_total", **exited) == 1, job_run.describe()
    assert _value(after, "trainguard_restores_total", **exited, mode="restart") == 1
    assert _value(after, "trainguard_commands_total", type="resume") == 1
    assert _value(after, "trainguard_detection_latency_seconds_count", **exited) == 1
    assert _value(after, "trainguard_time_to_resume_seconds_count", mode="restart") == 1
    assert _value(after, "trainguard_events_folded_total", type="heartbeat") > 0

    code = job_run.finish()
    assert_exact(job_run, code, job_run.record())
