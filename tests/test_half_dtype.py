from __future__ import annotations

import pytest
import torch

import dls


@pytest.mark.parametrize(
    ("value", "dtype", "name"),
    [
        ("float16", torch.float16, "float16"),
        ("bfloat16", torch.bfloat16, "bfloat16"),
        ("cbfloat16", torch.float16, "cbfloat16"),
        (torch.float16, torch.float16, "float16"),
        (torch.bfloat16, torch.bfloat16, "bfloat16"),
    ],
)
def test_set_half_dtype(value: str | torch.dtype, dtype: torch.dtype, name: str) -> None:
    assert dls.set_half_dtype(value) == dtype
    assert dls.get_half_dtype() == dtype
    assert dls.get_half_dtype_str() == name


@pytest.mark.parametrize("bad", ["fp16", "float32", torch.float32, 16, None])
def test_unknown_half_dtype_is_an_error_and_changes_nothing(bad: object) -> None:
    dls.set_half_dtype("bfloat16")
    with pytest.raises(ValueError, match="half_dtype must be one of"):
        dls.set_half_dtype(bad)  # type: ignore[arg-type]
    assert dls.get_half_dtype_str() == "bfloat16"
