"""The small-gradient task of ``dls demo`` in Lightning, Accelerate and the Hugging Face Trainer, fp16 on CPU.

Task (as ``dls demo``): a 3-layer tanh MLP (32 -> 128 -> 128 -> 128 -> 64) learns the embedded teacher regression
(4096 samples), batch 128, fused AdamW (lr 1e-3, no weight decay, constant LR), the loss multiplied by 1e-4: the
gradients are 1e4 times smaller, and in float16 most activation gradients fall below its smallest subnormal
unless the loss is scaled. Same initial weights for every run of a framework; one thread (the matrices are tiny).

Runs per framework:

* ``float32``;
* ``"fp16", no dls``: what the framework does with its own fp16 switch on CPU (Lightning ``precision="16-mixed"``,
  Accelerate ``mixed_precision="fp16"``, the Trainer's ``fp16=True``);
* ``float16, no loss scaling``: the dls integration with a disabled scaler (float16 autocast, scale 1);
* ``float16 + torch.amp.GradScaler`` (Lightning only: its own ``MixedPrecision`` plugin given explicitly);
* ``float16 + dls``: the dls integration with its default scaler;
* ``float16 + dls, from 2^40, growth every 100``: the scale rule of ``dls demo``'s DLS run, which starts far too
  high so that the first steps overflow and are skipped, and probes upwards every 100 steps.

Columns: ``computes in`` is the dtype of the first layer's output, recorded by a forward hook (what the run really
computes in); ``loss`` the unweighted MSE over all 4096 samples in float32 after training; ``vs fp32`` its ratio
to the framework's float32 run; ``skipped`` the optimizer steps the fused AdamW did not apply (attempted steps
minus its own step count); ``scale`` the loss scale at the end.

    python benchmarks/frameworks_fp16.py              # 600 steps per run, about a minute and a half
    python benchmarks/frameworks_fp16.py --steps 200
    python benchmarks/frameworks_fp16.py --smoke      # 3 steps per run: every run starts and ends, nothing to read
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

import dls
from dls.train.data import MLP, TeacherRegression

os.environ.setdefault("HF_HUB_OFFLINE", "1")
LOSS_WEIGHT = 1e-4
# The "fp16 + DLS" run of dls demo: start far too high, back off on overflow, probe upwards every 100 steps.
DEMO_SCALER = {"init_scale": 2.0**40, "growth_interval": 100}
BATCH = 128
LR = 1e-3
DATA = SimpleNamespace(num_samples=4096, input_dim=32, output_dim=64, noise_std=0.0, dataset_seed=1234)
MODEL = SimpleNamespace(depth=3, hidden_size=128, activation_fn="tanh", dropout=0.0)


@dataclass
class Result:
    framework: str
    run: str
    dtype: str
    loss: float
    skipped: int
    scale: float | None
    seconds: float


class Probe:
    """The dtype the first layer computes in, and how many steps the fused AdamW applied."""

    def __init__(self, model: MLP) -> None:
        self.dtypes: set[torch.dtype] = set()
        model.net[0].register_forward_hook(lambda module, args, out: self.dtypes.add(out.dtype))

    def dtype(self) -> str:
        return ", ".join(sorted(str(d).removeprefix("torch.") for d in self.dtypes))


def _data() -> TeacherRegression:
    return TeacherRegression(DATA)  # type: ignore[arg-type]


def _model(data: TeacherRegression) -> MLP:
    torch.manual_seed(0)
    return MLP(MODEL, data.info)  # type: ignore[arg-type]


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)


def _applied(optimizer: torch.optim.Optimizer) -> int:
    first = optimizer.param_groups[0]["params"][0]
    return int(optimizer.state[first]["step"]) if first in optimizer.state else 0


def _final_loss(model: MLP, data: TeacherRegression) -> float:
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model.net.float()(data.x), data.y))


def _loader(data: TeacherRegression) -> torch.utils.data.DataLoader:
    dataset = torch.utils.data.TensorDataset(data.x, data.y)
    generator = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True, generator=generator, drop_last=True)


# ---------------------------------------------------------------------------------------------------- Lightning
def lightning_runs() -> dict[str, Callable[[int], Result]]:
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    from dls.integrations.lightning import DLSPrecision

    class Module(L.LightningModule):
        def __init__(self, model: MLP) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model.loss(batch) * LOSS_WEIGHT

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return _optimizer(self.model)

    def run(name: str, precision: str | None = None, plugin: Any = None) -> Callable[[int], Result]:
        def go(steps: int) -> Result:
            data, start = _data(), time.perf_counter()
            model = _model(data)
            probe = Probe(model)
            plugin_now = plugin() if plugin is not None else None
            trainer = L.Trainer(
                accelerator="cpu",
                devices=1,
                max_steps=steps,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                **({"plugins": [plugin_now]} if plugin_now is not None else {"precision": precision}),
            )
            trainer.fit(Module(model), _loader(data))
            scaler = getattr(plugin_now, "scaler", None)
            scale = scaler.get_scale() if scaler is not None and scaler.is_enabled() else None
            skipped = steps - _applied(trainer.optimizers[0])
            seconds = time.perf_counter() - start
            return Result("Lightning", name, probe.dtype(), _final_loss(model, data), skipped, scale, seconds)

        return go

    return {
        "float32": run("float32", precision="32-true"),
        '"fp16", no dls': run('precision="16-mixed"', precision="16-mixed"),
        "float16, no loss scaling": run(
            "float16, no loss scaling",
            plugin=lambda: DLSPrecision("16-mixed", "cpu", scaler=dls.GradScaler(device="cpu", enabled=False)),
        ),
        "float16 + torch.amp.GradScaler": run(
            "float16 + torch.amp.GradScaler", plugin=lambda: MixedPrecision("16-mixed", "cpu")
        ),
        "float16 + dls": run("float16 + dls (DLSPrecision)", plugin=lambda: DLSPrecision("16-mixed", "cpu")),
        "float16 + dls, demo's scale rule": run(
            "float16 + dls, from 2^40, growth every 100",
            plugin=lambda: DLSPrecision("16-mixed", "cpu", scaler=dls.GradScaler(device="cpu", **DEMO_SCALER)),
        ),
    }


# ---------------------------------------------------------------------------------------------------- Accelerate
def accelerate_runs() -> dict[str, Callable[[int], Result]]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import set_seed

    from dls.integrations.accelerate import use_dls

    def run(name: str, mixed_precision: str, dls_kwargs: dict[str, Any] | None) -> Callable[[int], Result]:
        def go(steps: int) -> Result:
            AcceleratorState._reset_state(reset_partial_state=True)  # each run its own Accelerator
            set_seed(0)
            data, start = _data(), time.perf_counter()
            accelerator = Accelerator(mixed_precision=mixed_precision, cpu=True)
            scaler = use_dls(accelerator, **dls_kwargs) if dls_kwargs is not None else None
            model = _model(data)
            probe = Probe(model)
            prepared, optimizer, loader = accelerator.prepare(model, _optimizer(model), _loader(data))
            done = 0
            while done < steps:
                for x, y in loader:
                    loss = prepared.loss((x, y)) * LOSS_WEIGHT
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                    done += 1
                    if done == steps:
                        break
            scale = scaler.get_scale() if scaler is not None and scaler.is_enabled() else None
            skipped = steps - _applied(optimizer.optimizer)
            trained = accelerator.unwrap_model(prepared, keep_fp32_wrapper=False)
            seconds = time.perf_counter() - start
            return Result("Accelerate", name, probe.dtype(), _final_loss(trained, data), skipped, scale, seconds)

        return go

    return {
        "float32": run("float32", "no", None),
        '"fp16", no dls': run('mixed_precision="fp16"', "fp16", None),
        "float16, no loss scaling": run("float16, no loss scaling", "fp16", {"enabled": False}),
        "float16 + dls": run("float16 + dls (use_dls)", "fp16", {}),
        "float16 + dls, demo's scale rule": run("float16 + dls, from 2^40, growth every 100", "fp16", DEMO_SCALER),
    }


# ---------------------------------------------------------------------------------------------------- HF Trainer
def trainer_runs() -> dict[str, Callable[[int], Result]]:
    from accelerate.state import AcceleratorState
    from transformers import PrinterCallback, Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    from dls.integrations.transformers import use_dls

    hf_logging.set_verbosity_error()

    class WithLoss(torch.nn.Module):
        def __init__(self, model: MLP) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": self.model.loss((x, y)) * LOSS_WEIGHT}

    def run(name: str, fp16: bool, dls_kwargs: dict[str, Any] | None) -> Callable[[int], Result]:
        def go(steps: int) -> Result:
            AcceleratorState._reset_state(reset_partial_state=True)
            data, start = _data(), time.perf_counter()
            model = _model(data)
            probe = Probe(model)
            with tempfile.TemporaryDirectory() as out:
                args = TrainingArguments(
                    output_dir=out,
                    fp16=fp16,
                    use_cpu=True,
                    max_steps=steps,
                    per_device_train_batch_size=BATCH,
                    learning_rate=LR,
                    lr_scheduler_type="constant",
                    save_strategy="no",
                    logging_strategy="no",
                    report_to=[],
                    disable_tqdm=True,
                    remove_unused_columns=False,
                    dataloader_drop_last=True,
                    seed=0,
                )
                samples = [{"x": x, "y": y} for x, y in zip(data.x, data.y)]
                trainer = Trainer(model=WithLoss(model), args=args, train_dataset=samples)
                trainer.remove_callback(PrinterCallback)  # the end-of-training metrics line
                scaler = use_dls(trainer, **dls_kwargs) if dls_kwargs is not None else None
                trainer.train()
            scale = scaler.get_scale() if scaler is not None and scaler.is_enabled() else None
            skipped = steps - _applied(trainer.optimizer.optimizer)
            seconds = time.perf_counter() - start
            return Result("HF Trainer", name, probe.dtype(), _final_loss(model, data), skipped, scale, seconds)

        return go

    return {
        "float32": run("float32", False, None),
        '"fp16", no dls': run("fp16=True", True, None),
        "float16, no loss scaling": run("float16, no loss scaling", True, {"enabled": False}),
        "float16 + dls": run("float16 + dls (use_dls)", True, {}),
        "float16 + dls, demo's scale rule": run("float16 + dls, from 2^40, growth every 100", True, DEMO_SCALER),
    }


# ---------------------------------------------------------------------------------------------------- report
@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
            logging.getLogger(name).setLevel(logging.ERROR)
        yield


def _pow2(value: float | None) -> str:
    if value is None:
        return "-"
    exponent = math.log2(value)
    return f"2^{exponent:.0f}" if exponent.is_integer() else f"{value:g}"


def print_table(results: list[Result], steps: int) -> None:
    print(f"\n{steps} steps per run; loss = unweighted MSE over all samples after training (float32)\n")
    print("| framework | run | computes in | loss | vs fp32 | skipped | scale |")
    print("|---|---|---|---|---|---|---|")
    reference = {r.framework: r.loss for r in results if r.run == "float32"}
    for r in results:
        ratio = r.loss / reference[r.framework] if r.framework in reference else float("nan")
        skipped = f"{r.skipped} ({r.skipped / steps:.1%})"
        print(f"| {r.framework} | {r.run} | {r.dtype} | {r.loss:.4g} | {ratio:.2f}x | {skipped} | {_pow2(r.scale)} |")
    print(f"\nwall time per run: {', '.join(f'{r.framework}/{r.run} {r.seconds:.1f}s' for r in results)}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--frameworks", default="lightning,accelerate,trainer")
    parser.add_argument(
        "--smoke", action="store_true", help="3 steps per run: checks that the script runs (seconds), no figures"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps = 3
    torch.set_num_threads(1)
    builders = {"lightning": lightning_runs, "accelerate": accelerate_runs, "trainer": trainer_runs}
    results = []
    with _quiet():
        for name in args.frameworks.split(","):
            for run in builders[name]().values():
                results.append(run(args.steps))
                r = results[-1]
                print(f"{r.framework:11s} {r.run:34s} {r.dtype:9s} loss {r.loss:.4g} skipped {r.skipped}", flush=True)
    print_table(results, args.steps)


if __name__ == "__main__":
    main()
