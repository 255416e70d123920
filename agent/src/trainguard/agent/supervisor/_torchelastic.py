"""What torchrun says about the rank that failed, for the exit report of a plain-mode worker.

``trainguard run --ranks 0-7 -- torchrun --max-restarts 0 ...`` runs torchrun as one worker.
When a rank fails, torchrun stops the others and exits 1, and what the supervisor would quote
from its stderr (:func:`._stderr.last_words`) is torchrun's own ``ChildFailedError``, which
names no rank. torchrun says more in two places, both read here:

* ``TORCHELASTIC_ERROR_FILE``: the supervisor sets it for the worker (or uses the file the
  operator named), and torchrun, whose entry point is wrapped in ``@record``, copies there the
  error file of the rank that failed first: the JSON the rank's own ``@record`` wrote for an
  exception (``{"message": {"message": "RuntimeError: ...", "extraInfo": {...}}, ...}``;
  ``torch.distributed.elastic.multiprocessing.errors``). A rank without ``@record``, or one
  that died of a signal, writes none, and nothing is copied.
* The "Root Cause (first observed failure)" block torchrun prints on stderr: the failing
  rank, its exit code and, for a signal, ``Signal 9 (SIGKILL) received by PID ...``.

:func:`describe_failure` makes one line of them: ``torchrun: rank 1 (local rank 1) failed:
RuntimeError: boom`` (the error file's message), or ``... failed: exit code -9: Signal 9
(SIGKILL) received by PID 8575`` (the block's).

:func:`torchrun_max_restarts` reads the ``--max-restarts`` a torchrun command line asks for,
with torchrun's own parser: a torchrun that restarts its ranks itself does so in the same
generation, behind the daemon's back, so the supervisor refuses it.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ERROR_FILE_ENV", "describe_failure", "error_file_message", "torchrun_max_restarts"]

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
"""The variable naming the file torchrun's ``@record`` writes a failure into."""

_ROOT_CAUSE = "Root Cause (first observed failure):"
_FIELD = re.compile(r"^\s*(?P<name>rank|exitcode|traceback)\s*:\s?(?P<value>.*)$")
_RANK = re.compile(r"(?P<rank>\d+) \(local_rank: (?P<local>\d+)\)")
_EXITCODE = re.compile(r"(?P<code>-?\d+)")
_NO_TRACEBACK = "To enable traceback"  # torchrun's text for a failure without an error file


def error_file_message(path: Path) -> str:
    """The failure's message in the torchelastic error file ``path`` (``message.message``, or
    ``message`` where it is a string), ``""`` when the file is missing, unreadable or not such
    JSON."""
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError):
        return ""
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    return message.strip() if isinstance(message, str) else ""


def _root_cause(stderr: str) -> dict[str, str]:
    """The ``rank``, ``exitcode`` and first ``traceback`` line of the last root-cause block in
    ``stderr``; the fields found."""
    start = stderr.rfind(_ROOT_CAUSE)
    if start < 0:
        return {}
    fields: dict[str, str] = {}
    for line in stderr[start + len(_ROOT_CAUSE) :].splitlines():
        found = _FIELD.match(line)
        if found is not None:
            fields.setdefault(found["name"], found["value"].strip())
    return fields


def describe_failure(error_file: Path | None, stderr: str) -> str:
    """One line about torchrun's failed rank, from ``error_file`` (the worker's
    ``TORCHELASTIC_ERROR_FILE``) and the tail of its ``stderr``; ``""`` when neither says
    anything (the command was no torchrun, or failed before any rank ran).

    The failure is the error file's message; without one, the root-cause block's exit code and
    traceback line (a signal's description; nothing from torchrun's hint to use ``@record``).
    """
    cause = _root_cause(stderr)
    what = error_file_message(error_file) if error_file is not None else ""
    if not what and cause:
        code = _EXITCODE.match(cause.get("exitcode", ""))
        said = cause.get("traceback", "")
        parts = [f"exit code {code['code']}"] if code is not None else []
        if said and not said.startswith(_NO_TRACEBACK) and not said.startswith("Traceback"):
            parts.append(said)
        what = ": ".join(parts)
    if not what:
        return ""
    rank = _RANK.match(cause.get("rank", ""))
    who = f"rank {rank['rank']} (local rank {rank['local']})" if rank is not None else "a rank"
    return f"torchrun: {who} failed: {what}"


_TORCHRUN_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch"})
"""The modules ``python -m`` runs torchrun as (``launch`` is its deprecated alias)."""


def _torchrun_arguments(command: Sequence[str]) -> list[str] | None:
    """torchrun's own arguments in ``command`` (``torchrun ARGS`` or ``python [OPTIONS] -m
    torch.distributed.run ARGS``), or ``None`` when the command runs no torchrun."""
    if not command:
        return None
    if Path(command[0]).name == "torchrun":
        return list(command[1:])
    if not Path(command[0]).name.startswith("python"):
        return None
    for at, word in enumerate(command[1:-1], start=1):
        if word == "-m":
            return list(command[at + 2 :]) if command[at + 1] in _TORCHRUN_MODULES else None
    return None


def torchrun_max_restarts(command: Sequence[str]) -> int | None:
    """The restarts torchrun would make of its own for worker command ``command``
    (``--max-restarts``, or ``PET_MAX_RESTARTS`` of this process's environment; torchrun's
    default is 0), or ``None`` when the command runs no torchrun, torch is not importable here,
    or torchrun would refuse the arguments itself (it then says why when it runs).

    The arguments are parsed by torchrun's own parser
    (``torch.distributed.run.get_args_parser``, which accepts the same spellings and
    abbreviations torchrun does); torch is imported only for a torchrun command.
    """
    arguments = _torchrun_arguments(command)
    if arguments is None:
        return None
    try:
        from torch.distributed.run import get_args_parser
    except ImportError:
        return None
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            parsed = get_args_parser().parse_args(arguments)
        except SystemExit:  # argparse's way to refuse: torchrun will say it when it runs
            return None
    return int(parsed.max_restarts)
