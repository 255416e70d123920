"""What a plain-mode exit report says about a failed torchrun (``agent/supervisor/
_torchelastic.py``), from the texts torch 2.13's torchrun writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard.agent.supervisor._torchelastic import (
    describe_failure,
    error_file_message,
    torchrun_max_restarts,
)

SIGNALLED = """\
[W1204 17:00:11.0 api.py:900] Sending process 8574 closing signal SIGTERM
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
fail.py FAILED
------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-04_17:00:11
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 8574)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 8574
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-04_17:00:11
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 8575)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 8575
======================================================
"""

RAISED = """\
Root Cause (first observed failure):
[0]:
  time      : 2026-12-04_16:59:46
  host      : localhost
  rank      : 3 (local_rank: 1)
  exitcode  : 1 (pid: 8355)
  error_file: /tmp/torchelastic_x/attempt_0/1/error.json
  traceback : Traceback (most recent call last):
    File "/tmp/trt/fail.py", line 8, in main
      raise RuntimeError("boom on rank 1")
  RuntimeError: boom on rank 1
============================================================
"""


def _error_file(tmp_path: Path, message: object) -> Path:
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": message}))
    return path


def test_a_signal_is_named_from_the_root_cause_block() -> None:
    assert describe_failure(None, SIGNALLED) == (
        "torchrun: rank 1 (local rank 1) failed: exit code -9: Signal 9 (SIGKILL) received by "
        "PID 8575"
    )


def test_the_error_file_s_message_names_the_exception(tmp_path: Path) -> None:
    error = _error_file(
        tmp_path,
        {"message": "RuntimeError: boom on rank 1", "extraInfo": {"timestamp": "1"}},
    )

    assert describe_failure(error, RAISED) == (
        "torchrun: rank 3 (local rank 1) failed: RuntimeError: boom on rank 1"
    )
    # The error file alone (the block cut off the kept stderr tail): no rank, the error still.
    assert describe_failure(error, "") == "torchrun: a rank failed: RuntimeError: boom on rank 1"


def test_a_traceback_without_error_file_gives_the_exit_code_only() -> None:
    assert describe_failure(None, RAISED) == "torchrun: rank 3 (local rank 1) failed: exit code 1"


def test_nothing_is_said_for_what_is_no_torchrun(tmp_path: Path) -> None:
    assert describe_failure(tmp_path / "missing.json", "Traceback ...\nValueError: x\n") == ""
    (tmp_path / "junk.json").write_text("not json")
    assert error_file_message(tmp_path / "junk.json") == ""
    assert error_file_message(_error_file(tmp_path, "RuntimeError: newer format")) == (
        "RuntimeError: newer format"
    )


@pytest.mark.parametrize(
    ("command", "restarts"),
    [
        (["torchrun", "--standalone", "--max-restarts", "3", "train.py"], 3),
        (["/opt/venv/bin/torchrun", "--max_restarts=2", "train.py"], 2),
        (["torchrun", "--max-re", "1", "train.py"], 1),  # argparse's abbreviation
        ([sys.executable, "-u", "-m", "torch.distributed.run", "--max-restarts", "4", "t.py"], 4),
        (["python3", "-m", "torch.distributed.launch", "--max-restarts=1", "t.py"], 1),
        (["torchrun", "--nproc-per-node", "2", "train.py", "--max-restarts", "5"], 0),
        (["torchrun", "--nproc-per-node", "2", "-m", "examples.lightning.train"], 0),
        (["torchrun", "--no-such-option", "train.py"], None),  # torchrun refuses it itself
        ([sys.executable, "train.py", "--max-restarts", "3"], None),
        (["python", "-m", "examples.charlm.train", "--max-restarts", "3"], None),
        (["bash", "-c", "torchrun --max-restarts 3 t.py"], None),
    ],
)
def test_torchruns_own_restarts_are_read_as_torchrun_reads_them(
    command: list[str], restarts: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PET_MAX_RESTARTS", raising=False)
    assert torchrun_max_restarts(command) == restarts


def test_torchruns_restarts_may_come_from_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_MAX_RESTARTS", "2")
    assert torchrun_max_restarts(["torchrun", "--standalone", "train.py"]) == 2
    assert torchrun_max_restarts(["torchrun", "--max-restarts", "0", "train.py"]) == 0


def test_restarts_hidden_in_a_wrapper_script_are_refused_by_every_rank_at_its_first_start(
    tmp_path: Path,
) -> None:
    """A real torchrun with ``--max-restarts 1`` behind a shell script, in a rank's environment
    as ``trainguard run`` makes it (``TRAINGUARD_GENERATION``): the supervisor cannot read the
    flag, but torchrun puts it in each worker's environment, and the agent's settings refuse it
    before anything is trained, at the first start and at torchrun's own restart."""
    trained = tmp_path / "trained"
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import pathlib, sys\n"
        "from trainguard.agent import AgentConfig\n"
        "AgentConfig.resolve()\n"
        f"pathlib.Path({str(trained)!r}).write_text('a step')\n"
    )
    wrapper = tmp_path / "train.sh"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'exec "{sys.executable}" -m torch.distributed.run --standalone --nproc-per-node 1 '
        f'--max-restarts 1 "{worker}"\n'
    )
    wrapper.chmod(0o755)
    command = [str(wrapper)]
    assert torchrun_max_restarts(command) is None  # what the supervisor can see
    env = {**os.environ, "TRAINGUARD_JOB": "j", "TRAINGUARD_GENERATION": "0"}
    env.pop("PET_MAX_RESTARTS", None)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, done.stdout + done.stderr
    assert not trained.exists(), "a rank trained although torchrun may restart it itself"
    refusals = done.stderr.count("torchrun restarts this rank itself")
    assert refusals >= 2, done.stderr  # the first start and torchrun's one restart
    assert "TORCHELASTIC_MAX_RESTARTS=1" in done.stderr
