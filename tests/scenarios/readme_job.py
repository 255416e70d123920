"""The training loop of the repository's README, as printed, made into a worker script.

:func:`readme_loop` takes the Python block of README.md's "In your training loop" section
verbatim (a test using it breaks when the README drifts); :func:`write_worker` puts the names
the block takes as given in front of it (a dataset whose samples are their own ids, a one-weight
model with a constant loss, an optimizer, ``total_steps``), a barrier a step under a launcher
(ranks in lockstep, as DDP's all-reduce keeps them) and a ledger of what every step trained: each
``agent.step(step, ...)`` call first appends ``{"generation", "step", "rank", "samples"}`` to
``ledger-rank-<r>.jsonl`` (the format of ``examples/charlm/ledger.py``), the samples being the
batch the model saw last. :func:`expected_ledger` is what an exact run trains: the global order's
next batch at every step, with a restore's skipped batches left out.
"""

from __future__ import annotations

import re
from pathlib import Path

from examples.charlm.ledger import LedgerRecord
from trainguard.agent import GlobalOrder
from trainguard.schemas import StepRange

REPO = Path(__file__).resolve().parents[2]

JOB = "llm-7b"
"""The job id the README's block gives its agent."""

SAMPLES = 100
"""Dataset length: a global batch of 16 (2 ranks x 8) spans epoch boundaries every few epochs."""

PER_RANK = 8
"""The README's ``per_rank_batch_size``."""

SEED = 0
"""The README's sampler seed."""

VERSION = "readme-v1"
"""The data version the prelude passes as ``version``."""

_PRELUDE = f'''\
"""Worker: the README's training loop (appended verbatim below) on a toy job."""
import json
import os
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import trainguard.agent._agent

rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
total_steps = int(os.environ["README_TOTAL_STEPS"])
pace_s = float(os.environ.get("README_PACE_S", "0"))
dataset = list(range({SAMPLES}))  # sample i is i: a batch is its own sample ids
version = {VERSION!r}
torch.manual_seed(0)
model = torch.nn.Linear(1, 1)
optim = torch.optim.SGD(model.parameters(), lr=1e-3)
seen = []


def criterion(output):
    # A constant loss with a gradient: the toy job tests the data position, not learning, and
    # a flat loss keeps the daemon's loss detectors quiet.
    return output.sum() * 0.0 + 1.0


def evaluate(module):
    pass


_forward = model.forward


# Under a launcher (trainguard run) the ranks keep in lockstep, as a DDP job's gradient
# all-reduce keeps them: the toy model has no collective of its own, and ranks that train apart
# can be any number of steps apart when one dies (no checkpoint of every rank exists then).
lockstep = "MASTER_ADDR" in os.environ
if lockstep:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))


def _recording_forward(batch):
    if lockstep:
        dist.barrier()
    seen[:] = batch.tolist()
    time.sleep(pace_s)  # paces the job like a bigger one
    return _forward(batch.float().unsqueeze(1))


model.forward = _recording_forward
_ledger = (Path(os.environ["README_OUT"]) / f"ledger-rank-{{rank}}.jsonl").open("a")
_step = trainguard.agent._agent.Agent.step


def _recorded_step(self, step, **kwargs):
    line = {{"generation": self.config.generation, "step": step, "rank": rank, "samples": seen}}
    _ledger.write(json.dumps(line) + "\\n")
    _ledger.flush()
    return _step(self, step, **kwargs)


trainguard.agent._agent.Agent.step = _recorded_step

# -- README.md, "In your training loop", verbatim --------------------------------------------
'''


def readme_loop(readme: Path = REPO / "README.md") -> str:
    """The first Python block of README.md's "In your training loop" section, verbatim.

    Raises:
        AssertionError: the section or its block is gone.
    """
    text = readme.read_text()
    section = text.partition("## In your training loop")[2]
    assert section, "README.md has no section 'In your training loop'"
    found = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert found is not None, "the section 'In your training loop' has no python block"
    return found.group(1)


def write_worker(path: Path) -> Path:
    """Write the worker script (prelude and the README's block) to ``path``; return it."""
    path.write_text(_PRELUDE + readme_loop())
    return path


def expected_ledger(
    world_size: int, total: int, skip: StepRange | None = None
) -> list[LedgerRecord]:
    """What an exact run of ``total`` steps trains on each rank: at step s the global order's
    next batch, with the batches of ``skip`` (a restore's) left out from ``skip.from_step``
    on."""
    order = GlobalOrder(SAMPLES, SEED, VERSION)
    size = world_size * PER_RANK
    out: list[LedgerRecord] = []
    for step in range(1, total + 1):
        left_out = 0 if skip is None or step < skip.from_step else skip.to_step - skip.from_step + 1
        cursor = order.cursor_at((step - 1 + left_out) * size, world_size)
        for rank in range(world_size):
            samples = tuple(order.rank_batch(cursor, size, world_size, rank))
            out.append(LedgerRecord(generation=0, step=step, rank=rank, samples=samples))
    return out
