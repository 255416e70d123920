"""What the Lightning callback refuses before anything trains: ranks that Lightning would start
itself (``ddp_spawn``, ``ddp_fork``), so that the user reads the fix instead of a pickling
traceback or a job whose ranks the agent does not know."""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Any, cast

import pytest
from lightning.pytorch.strategies import DDPStrategy

from trainguard.agent import ConfigError
from trainguard.integrations.lightning import TrainguardCallback


def _callback() -> TrainguardCallback:
    # No agent is needed for what is refused first.
    return TrainguardCallback.__new__(TrainguardCallback)


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_a_ddp_strategy_that_starts_its_own_processes_is_refused(start_method: str) -> None:
    strategy = DDPStrategy(start_method=cast(Any, start_method))
    trainer = cast(Any, SimpleNamespace(strategy=strategy))
    with pytest.raises(ConfigError, match=f"strategy 'ddp_{start_method}' starts them"):
        _callback().setup(trainer, cast(Any, None), "fit")


def test_the_callback_cannot_be_pickled_into_a_spawned_process() -> None:
    """``ddp_spawn`` pickles the callbacks before ``setup`` runs: the error names the fix."""
    with pytest.raises(ConfigError, match="use strategy='ddp'"):
        pickle.dumps(_callback())


def test_a_missing_extra_names_the_pip_install_that_adds_it() -> None:
    from trainguard.integrations._extras import require

    with pytest.raises(ImportError, match=r"pip install 'trainguard\[lightning\]'") as raised:
        require("trainguard.integrations.lightning", "lightning", "lightning", "no_such_module")
    assert raised.value.name == "no_such_module"
    require("trainguard.integrations.lightning", "lightning", "lightning")  # installed here
