"""Quickstart: a small regression model trained on CPU in float16 autocast with dls.GradScaler.

Run: ``python examples/quickstart.py``. Prints loss, loss scale and skipped steps as training goes.
The first steps overflow at the default scale (2**15) and are skipped while the scale backs off; then the
scale settles where float16 gradients neither overflow nor underflow.
"""

from __future__ import annotations

import torch

import dls


def main(steps: int = 300, log_every: int = 50) -> dict[str, float]:
    torch.manual_seed(0)
    x = torch.randn(1024, 32)
    y = x @ torch.randn(32, 1) * 8.0  # large targets: the float16 loss overflows at the first scales
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = dls.GradScaler(loss_scale="dynamic", steps_per_increase=100)

    for step in range(1, steps + 1):
        batch = torch.randint(0, len(x), (64,))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x[batch]), y[batch])
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # skipped if any gradient is inf/NaN
        scaler.update()  # backs off on overflow, grows after 100 clean steps
        optimizer.zero_grad()
        if step % log_every == 0 or step == 1:
            print(
                f"step {step:4d}  loss {loss.item():10.4f}  loss scale {scaler.get_scale():8.0f}  "
                f"skipped {scaler.get_num_skipped_steps()}"
            )
    return {"loss": loss.item(), "scale": scaler.get_scale(), "skipped": scaler.get_num_skipped_steps()}


if __name__ == "__main__":
    main()
