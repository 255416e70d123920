"""charlm: a tiny, deterministic byte-level transformer trained with DDP on CPU.

The example training job for trainguard. Modules: :mod:`~examples.charlm.model` (the network),
:mod:`~examples.charlm.data` (standard-library source bytes as fixed windows),
:mod:`~examples.charlm.ledger` (sample ledger and exactness checker) and
:mod:`~examples.charlm.train` (the entry point, run with ``torchrun ... -m
examples.charlm.train``; checkpoints and restores go through :class:`trainguard.agent.Agent`).
"""

__all__: list[str] = []
