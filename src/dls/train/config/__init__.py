"""Training configs: YAML in either Cerebras Model Zoo layout (or dls's own) to a validated :class:`TrainConfig`, in
torchtitan's ``config/`` cut:

- ``schema``: dls's sections, each key declared once as a pydantic field (type, bounds, default, help);
- ``manager``: the YAML file read safely, the command line's overrides applied;
- ``layouts``: Model Zoo's layouts (and Release 1.x's names) key by key onto the sections, Model Zoo's defaults, and
  back to dls's own layout (``to_dict``);
- ``zoo_keys``: the keys of a Model Zoo model's and data processor's own sections (``parse_model``,
  ``parse_loader``), which ``dls.train.modelzoo`` builds from;
- ``validation``: ``parse_config`` (every problem under its key as written, the loss-scaling keys judged by
  ``ScalerSettings``), the scaler's settings of a config, the memory a run needs.

:func:`load_config` is all of it for a file. Every error names the key as the file wrote it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dls.train.config.layouts import CEREBRAS, IGNORED_OFF_CEREBRAS, NOT_DONE, ZOO_RUNCONFIG, to_dict
from dls.train.config.manager import apply_overrides, default_model_dir, load_yaml, read_config
from dls.train.config.schema import (
    CHECKPOINT_STATES,
    MODEL_NAMES,
    SCALER_KEYS,
    SECTION_CLASSES,
    ZOO_MODELS,
    ZOO_PROCESSORS,
    DataConfig,
    Finite,
    ModelConfig,
    OptimizerConfig,
    PrecisionConfig,
    RunConfig,
    SchedulePiece,
    TrainConfig,
    describe_keys,
    did_you_mean,
    parse_checkpoint_states,
)
from dls.train.config.validation import (
    GPU_NEVER,
    loss_scaling_mode,
    memory_problem,
    optimizer_class,
    parse_config,
    scaler_settings,
    step_once,
)

__all__ = [
    "CEREBRAS", "CHECKPOINT_STATES", "GPU_NEVER", "IGNORED_OFF_CEREBRAS", "MODEL_NAMES", "NOT_DONE", "SCALER_KEYS",
    "SECTION_CLASSES", "ZOO_MODELS", "ZOO_PROCESSORS", "ZOO_RUNCONFIG", "DataConfig", "Finite", "ModelConfig",
    "OptimizerConfig", "PrecisionConfig", "RunConfig", "SchedulePiece", "TrainConfig", "apply_overrides",
    "default_model_dir", "describe_keys", "did_you_mean", "load_config", "load_yaml", "loss_scaling_mode",
    "memory_problem", "optimizer_class", "parse_checkpoint_states", "parse_config", "read_config",
    "scaler_settings", "step_once", "to_dict",
]  # fmt: skip


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML config file, apply overrides, validate. Raises ``ConfigError``."""
    notes: list[str] = []
    return parse_config(read_config(path, overrides, notes), source=str(path), notes=notes)
