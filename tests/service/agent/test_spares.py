"""The spare pool of ``trainguard run --warm`` (``trainguard.agent.supervisor._spares``) and the
worker's hand-off point (``trainguard.agent.await_handoff``), with real processes running a
small script instead of a training job: a spare becomes a worker with the generation's
environment, a dead spare is started again, a script that reads its settings before the
hand-off turns the pool off, a discarded spare exits 0."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from trainguard.agent.supervisor._spares import GENERATION_KEYS, Spare, SparePool

pytestmark = pytest.mark.anyio

HANDS_OFF = (
    "import os, sys\n"
    "from trainguard.agent import await_handoff\n"
    "assert 'TRAINGUARD_GENERATION' not in os.environ\n"
    "print('spare' if await_handoff() else 'cold', os.environ['TRAINGUARD_GENERATION'],"
    " 'TRAINGUARD_SPARE_FD' in os.environ, file=open(sys.argv[1], 'w'))\n"
)
"""A worker that writes whether it was a spare, its generation and whether the socket's
variable is left, to the file named by its argument."""

READS_EARLY = "from trainguard.agent import AgentConfig, exit_on_config_error\n" + (
    "with exit_on_config_error():\n    AgentConfig.resolve()\n"
)
"""A worker that reads its settings before any hand-off point."""


def worker_env(generation: int) -> dict[str, str]:
    """A worker environment of ``generation`` (launcher mode's generation variables)."""
    return {
        **os.environ,
        "TRAINGUARD_JOB": "spares",
        "RANK": "0",
        "TRAINGUARD_GENERATION": str(generation),
        "MASTER_PORT": str(29500 + generation),
    }


async def until(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition()`` every 20 ms until it holds (at most 60 s)."""
    for _ in range(3000):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never: {what}")


async def test_a_ready_spare_becomes_a_worker_of_the_generation_it_is_handed(
    tmp_path: Path,
) -> None:
    said = tmp_path / "said"
    pool = SparePool([sys.executable, "-c", HANDS_OFF, str(said)])
    try:
        spare = await taken_when_ready(pool)
        assert not GENERATION_KEYS & set(spare.env)
        assert await pool.hand_off(spare, worker_env(3))
        assert await spare.proc.wait() == 0
        spare.stderr.close()
        assert said.read_text().split() == ["spare", "3", "False"]
        assert pool.take((0,)) is None  # taken: the pool starts another only when told
    finally:
        await pool.close()


async def test_a_stopped_spare_is_not_handed_off_and_the_rank_starts_cold(tmp_path: Path) -> None:
    """A ready spare that cannot run (SIGSTOP here; swapped out or stuck alike) does not answer
    the ping before the hand-off: it is killed and ``hand_off`` says so, so the supervisor
    starts the rank cold, instead of the restore waiting ``restore_timeout_s`` for it."""
    said = tmp_path / "said"
    pool = SparePool([sys.executable, "-c", HANDS_OFF, str(said)])
    try:
        spare = await taken_when_ready(pool)
        os.kill(spare.proc.pid, signal.SIGSTOP)
        assert not await pool.hand_off(spare, worker_env(3))
        assert spare.proc.returncode == -signal.SIGKILL
        assert not said.exists()  # it never ran past its hand-off point
    finally:
        await pool.close()


async def taken_when_ready(pool: SparePool) -> Spare:
    """Start rank 0's spare in ``pool``, wait until it is ready and take it."""
    await pool.fill([((0,), worker_env(0))])
    await until(lambda: _ready(pool), "spare ready")
    spare = pool.take((0,))
    assert spare is not None
    return spare


def _ready(pool: SparePool) -> bool:
    """Whether rank 0's spare is ready (the pool's own view)."""
    spare = pool._spares.get((0,))
    return spare is not None and spare.ready.is_set()


async def test_a_spare_that_dies_waiting_is_replaced_and_a_closed_pool_kills_its_spares(
    tmp_path: Path,
) -> None:
    pool = SparePool([sys.executable, "-c", HANDS_OFF, str(tmp_path / "said")])
    try:
        await pool.fill([((0,), worker_env(0))])
        await until(lambda: _ready(pool), "spare ready")
        first = pool._spares[(0,)].proc.pid
        os.kill(first, signal.SIGKILL)
        await until(lambda: _ready(pool) and pool._spares[(0,)].proc.pid != first, "another")
        assert not pool.off
        second = pool._spares[(0,)].proc
    finally:
        await pool.close()
    assert second.returncode == -signal.SIGKILL
    assert not (tmp_path / "said").exists()  # no spare ever ran past its hand-off point


async def test_a_script_that_reads_its_settings_before_the_hand_off_turns_the_pool_off() -> None:
    pool = SparePool([sys.executable, "-c", READS_EARLY])
    try:
        await pool.fill([((0,), worker_env(0))])
        await until(lambda: pool.off, "pool off")
        assert pool.take((0,)) is None
        await pool.fill([((0,), worker_env(0))])
        assert pool.take((0,)) is None  # no more spares: every restart is cold
    finally:
        await pool.close()


async def test_a_process_that_is_no_spare_passes_the_hand_off_point(tmp_path: Path) -> None:
    said = tmp_path / "said"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HANDS_OFF.replace("assert 'TRAINGUARD_GEN", "assert 'NOT_GEN"),
        str(said), env=worker_env(5),
    )  # fmt: skip
    assert await proc.wait() == 0
    assert said.read_text().split() == ["cold", "5", "False"]


async def test_the_hand_off_point_never_waits_for_a_rendezvous_store(tmp_path: Path) -> None:
    """A rank other than 0 of a script that joins no process group passes ``await_handoff`` at
    once: it never dials ``MASTER_ADDR:MASTER_PORT``, where nothing may ever listen (it waited
    there for 60 s before). ``wait_for_store``, called on its own, does dial it."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        env = {
            **worker_env(2),
            "RANK": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(listener.getsockname()[1]),
        }
        said = tmp_path / "said"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", HANDS_OFF.replace("assert 'TRAINGUARD_GEN", "assert 'NOT_GEN"),
            str(said), env=env,
        )  # fmt: skip
        assert await proc.wait() == 0
        assert said.read_text().split() == ["cold", "2", "False"]
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody dialled the store
        dials = (
            "from trainguard.agent import wait_for_store\n"
            "raise SystemExit(0 if wait_for_store() else 1)\n"
        )
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", dials, env=env)
        assert await proc.wait() == 0
        listener.accept()[0].close()
