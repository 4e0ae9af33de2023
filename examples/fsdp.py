"""Sharded float16 training with FSDP2 (``fully_shard``) and ``dls.GradScaler``, with global-norm clipping.

Each rank holds a shard of every parameter and of its gradient (``DTensor``). An overflow lands in the shard
of one rank only; the scaler all-reduces its overflow flag (MAX) so every rank skips the same steps and holds
the same scale. ``max_gradient_norm`` clips by the norm of the whole model: squared norms of the local shards
are summed across the ranks (automatically for sharded ``DTensor`` gradients). Run it with::

    torchrun --nproc_per_node=2 examples/fsdp.py                     # CPU (gloo), or one GPU per rank (NCCL)
    torchrun --nproc_per_node=4 examples/fsdp.py --steps 200 --overflow-every 7

``--overflow-every N`` puts an inf into ONE rank's gradient shard every N steps. At the end every rank checks
that the scaler state is the same everywhere and that the clipping norm matches ``clip_grad_norm_``'s. The set-up,
data and loop shared with ``examples/ddp.py`` are in ``examples/_common.py``.
"""

from __future__ import annotations

import argparse

import torch
from _common import Data, check_scaler_states_agree, launch, make_model, report, train_loop
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import dls


def train(args: argparse.Namespace, device: torch.device, use_cuda: bool) -> None:
    model = make_model(device)
    # float16 compute and all-gathers, float32 gradient reduction and float32 sharded master parameters.
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    assert isinstance(model[0].weight, DTensor)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = dls.GradScaler(max_gradient_norm=1.0)  # the norm is global: the gradients are sharded DTensors
    data = Data(device)
    train_loop(args, model, model[0].weight, optimizer, scaler, data, autocast=False)
    state = check_scaler_states_agree(scaler)

    # The clipping norm is the whole model's: compare with torch's clip_grad_norm_ on the DTensor gradients.
    check = dls.GradScaler(max_gradient_norm=1e-3, init_scale=1.0, min_loss_scale=1.0)
    x, y = data.batch()
    check.scale(torch.nn.functional.mse_loss(model(x).float(), y)).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    before = torch.nn.utils.get_total_norm(grads).full_tensor()  # type: ignore[attr-defined]
    check.clip_gradients_and_return_isfinite(optimizer)
    after = torch.nn.utils.get_total_norm(grads).full_tensor()  # type: ignore[attr-defined]
    assert torch.allclose(after, torch.clamp(before, max=1e-3), rtol=1e-3), (before, after)
    report(state, f"global norm {before.item():.4g} clipped to {after.item():.4g}")


if __name__ == "__main__":
    launch(__doc__.split("\n")[0], train)
