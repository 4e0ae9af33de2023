"""``dls train`` / ``dls demo``: a Model-Zoo-style YAML trainer for small built-in models, with checkpoints,
metrics and plots (needs the ``train`` extra: PyYAML, rich, matplotlib, numpy).

``Trainer(cfg).train()`` runs a validated :class:`dls.config.TrainConfig`; :func:`dls.train.demo.run_demo` is
what ``dls demo`` runs. The command line is :mod:`dls.train.cli`.
"""

from dls.train.trainer import Trainer, TrainingStopped, TrainResult

__all__ = ["TrainResult", "Trainer", "TrainingStopped"]
