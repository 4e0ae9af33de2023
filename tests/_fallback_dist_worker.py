"""One rank of ``test_fallback.py::test_ranks_keep_the_same_modules``: DDP over gloo, the amplifying model; only
rank 1's batches overflow in float16 (rank 0's inputs are scaled down so they fit), yet both ranks must keep the
same module and skip the same steps. Writes ``{"kept": [...], "skipped": [...]}``."""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import dls
from _amplify import amplifying_model, batch, scaled_step
from conftest import run_rank

RANK = int(os.environ["RANK"])


def run() -> dict[str, object]:
    torch.set_num_threads(1)
    model = DistributedDataParallel(amplifying_model())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = dls.GradScaler("cpu", init_scale=2.0**16)
    watch = scaler.watch(model, fallback=True)
    skipped = []
    for step in range(5):
        x, y = batch(step)
        x = x if RANK == 1 else x * 1e-3  # rank 0's activations stay below float16's largest value
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        scaled_step(scaler, optimizer, loss)
        skipped.append(scaler.step_was_skipped(optimizer))
    return {"kept": list(watch.kept_in_float32), "skipped": skipped}


if __name__ == "__main__":
    run_rank(run)
