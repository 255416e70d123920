"""The job state codec across processes: the same state encodes to the same bytes in every
process (whatever its hash seed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from trainguard.daemon.core._state_codec import decode_state

STRING_KEYS = """
import sys
from msgspec import structs
from rpds import HashTrieMap
from tests.support.machine_scenarios import killed_job
from trainguard.daemon.core._state_codec import encode_state
_, state, _ = killed_job()
versions = HashTrieMap({f"v{i}": i for i in range(40)})
state = structs.replace(state, watch=state.watch._replace(versions=versions))
sys.stdout.buffer.write(encode_state(state))
"""


def test_the_same_state_encodes_to_the_same_bytes_in_every_process() -> None:
    """Maps and sets are written sorted: string keys' hash order (which varies with the hash
    seed) does not leak into the bytes."""
    outputs = set()
    root = Path(__file__).resolve().parents[3]
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(root)}
        done = subprocess.run(
            [sys.executable, "-c", STRING_KEYS], env=env, capture_output=True, check=True
        )
        outputs.add(done.stdout)
    [output] = outputs
    assert decode_state(output).watch.versions["v7"] == 7
