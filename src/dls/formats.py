"""Half-precision dtypes: which one the run trains in, and (see issue 3) exact emulation of each format.

``set_half_dtype`` mirrors ``cstorch.amp.set_half_dtype``: it records the half format the run uses and returns
the torch dtype that stands in for it. cbfloat16 has no torch dtype; its proxy is ``torch.float16`` (as on
Cerebras) and its numerics come from emulation.
"""

from __future__ import annotations

import torch

HALF_DTYPE_NAMES = ("float16", "bfloat16", "cbfloat16")

_PROXY_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "cbfloat16": torch.float16,
}

_half_dtype_str = "float16"


def _half_name(value: str | torch.dtype) -> str:
    if isinstance(value, torch.dtype):
        for name in ("float16", "bfloat16"):
            if value == _PROXY_DTYPES[name]:
                return name
    elif isinstance(value, str) and value in _PROXY_DTYPES:
        return value
    raise ValueError(
        f"half_dtype must be one of {', '.join(repr(n) for n in HALF_DTYPE_NAMES)}, "
        f"torch.float16 or torch.bfloat16; got {value!r}"
    )


def set_half_dtype(value: str | torch.dtype) -> torch.dtype:
    """Choose the half format of the run; returns the torch dtype that computes in it (cbfloat16 → float16)."""
    global _half_dtype_str
    _half_dtype_str = _half_name(value)
    return _PROXY_DTYPES[_half_dtype_str]


def get_half_dtype() -> torch.dtype:
    """The torch dtype that stands in for the chosen half format."""
    return _PROXY_DTYPES[_half_dtype_str]


def get_half_dtype_str() -> str:
    """The chosen half format's name: ``"float16"``, ``"bfloat16"`` or ``"cbfloat16"``."""
    return _half_dtype_str
