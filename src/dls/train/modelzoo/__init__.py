"""Cerebras Model Zoo's models and data formats for ``dls train`` (needs the ``modelzoo`` extra: h5py, transformers).

* :func:`build_model` / :func:`check_model`: ``fc_mnist``, ``gpt2``, ``gpt3``, ``llama`` from a ``model`` section.
* :func:`build_loader` / :func:`check_data`: ``GptHDF5DataProcessor``, ``GptHDF5MapDataProcessor``,
  ``MNISTDataProcessor`` from a data loader section; :func:`fit_to_data`: can the model read it.
* :func:`write_tiny_data` and :func:`main` (``dls data {mnist,gpt} DIR``): tiny data sets in those formats.
"""

from dls.train.config import ZOO_MODELS as MODELS
from dls.train.config import ZOO_PROCESSORS as PROCESSORS
from dls.train.modelzoo.data import build_loader, check_data, fit_to_data
from dls.train.modelzoo.models import build_model, check_model
from dls.train.modelzoo.tiny import main, write_tiny_data

__all__ = [
    "MODELS",
    "PROCESSORS",
    "build_loader",
    "build_model",
    "check_data",
    "check_model",
    "fit_to_data",
    "main",
    "write_tiny_data",
]
