"""Hugging Face Trainer: ``fp16=True`` with dls's loss scaling, on CPU or GPU (``use_dls``).

Run: ``python examples/hf_trainer_fp16.py`` (``pip install 'dls[hf]'``). A 2-layer GPT-2 built from a config (no
download) learns sequences that count up modulo the vocabulary, with the Trainer's default fused AdamW and linear
LR schedule. The scale starts at 2**32 on purpose: the first steps overflow and are skipped while it backs off,
and the LR schedule waits for them (with Accelerate's own check it would not: the fused kernel skips inside
``step()``).
"""

from __future__ import annotations

import logging
import tempfile
from typing import Any

import torch

# Importing transformers' Trainer imports torchao where it is installed (dls's dev extra); torchao then logs that its
# CUDA kernels cannot load on this machine, and torch a deprecation inside torchao: nothing a user can act on.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from dls.integrations.transformers import use_dls  # noqa: E402


def main(steps: int = 60, output_dir: str | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    # bos/eos inside the 64-token vocabulary (GPT-2's default 50256 is not, and transformers warns about it)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    starts = torch.randint(0, 64, (512, 1))
    sequences = (starts + torch.arange(32)) % 64
    data = [{"input_ids": s, "labels": s} for s in sequences]
    args = TrainingArguments(
        output_dir=output_dir or tempfile.mkdtemp(),
        fp16=True,  # on CPU, without use_dls, the Trainer would silently train in float32
        use_cpu=not torch.cuda.is_available(),
        max_steps=steps,
        per_device_train_batch_size=16,
        learning_rate=3e-3,
        save_strategy="no",
        logging_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    scaler = use_dls(trainer, init_scale=2.0**32)  # after building the Trainer, before train()
    output = trainer.train()

    result = {
        "loss": output.training_loss,
        "steps": trainer.state.global_step,
        "skipped": scaler.get_num_skipped_steps(),
        "scheduler_steps": trainer.lr_scheduler.last_epoch,
        "scale": scaler.get_scale(),
    }
    print(
        f"{result['steps']} optimizer steps, {result['skipped']} skipped (overflow); LR schedule advanced "
        f"{result['scheduler_steps']} times; loss scale now {result['scale']:g}; mean training loss "
        f"{result['loss']:.4g}"
    )
    return result


if __name__ == "__main__":
    main()
