"""What a saved optimizer state must be before it is loaded: :func:`check_optimizer_state` judges a state dict
against the optimizer that would load it, before anything changes, and :func:`tensor_problem` judges one tensor as
it will be held. torch's ``Optimizer.load_state_dict`` checks the groups' sizes and converts each floating tensor
to its parameter's dtype, but takes any value: a NaN ``exp_avg`` or a negative ``exp_avg_sq`` (finite, impossible:
its square root is NaN) loads, and the next applied step writes NaN into the weights.

The rules, per entry ``state[i]`` of the parameter ``i`` (its index in the groups' ``params``, as torch maps them):

* the saved groups hold as many parameters as the optimizer's, each index an integer given once;
* ``step`` (and any value that is not a tensor) a finite number, ``step`` >= 0;
* a tensor is dense, real unless its parameter is complex, floating (or complex) for a floating parameter (not
  integers or booleans), and of the parameter's shape, but for the per-parameter scalars (:data:`SCALARS`: NAdam's
  ``mu_product``, ASGD's ``eta`` and ``mu``, 0-dim) and Adafactor's factored second moments (``row_var`` /
  ``col_var``, the parameter's shape with its last / second-to-last dimension 1);
* converted to the parameter's dtype, as loading converts it, finite (complex values by both parts, float8 read
  through float32), and nothing the conversion turns into inf;
* the second moments and the other states that are never negative (:data:`NON_NEGATIVE`) hold no negative value.

Imports torch (and dls's message helper) only: the trainer's checkpoints and ``dls.master_weights`` use it alike.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any

import torch

from dls.checks import shown

__all__ = ["NON_FINITE", "NON_NEGATIVE", "SCALARS", "all_finite", "check_optimizer_state", "tensor_problem"]

# Per-parameter states that no step of their optimizer makes negative: squares and their averages (Adam's and its
# kin's exp_avg_sq, Adagrad's sum, RMSprop's and Adadelta's square_avg and acc_delta, Adafactor's), Adamax's
# infinity norm, Rprop's step sizes, ASGD's eta and mu, NAdam's momentum product, and every step count.
NON_NEGATIVE = frozenset(
    {
        "step", "exp_avg_sq", "max_exp_avg_sq", "sum", "square_avg", "acc_delta", "exp_inf", "row_var", "col_var",
        "variance", "step_size", "eta", "mu", "mu_product",
    }
)  # fmt: skip
NON_FINITE = "holds inf/NaN values"
# The per-parameter states that are one number (0-dim tensors): every other tensor has its parameter's shape.
SCALARS = frozenset({"mu_product", "eta", "mu"})


def check_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: Any, *, name: str = "optimizer") -> None:
    """Whether ``state_dict`` may be loaded into ``optimizer`` by the rules of the module docstring; a
    ``ValueError`` naming the first field that may not (``name.state[i].key``, ``name.param_groups[g].params``),
    reading only. ``optimizer`` is the one whose ``load_state_dict`` takes it (for ``dls.master_weights``, the inner
    optimizer: its parameters are the float32 masters).

    Args:
        optimizer: the optimizer that would load ``state_dict``.
        state_dict: what its ``state_dict()`` returned, or a saved one.
        name: how errors name ``state_dict``.
    """
    groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
    entries = state_dict.get("state") if isinstance(state_dict, Mapping) else None
    if not isinstance(entries, Mapping) or not isinstance(groups, list):
        raise ValueError(f"{name} is not an optimizer state dict (state, param_groups)")
    if not all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups):
        raise ValueError(f"{name}.param_groups must be mappings, each with a list of params")
    sizes, now_sizes = [len(g["params"]) for g in groups], [len(g["params"]) for g in optimizer.param_groups]
    if sizes != now_sizes:
        raise ValueError(f"{name}.param_groups hold {sizes} parameters; the optimizer's {now_sizes}")
    params: dict[int, torch.Tensor] = {}
    for g, (group, now) in enumerate(zip(groups, optimizer.param_groups)):
        for index, param in zip(group["params"], now["params"]):
            if isinstance(index, bool) or not isinstance(index, int) or index in params:
                raise ValueError(
                    f"{name}.param_groups[{g}].params must be distinct integers (one per parameter); got "
                    f"{shown(group['params'])}"
                )
            params[index] = param
    for index, entry in entries.items():
        field = f"{name}.state[{shown(index)}]"
        if isinstance(index, bool) or index not in params or not isinstance(entry, Mapping):
            raise ValueError(f"{field} is not the state of one of the optimizer's parameters")
        for key, value in entry.items():
            if value is not None:  # SGD without momentum keeps momentum_buffer None
                _check_value(f"{field}.{key}", key, value, params[index])


def _check_value(field: str, key: Any, value: Any, param: torch.Tensor) -> None:
    """One value of a parameter's state (see the module docstring); a ``ValueError`` naming ``field``."""
    if key == "step" and isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        if value.layout != torch.strided or value.is_meta:
            raise ValueError(f"{field} must be a number >= 0; got {shown(value)}")
        value = value.item()
    if key == "step":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= sys.float_info.max:
            raise ValueError(f"{field} must be a number >= 0; got {shown(value)}")
        return
    if not isinstance(value, torch.Tensor):
        if not all_finite(value):
            raise ValueError(f"{field} {NON_FINITE}")
        return
    shape = param.shape
    if key in SCALARS:  # a per-parameter scalar
        shape = torch.Size(())
    elif key in ("row_var", "col_var") and param.dim() >= 2:  # Adafactor's factored second moments
        shape = torch.Size((*param.shape[:-1], 1) if key == "row_var" else (*param.shape[:-2], 1, param.shape[-1]))
    like = param.new_empty(shape)
    kinds = (
        (value.is_floating_point() or value.is_complex()) if param.is_floating_point() or param.is_complex() else True
    )
    if value.shape != shape or not kinds:
        raise ValueError(
            f"{field} is a {value.dtype} tensor of shape {tuple(value.shape)}; its parameter needs a "
            f"{'floating-point ' if param.is_floating_point() else ''}tensor of shape {tuple(shape)}"
        )
    if problem := tensor_problem(value, like, whose="its parameter"):
        raise ValueError(f"{field} {problem}")
    real = not (value.is_complex() or like.is_complex())
    if key in NON_NEGATIVE and real and value.numel() and bool((_real_view(value.to(like.dtype)) < 0).any()):
        raise ValueError(f"{field} holds negative values (as low as {float(_real_view(value).min()):.6g}); it never "
                         "is negative")  # fmt: skip


def tensor_problem(value: Any, like: torch.Tensor, finite: bool = True, whose: str = "the target") -> str | None:
    """What keeps ``value`` from being loaded into a tensor like ``like`` (``None``: nothing), checked in this order:
    a dense tensor of ``like``'s shape (before anything reads its values: a crafted view of 10^12 elements costs
    nothing until then); real unless ``like`` is complex, floating (or complex) when ``like`` is; then, converted to
    ``like``'s dtype as loading converts it, representable: :data:`NON_FINITE` where it holds inf/NaN and ``finite``
    is asked, and values that the conversion turned into inf (a float64 1e300 into float32) in any case. Complex
    values count by both parts; float8 values are read through a float32 view. Integer targets take integer values
    within their range. ``whose`` names ``like`` in the messages."""
    if not isinstance(value, torch.Tensor):
        return f"is {shown(value)}, not a tensor"
    if value.layout != torch.strided or value.is_quantized or value.is_meta:
        return f"is a {value.layout} {value.dtype} tensor{' on meta' if value.is_meta else ''}; a dense one is needed"
    if value.shape != like.shape:
        return f"is a tensor of shape {tuple(value.shape)}; {whose} needs shape {tuple(like.shape)}"
    dtype, name = like.dtype, str(like.dtype).removeprefix("torch.")
    if value.is_complex() and not dtype.is_complex:
        return f"is complex ({value.dtype}); it loads into {name}, which is real"
    if not (dtype.is_floating_point or dtype.is_complex):
        if value.is_floating_point() or value.is_complex():
            return f"is a {value.dtype} tensor; it loads into {name}, which holds integers"
        info = torch.iinfo(dtype) if dtype != torch.bool else None
        low, high = (int(value.min()), int(value.max())) if value.numel() and info else (0, 0)
        return None if info is None or info.min <= low <= high <= info.max else f"holds values beyond {name}'s range"
    if not (value.is_floating_point() or value.is_complex()):
        return f"is a {value.dtype} tensor; it loads into {name}, which holds floating-point values"
    was = torch.isfinite(_real_view(value))
    if finite and not bool(was.all()):
        return NON_FINITE
    now = torch.isfinite(_real_view(value.to(dtype)))
    if not bool((now | ~was).all()):
        largest = float(_real_view(value).abs()[was & ~now].max())
        return f"holds values beyond {name}'s range (largest |value| {largest:.6g}), which loading would make inf"
    return None


def _real_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` in a dtype ``torch.isfinite`` and comparisons take: float8 (which they do not) as float32."""
    return t.float() if t.is_floating_point() and t.element_size() == 1 else t


def all_finite(value: Any) -> bool:
    """Whether every number in ``value`` (nested in lists, tuples, dicts) is finite."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple, dict)):
        return all(all_finite(v) for v in (value.values() if isinstance(value, dict) else value))
    return True
