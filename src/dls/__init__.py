"""dls: dynamic loss scaling for mixed-precision training in PyTorch."""

from dls.formats import get_half_dtype, get_half_dtype_str, set_half_dtype
from dls.scaler import GradScaler
from dls.step import optimizer_step

__all__ = [
    "GradScaler",
    "get_half_dtype",
    "get_half_dtype_str",
    "optimizer_step",
    "set_half_dtype",
]

__version__ = "0.1.0"
