"""FP8 on real hardware: ``dls.fp8.emulate_recipe`` with ``CurrentScaling()`` against real FP8 training (issue 23,
item 6).

The same small transformer (every ``nn.Linear`` but the output head in FP8, tensorwise current scaling: E4M3
inputs and weights, E5M2 output gradients) is trained three ways from the same weights on the same batches:

* ``emulated`` -- ``dls.fp8.emulate_recipe(model, CurrentScaling())``: FP8 operands, float32 products and sums;
* ``real``     -- real FP8 GEMMs: torchao's ``Float8Linear`` (``convert_to_float8_training``, tensorwise recipe)
  when torchao is importable and the GPU has FP8 tensor cores (compute capability 8.9 or more); otherwise the
  three GEMMs of each layer through ``torch._scaled_mm`` with the scales of ``dls.fp8.scale_from_amax`` and
  payloads cast by torch (``--reference`` chooses);
* ``high``     -- no FP8 (float32), for context.

Printed, from one run:

1. the first step, layer by layer, on identical inputs: each operand's scale (dls's rule against a float32 true
   division ``fp8_max / amax`` in torch, bitwise), its payload (dls's rounding of the scaled values,
   ``dls.formats``, against torch's cast to ``float8_e4m3fn`` / ``float8_e5m2``, bitwise) and the GEMM output
   (emulated vs real FP8: largest difference relative to the largest output; real GEMMs apply the scales to the
   float32 accumulator and sum in another order, so they differ by float32 rounding, never by FP8 rounding);
2. training (``--steps``, default 200, AdamW): the loss of each run at a few steps, and the per-step relative loss
   difference between emulated and real (largest and mean);
3. the cost of a step: emulated vs real (and real vs high precision), timed side by side, interleaved, with an A/A
   row (``high again`` / ``high``).

    python3 benchmarks/bench_fp8_gpu.py                        # CUDA, 200 steps
    python3 benchmarks/bench_fp8_gpu.py --reference scaled_mm  # torch._scaled_mm even where torchao is importable
    python3 benchmarks/bench_fp8_gpu.py --quick                # seconds, on the CPU too (a smoke run, no figures)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import warnings
from collections.abc import Sequence
from typing import Any

import _this_tree  # noqa: F401  (first: puts this tree's src/ on the path)
import torch
from bench_gpu import AA
from bench_scaler import Case, add_common_args, describe, interleave, median_ms, print_table, ratio, setup
from torch import nn
from torch.nn import functional as F

import dls
import dls.fp8
from dls import formats

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# ---------------------------------------------------------------------------------------------- the model
class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, w)
        x = x + self.proj(att)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class SmallLM(nn.Module):
    """A small causal transformer; every ``nn.Linear`` but ``head`` runs in FP8."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(context, width) * 0.02)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.norm(self.blocks(x)))


def in_fp8(name: str, module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and name != "head"


# ---------------------------------------------------------------------------------------------- real FP8 GEMMs
def cast(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensorwise current scaling: ``(scale, payload)``, the scale from ``dls.fp8.scale_from_amax``, the payload
    cast by torch (saturated to the format's max, as torchao and TransformerEngine do)."""
    scale = dls.fp8.scale_from_amax(t.detach().abs().amax().float(), dtype)
    limit = torch.finfo(dtype).max
    return scale, (t.float() * scale).clamp(-limit, limit).to(dtype)


def column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


class ScaledMM(torch.autograd.Function):
    """``x @ w.T`` with its three GEMMs in real FP8 through ``torch._scaled_mm`` (E4M3 x E4M3 forward, E5M2
    gradients), float32 outputs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        xs, x8 = cast(x2, E4M3)
        ws, w8 = cast(w, E4M3)
        ctx.save_for_backward(x8, xs, w8, ws)
        ctx.shape = x.shape
        out = torch._scaled_mm(x8, w8.t(), scale_a=xs.reciprocal(), scale_b=ws.reciprocal(), out_dtype=torch.float32)
        return out.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x8, xs, w8, ws = ctx.saved_tensors
        gs, g8 = cast(grad.reshape(-1, grad.shape[-1]), E5M2)
        inv_g = gs.reciprocal()
        grad_x = torch._scaled_mm(g8, column_major(w8), scale_a=inv_g, scale_b=ws.reciprocal(), out_dtype=torch.float32)
        grad_w = torch._scaled_mm(
            g8.t().contiguous(), column_major(x8), scale_a=inv_g, scale_b=xs.reciprocal(), out_dtype=torch.float32
        )
        return grad_x.reshape(ctx.shape), grad_w


def scaled_mm_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out = ScaledMM.apply(x, module.weight)
    return out if module.bias is None else out + module.bias


def to_real_fp8(model: nn.Module, reference: str) -> str:
    """Make ``model``'s FP8 layers compute real FP8 GEMMs; returns what does it."""
    if reference == "torchao":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        emulate = not torch.cuda.is_available()
        convert_to_float8_training(
            model, config=Float8LinearConfig(emulate=emulate), module_filter_fn=lambda m, name: in_fp8(name, m)
        )
        return "torchao Float8Linear (tensorwise)" + (" emulate=True: NOT real FP8 (no GPU)" if emulate else "")
    for name, module in model.named_modules():
        if in_fp8(name, module):
            module.forward = lambda x, m=module: scaled_mm_linear(m, x)  # type: ignore[method-assign]
    return "torch._scaled_mm with dls's scales and torch's casts"


def pick_reference(choice: str, device: torch.device) -> str:
    if choice != "auto":
        return choice
    fp8_cores = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao.float8  # noqa: F401
    except Exception:  # not installed, or built for another torch
        return "scaled_mm"
    return "torchao" if fp8_cores else "scaled_mm"


# ---------------------------------------------------------------------------------------------- 1. first step
def first_step_table(template: nn.Module, tokens: torch.Tensor) -> None:
    """Scales, payloads and GEMM outputs of every FP8 layer on the same first batch."""
    model = copy.deepcopy(template)
    inputs: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if in_fp8(name, module):
            module.register_forward_pre_hook(lambda m, a, n=name: inputs.__setitem__(n, a[0].detach().clone()))
            module.register_full_backward_hook(lambda m, gi, go, n=name: grads.__setitem__(n, go[0].detach().clone()))
    emulated = dls.fp8.emulate_recipe(model, dls.fp8.CurrentScaling(), module_filter=in_fp8)
    lm_loss(model, tokens).backward()
    rows = []
    for name, module in model.named_modules():
        if not in_fp8(name, module):
            continue
        assert isinstance(module, nn.Linear)
        operands = {"input": (inputs[name], E4M3), "weight": (module.weight.detach(), E4M3)}
        operands["grad_output"] = (grads[name], E5M2)
        for role, (t, dtype) in operands.items():
            t2 = t.reshape(-1, t.shape[-1]).float()
            amax = t2.abs().amax()
            scale = dls.fp8.scale_from_amax(amax, dtype)
            # A float32 true division (``number / tensor`` would multiply by a rounded reciprocal in torch).
            torch_scale = torch.full_like(amax, torch.finfo(dtype).max) / amax
            limit = torch.finfo(dtype).max
            scaled = (t2 * scale).clamp(-limit, limit)
            ours = formats.get(dtype).quantize(scaled)
            theirs = scaled.to(dtype).float()
            same_payload = torch.equal(ours.view(torch.int32), theirs.view(torch.int32))
            gemm = ""
            if role == "input":
                with torch.no_grad():
                    out = module(t)  # emulated
                    real = scaled_mm_linear(module, t)
                gemm = f"{((out - real).abs().amax() / real.abs().amax()).item():.2e}"
            rows.append(
                [
                    name,
                    role,
                    f"{scale.item():.6g}",
                    "yes" if torch.equal(scale, torch_scale) else "NO",
                    "yes" if same_payload else "NO",
                    gemm,
                ]
            )
    emulated.remove()
    print_table(
        "1. first step, same inputs: dls's scale and payload vs torch's; GEMM output emulated vs torch._scaled_mm "
        "(max |difference| / max |output|)",
        ["layer", "operand", "scale", "scale bitwise", "payload bitwise", "GEMM rel. diff"],
        rows,
    )


# ---------------------------------------------------------------------------------------------- 2. training
def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def make_run(template: nn.Module, kind: str, reference: str) -> tuple[nn.Module, torch.optim.Optimizer, str]:
    model = copy.deepcopy(template)
    what = "float32, no FP8"
    if kind == "emulated":
        dls.fp8.emulate_recipe(model, dls.fp8.CurrentScaling(), module_filter=in_fp8)
        what = "dls.fp8.emulate_recipe(CurrentScaling())"
    elif kind == "real":
        what = to_real_fp8(model, reference)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), what


def train_table(template: nn.Module, batches: list[torch.Tensor], reference: str, steps: int) -> None:
    losses: dict[str, list[float]] = {}
    for kind in ("high", "emulated", "real"):
        model, opt, what = make_run(template, kind, reference)
        print(f"  {kind}: {what}")
        losses[kind] = []
        for step in range(steps):
            loss = lm_loss(model, batches[step % len(batches)])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[kind].append(loss.item())
    marks = sorted({1, min(10, steps), steps // 2, steps} - {0})
    rows = [[kind, *(f"{values[m - 1]:.4f}" for m in marks)] for kind, values in losses.items()]
    diff = [abs(e - r) / abs(r) for e, r in zip(losses["emulated"], losses["real"])]
    print_table(f"2. training loss (AdamW, {steps} steps)", ["run", *(f"step {m}" for m in marks)], rows)
    print(f"   |emulated - real| / |real| per step: max {max(diff):.2e}, mean {statistics.mean(diff):.2e}")
    print(
        f"   |high - real| / |real| per step (the FP8 effect, for scale): max "
        f"{max(abs(h - r) / abs(r) for h, r in zip(losses['high'], losses['real'])):.2e}"
    )


# ---------------------------------------------------------------------------------------------- 3. cost
def cost_table(template: nn.Module, tokens: torch.Tensor, reference: str, device: torch.device, args: Any) -> None:
    cases: dict[str, Case] = {}
    for name, kind in (("high", "high"), ("high again", "high"), ("emulated", "emulated"), ("real", "real")):
        model, opt, _ = make_run(template, kind, reference)

        def step(model: nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
            lm_loss(model, tokens).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        cases[name] = Case(run=step)
    t = interleave(cases, device, args.reps, args.warmup)
    aa = AA()
    aa_value = aa.add(t, "high again", "high")
    rows: list[list[str]] = [
        [
            "emulated / real",
            f"{median_ms(t['emulated']):.2f}",
            f"{median_ms(t['real']):.2f}",
            f"{ratio(t, 'emulated', 'real'):.3f}",
        ],
        [
            "real / high",
            f"{median_ms(t['real']):.2f}",
            f"{median_ms(t['high']):.2f}",
            f"{ratio(t, 'real', 'high'):.3f}",
        ],
        [
            "A/A: high again / high",
            f"{median_ms(t['high again']):.2f}",
            f"{median_ms(t['high']):.2f}",
            f"{aa_value:.3f}",
        ],
    ]
    print_table("3. cost of a training step (eager, side by side)", ["ratio", "A ms", "B ms", "A/B"], rows)


# ---------------------------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, reps=21, warmup=3)
    parser.set_defaults(device="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--reference",
        choices=["auto", "torchao", "scaled_mm"],
        default="auto",
        help="what computes the real FP8 GEMMs (default auto: torchao where it can, else scaled_mm)",
    )
    parser.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    parser.add_argument("--quick", action="store_true", help="a tiny model and 5 steps: a smoke run (CPU too)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.reps, args.warmup = min(args.steps, 5), min(args.reps, 3), min(args.warmup, 1)
    device = setup(args)
    print(f"bench_fp8_gpu: {describe(device, args.threads)}")
    reference = pick_reference(args.reference, device)
    vocab, width, layers, heads, context, batch = (64, 32, 1, 2, 16, 2) if args.quick else (8192, 768, 4, 12, 512, 8)
    torch.manual_seed(args.seed)
    template = SmallLM(vocab, width, layers, heads, context).to(device)
    gen = torch.Generator().manual_seed(args.seed)
    batches = [torch.randint(vocab, (batch, context + 1), generator=gen).to(device) for _ in range(8)]
    params = sum(p.numel() for p in template.parameters())
    print(
        f"  model: {layers} blocks, width {width}, {params / 1e6:.1f}M parameters; batch {batch} x {context}; "
        f"real FP8 through: {reference}"
    )
    first_step_table(template, batches[0])
    train_table(template, batches, reference, args.steps)
    cost_table(template, batches[0], reference, device, args)


if __name__ == "__main__":
    main()
