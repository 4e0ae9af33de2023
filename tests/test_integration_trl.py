"""TRL's ``SFTTrainer`` and ``GRPOTrainer`` (without vLLM) in real float16 with ``use_dls(trainer)``: a tiny GPT-2
built from a config and a word-level tokenizer made here (no download), on the device of the suite (CPU by
default). Started far too high (2**40), the first steps overflow in float16 and are skipped; the LR schedule
counts only applied steps, with Accelerate's fused AdamW (whose own skip flag stays False on such steps) and
with the unfused one. The control: TRL's ``fp16=True`` alone computes in float32 on CPU.

Entry points for other devices: ``sft_run(device, ...)`` and ``grpo_run(device, ...)``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the Hub: the model is built from a config
pytest.importorskip("trl", reason="needs the trl extra: pip install 'dls[trl]'")
from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, TrainerCallback

from dls.integrations.transformers import use_dls

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

WORDS = [f"w{i}" for i in range(60)]


def tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<pad>", "<eos>", "<unk>"]
    vocab = {t: i for i, t in enumerate([*specials, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def gpt2(tok: PreTrainedTokenizerFast) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


class Record(TrainerCallback):
    """Per optimizer step: whether the scaler skipped it, the scheduler's count, the dtype of a forward."""

    def __init__(self) -> None:
        self.skipped: list[bool] = []
        self.last_epoch = 0
        self.dtypes: set[str] = set()
        self.trainer: Any = None

    def watch(self, trainer: Any) -> None:
        self.trainer = trainer
        trainer.model.transformer.h[0].attn.register_forward_hook(lambda m, a, out: self.dtypes.add(str(out[0].dtype)))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.skipped.append(bool(self.trainer.accelerator.optimizer_step_was_skipped))
        self.last_epoch = kwargs["lr_scheduler"].last_epoch


def _common(device: torch.device, out: Path, optim: str, steps: int) -> dict[str, Any]:
    return {
        "output_dir": str(out), "fp16": True, "use_cpu": device.type == "cpu", "max_steps": steps,
        "learning_rate": 1e-3, "optim": optim, "report_to": [], "save_strategy": "no", "logging_steps": 1000,
        "lr_scheduler_type": "linear", "disable_tqdm": True,
    }  # fmt: skip


def sft_run(device: torch.device, out: Path, optim: str, dls: bool = True, steps: int = 12) -> tuple[Record, Any]:
    from trl import SFTConfig, SFTTrainer

    tok = tokenizer()
    texts = [" ".join(WORDS[(i + k) % 60] for k in range(24)) for i in range(64)]
    args = SFTConfig(**_common(device, out, optim, steps), per_device_train_batch_size=4, max_length=32)
    trainer = SFTTrainer(model=gpt2(tok), args=args, train_dataset=Dataset.from_dict({"text": texts}),
                         processing_class=tok)  # fmt: skip
    record = Record()
    trainer.add_callback(record)
    record.watch(trainer)
    scaler = use_dls(trainer, init_scale=2.0**40, backoff_factor=2.0**-8, growth_interval=1000) if dls else None
    trainer.train()
    return record, scaler


def grpo_run(device: torch.device, out: Path, optim: str, steps: int = 8) -> tuple[Record, Any]:
    from trl import GRPOConfig, GRPOTrainer

    tok = tokenizer()
    prompts = [" ".join(WORDS[(i + k) % 60] for k in range(6)) for i in range(32)]

    def reward(completions: list[str], **kwargs: Any) -> list[float]:
        return [float(c.count("w1")) + 0.01 * len(c) for c in completions]

    args = GRPOConfig(
        **_common(device, out, optim, steps), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, use_vllm=False,
    )  # fmt: skip
    trainer = GRPOTrainer(model=gpt2(tok), reward_funcs=reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok)  # fmt: skip
    record = Record()
    trainer.add_callback(record)
    record.watch(trainer)
    scaler = use_dls(trainer, init_scale=2.0**40, backoff_factor=2.0**-8, growth_interval=1000)
    trainer.train()
    return record, scaler


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
def test_sft_trains_in_float16_and_the_schedule_counts_applied_steps(
    device: torch.device, tmp_path: Path, optim: str
) -> None:
    record, scaler = sft_run(device, tmp_path, optim)
    assert record.dtypes == {"torch.float16"}
    skipped = scaler.get_num_skipped_steps()
    assert 0 < skipped < len(record.skipped)  # 2**40 overflows in float16, the scale backs off, then it trains
    assert sum(record.skipped) == skipped  # Accelerate's flag, right for the fused AdamW too
    assert record.last_epoch == len(record.skipped) - skipped
    assert scaler.get_scale() < 2.0**40


def test_grpo_trains_in_float16_without_vllm(device: torch.device, tmp_path: Path) -> None:
    record, scaler = grpo_run(device, tmp_path, "adamw_torch_fused")
    assert record.dtypes == {"torch.float16"}
    skipped = scaler.get_num_skipped_steps()
    assert 0 < skipped < len(record.skipped)
    assert sum(record.skipped) == skipped
    assert record.last_epoch == len(record.skipped) - skipped


def test_trl_fp16_alone_computes_in_float32_on_cpu(tmp_path: Path) -> None:
    """The control the frameworks page states: on CPU, Accelerate drops fp16 without a word."""
    record, _ = sft_run(torch.device("cpu"), tmp_path, "adamw_torch_fused", dls=False, steps=2)
    assert record.dtypes == {"torch.float32"}
