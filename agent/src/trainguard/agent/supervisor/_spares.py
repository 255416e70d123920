"""Warm spares of ``trainguard run --warm`` (``docs/warm-restarts.md``): per local rank, a
worker process started ahead of need that waits at the script's hand-off point
(:func:`trainguard.agent.await_handoff`) with its imports and warm-up done.

The supervisor starts a spare with the worker command and its rank's environment less what
belongs to a generation (:data:`GENERATION_KEYS`), plus ``TRAINGUARD_SPARE_FD``: its end of a
socket pair whose other end the pool keeps. The spare writes ``ready`` on it at the hand-off
point. At a restore, :meth:`SparePool.hand_off` sends it the rest of the generation's
environment, and the spare becomes that generation's worker of its rank: from there on it is
watched, stopped and reported like any worker. A spare never trains with stale state: before
the hand-off its environment names no generation (its agent refuses to start:
``ConfigError``), and after it, the process is exactly a freshly started worker of the new
generation that loads the restore target.

Spares are no part of the job: a spare's exit is logged, never reported on the bus, and a
spare that exits while it waits is started again. A spare that exits before it is ready
:data:`MAX_EARLY_EXITS` times in a row, or with :data:`~trainguard.schemas.EXIT_CONFIG` (a
script that reads its settings before the hand-off point), turns the pool off: restarts are
cold from then on, which is also what happens to a rank whose spare is not ready, died or
cannot be handed off.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import orjson
import structlog

from trainguard.agent._handoff import PING, PONG, READY, SPARE_FD_ENV
from trainguard.agent.checkpoint._step_file import STEP_FILE_ENV
from trainguard.agent.supervisor._process import die_with_parent, signal_group
from trainguard.agent.supervisor._spool import SPOOL_DIR_ENV
from trainguard.agent.supervisor._stderr import StderrTail, last_words
from trainguard.schemas import EXIT_CONFIG

__all__ = ["GENERATION_KEYS", "MAX_EARLY_EXITS", "Spare", "SparePool"]

log = structlog.get_logger("trainguard.supervisor")

GENERATION_KEYS = frozenset({"TRAINGUARD_GENERATION", "MASTER_PORT", STEP_FILE_ENV, SPOOL_DIR_ENV})
"""Variables of a worker's environment that belong to its generation: left out of a spare's,
sent at the hand-off."""

MAX_EARLY_EXITS = 3
"""Spares of one rank that may exit before they are ready, in a row, before the pool is off."""

ANSWER_TIMEOUT_S = 2.0
"""Seconds a ready spare has to answer the ``ping`` right before its hand-off; one that does
not (stopped, swapped out, stuck) is killed and its rank starts cold. Generous: a waiting
spare answers from a blocked ``readline``, milliseconds even on a loaded machine, while the
restore would otherwise wait ``restore_timeout_s`` (120 s by default) for a spare that never
runs."""


@dataclass(eq=False)  # compared by identity
class Spare:
    """One spare process.

    Attributes:
        ranks: the global ranks it is a spare for (one, in launcher mode).
        proc: the process.
        stderr: its stderr pipe (:class:`StderrTail`), passed on to the worker it becomes.
        env: the environment it was started with.
        channel: the pool's end of its socket (non-blocking).
        ready: set once it wrote ``ready``.
    """

    ranks: tuple[int, ...]
    proc: asyncio.subprocess.Process
    stderr: StderrTail
    env: Mapping[str, str]
    channel: socket.socket
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    watcher: asyncio.Task[None] | None = None


class SparePool:
    """The node's spares, one per local rank: started, watched, handed off, discarded.

    Args:
        command: the worker command.
    """

    def __init__(self, command: Sequence[str]) -> None:
        self._command = tuple(command)
        self._spares: dict[tuple[int, ...], Spare] = {}
        self._envs: dict[tuple[int, ...], dict[str, str]] = {}
        self._early_exits: dict[tuple[int, ...], int] = {}
        self._off = False
        self._closed = False

    @property
    def off(self) -> bool:
        """Whether the pool gave up (every restart is cold from then on)."""
        return self._off

    async def fill(self, envs: Sequence[tuple[tuple[int, ...], Mapping[str, str]]]) -> None:
        """Start a spare for every ``(ranks, worker environment)`` that has none; the spare's
        environment is the worker's less :data:`GENERATION_KEYS`. Failures to start one are
        logged (that rank restarts cold)."""
        for ranks, env in envs:
            self._envs[ranks] = {k: v for k, v in env.items() if k not in GENERATION_KEYS}
            if ranks not in self._spares:
                await self._spawn(ranks)

    async def _spawn(self, ranks: tuple[int, ...]) -> None:
        if self._off or self._closed:
            return
        mine, theirs = socket.socketpair()
        mine.setblocking(False)
        env = {**self._envs[ranks], SPARE_FD_ENV: str(theirs.fileno())}
        stderr = StderrTail()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._command,
                env=env,
                stderr=stderr.write_fd,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        except OSError as exc:
            stderr.close()
            mine.close()
            log.warning("spare not started: that rank restarts cold", ranks=ranks, error=str(exc))
            return
        finally:
            theirs.close()
        stderr.start(asyncio.get_running_loop())
        spare = Spare(ranks, proc, stderr, env, mine)
        self._spares[ranks] = spare
        spare.watcher = asyncio.ensure_future(self._watch(spare))
        log.info("spare started", ranks=ranks, pid=proc.pid)

    async def _watch(self, spare: Spare) -> None:
        """Wait for ``ready``, then for the spare's exit while it is one; start another."""
        loop = asyncio.get_running_loop()
        exited = asyncio.ensure_future(spare.proc.wait())
        said = asyncio.ensure_future(loop.sock_recv(spare.channel, len(READY)))
        try:
            await asyncio.wait({exited, said}, return_when=asyncio.FIRST_COMPLETED)
            answer = said.result() if said.done() and not said.exception() else None
            if answer == READY:
                spare.ready.set()
                self._early_exits[spare.ranks] = 0
                log.info("spare ready", ranks=spare.ranks, pid=spare.proc.pid)
            elif not exited.done() and answer != b"":  # b"": it closed the socket, exiting
                log.warning(
                    "spare said something else than ready: discarded",
                    ranks=spare.ranks,
                    pid=spare.proc.pid,
                )
                signal_group(spare.proc.pid, signal.SIGKILL)
            code = await exited
        finally:
            said.cancel()
            exited.cancel()
        # Still the rank's spare (not handed off, not discarded): it died waiting.
        self._discard(spare)
        spare.stderr.drain()
        words = last_words(spare.stderr.text) if code > 0 else ""
        if not spare.ready.is_set():
            self._early_exits[spare.ranks] = self._early_exits.get(spare.ranks, 0) + 1
        early = self._early_exits.get(spare.ranks, 0)
        if code == EXIT_CONFIG or early >= MAX_EARLY_EXITS:
            if not self._off:
                log.error(
                    "spares exit before they reach the hand-off point: warm restarts off, "
                    "every restart is cold (see the spare's last words: the script fails "
                    "before trainguard.agent.await_handoff(), or reads its settings before "
                    "calling it: docs/warm-restarts.md)",
                    ranks=spare.ranks,
                    exit_code=code,
                    last_words=words or None,
                )
            self._off = True
            return
        log.warning(
            "spare exited while waiting: starting another",
            ranks=spare.ranks,
            pid=spare.proc.pid,
            exit_code=code,
            last_words=words or None,
        )
        await self._spawn(spare.ranks)

    def _discard(self, spare: Spare) -> None:
        if self._spares.get(spare.ranks) is spare:
            del self._spares[spare.ranks]
        spare.channel.close()

    def take(self, ranks: tuple[int, ...]) -> Spare | None:
        """The ready spare of ``ranks``, now no longer the pool's, or ``None`` (none, or it
        has not reached the hand-off point yet)."""
        spare = self._spares.get(ranks)
        if spare is None or not spare.ready.is_set() or spare.proc.returncode is not None:
            return None
        del self._spares[ranks]
        if spare.watcher is not None:
            spare.watcher.cancel()
        return spare

    async def hand_off(self, spare: Spare, env: Mapping[str, str]) -> bool:
        """Send ``spare`` (from :meth:`take`) what ``env``, its rank's worker environment of
        the new generation, has that its own has not; whether it took it. First the spare must
        answer a ``ping`` within :data:`ANSWER_TIMEOUT_S`. When it does not, or the hand-off
        fails (it died meanwhile), it is killed and its pipes closed: start the rank cold."""
        message = {k: v for k, v in env.items() if spare.env.get(k) != v}
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_sendall(spare.channel, PING)
            answer = await asyncio.wait_for(
                loop.sock_recv(spare.channel, len(PONG)), ANSWER_TIMEOUT_S
            )
            if answer != PONG:
                raise OSError(f"it answered {answer!r} to ping")
            await loop.sock_sendall(spare.channel, orjson.dumps(message) + b"\n")
        except (OSError, TimeoutError) as exc:
            why = str(exc) or f"no answer to ping within {ANSWER_TIMEOUT_S:g} s"
            log.warning(
                "spare could not be handed off: the rank starts cold",
                ranks=spare.ranks,
                pid=spare.proc.pid,
                error=why,
            )
            signal_group(spare.proc.pid, signal.SIGKILL)
            await spare.proc.wait()
            spare.stderr.close()
            return False
        finally:
            spare.channel.close()
        log.info("spare handed off", ranks=spare.ranks, pid=spare.proc.pid)
        return True

    async def close(self) -> None:
        """Stop every spare (SIGKILL to its process group: it holds nothing of the job) and
        reap it; no spare is started after this."""
        self._closed = True
        spares = list(self._spares.values())
        self._spares.clear()
        for spare in spares:
            if spare.watcher is not None:
                spare.watcher.cancel()
            signal_group(spare.proc.pid, signal.SIGKILL)
        for spare in spares:
            with contextlib.suppress(ProcessLookupError):
                await spare.proc.wait()
            spare.channel.close()
            spare.stderr.close()
