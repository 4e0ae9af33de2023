"""dls: dynamic loss scaling for mixed-precision training in PyTorch."""

from dls import formats
from dls.emulate import emulate
from dls.formats import get_half_dtype, get_half_dtype_str, get_half_format, set_half_dtype
from dls.scaler import GradScaler, Stage
from dls.settings import ScalerSettings
from dls.step import StepResult, optimizer_step

__all__ = [
    "GradScaler",
    "ScalerSettings",
    "Stage",
    "StepResult",
    "emulate",
    "formats",
    "get_half_dtype",
    "get_half_dtype_str",
    "get_half_format",
    "optimizer_step",
    "set_half_dtype",
]

__version__ = "0.1.0"
