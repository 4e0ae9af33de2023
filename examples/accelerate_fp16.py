"""Accelerate: ``mixed_precision="fp16"`` with dls's loss scaling, on CPU or GPU (``use_dls``).

Run: ``python examples/accelerate_fp16.py`` (``pip install 'dls[hf]'``). A small regression whose loss is
multiplied by 1e-4, with a fused AdamW, an LR warm-up prepared by Accelerate, an EMA, and gradient accumulation.
The scale starts at 2**32 on purpose: the first steps overflow and are skipped while it backs off, and the
warm-up and the EMA wait for them (Accelerate alone would step the scheduler after a fused optimizer's skip).
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from dls.integrations.accelerate import use_dls
from dls.skip import skip_aware


def main(steps: int = 300, accumulate: int = 2) -> dict[str, Any]:
    accelerator = Accelerator(
        mixed_precision="fp16", cpu=not torch.cuda.is_available(), gradient_accumulation_steps=accumulate
    )
    scaler = use_dls(accelerator, init_scale=2.0**32)  # without use_dls, fp16 on CPU silently trains float32

    torch.manual_seed(0)
    x = torch.randn(4096, 32)
    y = torch.tanh(x @ torch.randn(32, 16) / 32**0.5) @ torch.randn(16, 1) / 4
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 100))
    ema = skip_aware(AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99)), scaler, optimizer=optimizer)
    model, optimizer, warmup, loader = accelerator.prepare(model, optimizer, warmup, loader)

    done = 0
    while done < steps:
        for xb, yb in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(xb), yb) * 1e-4
                accelerator.backward(loss)
                optimizer.step()  # through the dls scaler, on the last micro-batch of each step
                warmup.step()  # Accelerate steps it unless optimizer.step_was_skipped
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                ema.update_parameters(model)
                done += 1
                if done == steps:
                    break

    with torch.no_grad():
        final = torch.nn.functional.mse_loss(
            accelerator.unwrap_model(model, keep_fp32_wrapper=False).cpu()(x), y
        ).item()
    result = {
        "loss": final,
        "steps": done,
        "skipped": scaler.get_num_skipped_steps(),
        "scheduler_steps": warmup.scheduler.last_epoch,
        "ema_updates": int(ema.n_averaged),
        "scale": scaler.get_scale(),
    }
    print(
        f"{done} optimizer steps, {result['skipped']} skipped (overflow); LR schedule and EMA advanced "
        f"{result['scheduler_steps']} and {result['ema_updates']} times; loss scale now {result['scale']:g}; "
        f"final loss {final:.4g}"
    )
    return result


if __name__ == "__main__":
    main()
