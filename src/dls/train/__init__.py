"""``dls train``: a Model-Zoo-style YAML trainer (the ``train`` extra). ``Trainer(cfg).train()`` runs a validated
:class:`dls.train.config.TrainConfig`; the names below are imported on first use, so that the ``dls`` command starts
without the extra and can say that it is missing."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["TrainResult", "Trainer", "TrainingStopped"]

if TYPE_CHECKING:
    from dls.train.errors import TrainingStopped
    from dls.train.trainer import Trainer, TrainResult


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'dls.train' has no attribute {name!r}")
    module = "dls.train.errors" if name == "TrainingStopped" else "dls.train.trainer"  # errors: no torch needed
    return getattr(importlib.import_module(module), name)
