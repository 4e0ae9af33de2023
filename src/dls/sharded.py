"""``ShardedGradScaler``: a verbatim drop-in for ``torch.distributed.fsdp.ShardedGradScaler``.

Swap the import and keep the line::

    from dls import ShardedGradScaler     # was: from torch.distributed.fsdp.sharded_grad_scaler import ...
    scaler = ShardedGradScaler(growth_interval=400)                                  # verl's line, unchanged

It is a ``dls.GradScaler`` in the torch dialect with torch's ``ShardedGradScaler`` constructor (its argument order,
``backoff_factor`` before ``growth_factor``, and ``process_group``). Under FSDP2 ``fully_shard`` with
``MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)`` it trains bit-identically to
torch's, overflows included (``tests/test_fsdp_mesh.py``). What differs, on purpose:

* ``scale(loss)`` of a half-precision loss is float32 (dls's rule: ``2**16`` times a float16 loss overflows); torch
  casts it back to the loss's dtype. The gradients that backward produces are the same.
* the overflow flag is all-reduced (MAX) once per optimizer and step, asynchronously, over ``process_group``;
  with gradients offloaded to the CPU (``CPUOffloadPolicy``) nothing is read back per tensor or per step beyond
  the one read of the skip decision (``benchmarks/bench_sharded.py`` counts both scalers' reads).
* a growth that would make the scale inf is dropped (torch's CPU path multiplies without a check).
"""

from __future__ import annotations

from typing import Any

from dls.scaler import GradScaler

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(GradScaler):
    """``torch.distributed.fsdp.ShardedGradScaler``'s signature, dls's scaler.

    Args:
        device: where the scale lives (``"cuda"`` by default; without CUDA a warning and a disabled scaler, as
            in torch).
        init_scale: the first scale.
        backoff_factor: multiplies the scale after an overflow.
        growth_factor: multiplies the scale after ``growth_interval`` clean steps.
        growth_interval: clean steps before the scale grows.
        enabled: ``False`` makes every method a pass-through.
        process_group: the ranks that must agree on an overflow; ``None`` or ``torch.distributed.group.WORLD``
            (torch's default): the world.

    Raises:
        ValueError: a bad argument, named.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: Any = None,
    ) -> None:
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
            process_group=process_group,
        )
