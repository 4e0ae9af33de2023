"""``use_dls`` on a real ``accelerate.Accelerator`` on CPU: float16 autocast, fused AdamW skipping overflows,
Accelerate's own ``step_was_skipped`` and prepared scheduler, EMA, ``save_state``/``load_state``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import dls
from _amplify import amplifying_model, eval_loss
from _amplify import batch as amplify_batch
from conftest import load_example
from dls.skip import skip_aware

pytest.importorskip("accelerate")
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import GradScalerKwargs

from dls.integrations.accelerate import DLSAcceleratedOptimizer, use_dls

ACCUMULATE = 2
OPT_STEPS = 6
OVERFLOW_STEPS = {0, 3}  # optimizer steps (0-based) whose last micro-batch gets an inf gradient; 0: the first step


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def _setup() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, list[torch.dtype]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    dtypes: list[torch.dtype] = []
    model[0].register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + s))
    return model, optimizer, scheduler, dtypes


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, 8, generator=gen)
    return [(xi, xi.sum(1, keepdim=True) * 0.1) for xi in x]


def test_fp16_loop_skips_overflows_with_fused_adamw_and_checkpoints(tmp_path: Path) -> None:
    accelerator = Accelerator(mixed_precision="fp16", cpu=True, gradient_accumulation_steps=ACCUMULATE)
    assert accelerator.scaler is None  # Accelerate alone: no scaler, no autocast on CPU
    scaler = use_dls(accelerator)
    assert accelerator.scaler is scaler and isinstance(scaler, dls.GradScaler)
    model, optimizer, scheduler, dtypes = _setup()
    ema = skip_aware(AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5)), scaler, optimizer=optimizer)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    assert isinstance(optimizer, DLSAcceleratedOptimizer)

    seen = []
    for i, (x, y) in enumerate(_batches(OPT_STEPS * ACCUMULATE)):
        opt_step, micro = divmod(i, ACCUMULATE)
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            if opt_step in OVERFLOW_STEPS and micro == ACCUMULATE - 1:
                model[0].weight.grad[0, 0] = float("inf")
            before = [p.detach().clone() for p in model.parameters()]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            ema.update_parameters(model)
            seen.append(
                (
                    optimizer.step_was_skipped,
                    accelerator.optimizer_step_was_skipped,
                    scaler.step_was_skipped(optimizer.optimizer),
                    all(torch.equal(a, b) for a, b in zip(before, model.parameters())),
                )
            )

    assert set(dtypes) == {torch.float16}  # really float16 on CPU
    expected = [i in OVERFLOW_STEPS for i in range(OPT_STEPS)]
    assert [s[0] for s in seen] == expected  # Accelerate's notion, right with the fused kernel
    assert [s[1] for s in seen] == expected
    assert [s[2] for s in seen] == expected
    assert [s[3] for s in seen] == expected  # parameters bit-identical across skipped steps
    real = OPT_STEPS - len(OVERFLOW_STEPS)
    assert scheduler.scheduler.last_epoch == real  # Accelerate's prepared scheduler follows real updates
    assert int(ema.n_averaged) == real
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert scaler.get_num_skipped_steps() == len(OVERFLOW_STEPS)

    accelerator.save_state(str(tmp_path))
    saved = torch.load(tmp_path / "scaler.pt", weights_only=True)
    assert saved == scaler.state_dict()

    # Resume in a new Accelerator; this time dls comes in after prepare(), which it must convert too.
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    model, optimizer, scheduler, dtypes = _setup()
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    resumed = use_dls(accelerator)
    accelerator.load_state(str(tmp_path))
    assert resumed.state_dict() == saved
    assert scheduler.scheduler.last_epoch == real
    x, y = _batches(1)[0]
    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
    model[0].weight.grad[0, 0] = float("nan")
    optimizer.step()
    scheduler.step()
    assert dtypes == [torch.float16]
    assert optimizer.step_was_skipped and scheduler.scheduler.last_epoch == real
    assert resumed.get_scale() == saved["loss_scale"] / 2


def test_use_dls_arguments() -> None:
    with pytest.raises(ValueError, match=r"must be an accelerate\.Accelerator"):
        use_dls(object())  # type: ignore[arg-type]
    plain = Accelerator(cpu=True)
    with pytest.raises(ValueError, match="mixed_precision='fp16'"):
        use_dls(plain)
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(
        mixed_precision="fp16", cpu=True, kwargs_handlers=[GradScalerKwargs(init_scale=1024.0, growth_interval=7)]
    )
    with pytest.raises(ValueError, match=r"scaler must be a dls\.GradScaler"):
        use_dls(accelerator, scaler=torch.amp.GradScaler("cpu"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not both"):
        use_dls(accelerator, scaler=dls.GradScaler(device="cpu"), init_scale=2.0)
    assert accelerator.scaler is None and not accelerator.native_amp  # errors changed nothing
    scaler = use_dls(accelerator, growth_interval=3)
    assert scaler.get_scale() == 1024.0  # from the Accelerator's GradScalerKwargs
    assert scaler.get_growth_interval() == 3  # scaler_kwargs win over it
    with pytest.raises(ValueError, match="already called"):
        use_dls(accelerator)


def test_example_runs_and_its_schedule_and_ema_skip_with_the_steps() -> None:
    result = load_example("accelerate_fp16.py").main(steps=20)
    assert result["steps"] == 20 and result["skipped"] > 0  # the example starts at a scale that overflows
    assert result["scheduler_steps"] == result["ema_updates"] == 20 - result["skipped"]


# ----------------------------------------------------------------------------- the float32 fallback
FALLBACK_STEPS = 6


def _amplifying() -> tuple[torch.nn.Module, torch.optim.Optimizer, list[torch.dtype]]:
    model = amplifying_model()
    dtypes: list[torch.dtype] = []
    model.amplify.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2, fused=True), dtypes


def _run(accelerator: Accelerator, model: Any, optimizer: Any, steps: range) -> tuple[list[bool], list[float]]:
    skipped, losses = [], []
    for step in steps:
        x, y = amplify_batch(step, size=16)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        skipped.append(optimizer.step_was_skipped)
        losses.append(loss.item())
    return skipped, losses


@pytest.mark.filterwarnings("ignore:dls fallback:UserWarning")
def test_fallback_keeps_the_amplifying_layer_of_the_prepared_model_and_resumes_with_it(tmp_path: Path) -> None:
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    scaler = use_dls(accelerator, fallback=True)  # before prepare: the model is watched when prepared
    model, optimizer, dtypes = _amplifying()
    model, optimizer = accelerator.prepare(model, optimizer)
    skipped, losses = _run(accelerator, model, optimizer, range(FALLBACK_STEPS))

    # The overflow seen, then the armed pass that found where it was born; then it trains (fused Adam).
    assert skipped == [True, True] + [False] * (FALLBACK_STEPS - 2)
    assert [math.isfinite(v) for v in losses] == [False, False] + [True] * (FALLBACK_STEPS - 2)
    assert eval_loss(accelerator.unwrap_model(model)) < eval_loss(amplifying_model())  # it trains on
    assert dtypes[:2] == [torch.float16] * 2 and set(dtypes[2:]) == {torch.float32}
    assert scaler.state_dict()["kept_in_float32"] == ["amplify"]
    accelerator.save_state(str(tmp_path))
    saved = torch.load(tmp_path / "scaler.pt", weights_only=True)
    assert saved["kept_in_float32"] == ["amplify"]

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    model, optimizer, dtypes = _amplifying()
    model, optimizer = accelerator.prepare(model, optimizer)
    resumed = use_dls(accelerator, fallback=True)  # after prepare: the prepared model is watched at once
    accelerator.load_state(str(tmp_path))
    assert resumed.state_dict() == saved
    skipped, losses = _run(accelerator, model, optimizer, range(FALLBACK_STEPS, FALLBACK_STEPS + 3))
    assert skipped == [False] * 3 and all(math.isfinite(v) for v in losses)
    assert set(dtypes) == {torch.float32}


def test_fallback_argument_and_one_model() -> None:
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    with pytest.raises(ValueError, match="fallback must be True or False"):
        use_dls(accelerator, fallback="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fallback=True needs an enabled scaler"):
        use_dls(accelerator, scaler=dls.GradScaler(device="cpu", enabled=False), fallback=True)
    assert accelerator.scaler is None  # errors changed nothing
    first, second, evaluated = (torch.nn.Linear(2, 2) for _ in range(3))
    scaler = use_dls(accelerator, fallback=True)
    accelerator.prepare(first)
    accelerator.prepare(first)  # the same model again
    accelerator.prepare_model(evaluated, evaluation_mode=True)  # not trained: not watched, not counted
    assert scaler.state_dict()["kept_in_float32"] == []
    with pytest.raises(ValueError, match=r"keeps modules of one model.*second one \(Linear, after Linear\)"):
        accelerator.prepare(second)
    assert second not in accelerator._models  # refused before Accelerate took it


def test_two_prepared_models_refuse_the_fallback() -> None:
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    accelerator.prepare(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="keeps modules of one model"):
        use_dls(accelerator, fallback=True)
    assert accelerator.scaler is None and not accelerator.native_amp
