"""The state machine across processes: a replay of the same inputs is exact in another
interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPLAY = """
import json
from tests.support.machine_scenarios import killed_job, play
sim, state, _ = killed_job()
state, trace = play(sim, state, [("ack", 0, 5), ("exit", 2, 3), ("beat", 1, 20), ("tick", 0, 900),
                                 ("ack", 1, 1), ("corrupt", 3, 2), ("tick", 0, 2000)] * 2)
print(json.dumps([d.to_dict() for _, ds in trace for d in ds], sort_keys=True))
"""


def test_replay_is_exact_across_processes() -> None:
    """Decisions do not depend on per-process state such as string hash seeds."""
    outputs = set()
    root = Path(__file__).resolve().parents[3]
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(root)}
        done = subprocess.run(
            [sys.executable, "-c", REPLAY], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(done.stdout)
    [output] = outputs
    assert len(json.loads(output)) > 5
