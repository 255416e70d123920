"""The charlm example trained for real in one process, through the agent on an embedded bus: a
run restored from a hand-published restore command ends where the uninterrupted one does, and
a paced run lasts steps times its period and changes no number."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from examples.charlm.ledger import compare_ledgers, read_ledger
from examples.charlm.model import ModelConfig
from examples.charlm.train import DEFAULT_JOB, TrainConfig, agent_config, train
from tests.support import jobbus as daemon
from trainguard.schemas import Checkpoint

# --- training through the agent ------------------------------------------------------------


def tiny(out: Path, steps: int) -> TrainConfig:
    """A seconds-long configuration: a 1-layer model of width 16 on 16-byte windows."""
    return TrainConfig(
        steps=steps,
        seed=0,
        out=out,
        checkpoint_every=3,
        blocking_checkpoints=False,
        per_rank_batch=4,
        lr=3e-3,
        threads=1,
        model=ModelConfig(context=16, d_model=16, n_layers=1, n_heads=2, dropout=0.1),
    )


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run torch on one thread (as the example's main does), so runs compare bitwise."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_restored_run_ends_where_the_uninterrupted_one_does(tmp_path, one_thread):
    reference = tiny(tmp_path / "reference", steps=7)
    train(reference, agent_config(reference, env={}))

    first = tiny(tmp_path / "run", steps=5)  # no daemon: the agent only publishes
    train(first, agent_config(first, env={}))
    bus = f"sqlite://{(tmp_path / 'run' / 'bus.db').resolve()}"
    events = daemon.read_events(bus, DEFAULT_JOB)
    shards = daemon.of_type(events, Checkpoint)
    # Checkpoints at 3 and at the last step; each cursor is the sample offset after its step.
    assert [(c.step, c.cursor.offset) for c in shards] == [(3, 12), (5, 20)]
    manifest = daemon.committed_manifest(events, DEFAULT_JOB, world_size=1)
    assert manifest is not None

    daemon.publish(bus, daemon.restore(DEFAULT_JOB, 1, manifest))
    helper = daemon.after_acks(bus, 1, range(1), daemon.resume(DEFAULT_JOB, 1, step=5))
    second = tiny(tmp_path / "run", steps=7)
    train(second, agent_config(second, env={"TRAINGUARD_GENERATION": "1"}))
    helper.join()

    def digest(out: Path) -> str:
        return (out / "final.sha256").read_text()

    assert digest(tmp_path / "run") == digest(tmp_path / "reference")
    run_ledger = read_ledger([tmp_path / "run" / "ledger-rank-0.jsonl"])
    assert min(r.step for r in run_ledger if r.generation == 1) == 6
    reference_ledger = read_ledger([tmp_path / "reference" / "ledger-rank-0.jsonl"])
    assert compare_ledgers(run_ledger, reference_ledger, world_size=1).exact


# --- pacing ----------------------------------------------------------------------------------


def test_a_paced_run_lasts_steps_times_period_and_changes_no_number(tmp_path, one_thread):
    plain = tiny(tmp_path / "plain", steps=4)
    train(plain, agent_config(plain, env={}))
    paced = dataclasses.replace(tiny(tmp_path / "paced", steps=4), step_period=0.5)
    began = time.monotonic()
    train(paced, agent_config(paced, env={}))
    assert time.monotonic() - began >= 4 * 0.5  # a lower bound: load only adds to it
    digest = "final.sha256"
    assert (tmp_path / "paced" / digest).read_text() == (tmp_path / "plain" / digest).read_text()
