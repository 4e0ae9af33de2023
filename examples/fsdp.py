"""Sharded float16 training with FSDP2 (``fully_shard``) and ``dls.GradScaler``, with global-norm clipping.

Each rank holds a shard of every parameter and of its gradient (``DTensor``). An overflow lands in the shard
of one rank only; the scaler all-reduces its overflow flag (MAX) so every rank skips the same steps and holds
the same scale. ``max_gradient_norm`` clips by the norm of the whole model: squared norms of the local shards
are summed across the ranks (automatically for sharded ``DTensor`` gradients). Run it with::

    torchrun --nproc_per_node=2 examples/fsdp.py                     # CPU (gloo), or one GPU per rank (NCCL)
    torchrun --nproc_per_node=4 examples/fsdp.py --steps 200 --overflow-every 7

``--overflow-every N`` puts an inf into ONE rank's gradient shard every N steps. At the end every rank checks
that the scaler state is the same everywhere and that the clipping norm matches ``clip_grad_norm_``'s.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import dls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--overflow-every", type=int, default=10, help="0: no injected overflow")
    parser.add_argument("--cpu", action="store_true", help="use gloo on CPU even when CUDA is available")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available() and not args.cpu
    dist.init_process_group("nccl" if use_cuda else "gloo")
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    train(args, device, use_cuda)
    # Free the model and optimizer (their tensors and hooks hold the process group) before destroying the group:
    # with gloo, a group still referenced at interpreter exit can abort the process as it shuts down.
    gc.collect()
    dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device, use_cuda: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)
    ).to(device)
    # float16 compute and all-gathers, float32 gradient reduction and float32 sharded master parameters.
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = dls.GradScaler(max_gradient_norm=1.0)  # the norm is global: the gradients are sharded DTensors

    data = torch.Generator().manual_seed(1 + rank)
    target = torch.randn(32, 1, generator=torch.Generator().manual_seed(0))
    first_weight = model[0].weight
    assert isinstance(first_weight, DTensor)
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=data).to(device)
        y = x @ target.to(device)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        every = args.overflow_every
        if every and step % every == every - 1 and rank == (step // every) % world:
            grad = first_weight.grad
            assert isinstance(grad, DTensor)
            grad.to_local().view(-1)[0] = float("inf")  # only this rank's shard
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.5f}  scale {scaler.get_scale():g}", flush=True)

    states: list[object] = [None] * world
    dist.all_gather_object(states, scaler.state_dict())
    assert all(s == states[0] for s in states), f"scaler states differ across ranks: {states}"

    # The clipping norm is the whole model's: compare with torch's clip_grad_norm_ on the DTensor gradients.
    check = dls.GradScaler(max_gradient_norm=1e-3, init_scale=1.0, min_loss_scale=1.0)
    x = torch.randn(64, 32, generator=data).to(device)
    check.scale(torch.nn.functional.mse_loss(model(x).float(), x @ target.to(device))).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    before = torch.nn.utils.get_total_norm(grads).full_tensor()  # type: ignore[attr-defined]
    check.clip_gradients_and_return_isfinite(optimizer)
    after = torch.nn.utils.get_total_norm(grads).full_tensor()  # type: ignore[attr-defined]
    assert torch.allclose(after, torch.clamp(before, max=1e-3), rtol=1e-3), (before, after)
    if rank == 0:
        state = scaler.state_dict()
        print(
            f"all {world} ranks agree: scale {state['loss_scale']:g}, {state['num_skipped_steps']} skipped steps; "
            f"global norm {before.item():.4g} clipped to {after.item():.4g}",
            flush=True,
        )


if __name__ == "__main__":
    main()
