"""The ``modelzoo`` extra (h5py, transformers), imported where it is used."""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

from dls.train.errors import MissingExtras


def require(module: str) -> ModuleType:
    """Import ``module`` of the ``modelzoo`` extra, or ``MissingExtras`` naming the extra."""
    # transformers' model modules import torchao, which logs warnings about its optional C extensions and pytree
    # registrations at import: nothing about this run, so logging is quiet while they load.
    quiet = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra = "Model Zoo models and data need the modelzoo extra: pip install 'dls[modelzoo]'"
        raise MissingExtras(f"{module.split('.')[0]} is not installed; {extra}") from exc
    finally:
        logging.disable(quiet)
