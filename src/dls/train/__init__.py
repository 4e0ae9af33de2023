"""``dls train`` / ``dls demo``: a Model-Zoo-style YAML trainer for small built-in models, with checkpoints,
metrics and plots (needs the ``train`` extra: PyYAML, rich, matplotlib, numpy).

``Trainer(cfg).train()`` runs a validated :class:`dls.train.schema.TrainConfig`; :func:`dls.train.demo.run_demo` is
what ``dls demo`` runs. The command line is :mod:`dls.train.cli`.

The names below are imported on first use, so that ``dls.train.cli`` (the ``dls`` command) starts without the
``train`` extra and can say that it is missing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["TrainResult", "Trainer", "TrainingStopped"]

if TYPE_CHECKING:
    from dls.train.errors import TrainingStopped
    from dls.train.trainer import Trainer, TrainResult


def __getattr__(name: str) -> Any:
    if name == "TrainingStopped":
        from dls.train.errors import TrainingStopped

        return TrainingStopped
    if name in ("Trainer", "TrainResult"):
        from dls.train import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'dls.train' has no attribute {name!r}")
