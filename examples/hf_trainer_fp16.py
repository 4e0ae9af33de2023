"""Hugging Face Trainer: ``fp16=True`` with dls's loss scaling, on CPU or GPU (``use_dls``).

Run: ``python examples/hf_trainer_fp16.py`` (``pip install 'dls[hf]'``). A 2-layer GPT-2 built from a config (no
download) learns sequences that count up modulo the vocabulary, with the Trainer's default fused AdamW and linear
LR schedule. The scale starts at 2**32 on purpose: the first steps overflow and are skipped while it backs off,
and the LR schedule waits for them (with Accelerate's own check it would not: the fused kernel skips inside
``step()``).
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from dls.integrations.transformers import use_dls


def main(steps: int = 60, output_dir: str | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
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
