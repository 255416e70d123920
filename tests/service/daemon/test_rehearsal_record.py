"""What ``trainguard demo`` (and the scenario tests) read back about a run: the commands the
daemon issued come from the audit trail, which the bus keeps whole, not from the compacted
``commands`` topic. The cached reference run: ``tests/unit/daemon/test_demo_cache.py``."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import orjson

from tests.support import jobbus as daemon
from trainguard.agent.bus import DEFAULT_TOPICS, BusConfig
from trainguard.agent.bus._sqlite import SQLiteBus
from trainguard.daemon.core._audit_entry import decision_entry
from trainguard.daemon.core._decisions import Issue
from trainguard.daemon.demo._harness import read_job_record
from trainguard.schemas import Command, StepRange, encode

JOB = "demo-job"
PREFIX = "rec."


def history() -> list[Command]:
    """A job restored twice: a kill (restart), then a loss spike restored in process with the
    spike's batches skipped; each restore resumed."""
    return [
        daemon.restore(JOB, 1, None),
        daemon.resume(JOB, 1, step=0),
        daemon.restore(JOB, 2, None, at_step=95, skip=StepRange(from_step=81, to_step=84)),
        daemon.resume(JOB, 2, step=0),
    ]


def audit_entry(offset: int, command: Command) -> bytes:
    """The daemon's audit entry for the input that made it issue ``command``."""
    entry = decision_entry(
        JOB,
        partition=0,
        offset=offset,
        at_ms=1_767_225_600_000 + offset,
        identity={"type": "tick", "daemon_id": "d", "seq": offset},
        config="0" * 16,
        decisions=[Issue(command=command, reason="test")],
    )
    return orjson.dumps(entry)


def write_compacted(url: str, commands: Sequence[Command], audited: Sequence[Command]) -> None:
    """Publish ``commands`` on ``commands`` and the audit entries of ``audited`` on an
    embedded bus that compacts at once (as it does after a minute): only the job's latest
    command stays on ``commands``."""

    async def _write() -> None:
        config = BusConfig(url=url, prefix=PREFIX, topics=DEFAULT_TOPICS)
        bus = SQLiteBus(
            config, url.removeprefix("sqlite://"), compaction_lag_s=0, compaction_interval_s=0
        )
        async with bus:
            for offset, command in enumerate(audited):
                await bus.publish("audit", JOB, audit_entry(offset, command))
            for command in commands:
                await bus.publish("commands", JOB, encode(command))
            # The pass after the next append deletes what is older than it (ts_ms < now).
            await asyncio.sleep(0.002)
            await bus.publish("commands", JOB, encode(commands[-1]))

    asyncio.run(_write())


def test_the_restores_of_a_run_come_from_the_audit_when_commands_are_compacted(
    tmp_path: Path,
) -> None:
    url = f"sqlite://{tmp_path / 'bus.db'}"
    issued = history()
    write_compacted(url, issued, issued)
    record = asyncio.run(read_job_record(url, PREFIX, JOB))
    assert [c.message for c in record.commands] == [issued[-1]]  # compacted: the latest
    assert record.restores() == [issued[0], issued[2]]
    assert [r.skip for r in record.restores()] == [None, StepRange(from_step=81, to_step=84)]
    assert record.resumes() == [issued[1], issued[3]]
    assert record.aborts() == []


def test_a_command_a_restarted_daemon_audited_again_counts_once(tmp_path: Path) -> None:
    """A daemon that crashed before committing its position decides its last input again: the
    audit holds that decision twice, the bus the command once."""
    url = f"sqlite://{tmp_path / 'bus.db'}"
    issued = history()
    write_compacted(url, issued, [*issued[:3], issued[2], issued[3]])
    record = asyncio.run(read_job_record(url, PREFIX, JOB))
    assert [r.generation for r in record.restores()] == [1, 2]
