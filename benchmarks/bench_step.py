"""A whole training step of a small transformer: dls vs ``torch.amp.GradScaler`` vs no scaler.

Each variant owns an identical copy of the model and optimizer; one step of each is timed per round,
interleaved, in a random order each round. A step is: forward under autocast (bfloat16 by default on CPU,
float16 on CUDA), backward of the (scaled) loss, optimizer step (through the scaler), scaler update,
``zero_grad``. Variants:

* ``none``  -- no scaler: ``loss.backward(); opt.step()``;
* ``torch`` -- ``torch.amp.GradScaler(device)``: ``scale(loss).backward(); step(opt); update()``;
* ``dls``   -- ``dls.GradScaler(device)`` (torch.amp's arguments and defaults: the same scale), the same calls;
* ``dls sync_free`` (only for non-fused optimizers, informational) -- ``dls.GradScaler(device, sync_free=True)``;
* ``none again`` -- a second copy of ``none``: its ratio to ``none`` (the "A/A" row) is the noise of the run.

Optimizers: AdamW (torch's default implementation for the device) and AdamW(fused=True), whose kernel takes
the scale and the flag itself (no unscale pass, no host sync).

Before timing, every variant runs ``--preroll`` untimed steps (default 20), so the timed steps are those of a
long run: optimizer state created, and dls's host-side bound of the scale as a long run keeps it (each new scale
is published to host memory without a synchronisation, so the bound stays exact and no step of this run takes the
scale-below-1 check; how often each path would: ``bench_scale_below_one.py``).

Targets: ``dls/torch <= 1.0`` (dls costs no more than torch's scaler on the same step) and ``dls/none <= 1.03``
(loss scaling adds at most 3 % to a step without a scaler). Every ratio is the median over rounds of ``time(A) /
time(B)`` measured in the same round of one run (``[iqr]``: 25th and 75th percentiles). ``ok``: the ratio
measured in this run is at or below the target; ``MISS``: above it in this run. Read them against the A/A row:
a ratio within the A/A row's distance from 1 cannot be told from noise. The ``reads`` column counts dls's host
reads of a device value per step (``.item()`` and the like, counted in one extra untimed step): 1 on the
default path, 0 on the fused one.

    python benchmarks/bench_step.py
    python benchmarks/bench_step.py --quick
    python benchmarks/bench_step.py --smoke     # a 1-layer model, 2 repetitions: runs, nothing to read
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from bench_scaler import (
    Case,
    add_common_args,
    add_smoke_arg,
    describe,
    interleave,
    print_table,
    ratio,
    setup,
    spread,
    verdict,
)

import dls

HEADER = ["optimizer", "scaler", "ms", "torch ms", "none ms", "/torch", "[iqr]", "<=1.0", "/none", "[iqr]", "<=1.03"]
HEADER.append("reads")
SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


class TinyLM(torch.nn.Module):
    """A small causal transformer language model."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Parameter(torch.randn(context, width) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.position[:n]
        mask = self.get_buffer("mask")[:n, :n]
        x = self.blocks(x, mask=mask, is_causal=True)
        return self.head(self.norm(x))


def token_batches(
    vocab: int, batch: int, context: int, count: int, seed: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` random (inputs, next-token targets) batches for ``TinyLM``, the same for a given seed."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(vocab, (batch, context + 1), generator=gen).to(device) for _ in range(count)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


@contextlib.contextmanager
def count_reads(calls: list[str]) -> Iterator[None]:
    saved = {name: torch.Tensor.__dict__.get(name) for name in SYNC_METHODS}

    def spy(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if "dls" in sys._getframe(1).f_code.co_filename.split("/"):
                calls.append(name)
            return original(self, *args, **kwargs)

        return wrapper

    for name in SYNC_METHODS:
        setattr(torch.Tensor, name, spy(name, getattr(torch.Tensor, name)))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, value)


def make_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    scaler: Any,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    amp_dtype: torch.dtype,
) -> Callable[[], None]:
    device_type = next(model.parameters()).device.type
    counter = [0]

    def step() -> None:
        tokens, targets = batches[counter[0] % len(batches)]
        counter[0] += 1
        with torch.autocast(device_type, dtype=amp_dtype):
            logits = model(tokens)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)

    return step


def run(args: argparse.Namespace, device: torch.device, fused: bool, amp_dtype: torch.dtype) -> list[Any]:
    torch.manual_seed(args.seed)
    base = TinyLM(args.vocab, args.width, args.layers, args.heads, args.context).to(device)
    batches = token_batches(args.vocab, args.batch, args.context, 4, args.seed, device)

    variants: dict[str, Any] = {
        "none": None,
        "none again": None,  # A/A control: the ratio of two identical variants shows the noise of the run
        "torch": torch.amp.GradScaler(device.type),
        "dls": dls.GradScaler(device.type),
    }
    if not fused:
        variants["dls sync_free"] = dls.GradScaler(device.type, sync_free=True)
    steps = {}
    reads = {}
    for name, scaler in variants.items():
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True if fused else None)
        step = make_step(model, opt, scaler, batches, amp_dtype)
        for _ in range(args.preroll):  # optimizer state created, and the scalers in a long run's state
            step()
        if isinstance(scaler, dls.GradScaler):
            calls: list[str] = []
            with count_reads(calls):
                step()
            reads[name] = len(calls)
        steps[name] = step
    times = interleave({name: Case(run=step) for name, step in steps.items()}, device, args.reps, args.warmup)
    for name, scaler in variants.items():
        if scaler is not None:
            assert scaler.get_scale() > 1.0, f"{name}: the scale collapsed (overflows in the benchmark)"

    r_torch, r_none = ratio(times, "dls", "torch"), ratio(times, "dls", "none")
    label = "AdamW fused" if fused else "AdamW"
    rows = [
        [
            label,
            "dls",
            f"{statistics.median(times['dls']) * 1e3:.2f}",
            f"{statistics.median(times['torch']) * 1e3:.2f}",
            f"{statistics.median(times['none']) * 1e3:.2f}",
            f"{r_torch:.3f}",
            "[{:.2f},{:.2f}]".format(*spread(times, "dls", "torch")),
            verdict(r_torch, 1.0),
            f"{r_none:.3f}",
            "[{:.2f},{:.2f}]".format(*spread(times, "dls", "none")),
            verdict(r_none, 1.03),
            reads["dls"],
        ]
    ]
    r_aa = ratio(times, "none again", "none")
    rows.append(
        [
            label,
            "none (A/A)",
            f"{statistics.median(times['none again']) * 1e3:.2f}",
            "",
            "",
            "",
            "",
            "",
            f"{r_aa:.3f}",
            "[{:.2f},{:.2f}]".format(*spread(times, "none again", "none")),
            "(noise)",
            "",
        ]
    )
    if "dls sync_free" in times:
        r_t, r_n = ratio(times, "dls sync_free", "torch"), ratio(times, "dls sync_free", "none")
        rows.append(
            [
                label,
                "dls sync_free",
                f"{statistics.median(times['dls sync_free']) * 1e3:.2f}",
                "",
                "",
                f"{r_t:.3f}",
                "[{:.2f},{:.2f}]".format(*spread(times, "dls sync_free", "torch")),
                "(info)",
                f"{r_n:.3f}",
                "[{:.2f},{:.2f}]".format(*spread(times, "dls sync_free", "none")),
                "(info)",
                reads["dls sync_free"],
            ]
        )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, reps=60, warmup=5)
    parser.add_argument("--amp-dtype", choices=["bfloat16", "float16"], help="default: bf16 on CPU, fp16 on CUDA")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--preroll", type=int, default=20, help="untimed steps per variant first (default 20)")
    parser.add_argument("--quick", action="store_true", help="15 repetitions")
    add_smoke_arg(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.warmup = 15, 3
    if args.smoke:
        args.reps, args.warmup, args.preroll = 2, 1, 2
        args.batch, args.context, args.vocab, args.width, args.layers, args.heads = 2, 16, 64, 32, 1, 2
    device = setup(args)
    amp_name = args.amp_dtype or ("float16" if device.type == "cuda" else "bfloat16")
    amp_dtype = getattr(torch, amp_name)
    params = sum(p.numel() for p in TinyLM(args.vocab, args.width, args.layers, args.heads, args.context).parameters())
    print(f"bench_step: {describe(device, args.threads)}")
    print(
        f"model: {args.layers}-layer transformer, width {args.width}, vocab {args.vocab}, {params / 1e6:.2f}M "
        f"parameters; batch {args.batch} x {args.context} tokens; autocast {amp_name}; {args.reps} rounds after "
        f"{args.preroll} untimed steps"
    )
    rows = []
    for fused in (False, True):
        rows += run(args, device, fused, amp_dtype)
        print(f"  ... {'fused' if fused else 'default'} AdamW done")
    print_table(
        "training step time: dls vs torch (target <= 1.0) and vs no scaler (<= 1.03); medians of per-round paired "
        "ratios [25%, 75%]",
        HEADER,
        rows,
    )


if __name__ == "__main__":
    main()
