"""Agreement across ranks: every rank must skip the same steps and hold the same scale.

A rank whose gradients overflowed while another's did not would otherwise apply a step the others skip and
silently fork the model. The overflow flag is all-reduced with MAX over the process group before any skip
decision or scale update: one collective of one element per flag. Nothing happens when ``torch.distributed`` is
not initialised (or the group has one rank).

Sharded gradients (FSDP2's ``DTensor`` gradients, or a ZeRO-style optimizer that owns a slice of the model) are
unscaled and checked through their local shards, and their global L2 norm is the square root of the squared
local norms summed across the ranks that hold the shards: each rank clipping by its local norm would not.

Every rank must make the same calls in the same order, whether or not it holds gradients this step: the
collectives never depend on which gradients exist.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dls import kernels

# Reduction key of a gradient: the process groups its squared norm is summed over (empty: replicated).
_Key = tuple[Any, ...]


def is_active(group: Any = None) -> bool:
    """Whether flags must be agreed on: torch.distributed is initialised and the group has several ranks."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return bool(dist.get_world_size(group) > 1)


class Agreement:
    """A collective on a flag (or norm) in flight: ``wait()`` returns the reduced tensor.

    With NCCL ``wait()`` does not block the host: it orders the current stream after the collective. A tensor
    on a device the group's backend cannot reduce on (a CPU flag with NCCL) was copied to one that it can; the
    result is copied back in ``wait()``.
    """

    __slots__ = ("_result", "_staged", "_work")

    def __init__(self, result: torch.Tensor, work: Any, staged: torch.Tensor | None) -> None:
        self._result = result
        self._work = work
        self._staged = staged

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._staged is not None:
            self._result.copy_(self._staged)
            self._staged = None
        return self._result


def start_agreement(found_inf: torch.Tensor, group: Any = None) -> Agreement | None:
    """Launch the MAX all-reduce of ``found_inf`` (in place) over ``group`` without waiting for it; ``None``
    (and nothing launched) when not distributed. ``found_inf`` must not be read before ``wait()``."""
    if not is_active(group):
        return None
    return _all_reduce(found_inf, dist.ReduceOp.MAX, group, async_op=True)


def agree_on_overflow(found_inf: torch.Tensor, group: Any = None) -> torch.Tensor:
    """The MAX of ``found_inf`` over the ranks of ``group`` (the world by default); ``found_inf`` itself when
    not distributed. Every rank must call it the same number of times, with or without gradients."""
    if not is_active(group):
        return found_inf
    return _all_reduce(found_inf, dist.ReduceOp.MAX, group, async_op=False).wait()


def _all_reduce(tensor: torch.Tensor, op: Any, group: Any, async_op: bool) -> Agreement:
    device = _reduction_device(tensor.device, group)
    staged = None if device is None else tensor.to(device)
    work = dist.all_reduce(tensor if staged is None else staged, op=op, group=group, async_op=async_op)
    return Agreement(tensor, work if async_op else None, staged)


def _reduction_device(device: torch.device, group: Any) -> torch.device | None:
    """``None`` when the group's backend reduces tensors on ``device``; otherwise a device where it does (the
    current CUDA device for a CPU tensor and NCCL, the CPU for a device gloo lacks)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        types = [torch.device(t).type for t in pg._device_types]
    except (AttributeError, RuntimeError):  # older torch: infer from the backend's name
        backend = str(dist.get_backend(group)).lower()
        types = (["cpu"] if "gloo" in backend or "mpi" in backend else []) + (["cuda"] if "nccl" in backend else [])
    if not types or device.type in types:
        return None
    kind = "cuda" if "cuda" in types else types[0]
    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind, None)
    index = module.current_device() if module is not None and hasattr(module, "current_device") else 0
    return torch.device(kind, index)


# ---------------------------------------------------------------------- sharded gradients
def dtensor_class() -> Any:
    # No DTensor can exist unless torch.distributed.tensor was imported: nothing is imported (or paid) here.
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None)
    return cls if isinstance(cls, type) else None


def has_dtensors(params: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``params`` is a ``DTensor`` (an FSDP2 or tensor-parallel parameter)."""
    cls = dtensor_class()
    return cls is not None and any(isinstance(p, cls) for p in params)


def local_shards(groups: kernels.Groups) -> kernels.Groups:
    """``groups`` with every ``DTensor`` gradient replaced by its local shard (same device, dtype and storage:
    in-place passes reach the gradient itself)."""
    cls = dtensor_class()
    if cls is None:
        return groups
    return {key: [g.to_local() if isinstance(g, cls) else g for g in grads] for key, grads in groups.items()}


def norm_is_sharded(optimizers: Sequence[torch.optim.Optimizer], setting: bool | None, group: Any = None) -> bool:
    """Whether the global gradient norm needs a sum across ranks: ``setting`` (``gradients_sharded``) when given,
    else whether any parameter is a ``DTensor`` sharded over some mesh dimension. Never when not distributed."""
    if setting is False or not is_active(None):
        return False
    if setting:
        return True
    cls = dtensor_class()
    if cls is None:
        return False
    return any(
        isinstance(p, cls) and bool(_split_dims(p.placements))
        for opt in optimizers
        for g in opt.param_groups
        for p in g["params"]
    )


def _split_dims(placements: Sequence[Any]) -> list[int]:
    """The mesh dimensions over which a parameter is split: every placement but ``Replicate``. Not
    ``is_shard()``: the ``_StridedShard`` that FSDP2 gives tensor-parallel parameters on a 2-D mesh is no ``Shard``
    (torch 2.13), and counting it as replicated made each data-parallel half clip by its own norm."""
    return [d for d, placement in enumerate(placements) if not placement.is_replicate()]


def global_norm(
    parts: Sequence[tuple[Sequence[torch.optim.Optimizer], torch.Tensor]],
    device: torch.device,
    group: Any = None,
    plain_sharded: bool = False,
) -> torch.Tensor:
    """The L2 norm (float32 0-dim on ``device``) of the gradients of every optimizer of ``parts``, each times its
    part's factor, over the whole model however it is sharded.

    A ``DTensor`` gradient counts its local shard, summed over the mesh dimensions where its parameter is
    split (``Shard``, ``_StridedShard``) and counted once where it is replicated; parameters on different meshes
    (a LayerNorm sharded over ``dp`` only, linears over ``dp`` x ``tp``) each sum over their own mesh's groups.
    A plain gradient counts once when ``plain_sharded`` is false (replicated: every rank holds the same), else it
    is summed over ``group``. The keys, hence the collectives, come from parameters, not gradients: a rank
    without gradients joins them all.
    """
    empty: list[list[torch.Tensor]] = [[] for _ in parts]
    buckets: dict[_Key, list[list[torch.Tensor]]] = {}
    if plain_sharded:
        buckets[(group,)] = [list(x) for x in empty]  # first, on every rank, even one that owns no parameter
    cls = dtensor_class()
    mesh_groups: dict[tuple[int, Any], _Key] = {}
    for i, (optimizers, _factor) in enumerate(parts):
        for opt in optimizers:
            for param_group in opt.param_groups:
                for p in param_group["params"]:
                    if cls is not None and isinstance(p, cls):
                        cache_key = (id(p.device_mesh), tuple(p.placements))
                        key = mesh_groups.get(cache_key)
                        if key is None:
                            mesh = p.device_mesh
                            dims = _split_dims(p.placements)
                            key = mesh_groups[cache_key] = tuple(mesh.get_group(d) for d in dims)
                    else:
                        key = (group,) if plain_sharded else ()
                    buckets.setdefault(key, [list(x) for x in empty])[i].append(p)
    dtype = torch.float32 if device.type == "mps" else torch.float64  # squares of large norms stay finite
    total = torch.zeros((), dtype=dtype, device=device)
    for key, per_part in buckets.items():
        squares = torch.zeros((), dtype=dtype, device=device)
        for (_opts, factor), params in zip(parts, per_part):
            groups = local_shards(kernels.group_grads(params))
            norm = kernels.global_norm(groups, kernels.per_device(factor, {d for d, _ in groups}), device)
            squares = squares + norm.to(dtype) ** 2
        for pg in key:
            if is_active(pg):
                _all_reduce(squares, dist.ReduceOp.SUM, pg, async_op=False).wait()
        total = total + squares
    return total.sqrt().float()
