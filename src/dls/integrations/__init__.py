"""dls in the frameworks most people train with: ``lightning``, ``accelerate``, ``transformers``, ``torchtitan``.

Each submodule imports its framework and fails with an ``ImportError`` naming the extra to install when it is
missing; this package itself imports none of them, so ``import dls`` needs torch alone.

* ``dls.integrations.lightning.DLSPrecision``: a precision plugin for ``L.Trainer(plugins=[...])``.
* ``dls.integrations.accelerate.use_dls(accelerator)``: installs a ``dls.GradScaler`` into an ``Accelerator``.
* ``dls.integrations.transformers.use_dls(trainer)``: the same for a Hugging Face ``Trainer`` (TRL's trainers too).
* ``dls.integrations.torchtitan``: ``--module dls.integrations.torchtitan --config NAME_fp16`` for torchtitan's
  trainer, ``with_dls(config)`` in a config function of your own.

The first three take ``fallback=True`` (``DLSPrecision(..., fallback=True)``, ``use_dls(..., fallback=True)``):
the float32 fallback of ``scaler.watch(model, fallback=True)`` on the model the framework trains, its kept modules
carried by the framework's own checkpoints.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["accelerate", "lightning", "torchtitan", "transformers"]


def __getattr__(name: str) -> ModuleType:
    # dls.integrations.lightning etc. resolve on first use, so that importing dls never imports a framework.
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
