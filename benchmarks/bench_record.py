"""What recording a trace (``scaler.record``, ``dls.diagnostics.record``) costs a training step, side by side with
recording off, in one run.

Model: a ~96M-parameter causal transformer (``bench_step.TinyLM``: vocabulary 16000, width 768, 10 layers, 12
heads, 128 tokens, batch 4; AdamW) trained on the CPU in float32 with a ``dls.GradScaler`` (dynamic, scale 2**10,
no growth): float16 matrix multiplies on a CPU are slow and would only make the step longer, which flatters the
recorder; its cost does not depend on the compute dtype. Each variant owns an identical copy of the model, the
optimizer and the scaler; a whole step (forward, ``scale(loss).backward()``, ``step``, ``update``, ``zero_grad``) of
each is timed per round, interleaved in a fresh random order:

* ``off``        -- no recorder;
* ``off again``  -- a second copy of ``off``: its ratio to ``off`` (the A/A row) is the noise of the run;
* ``record``     -- ``scaler.record(file)`` with the defaults (a histogram every 100 steps, written every 100
  steps): a timed step is a step between those (the per-step cost: the scale, the flag and one pass over the
  gradients for their largest magnitude);
* ``record, histogram every step`` -- ``histogram_every=1``: a bound on the histogram's cost (every step pays it);
* ``record(model=...)`` -- with the model hooks (every tensor of backward measured): optional, not in the target.

Target: ``record / off <= 1.02``, the per-step cost plus the histogram's amortised over its 100 steps (``record``
+ (``histogram every step`` - ``record``) / 100; the write, once per 100 steps, is timed apart and amortised
too). Ratios are medians over rounds of paired times (``[iqr]``: 25th-75th percentiles); read them against the
A/A row. A second table counts dls's host reads per step (``.item()`` and the like) with recording off and on,
on the default, fused and sync-free paths: recording adds none.

    python benchmarks/bench_record.py --threads 1
    python benchmarks/bench_record.py --smoke
"""

from __future__ import annotations

import argparse
import copy
import io
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_scaler import Case, add_common_args, describe, interleave, print_table, ratio, setup, spread, verdict
from bench_step import TinyLM, count_reads, token_batches

import dls

TARGET = 1.02
NO_GROWTH = 10**9


class Variant:
    """One model + AdamW + scaler (+ recorder); ``step`` is timed."""

    def __init__(self, model: torch.nn.Module, batches: list[Any], record: dict[str, Any] | None) -> None:
        self.model, self.batches = model, batches
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        self.scaler = dls.GradScaler("cpu", init_scale=2.0**10, growth_interval=NO_GROWTH)
        self.recorder = None
        if record is not None:
            kwargs = dict(record)
            if kwargs.pop("model", False):
                kwargs["model"] = model
            self.recorder = self.scaler.record(io.BytesIO(), **kwargs)
        self.round = 0
        self.in_recorder = 0.0  # seconds spent in the recorder's hook, timed steps only
        if self.recorder is not None:
            self._timed_hook()

    def _timed_hook(self) -> None:
        assert self.recorder is not None
        inner = self.recorder.before_rule

        def timed(found_inf: torch.Tensor, gradients: Any) -> None:
            t0 = time.thread_time()
            inner(found_inf, gradients)
            self.in_recorder += time.thread_time() - t0

        self.recorder.before_rule = timed  # type: ignore[method-assign]

    def step(self) -> None:
        tokens, targets = self.batches[self.round % len(self.batches)]
        self.round += 1
        loss = torch.nn.functional.cross_entropy(self.model(tokens).flatten(0, 1), targets.flatten())
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        if self.scaler.step_was_skipped(self.opt):
            raise RuntimeError("a step overflowed: this benchmark times clean steps")
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)


def cost_table(args: argparse.Namespace, device: torch.device) -> None:
    torch.manual_seed(args.seed)
    base = TinyLM(args.vocab, args.width, args.layers, args.heads, args.context)
    params = sum(p.numel() for p in base.parameters())
    batches = token_batches(args.vocab, args.batch, args.context, 2, args.seed, device)
    defaults = {"histogram_every": 100, "flush_every": 100}
    specs: dict[str, dict[str, Any] | None] = {
        "off": None,
        "off again": None,
        "record": defaults,
        "record, histogram every step": {**defaults, "histogram_every": 1},
    }
    if not args.no_model_hooks:
        specs["record(model=...)"] = {**defaults, "model": True}
    variants = {name: Variant(copy.deepcopy(base), batches, spec) for name, spec in specs.items()}
    del base
    for v in variants.values():  # optimizer state exists before anything is timed
        v.step()
        v.in_recorder = 0.0
    times = interleave({name: Case(run=v.step) for name, v in variants.items()}, device, args.reps, args.warmup)
    off_ms = statistics.median(times["off"]) * 1e3
    hook_ms = {n: v.in_recorder / args.reps * 1e3 for n, v in variants.items() if v.recorder is not None}
    rows = []
    for name in variants:
        if name == "off":
            continue
        r = ratio(times, name, "off")
        lo, hi = spread(times, name, "off")
        hook = f"{hook_ms[name]:.1f}" if name in hook_ms else ""
        rows.append([name, f"{statistics.median(times[name]) * 1e3:.0f}", f"{off_ms:.0f}", f"{r:.4f}",
                     f"[{lo:.3f},{hi:.3f}]", hook])  # fmt: skip
    print_table(
        f"Recording cost per step: {params / 1e6:.1f}M parameters, float32 CPU step ({args.reps} rounds; hook ms: "
        "time inside the recorder's hook per step, thread clock)",
        ["variant", "ms", "off ms", "/off", "[iqr]", "hook ms"],
        rows,
    )
    flush_ms = write_ms()
    per_step = ratio(times, "record", "off")
    histogram = ratio(times, "record, histogram every step", "off") - per_step
    amortised = per_step + histogram / 100 + flush_ms / off_ms / 100
    hooks = hook_ms["record"] + (hook_ms["record, histogram every step"] - hook_ms["record"]) / 100 + flush_ms / 100
    print(
        f"\nthe write of 100 rows: {flush_ms:.1f} ms, once per 100 steps\n"
        f"record / off, amortised over 100 steps (per step + histogram/100 + write/100): {amortised:.4f} "
        f"(target <= {TARGET}: {verdict(amortised, TARGET)})\n"
        f"the same from the recorder's own time (hook ms, amortised): {hooks:.1f} ms of {off_ms:.0f} ms = "
        f"{1 + hooks / off_ms:.4f}"
    )


def write_ms() -> float:
    """The write of 100 buffered rows (one with a histogram): what a recorder does once per 100 steps; the rows'
    formatting does not depend on the model's size (a small one records them)."""
    torch.manual_seed(0)
    model = TinyLM(64, 32, 2, 4, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = token_batches(64, 2, 16, 4, 0, torch.device("cpu"))
    out = []
    for _ in range(3):
        scaler = dls.GradScaler("cpu", init_scale=2.0**10, growth_interval=NO_GROWTH)
        recorder = scaler.record(io.BytesIO(), histogram_every=100, flush_every=101)
        for i in range(100):
            tokens, targets = batches[i % len(batches)]
            loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        t0 = time.thread_time()
        recorder.flush()
        out.append(time.thread_time() - t0)
        recorder.close()
    return statistics.median(out) * 1e3


def reads_table() -> None:
    """dls's host reads per step, recording off and on, per path (a small model: reads do not depend on size)."""
    rows = []
    for label, make_opt, sync_free in [
        ("default (AdamW)", lambda p: torch.optim.AdamW(p, lr=1e-3), False),
        ("fused (AdamW fused=True)", lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True), False),
        ("sync_free (AdamW)", lambda p: torch.optim.AdamW(p, lr=1e-3), True),
    ]:
        counts = []
        for record in (False, True):
            counts.append(_reads(make_opt, sync_free, record))
        rows.append([label, f"{counts[0]:.2f}", f"{counts[1]:.2f}", "ok" if counts[1] == counts[0] else "MISS"])
    print_table(
        "dls host reads per step (mean over 20 steps after 2 warm-up steps; recording buffers 100 rows)",
        ["path", "off", "record", "no extra"],
        rows,
    )


def _reads(make_opt: Callable[[Any], torch.optim.Optimizer], sync_free: bool, record: bool) -> float:
    torch.manual_seed(0)
    model = TinyLM(64, 32, 2, 4, 16)
    opt = make_opt(model.parameters())
    scaler = dls.GradScaler("cpu", init_scale=2.0**10, growth_interval=NO_GROWTH, sync_free=sync_free)
    recorder = scaler.record(io.BytesIO(), histogram_every=7) if record else None
    batches = token_batches(64, 2, 16, 4, 0, torch.device("cpu"))

    def step(i: int) -> None:
        tokens, targets = batches[i % len(batches)]
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    for i in range(2):
        step(i)
    calls: list[str] = []
    with count_reads(calls):
        for i in range(2, 22):
            step(i)
    if recorder is not None:
        recorder.close()
    return len(calls) / 20


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, reps=6, warmup=1)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--no-model-hooks", action="store_true", help="leave out the record(model=...) variant")
    parser.add_argument("--smoke", action="store_true", help="a 1M-parameter model, 3 rounds (a smoke test)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.vocab, args.width, args.layers, args.heads, args.reps = 1000, 128, 2, 4, 3
    device = setup(args)
    print(describe(device, args.threads))
    cost_table(args, device)
    reads_table()


if __name__ == "__main__":
    main()
