"""Agreement across ranks: every rank must skip the same steps and hold the same scale.

A rank whose gradients overflowed while another's did not would otherwise apply a step the others skip and
silently fork the model. The overflow flag is all-reduced with MAX over the process group before any skip
decision or scale update. Nothing happens when ``torch.distributed`` is not initialised.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_active(group: Any = None) -> bool:
    """Whether flags must be agreed on: torch.distributed is initialised and the group has several ranks."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return bool(dist.get_world_size(group) > 1)


def agree_on_overflow(found_inf: torch.Tensor, group: Any = None) -> torch.Tensor:
    """The MAX of ``found_inf`` over the ranks of ``group`` (the world by default); ``found_inf`` itself when
    not distributed. Every rank must call it the same number of times, with or without gradients."""
    if not is_active(group):
        return found_inf
    dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
    return found_inf
