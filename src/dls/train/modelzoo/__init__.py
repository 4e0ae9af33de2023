"""Cerebras Model Zoo's models and data formats for ``dls train`` (the ``modelzoo`` extra: h5py, transformers):

- ``models``: ``build_model`` on Hugging Face's classes, ``fit_to_data``, Model Zoo's parameter groups (the
  optimizer they train with, cstorch's Adam, is ``dls.train.cerebras_adam``);
- ``data``: the data readers (``build_loader``, ``check_data``), the tiny data sets of ``dls data`` (``main``);
- ``extra``: ``require``, the extra's imports.

The keys of a Model Zoo model's and data processor's sections (``parse_model``, ``parse_loader``) are the config's:
``dls.train.config.zoo_keys``, re-exported here with the optimizer, so that the models and data read as one room.
The config imports nothing of this package."""

from __future__ import annotations

from dls.train.cerebras_adam import CerebrasAdam
from dls.train.config.zoo_keys import (
    LR_GROUPS,
    FcMnistKeys,
    GptKeys,
    Initializer,
    LoaderKeys,
    parse_loader,
    parse_model,
)
from dls.train.modelzoo.data import (
    IGNORE_INDEX,
    MAX_VOCAB,
    GptDataset,
    MnistDataset,
    build_loader,
    check_data,
    main,
    read_idx,
    tiny_data_files,
    write_tiny_data,
)
from dls.train.modelzoo.extra import require
from dls.train.modelzoo.models import CausalLM, FcMnist, build_model, fit_to_data, param_groups

__all__ = [
    "IGNORE_INDEX", "LR_GROUPS", "MAX_VOCAB", "CausalLM", "CerebrasAdam", "FcMnist", "FcMnistKeys", "GptDataset",
    "GptKeys", "Initializer", "LoaderKeys", "MnistDataset", "build_loader", "build_model", "check_data",
    "fit_to_data", "main", "param_groups", "parse_loader", "parse_model", "read_idx", "require", "tiny_data_files",
    "write_tiny_data",
]  # fmt: skip
