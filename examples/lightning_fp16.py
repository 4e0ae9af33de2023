"""Lightning: float16 mixed precision with dls's loss scaling, on CPU or GPU (``DLSPrecision``).

Run: ``python examples/lightning_fp16.py`` (``pip install 'dls[lightning]'``). A small regression whose loss is
multiplied by 1e-4, so its float16 gradients need loss scaling. The scale starts at 2**32 on purpose: the first
steps overflow and are skipped while it backs off, and the LR warm-up and the EMA wait for them.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import dls
from dls.integrations.lightning import DLSPrecision
from dls.skip import skip_aware


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1))
        self.ema = AveragedModel(self.net, multi_avg_fn=get_ema_multi_avg_fn(0.99))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y) * 1e-4

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.net.parameters(), lr=1e-3, fused=True)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 100))
        # DLSPrecision makes step-interval schedulers skip-aware: they advance on applied steps only.
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    def on_train_start(self) -> None:
        # The EMA takes in applied steps only. (The optimizer exists from here on.)
        scaler = self.trainer.precision_plugin.scaler
        self.ema = skip_aware(self.ema, scaler, optimizer=self.optimizers())

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.ema.update_parameters(self.net)


def main(steps: int = 300) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    x = torch.randn(4096, 32)
    y = torch.tanh(x @ torch.randn(32, 16) / 32**0.5) @ torch.randn(16, 1) / 4
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=128, shuffle=True)

    plugin = DLSPrecision("16-mixed", device, scaler=dls.GradScaler(device=device, init_scale=2.0**32))
    trainer = L.Trainer(
        accelerator=device,
        devices=1,
        plugins=[plugin],  # instead of precision="16-mixed" (which on CPU would mean bf16)
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regression()
    trainer.fit(model, loader)

    scheduler = trainer.lr_scheduler_configs[0].scheduler
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(model.net.float().cpu()(x), y).item()
    result = {
        "loss": loss,
        "steps": trainer.global_step,
        "skipped": plugin.scaler.get_num_skipped_steps(),
        "scheduler_steps": scheduler.last_epoch,
        "ema_updates": int(model.ema.n_averaged),
        "scale": plugin.scaler.get_scale(),
    }
    print(
        f"{result['steps']} optimizer steps, {result['skipped']} skipped (overflow); LR schedule and EMA advanced "
        f"{result['scheduler_steps']} and {result['ema_updates']} times; loss scale now {result['scale']:g}; "
        f"final loss {loss:.4g}"
    )
    return result


if __name__ == "__main__":
    main()
