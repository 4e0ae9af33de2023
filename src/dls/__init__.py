"""dls: dynamic loss scaling for mixed-precision training in PyTorch."""

from dls.formats import get_half_dtype, get_half_dtype_str, set_half_dtype

__all__ = [
    "get_half_dtype",
    "get_half_dtype_str",
    "set_half_dtype",
]

__version__ = "0.1.0"
