"""The policy lab's evidence (issue 33, item 4), measured in one run: what replaying a trace predicts, against
what each policy does.

Two models, each trained on the CPU in float16 (``torch.autocast``) with a recorder attached
(``scaler.record(..., model=model)``), from a fixed seed, on fixed batches:

* **demo**: the MLP of ``dls demo`` (``configs/mlp_fp16_dls.yaml``: loss weight 1e-4, teacher regression), recorded
  under the demo's ``fp16 + DLS`` settings (Cerebras dialect, ``steps_per_increase=100``, ``max_loss_scale=2**40``:
  it starts at 2**40, backs off, then probes upwards every 101 steps);
* **gpt**: the small GPT of ``configs/transformer_lm_fp16_dls.yaml`` (AdamW, warm-up and cosine schedule left out:
  a constant 1e-3; clipping at 1.0 as the config), with **induced overflow bursts**: at a few steps the loss is
  multiplied by 2**12, recorded under torch's rule with ``growth_interval=25``.

Table (a): ``replay(trace, ["recorded"])`` against the run itself: scales and skips per step (they must be equal).

Table (b), per model and policy: the replay's prediction from the trace (estimate, [lowest, highest] the trace
allows, undecided steps), against two measurements:

* **same weights**: during the recorded run, before each step, a *shadow* of the policy (its ``LossScale``, the
  scaler's own) decides from a backward pass of the same batch on the same weights at the policy's own scale
  whether the step overflows, then updates: what the policy would have done on this run's gradients. Where the
  trace decides, the replay must match it exactly (``decided == shadow``: steps at which the estimate and the
  shadow hold the same scale and the estimate's outcome was decided, and how many of them agree);
* **trained**: training from the same weights on the same batches (the same bursts) with the policy itself. Its
  gradients drift from the recorded run's once a skipped step differs, so the trained count may leave the
  bounds; the table says whether it is within them, and the first step where its skips differ from the estimate.

    python benchmarks/policy_lab_evidence.py                # about 15 minutes on 2 CPU cores
    python benchmarks/policy_lab_evidence.py --smoke        # a smoke run (fewer steps)
"""

from __future__ import annotations

import argparse
import io
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _this_tree  # noqa: F401  # this tree's src/ first
import torch
from bench_scaler import print_table

import dls
from dls.diagnostics.policies import parse_policy
from dls.diagnostics.replaying import Replay, replay
from dls.diagnostics.trace import read_trace
from dls.loss_scale import LossScale
from dls.settings import ScalerSettings
from dls.train import config, data

ROOT = Path(__file__).resolve().parents[1]
OTHERS = [
    "torch",
    "cerebras",
    "megatron",
    "deepspeed",
    "torch:growth_interval=50",
    "cerebras:steps_per_increase=50,max_loss_scale=2**24",
    "megatron:growth_interval=50",
    "deepspeed:loss_scale_window=50",
]


class Model:
    """A config's model, its batches and its loss; ``fresh()`` gives the same initial weights every time."""

    def __init__(self, name: str, config_file: str, steps: int, bursts: dict[int, float], lr: float) -> None:
        self.name, self.steps, self.bursts, self.lr = name, steps, bursts, lr
        self.cfg = config.load_config(ROOT / "configs" / config_file)
        self.clip = self.cfg.optimizer.max_gradient_norm
        self.weight = self.cfg.model.loss_weight

    def fresh(self) -> tuple[torch.nn.Module, Any]:
        torch.manual_seed(0)
        batches = data.build_batches(self.cfg.data, 0, "train")
        model = data.build_model(self.cfg.model, batches.dataset.info)
        return model, batches

    def loss(self, model: torch.nn.Module, batch: Any, step: int) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model.loss(batch)
        return loss * (self.weight * self.bursts.get(step, 1.0))

    def optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        if self.cfg.optimizer.optimizer_type == "AdamW":
            return torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=self.cfg.optimizer.weight_decay)
        return torch.optim.Adam(model.parameters(), lr=self.lr)


def train(
    m: Model, settings: ScalerSettings, shadows: dict[str, ScalerSettings] | None = None
) -> tuple[list[tuple[float, bool]], dict[str, list[tuple[float, bool]]], Any]:
    """Train ``m`` with ``settings``; with ``shadows``, record a trace and run each shadow policy on the same
    weights. Returns per step (scale, skipped), the shadows' (scale, overflowed) per step, and the trace."""
    model, batches = m.fresh()
    opt = m.optimizer(model)
    scaler = dls.GradScaler.from_settings(settings, device="cpu")
    buf = io.BytesIO()
    recorder = scaler.record(buf, model=model, histogram_every=10) if shadows is not None else None
    states = {name: LossScale(s, torch.device("cpu")) for name, s in (shadows or {}).items()}
    shadow_seen: dict[str, list[tuple[float, bool]]] = {name: [] for name in states}
    params = [p for p in model.parameters() if p.requires_grad]
    seen = []
    for step in range(m.steps):
        batch = batches.next()
        if states:
            assert recorder is not None
            with recorder.paused():  # not a step of the run: the hooks measure nothing
                for name, state in states.items():
                    scale = float(state.state.loss_scale)
                    grads = torch.autograd.grad(m.loss(model, batch, step).float() * scale, params, allow_unused=True)
                    overflow = not all(bool(torch.isfinite(g).all()) for g in grads if g is not None)
                    shadow_seen[name].append((scale, overflow))
                    state.update(torch.tensor(float(overflow)))
        scale = scaler.get_scale()
        dls.optimizer_step(m.loss(model, batch, step), opt, scaler, max_gradient_norm=m.clip)
        seen.append((scale, scaler.step_was_skipped(opt)))
    trace = None
    if recorder is not None:
        recorder.close()
        buf.seek(0)
        trace = read_trace(buf)
    return seen, shadow_seen, trace


def count(triple: tuple[int, int, int]) -> str:
    estimate, low, high = triple
    return f"{estimate}" if low == high == estimate else f"{estimate} [{low}, {high}]"


def evidence(m: Model, recorded: ScalerSettings, others: Sequence[str]) -> tuple[list[list[str]], list[list[str]]]:
    policies = {spec: parse_policy(spec, half_dtype="float16") for spec in others if _buildable(spec)}
    started = time.perf_counter()
    seen, shadows, trace = train(m, recorded, {spec: p.settings for spec, p in policies.items()})
    print(f"{m.name}: recorded run with {len(policies)} shadows, {time.perf_counter() - started:.0f} s", flush=True)
    results: list[Replay] = replay(trace, ["recorded", *policies.values()])
    rec = results[0]
    scale_diff = sum(a != b for a, b in zip(rec.scales, (s for s, _ in seen)))
    skip_diff = sum(a != b for a, b in zip(rec.skips, (k for _, k in seen)))
    table_a = [
        [m.name, str(m.steps), str(sum(k for _, k in seen)), str(sum(rec.skips)), str(scale_diff), str(skip_diff)]
    ]
    table_b = []
    for r in results[1:]:
        spec = r.policy.spec
        started = time.perf_counter()
        trained, _, _ = train(m, r.policy.settings)
        shadow = shadows[spec]
        same = [(k, sk) for s, k, g, (ss, sk) in zip(r.scales, r.skips, r.guessed, shadow) if s == ss and not g]
        trained_skips = sum(k for _, k in trained)
        first = next((i + 1 for i, ((_, k), e) in enumerate(zip(trained, r.skips)) if k != e), None)
        table_b.append([
            m.name, spec, count(r.skipped), str(r.undecided), str(sum(k for _, k in shadow)),
            f"{sum(k == sk for k, sk in same)}/{len(same)}",
            str(trained_skips), "yes" if r.skipped[1] <= trained_skips <= r.skipped[2] else "NO",
            "none" if first is None else str(first),
        ])  # fmt: skip
        print(f"{m.name}: trained {spec}, {time.perf_counter() - started:.0f} s", flush=True)
    return table_a, table_b


def _buildable(spec: str) -> bool:
    try:
        parse_policy(spec, half_dtype="float16")
    except ValueError as exc:
        print(f"left out: {spec}: {exc}")
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a smoke run: 60 demo steps, 40 GPT steps")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    print(f"torch {torch.__version__}, Python {platform.python_version()}, CPU, {args.threads} thread(s)")
    demo_steps, gpt_steps = (60, 40) if args.smoke else (600, 240)
    gpt_bursts = {s: 2.0**12 for s in (60, 61, 62, 150, 151, 200) if s < gpt_steps}
    if args.smoke:
        gpt_bursts = {10: 2.0**12, 11: 2.0**12, 25: 2.0**12}
    models: list[tuple[Model, ScalerSettings]] = [
        (
            Model("demo", "mlp_fp16_dls.yaml", demo_steps, {}, 1e-3),
            ScalerSettings.cerebras(loss_scale="dynamic", steps_per_increase=100, max_loss_scale=2.0**40),
        ),
        (
            Model("gpt", "transformer_lm_fp16_dls.yaml", gpt_steps, gpt_bursts, 1e-3),
            ScalerSettings.torch(init_scale=2.0**16, growth_interval=25),
        ),
    ]
    rows_a: list[list[str]] = []
    rows_b: list[list[str]] = []
    for m, recorded in models:
        a, b = evidence(m, recorded, OTHERS)
        rows_a += a
        rows_b += b
    print_table(
        "(a) replaying the recorded policy against the recorded run",
        ["model", "steps", "skipped (run)", "skipped (replay)", "steps, scale differs", "steps, skip differs"],
        rows_a,
    )
    print_table(
        "(b) predicted from the trace vs the same weights (shadow) vs trained with the policy",
        ["model", "policy", "predicted skipped", "undecided", "same weights", "decided == shadow", "trained",
         "in bounds", "first differing step"],
        rows_b,
    )  # fmt: skip
    print(f"\nwall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
