"""Overflow provenance on clean steps: backward + step time with an ``OverflowWatch`` installed vs without.

Each variant owns an identical copy of the model, the optimizer (AdamW) and a ``dls.GradScaler``. Per round, the
forward pass of each variant runs untimed (``prep``), then its backward of the scaled loss, ``scaler.step``,
``scaler.update`` and ``zero_grad`` are timed, all variants interleaved in a fresh random order:

* ``none``       -- no watch;
* ``none again`` -- a second copy of ``none``: its ratio to ``none`` (the A/A row) is the noise of the run;
* ``watch``      -- ``scaler.watch(model)`` installed: the scaler builds a report only after a step it skipped,
  which never happens here (checked: a skipped step stops the benchmark, since its report pass would be timed).

Models: the small transformer of ``bench_step.py`` (the target: watch / none <= 1.01) and a deep MLP of many
small layers, the worst case for hooks that cost per parameter. ``us/param``: the median per-round difference to
``none`` divided by the number of parameters (the hook's price; meaningful where the A/A noise is small against it).

    python benchmarks/bench_watch.py
    python benchmarks/bench_watch.py --quick
    python benchmarks/bench_watch.py --smoke    # tiny models, 2 repetitions: runs, nothing to read
"""

from __future__ import annotations

import argparse
import copy
import statistics
from collections.abc import Callable, Sequence
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
from bench_step import TinyLM, token_batches

import dls

TARGET = 1.01
HEADER = ["model", "params", "variant", "ms", "none ms", "/none", "[iqr]", f"<={TARGET}", "us/param"]


class Variant:
    """One model + optimizer + scaler; ``forward`` (untimed) then ``backward_and_step`` (timed)."""

    def __init__(
        self, model: torch.nn.Module, loss_of: Callable[[torch.nn.Module, int], torch.Tensor], watch: bool
    ) -> None:
        self.model = model
        self.loss_of = loss_of
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.scaler = dls.GradScaler(loss_scale="dynamic", init_scale=2.0**10, steps_per_increase=10**9)
        self.watch = self.scaler.watch(model) if watch else None
        self.loss: torch.Tensor | None = None
        self.round = 0

    def forward(self) -> None:
        self.loss = self.loss_of(self.model, self.round)
        self.round += 1

    def backward_and_step(self) -> None:
        assert self.loss is not None
        self.scaler.scale(self.loss).backward()
        self.scaler.step(self.opt)
        if self.scaler.step_was_skipped(self.opt):
            raise RuntimeError("a step overflowed: this benchmark times clean steps only")
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)


def transformer(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, Callable[..., Any]]:
    torch.manual_seed(args.seed)
    model = TinyLM(args.vocab, args.width, args.layers, args.heads, args.context).to(device)
    batches = token_batches(args.vocab, args.batch, args.context, 4, args.seed, device)

    def loss_of(m: torch.nn.Module, step: int) -> torch.Tensor:
        tokens, targets = batches[step % len(batches)]
        return torch.nn.functional.cross_entropy(m(tokens).flatten(0, 1), targets.flatten())

    return model, loss_of


def deep_mlp(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, Callable[..., Any]]:
    torch.manual_seed(args.seed)
    layers: list[torch.nn.Module] = []
    for _ in range(args.mlp_depth):
        layers += [torch.nn.Linear(args.mlp_width, args.mlp_width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers).to(device)
    x = torch.randn(args.batch, args.mlp_width, generator=torch.Generator().manual_seed(args.seed)).to(device)

    def loss_of(m: torch.nn.Module, step: int) -> torch.Tensor:
        return m(x).pow(2).mean()

    return model, loss_of


def run(label: str, build: Callable[..., Any], args: argparse.Namespace, device: torch.device) -> list[list[str]]:
    base, loss_of = build(args, device)
    params = len(list(base.parameters()))
    variants = {
        "none": Variant(copy.deepcopy(base), loss_of, watch=False),
        "none again": Variant(copy.deepcopy(base), loss_of, watch=False),
        "watch": Variant(copy.deepcopy(base), loss_of, watch=True),
    }
    for v in variants.values():  # optimizer state exists before anything is timed
        v.forward()
        v.backward_and_step()
    cases = {name: Case(run=v.backward_and_step, prep=v.forward) for name, v in variants.items()}
    times = interleave(cases, device, args.reps, args.warmup)
    watch = variants["watch"].watch
    assert watch is not None and len(watch.backward_order()) == params, "the watch's hooks did not run"
    rows = []
    none_ms = statistics.median(times["none"]) * 1e3
    for name in ("watch", "none again"):
        r = ratio(times, name, "none")
        per_param = statistics.median(a - b for a, b in zip(times[name], times["none"])) * 1e6 / params
        rows.append(
            [
                label,
                str(params),
                name if name == "watch" else "none (A/A)",
                f"{statistics.median(times[name]) * 1e3:.2f}",
                f"{none_ms:.2f}",
                f"{r:.3f}",
                "[{:.2f},{:.2f}]".format(*spread(times, name, "none")),
                verdict(r, TARGET) if name == "watch" else "(noise)",
                f"{per_param:.2f}" if name == "watch" else "",
            ]
        )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, reps=80, warmup=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--mlp-depth", type=int, default=64, help="Linear layers of the deep MLP (2 params each)")
    parser.add_argument("--mlp-width", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="20 repetitions")
    add_smoke_arg(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.warmup = 20, 3
    if args.smoke:
        args.reps, args.warmup, args.batch, args.context, args.vocab, args.width = 2, 1, 2, 16, 64, 32
        args.layers, args.heads, args.mlp_depth, args.mlp_width = 1, 2, 4, 16
    device = setup(args)
    print(f"bench_watch: {describe(device, args.threads)}")
    print(
        f"timed: backward of the scaled loss + scaler.step + update + zero_grad (AdamW), forward untimed; "
        f"{args.reps} rounds"
    )
    rows = run(f"transformer {args.layers}x{args.width}", transformer, args, device)
    rows += run(f"MLP {args.mlp_depth}x{args.mlp_width}", deep_mlp, args, device)
    print_table("clean steps with an OverflowWatch: medians of per-round paired ratios [25%, 75%]", HEADER, rows)


if __name__ == "__main__":
    main()
