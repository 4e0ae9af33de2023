"""``use_dls`` on a real Hugging Face ``Trainer`` (tiny config-built GPT-2, CPU, its default fused AdamW): float16
autocast, skipped steps, the Trainer's LR schedule, EMA, checkpoints and resume."""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from _amplify import amplifying_model, eval_loss
from _amplify import batch as amplify_batch
from conftest import load_example

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the Hub: the model is built from a config
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from dls.integrations.transformers import use_dls
from dls.skip import skip_aware

ACCUMULATE = 2
OPT_STEPS = 6
OVERFLOW_STEPS = {2, 4}  # Trainer global steps whose accumulated gradients get an inf


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


class OverflowingTrainer(Trainer):
    """Puts an inf into the gradients after backward (before clipping and the step) at ``OVERFLOW_STEPS``."""

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.state.global_step in OVERFLOW_STEPS:
            model.transformer.wte.weight.grad[0, 0] = float("inf")
        return loss


class Recorder(TrainerCallback):
    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.ema: Any = None
        self.snapshot: list[torch.Tensor] = []
        self.seen: list[tuple[bool, bool, bool]] = []
        self.state_at_begin: dict[str, Any] | None = None
        self.last_epoch_at_begin: int | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        assert self.trainer is not None
        self.state_at_begin = self.trainer.accelerator.scaler.state_dict()
        self.last_epoch_at_begin = kwargs["lr_scheduler"].last_epoch
        average = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
        # kwargs["optimizer"] is Accelerate's wrapper; skip_aware follows .optimizer to the fused AdamW.
        self.ema = skip_aware(average, self.trainer.accelerator.scaler, optimizer=kwargs["optimizer"])

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.snapshot = [p.detach().clone() for p in model.parameters()]

    def on_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        assert self.trainer is not None
        inner = kwargs["optimizer"].optimizer
        self.seen.append(
            (
                self.trainer.accelerator.optimizer_step_was_skipped,
                self.trainer.accelerator.scaler.step_was_skipped(inner),
                all(torch.equal(a, b) for a, b in zip(self.snapshot, model.parameters())),
            )
        )
        self.ema.update_parameters(model)


def _trainer(out: Path, max_steps: int, recorder: Recorder) -> Trainer:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (64, 16), generator=gen)
    data = [{"input_ids": t, "labels": t} for t in tokens]
    args = TrainingArguments(
        output_dir=str(out),
        fp16=True,
        use_cpu=True,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=ACCUMULATE,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        save_strategy="steps",
        save_steps=OPT_STEPS,
        report_to=[],
        disable_tqdm=True,
        logging_strategy="no",
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = OverflowingTrainer(model=model, args=args, train_dataset=data, callbacks=[recorder])
    recorder.trainer = trainer
    return trainer


def test_trainer_fp16_skips_overflows_keeps_schedule_and_resumes(tmp_path: Path) -> None:
    recorder = Recorder()
    trainer = _trainer(tmp_path, OPT_STEPS, recorder)
    dtypes: list[torch.dtype] = []
    trainer.model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    scaler = use_dls(trainer)
    trainer.train()

    assert trainer.optimizer.optimizer.defaults["fused"]  # the Trainer's default: fused AdamW
    assert set(dtypes) == {torch.float16}  # really float16 on CPU
    expected = [i in OVERFLOW_STEPS for i in range(OPT_STEPS)]
    assert [s[0] for s in recorder.seen] == expected  # the Trainer's (Accelerate's) notion
    assert [s[1] for s in recorder.seen] == expected
    assert [s[2] for s in recorder.seen] == expected  # parameters bit-identical across skipped steps
    real = OPT_STEPS - len(OVERFLOW_STEPS)
    assert trainer.lr_scheduler.last_epoch == real
    assert int(recorder.ema.n_averaged) == real
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert trainer.state.global_step == OPT_STEPS  # the Trainer still counts attempts; the schedule does not

    checkpoint = tmp_path / f"checkpoint-{OPT_STEPS}"
    saved = torch.load(checkpoint / "scaler.pt", weights_only=True)
    assert saved == scaler.state_dict() and saved["num_skipped_steps"] == len(OVERFLOW_STEPS)

    AcceleratorState._reset_state(reset_partial_state=True)
    resumed_recorder = Recorder()
    resumed = _trainer(tmp_path, OPT_STEPS + 1, resumed_recorder)
    use_dls(resumed)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed_recorder.state_at_begin == saved
    assert resumed_recorder.last_epoch_at_begin == real
    assert resumed.lr_scheduler.last_epoch == real + 1


def test_use_dls_needs_fp16(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"must be a transformers\.Trainer"):
        use_dls(object())  # type: ignore[arg-type]
    model = GPT2LMHeadModel(GPT2Config(vocab_size=8, n_positions=4, n_embd=8, n_layer=1, n_head=1))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="fp16=True"):
        use_dls(Trainer(model=model, args=args))


def test_example_runs_and_its_schedule_skips_with_the_steps(tmp_path: Path) -> None:
    result = load_example("hf_trainer_fp16.py").main(steps=12, output_dir=str(tmp_path))
    assert result["steps"] == 12 and result["skipped"] > 0  # the example starts at a scale that overflows
    assert result["scheduler_steps"] == 12 - result["skipped"]


# ----------------------------------------------------------------------------- the float32 fallback
FALLBACK_STEPS = 6


class Amplifying(torch.nn.Module):
    """``_amplify``'s model (float16 overflows in ``net.amplify``) with the Trainer's calling convention."""

    def __init__(self) -> None:
        super().__init__()
        self.net = amplifying_model()
        self.losses: list[float] = []
        self.amplify_dtypes: list[torch.dtype] = []
        self.net.amplify.register_forward_hook(lambda m, a, out: self.amplify_dtypes.append(out.dtype))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        loss = torch.nn.functional.mse_loss(self.net(x).float(), labels)
        self.losses.append(loss.item())
        return {"loss": loss}


class Skips(TrainerCallback):
    def __init__(self, trainer_of: list[Trainer]) -> None:
        self.trainer_of = trainer_of
        self.skipped: list[bool] = []

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.skipped.append(self.trainer_of[0].accelerator.optimizer_step_was_skipped)


def _fallback_trainer(out: Path, max_steps: int) -> tuple[Trainer, Skips]:
    trainers: list[Trainer] = []
    skips = Skips(trainers)
    data = []
    for step in range(FALLBACK_STEPS + 3):
        x, y = amplify_batch(step, size=16)
        data.extend({"x": xi, "labels": yi} for xi, yi in zip(x, y))
    args = TrainingArguments(
        output_dir=str(out),
        fp16=True,
        use_cpu=True,
        max_steps=max_steps,
        per_device_train_batch_size=16,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        save_strategy="steps",
        save_steps=FALLBACK_STEPS,
        report_to=[],
        disable_tqdm=True,
        logging_strategy="no",
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(model=Amplifying(), args=args, train_dataset=data, callbacks=[skips])
    trainers.append(trainer)
    return trainer, skips


@pytest.mark.filterwarnings("ignore:dls fallback:UserWarning")
def test_fallback_keeps_the_amplifying_layer_of_the_trainers_model_and_resumes_with_it(tmp_path: Path) -> None:
    trainer, skips = _fallback_trainer(tmp_path, FALLBACK_STEPS)
    scaler = use_dls(trainer, fallback=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    model = trainer.model
    assert isinstance(model, Amplifying)
    added = [str(w.message) for w in caught if "now runs in float32" in str(w.message)]
    assert len(added) == 1 and "'net.amplify'" in added[0]
    # The overflow seen, then the armed pass that found where it was born; then it trains (fused AdamW).
    assert skips.skipped == [True, True] + [False] * (FALLBACK_STEPS - 2)
    assert [math.isfinite(v) for v in model.losses] == [False, False] + [True] * (FALLBACK_STEPS - 2)
    assert eval_loss(model.net) < eval_loss(amplifying_model())  # it trains on
    assert model.amplify_dtypes[:2] == [torch.float16] * 2 and set(model.amplify_dtypes[2:]) == {torch.float32}
    assert scaler.state_dict()["kept_in_float32"] == ["net.amplify"]
    checkpoint = tmp_path / f"checkpoint-{FALLBACK_STEPS}"
    assert torch.load(checkpoint / "scaler.pt", weights_only=True)["kept_in_float32"] == ["net.amplify"]

    AcceleratorState._reset_state(reset_partial_state=True)
    resumed, resumed_skips = _fallback_trainer(tmp_path, FALLBACK_STEPS + 3)
    use_dls(resumed, fallback=True)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed_skips.skipped == [False] * 3
    assert all(math.isfinite(v) for v in resumed.model.losses)
    assert set(resumed.model.amplify_dtypes) == {torch.float32}
