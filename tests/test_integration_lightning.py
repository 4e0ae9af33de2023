"""``DLSPrecision`` inside a real ``L.Trainer`` on CPU: float16 autocast, skipped steps, schedules, EMA, checkpoints."""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import dls
from _amplify import amplifying_model, eval_loss
from _amplify import batch as amplify_batch
from conftest import load_example
from dls.skip import SkipAware, skip_aware

L = pytest.importorskip("lightning")
from dls.integrations.lightning import DLSPrecision  # noqa: E402

ACCUMULATE = 2
OPT_STEPS = 6
OVERFLOW_STEPS = {1, 4}  # optimizer steps (0-based) whose last micro-batch gets an inf gradient
EMA_DECAY = 0.5


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.ema = AveragedModel(self.net, multi_avg_fn=get_ema_multi_avg_fn(EMA_DECAY))
        self.output_dtypes: set[torch.dtype] = set()
        self.snapshot: list[torch.Tensor] | None = None
        self.seen: list[dict[str, Any]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        self.output_dtypes.add(out.dtype)
        return torch.nn.functional.mse_loss(out.float(), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.net.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_start(self) -> None:
        # The optimizer exists from here on; the wrapper replaces the registered average under the same name.
        scaler = self.trainer.precision_plugin.scaler
        self.ema = skip_aware(self.ema, scaler, optimizer=self.optimizers())  # a LightningOptimizer: unwrapped

    def on_after_backward(self) -> None:
        opt_step, micro = divmod(self.trainer.fit_loop.epoch_loop.batch_idx, ACCUMULATE)
        if opt_step in OVERFLOW_STEPS and micro == ACCUMULATE - 1:
            self.net[0].weight.grad[0, 0] = float("inf")

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.snapshot = [p.detach().clone() for p in self.net.parameters()]

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % ACCUMULATE:
            return
        assert self.snapshot is not None
        self.ema.update_parameters(self.net)
        optimizer = self.optimizers().optimizer
        self.seen.append(
            {
                "skipped": self.trainer.precision_plugin.scaler.step_was_skipped(optimizer),
                "unchanged": all(torch.equal(a, b) for a, b in zip(self.snapshot, self.net.parameters())),
                "params": [p.detach().clone() for p in self.net.parameters()],
            }
        )
        self.snapshot = None


class ScaleAtStart(L.Callback):
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.state = trainer.precision_plugin.scaler.state_dict()
        self.last_epoch = trainer.lr_scheduler_configs[0].scheduler.last_epoch


def _loader() -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=gen)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True) * 0.1)
    return torch.utils.data.DataLoader(data, batch_size=4)


def _trainer(max_steps: int, plugin: DLSPrecision, callbacks: list[Any] | None = None) -> Any:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[plugin],
        max_steps=max_steps,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


def test_fp16_fit_skips_overflows_and_keeps_schedule_ema_and_checkpoint(tmp_path: Path) -> None:
    plugin = DLSPrecision("16-mixed", "cpu")
    model = Regression()
    trainer = _trainer(OPT_STEPS, plugin)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice about dataloader workers
        trainer.fit(model, _loader())

    assert model.output_dtypes == {torch.float16}  # really float16 on CPU, not bf16
    expected = [i in OVERFLOW_STEPS for i in range(OPT_STEPS)]
    assert [s["skipped"] for s in model.seen] == expected
    assert [s["unchanged"] for s in model.seen] == expected
    real = OPT_STEPS - len(OVERFLOW_STEPS)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert isinstance(scheduler, SkipAware) and isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)
    assert scheduler.last_epoch == real
    assert scheduler.get_last_lr() == [pytest.approx(1e-2 / (1 + real))]
    # The EMA took in the parameters of each applied step, once.
    assert int(model.ema.n_averaged) == real
    reference: list[torch.Tensor] | None = None
    for s in model.seen:
        if s["skipped"]:
            continue
        if reference is None:
            reference = [p.clone() for p in s["params"]]
        else:
            reference = [EMA_DECAY * r + (1 - EMA_DECAY) * p for r, p in zip(reference, s["params"])]
    assert reference is not None
    for r, p in zip(reference, model.ema.module.parameters()):
        torch.testing.assert_close(p, r)
    assert all(torch.isfinite(p).all() for p in model.net.parameters())
    assert plugin.scaler.get_num_skipped_steps() == len(OVERFLOW_STEPS)

    # The checkpoint carries the scaler; resuming restores it (and the wrapped scheduler) before training goes on.
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    assert checkpoint["DLSPrecision"] == plugin.scaler.state_dict()
    initial = DLSPrecision("16-mixed", "cpu").scaler.get_scale()
    assert checkpoint["DLSPrecision"]["loss_scale"] == plugin.scaler.get_scale() == initial / 4  # two back-offs
    resumed_plugin, probe = DLSPrecision("16-mixed", "cpu"), ScaleAtStart()
    resumed = _trainer(OPT_STEPS + 1, resumed_plugin, [probe])
    resumed_model = Regression()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed.fit(resumed_model, _loader(), ckpt_path=path)
    assert probe.state == checkpoint["DLSPrecision"]
    assert probe.last_epoch == real
    assert resumed.lr_scheduler_configs[0].scheduler.last_epoch == real + 1
    assert int(resumed_model.ema.n_averaged) == real + 1  # the average rides in the checkpoint as a submodule


def test_plugin_arguments_and_defaults() -> None:
    with pytest.raises(ValueError, match="precision must be one of"):
        DLSPrecision("16-true", "cpu")
    with pytest.raises(ValueError, match="device must be"):
        DLSPrecision("16-mixed", "gpu0")
    with pytest.raises(ValueError, match=r"scaler must be a dls\.GradScaler"):
        DLSPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))  # type: ignore[arg-type]
    assert DLSPrecision("16-mixed", "cpu").scaler.is_enabled()
    bf16 = DLSPrecision("bf16-mixed", "cpu")
    assert isinstance(bf16.scaler, dls.GradScaler) and not bf16.scaler.is_enabled()
    assert bf16.autocast_context_manager().fast_dtype == torch.bfloat16
    mine = dls.GradScaler(device="cpu", init_scale=64.0)
    assert DLSPrecision("bf16-mixed", "cpu", scaler=mine).scaler is mine
    assert DLSPrecision("16-mixed", "cuda:0", scaler=mine).device == "cuda"

    # A checkpoint of Lightning's own MixedPrecision (torch's scaler) resumes with its scale.
    torch_state = torch.amp.GradScaler("cpu", init_scale=256.0).state_dict()
    plugin = DLSPrecision("16-mixed", "cpu")
    plugin.on_load_checkpoint({"MixedPrecision": torch_state})
    assert plugin.scaler.get_scale() == 256.0
    plugin.on_load_checkpoint({"MixedPrecision": torch_state | {"scale": 8.0}, "DLSPrecision": {}})
    assert plugin.scaler.get_scale() == 256.0  # dls's own state wins; the Trainer loads it


def test_example_runs_and_its_schedule_and_ema_skip_with_the_steps() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = load_example("lightning_fp16.py").main(steps=20)
    assert result["steps"] == 20 and result["skipped"] > 0  # the example starts at a scale that overflows
    assert result["scheduler_steps"] == result["ema_updates"] == 20 - result["skipped"]


# ----------------------------------------------------------------------------- the float32 fallback
FALLBACK_STEPS = 6


class Amplifying(L.LightningModule):
    """``_amplify``'s model, whose float16 forward overflows in ``net.amplify``. ``how`` its training step runs:
    ``"net"`` calls ``self.net`` (never ``self``), as many LightningModules do, so the fallback cannot rely on the
    module's own forward; ``"forward"`` calls ``self(x)``; ``"manual"`` is manual optimization (the step runs
    inside ``training_step``, inside the pass the fallback records)."""

    def __init__(self, how: str = "net") -> None:
        super().__init__()
        self.net = amplifying_model()
        self.how = how
        self.automatic_optimization = how != "manual"
        self.losses: list[float] = []
        self.skipped: list[bool] = []
        self.amplify_dtypes: list[torch.dtype] = []
        self.net.amplify.register_forward_hook(lambda m, a, out: self.amplify_dtypes.append(out.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss((self(x) if self.how == "forward" else self.net(x)).float(), y)
        self.losses.append(loss.item())
        if self.how == "manual":
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.net.parameters(), lr=1e-2)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        scaler = self.trainer.precision_plugin.scaler
        self.skipped.append(scaler.step_was_skipped(self.optimizers().optimizer))


class KeptAtStart(L.Callback):
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.kept = trainer.precision_plugin.watch.kept_in_float32


def _amplify_loader() -> torch.utils.data.DataLoader:
    data = [amplify_batch(i, size=16) for i in range(FALLBACK_STEPS + 4)]
    return torch.utils.data.DataLoader(data, batch_size=None)


def _fallback_trainer(max_steps: int, plugin: DLSPrecision, callbacks: list[Any] | None = None) -> Any:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[plugin],
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


@pytest.mark.filterwarnings("ignore:dls fallback:UserWarning")
@pytest.mark.parametrize("how", ["net", "forward", "manual"])
def test_fallback_keeps_the_amplifying_layer_of_the_lightning_module_and_resumes_with_it(
    tmp_path: Path, how: str
) -> None:
    plugin = DLSPrecision("16-mixed", "cpu", fallback=True)
    assert plugin.watch is None  # the Trainer has not set the model up yet
    model = Amplifying(how)
    trainer = _fallback_trainer(FALLBACK_STEPS, plugin)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, _amplify_loader())

    assert plugin.watch is not None and plugin.watch.kept_in_float32 == ("net.amplify",)
    # The overflow seen, then the armed training step that found where it was born; then it trains.
    assert model.skipped == [True, True] + [False] * (FALLBACK_STEPS - 2)
    assert [math.isfinite(v) for v in model.losses] == [False, False] + [True] * (FALLBACK_STEPS - 2)
    assert model.amplify_dtypes[:2] == [torch.float16] * 2 and set(model.amplify_dtypes[2:]) == {torch.float32}
    assert eval_loss(model.net) < eval_loss(amplifying_model())  # it trains on
    assert plugin.scaler.get_num_skipped_steps() == 2

    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    assert checkpoint["DLSPrecision"]["kept_in_float32"] == ["net.amplify"]

    resumed_plugin, probe = DLSPrecision("16-mixed", "cpu", fallback=True), KeptAtStart()
    resumed_model = Amplifying(how)
    resumed = _fallback_trainer(FALLBACK_STEPS + 3, resumed_plugin, [probe])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed.fit(resumed_model, _amplify_loader(), ckpt_path=path)
    assert probe.kept == ("net.amplify",)  # kept from the first resumed step
    assert resumed_model.skipped == [False] * 3 and all(math.isfinite(v) for v in resumed_model.losses)
    assert set(resumed_model.amplify_dtypes) == {torch.float32}


def test_fallback_argument() -> None:
    with pytest.raises(ValueError, match="fallback must be True or False"):
        DLSPrecision("16-mixed", "cpu", fallback=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fallback=True needs loss scaling"):
        DLSPrecision("bf16-mixed", "cpu", fallback=True)
    enabled = dls.GradScaler(device="cpu")
    assert DLSPrecision("bf16-mixed", "cpu", scaler=enabled, fallback=True).fallback

    # The Trainer connects the model at every fit/validate: the same model keeps its watch (and kept modules).
    plugin = DLSPrecision("16-mixed", "cpu", fallback=True)
    first, second = Amplifying(), Amplifying()
    plugin.connect(first, [], [])
    watch = plugin.watch
    assert watch is not None and watch.model is first and watch.active
    plugin.connect(first, [], [])
    assert plugin.watch is watch
    plugin.connect(second, [], [])  # another model: the first computes as before the watch again
    assert plugin.watch is not None and plugin.watch.model is second and not watch.active


class WrappedInDDP(L.Callback):
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.model = trainer.strategy.model


@pytest.mark.filterwarnings("ignore:dls fallback:UserWarning")
def test_fallback_under_ddp_watches_the_lightning_module_inside_the_wrapper() -> None:
    # One process of strategy="ddp": Lightning wraps the LightningModule in DistributedDataParallel (gloo), and
    # the fallback agrees across ranks at each skipped step. Lightning leaves its process group and environment
    # variables behind: both are put back as they were.
    environ = dict(os.environ)
    plugin, probe = DLSPrecision("16-mixed", "cpu", fallback=True), WrappedInDDP()
    model = Amplifying()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="ddp",
        plugins=[plugin],
        max_steps=FALLBACK_STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe],
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, _amplify_loader())
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
    assert isinstance(probe.model, torch.nn.parallel.DistributedDataParallel) and probe.model.module is model
    assert plugin.watch is not None and plugin.watch.model is model
    assert plugin.watch.kept_in_float32 == ("net.amplify",)
    assert model.skipped == [True, True] + [False] * (FALLBACK_STEPS - 2)
