"""The hand-off point of a warm spare (``trainguard run --warm``, ``docs/warm-restarts.md``).

A spare is a worker process that ``trainguard run --warm`` starts ahead of need, with the
worker command and the environment of one local rank, less what belongs to a generation
(``TRAINGUARD_GENERATION``, ``MASTER_PORT``, the step file, the spool folder). It runs the
script up to :func:`await_handoff`: the imports and whatever warm-up the script does before
that call (``import torch``, the job's modules, deterministic settings) are then paid before a
failure, not after. At a restore the supervisor sends the spare the rest of its rank's
environment of the new generation over a socket (``TRAINGUARD_SPARE_FD``, one JSON object
and a newline), :func:`await_handoff` puts it into ``os.environ`` and returns, and the script
goes on as a freshly started worker of that generation would: it creates its agent, joins the
process group, loads the restore target.

The protocol on the socket (both ends in this package): the spare writes ``ready\\n`` once
it reached the hand-off point. To hand it a rank, the supervisor first writes ``ping\n`` and
waits (briefly) for ``pong\n``: a spare that is stopped, swapped out or otherwise stuck does
not answer and is discarded, and the rank starts cold, instead of the restore waiting for it.
Then the supervisor writes the JSON object and a newline. It closes the socket to discard the
spare (which then exits 0).
"""

from __future__ import annotations

import os
import socket
import time

import orjson

__all__ = ["PING", "PONG", "READY", "SPARE_FD_ENV", "await_handoff", "wait_for_store"]

SPARE_FD_ENV = "TRAINGUARD_SPARE_FD"
"""The variable naming a spare's end of its socket to the supervisor (a file descriptor)."""

READY = b"ready\n"
"""What a spare writes once it reached the hand-off point."""

PING = b"ping\n"
"""What the supervisor asks a ready spare right before handing it a rank."""

PONG = b"pong\n"
"""A spare's answer to :data:`PING`: it is alive and still waiting at the hand-off point."""

_STORE_POLL_S = 0.005
"""Seconds between two attempts to reach rank 0's rendezvous store."""

_STORE_WAIT_S = 60.0
"""Seconds :func:`wait_for_store` tries before leaving the rendezvous to torch's own retries."""


def await_handoff() -> bool:
    """The hand-off point: in a spare, wait until the supervisor hands this process a rank,
    take that rank's environment of the new generation into ``os.environ``, and return
    ``True``; in any other process return ``False`` at once. It never waits for a rendezvous:
    a script that joins a process group calls :func:`wait_for_store` just before it does.

    Call it once, near the top of the script: after the imports and any warm-up that does not
    depend on the rank's generation, before anything reads ``TRAINGUARD_*`` settings,
    ``MASTER_PORT`` or creates the :class:`~trainguard.agent.Agent` or the process group. A
    spare discarded by the supervisor (it closed the socket) exits here with status 0, at
    once (``os._exit``: nothing of the job was started yet).

    Returns:
        whether this process was a spare, handed off just now.

    Raises:
        ValueError: ``TRAINGUARD_SPARE_FD`` is not a file descriptor number, or the
            supervisor's message is not a JSON object of strings.
        OSError: the socket failed (the supervisor died: this process dies with it).
    """
    named = os.environ.pop(SPARE_FD_ENV, None)
    if named is not None:
        with socket.socket(fileno=int(named)) as channel:
            channel.sendall(READY)
            lines = channel.makefile("rb")
            while (message := lines.readline()) == PING:
                channel.sendall(PONG)
        if not message:
            os._exit(0)
        env = orjson.loads(message)
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise ValueError(f"hand-off message is not an object of strings: {message[:200]!r}")
        os.environ.update(env)
    return named is not None


def wait_for_store(timeout_s: float = _STORE_WAIT_S) -> bool:
    """Wait until ``MASTER_ADDR:MASTER_PORT`` accepts a TCP connection, trying every 5 ms, for
    a process whose ``RANK`` is set and not 0 (rank 0 hosts the store); return at once for any
    other. Whether the store answered (``False``: it did not within ``timeout_s`` seconds, or
    there is none to wait for).

    Call it right before ``init_process_group`` (``env://`` rendezvous), and only then: in a
    job that starts no store (no process group) a rank would wait ``timeout_s`` for nothing.
    Under torchrun the store is torchrun's own, listening before any rank starts: it returns
    at once.

    Why: torch's TCPStore client that finds no server retries with an exponential back-off
    (0.01-0.7 s measured here, ``bench/RESULTS.md``), so a rank that reaches the rendezvous
    before rank 0 started its store pays up to a back-off interval after the store is up. A
    connection opened and closed at once is harmless to the store: it serves each client's
    requests on its own connection.
    """
    rank, host, port = (os.environ.get(k) for k in ("RANK", "MASTER_ADDR", "MASTER_PORT"))
    if rank in (None, "", "0") or not host or not port:
        return False
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(_STORE_POLL_S)
