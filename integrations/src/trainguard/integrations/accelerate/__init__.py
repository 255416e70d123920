"""trainguard for Accelerate loops (``pip install 'trainguard[accelerate]'``).

:class:`TrainguardAccelerate` wraps an ``Accelerator`` whose loaders are stateful
(``DataLoaderConfiguration(use_stateful_dataloader=True)``): ``save_state`` folders announced
with their files' digests, restores verified before ``load_state`` reads a byte, the data
position restored by the loader's own state (``docs/integrations-hf.md``). Importing this
package imports ``accelerate``.
"""

from __future__ import annotations

from trainguard.integrations._extras import require as _require

_require("trainguard.integrations.accelerate", "accelerate", "accelerate", "torchdata")

from trainguard.integrations.accelerate._guard import TrainguardAccelerate  # noqa: E402

__all__ = ["TrainguardAccelerate"]
