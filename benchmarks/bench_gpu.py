"""dls on a GPU, side by side with torch.amp: the tables of issue 23 (items 1 to 5), each from one run.

Runs with a plain ``python3`` that has torch (the GPU machine has no virtual environment): dls is imported from
``src/`` beside this directory (this tree's code, whatever is installed). Tables (``--tables``, default all):

1. ``unscale`` -- unscale + inf/NaN check: ``dls.GradScaler(dev).unscale_`` vs ``torch.amp.GradScaler(dev).unscale_``
   (for float16, which torch's public ``unscale_`` refuses, its own code path with the refusal lifted: the raw
   ``_amp_foreach_non_finite_check_and_unscale_`` kernel behind a found-inf per device) and vs the bandwidth floor
   (``torch._foreach_mul_`` over the same tensors); float32, bfloat16, float16; 10M to 1B elements in 10 to 10,000
   tensors. Targets: dls/torch <= 1.05; dls/floor <= 1.15 at 100M elements or more.
2. ``clip`` -- dls's ``clip_gradients_and_return_isfinite`` (scaler built with ``max_gradient_norm``) vs torch's
   ``unscale_`` + ``clip_grad_norm_``. Target <= 0.7.
3. ``step`` -- a whole training step of GPT-2 small (124M parameters, sequence 1024, float16 autocast; built with
   ``transformers`` when importable, else the small built-in transformer of ``bench_step.py`` at GPT-2-small's
   sizes) with AdamW, fused AdamW and ``sync_free=True``: vs torch.amp and vs no scaler. Targets with fused AdamW:
   dls/torch <= 1.00, dls/none <= 1.01; with AdamW and ``sync_free=True``: dls/torch <= 1.00; host syncs per step
   (``torch.cuda.set_sync_debug_mode("warn")``, counted around ``step`` + ``update`` in one untimed step): 0 on the
   fused path and on the sync-free path with state on the device, 1 on the default path and on the sync-free path
   where the optimizer keeps state on the host (AdamW's step counts without ``capturable=True``: dls then decides
   the step on the host, one read, as the default path does; ``benchmarks/bench_host_ops.py`` on CUDA measures the
   masked step with capturable AdamW).
4. ``overhead`` -- host overhead where steps are launch-bound: 1,000 small parameters, ``scale`` + ``step`` +
   ``update`` (gradients already there) vs torch's. No target in the issue: ratios for information, against A/A.
5. ``graphs`` -- a whole step captured in a CUDA graph vs the same step eager, dls and torch, on the paths that can
   be captured whole (fused optimizers with ``capturable=True``; dls's ``sync_free=True``). For information.

Reading the tables: every ratio is the median over repetitions of ``time(A) / time(B)``, both timed in the same
round of one run, in a fresh random order each round; absolute times (medians) beside them. CUDA timing: the
device is synchronised before each timed call, then CUDA events around it. Each table times a second copy of
torch's variant (``torch again``; ``none again`` in the step table) and prints its ratio to the first as the
**A/A row**: the run's noise. A figure is ``ok`` when it is at most its target plus the A/A spread (the larger of
|A/A median - 1| and half the A/A interquartile range, over the table), ``MISS`` otherwise.

    python3 benchmarks/bench_gpu.py                          # all tables, every point, on CUDA
    python3 benchmarks/bench_gpu.py --tables unscale clip    # some tables
    python3 benchmarks/bench_gpu.py --quick                  # seconds, on the CPU too (a smoke run, no figures)
    python3 benchmarks/bench_gpu.py --budget 120             # about 120 s of points (as scripts/gpu-check runs it)

``--budget SECONDS`` shares the time among the tables run (``BUDGET_SHARES``; what a table leaves unspent passes to
the next). Every table runs its first point; a table past its share runs no more points and names those it left out
under it (``budget: N of M points not run: ...``). The points still run are measured exactly as without a budget.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import _this_tree  # noqa: F401  (first: puts this tree's src/ on the path)
import torch
from bench_scaler import (
    DTYPES,
    NO_GROWTH,
    SCALE,
    Case,
    add_common_args,
    close_iteration,
    describe,
    human,
    interleave,
    median_ms,
    print_table,
    ratio,
    restorable_grads,
    scalers,
    setup,
    spread,
    torch_unscale_,
)

import dls

TABLES = ("unscale", "clip", "step", "overhead", "graphs")
# Each table's share of --budget: about what each takes on an H200 by the sizes and repetitions (tables 1 and 2 move
# about 200 GB each, table 3 runs 8 x 44 GPT-2-small steps; 4 and 5 are small).
BUDGET_SHARES = {"unscale": 0.3, "clip": 0.3, "step": 0.25, "overhead": 0.05, "graphs": 0.1}
SYNC_WARNING = "called a synchronizing CUDA operation"


# ---------------------------------------------------------------------------------------------- judging figures
class AA:
    """The A/A pairs of one table (a variant against its own second copy): their spread is the run's noise."""

    def __init__(self) -> None:
        self.medians: list[float] = []
        self.halves: list[float] = []

    def add(self, times: dict[str, list[float]], again: str, first: str) -> float:
        value = ratio(times, again, first)
        lo, hi = spread(times, again, first)
        self.medians.append(value)
        self.halves.append((hi - lo) / 2)
        return value

    @property
    def spread(self) -> float:
        if not self.medians:
            return 0.0
        return max(max(abs(m - 1) for m in self.medians), max(self.halves))

    def row(self, width: int) -> list[str]:
        text = f"{min(self.medians):.3f}-{max(self.medians):.3f}" if self.medians else "-"
        return ["A/A", text, f"spread {self.spread:.3f}", *[""] * (width - 3)]


def judge(value: float, target: float, aa: AA) -> str:
    """``ok`` when ``value`` is at most ``target`` plus the table's A/A spread."""
    return "ok" if value <= target + aa.spread else "MISS"


def judged(rows: list[list[Any]], aa: AA) -> list[list[str]]:
    """Rows whose verdict cells hold ``(value, target)`` pairs, judged once the table's A/A spread is known."""
    return [[judge(*c, aa) if isinstance(c, tuple) else str(c) for c in row] for row in rows]


def print_judged(title: str, header: list[str], rows: list[list[Any]], aa: AA) -> None:
    """The table: ``rows`` judged (``judged``), then the A/A row."""
    print_table(title, header, [*judged(rows, aa), aa.row(len(header))])


class Budget:
    """``--budget``: per table, the moment after which it starts no more points (``None``: no budget)."""

    def __init__(self, seconds: float | None, tables: Sequence[str]) -> None:
        self.deadlines: dict[str, float] = {}
        self.left_out: dict[str, str] = {}  # table: the line naming the points it left out
        if seconds is None:
            return
        start, total, spent = time.monotonic(), sum(BUDGET_SHARES[t] for t in tables), 0.0
        for table in tables:
            spent += BUDGET_SHARES[table]
            self.deadlines[table] = start + seconds * spent / total

    def points(self, table: str, points: Sequence[Any], label: Callable[[Any], str] = str) -> Iterator[Any]:
        """``points`` in order, the first always, the others while the table's share lasts; those left out are
        named by ``report``."""
        for i, point in enumerate(points):
            if i and table in self.deadlines and time.monotonic() > self.deadlines[table]:
                names = ", ".join(label(p) for p in points[i:])
                self.left_out[table] = f"   budget: {len(points) - i} of {len(points)} points not run: {names}"
                return
            yield point

    def report(self, table: str) -> None:
        """Under the table just printed: the points it left out, if any."""
        if table in self.left_out:
            print(self.left_out[table])


def point_label(point: tuple[str, int, int]) -> str:
    dtype_name, numel, count = point
    return f"{dtype_name} {human(numel)} x{count}"


@contextlib.contextmanager
def counted_syncs(device: torch.device) -> Iterator[list[str]]:
    """Host syncs inside the block (CUDA's sync debug mode, "warn"); an empty list on the CPU."""
    syncs: list[str] = []
    if device.type != "cuda":
        yield syncs
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield syncs
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    syncs.extend(str(w.message) for w in caught if SYNC_WARNING in str(w.message))


def torch_can_unscale(dtype_name: str, device: torch.device) -> bool:
    """Whether torch.amp's unscale kernel takes ``dtype_name`` gradients here: its CUDA kernel has no bfloat16
    (``_amp_foreach_non_finite_check_and_unscale_cuda`` "not implemented for 'BFloat16'"), its CPU kernel has."""
    grad = torch.ones(1, dtype=DTYPES[dtype_name], device=device)
    found_inf, inv_scale = torch.zeros(1, device=device), torch.ones(1, device=device)
    try:
        torch._amp_foreach_non_finite_check_and_unscale_([grad], found_inf, inv_scale)
    except (NotImplementedError, RuntimeError):
        return False
    return True


def comparable(points: list[tuple[str, int, int]], device: torch.device) -> list[tuple[str, int, int]]:
    """``points`` without those torch.amp cannot run on ``device`` (said once per dtype: nothing to compare)."""
    refused = sorted({d for d, _, _ in points if not torch_can_unscale(d, device)})
    for dtype_name in refused:
        print(f"  ... {dtype_name}: skipped, torch.amp cannot unscale {dtype_name} gradients on {device.type}")
    return [point for point in points if point[0] not in refused]


# ---------------------------------------------------------------------------------------------- 1. unscale
def unscale_points(quick: bool) -> list[tuple[str, int, int]]:
    if quick:
        return [("float32", 100_000, 10), ("float32", 100_000, 100), ("float16", 100_000, 10)]
    f32 = [(10**7, 10), (10**7, 1000), (10**8, 10), (10**8, 100), (10**8, 1000), (10**8, 10000)]
    f32 += [(10**9, 100), (10**9, 1000)]
    half = [(10**8, 100), (10**9, 1000)]
    return [("float32", n, c) for n, c in f32] + [(d, n, c) for d in ("bfloat16", "float16") for n, c in half]


POINT_HEADER = ["dtype", "elements", "tensors", "dls ms", "torch ms"]


def point_cells(dtype_name: str, numel: int, count: int, times: dict[str, list[float]]) -> list[Any]:
    """The first cells of a row of tables 1 and 2 (``POINT_HEADER``): the point, then dls's and torch's times."""
    return [dtype_name, human(numel), count, f"{median_ms(times['dls']):.3f}", f"{median_ms(times['torch']):.3f}"]


def table_unscale(device: torch.device, args: argparse.Namespace) -> None:
    aa = AA()
    rows: list[list[Any]] = []
    for dtype_name, numel, count in args.budget_of.points(
        "unscale", comparable(unscale_points(args.quick), device), point_label
    ):
        dtype = DTYPES[dtype_name]
        grads, opt, restore = restorable_grads(numel, count, dtype, device)
        ours, theirs = scalers(device)
        _, again = scalers(device)
        inv_scale = torch.tensor(1.0 / SCALE, device=device)
        fp16 = dtype == torch.float16

        def torch_run(scaler: torch.amp.GradScaler, opt: Any = opt, fp16: bool = fp16) -> None:
            torch_unscale_(scaler, opt, fp16)

        cases = {
            "dls": Case(run=lambda o=ours, p=opt: o.unscale_(p), prep=restore, reset=lambda o=ours: close_iteration(o)),
            "torch": Case(run=lambda t=theirs: torch_run(t), prep=restore, reset=theirs.update),
            "torch again": Case(run=lambda t=again: torch_run(t), prep=restore, reset=again.update),
            "floor": Case(run=lambda g=grads, s=inv_scale: torch._foreach_mul_(g, s), prep=restore),
        }
        t = interleave(cases, device, args.reps, args.warmup)
        assert ours.get_num_skipped_steps() == 0, "benchmark gradients overflowed"
        aa_value = aa.add(t, "torch again", "torch")
        r_torch, r_floor = ratio(t, "dls", "torch"), ratio(t, "dls", "floor")
        moved = 2 * numel * dtype.itemsize / statistics.median(t["floor"]) / 1e9
        rows.append(
            [
                *point_cells(dtype_name, numel, count, t),
                f"{median_ms(t['floor']):.3f}",
                f"{moved:.0f}",
                f"{r_torch:.3f}",
                (r_torch, 1.05),
                f"{r_floor:.3f}",
                (r_floor, 1.15) if numel >= 10**8 else "-",
                f"{aa_value:.3f}",
            ]
        )
        print(f"  ... {dtype_name} {human(numel)} x{count}: dls/torch {r_torch:.3f}, dls/floor {r_floor:.3f}")
        del grads, opt, restore, cases, t
    header = [*POINT_HEADER, "floor ms", "floor GB/s", "dls/torch", "<=1.05", "dls/floor", "<=1.15", "A/A"]
    print_judged("1. unscale + inf/NaN check: dls vs torch.amp and vs the bandwidth floor", header, rows, aa)


# ---------------------------------------------------------------------------------------------- 2. clip
def clip_points(quick: bool) -> list[tuple[str, int, int]]:
    if quick:
        return [("float32", 100_000, 10), ("bfloat16", 100_000, 100)]
    f32 = [(10**7, 10), (10**7, 1000), (10**8, 10), (10**8, 100), (10**8, 1000), (10**8, 10000), (10**9, 100)]
    half = [(10**8, 100), (10**9, 1000)]
    return [("float32", n, c) for n, c in f32] + [(d, n, c) for d in ("bfloat16", "float16") for n, c in half]


def table_clip(device: torch.device, args: argparse.Namespace) -> None:
    max_norm = 0.01  # below the unscaled norm at every size: the clip is active
    aa = AA()
    rows: list[list[Any]] = []
    for dtype_name, numel, count in args.budget_of.points(
        "clip", comparable(clip_points(args.quick), device), point_label
    ):
        dtype = DTYPES[dtype_name]
        _, opt, restore = restorable_grads(numel, count, dtype, device)
        params = [p for group in opt.param_groups for p in group["params"]]
        ours, theirs = scalers(device, max_gradient_norm=max_norm)
        _, again = scalers(device)
        fp16 = dtype == torch.float16

        def torch_clip(scaler: torch.amp.GradScaler, opt: Any = opt, params: Any = params, fp16: bool = fp16) -> None:
            torch_unscale_(scaler, opt, fp16)
            torch.nn.utils.clip_grad_norm_(params, max_norm)

        cases = {
            "dls": Case(
                run=lambda o=ours, p=opt: o.clip_gradients_and_return_isfinite(p),
                prep=restore,
                reset=lambda o=ours: close_iteration(o),
            ),
            "torch": Case(run=lambda t=theirs: torch_clip(t), prep=restore, reset=theirs.update),
            "torch again": Case(run=lambda t=again: torch_clip(t), prep=restore, reset=again.update),
        }
        t = interleave(cases, device, args.reps, args.warmup)
        aa_value = aa.add(t, "torch again", "torch")
        value = ratio(t, "dls", "torch")
        lo, hi = spread(t, "dls", "torch")
        rows.append(
            [
                *point_cells(dtype_name, numel, count, t),
                f"{value:.3f}",
                f"[{lo:.2f},{hi:.2f}]",
                (value, 0.7),
                f"{aa_value:.3f}",
            ]
        )
        print(f"  ... {dtype_name} {human(numel)} x{count}: dls/torch {value:.3f}")
        del opt, restore, params, cases, t
    header = [*POINT_HEADER, "dls/torch", "[iqr]", "<=0.7", "A/A"]
    print_judged("2. unscale + global clip: dls vs torch's unscale_ + clip_grad_norm_", header, rows, aa)


# ---------------------------------------------------------------------------------------------- 3. step
def build_lm(quick: bool, device: torch.device) -> tuple[torch.nn.Module, str, int, int]:
    """GPT-2 small (or a tiny one with ``quick``): the model, its description, its vocabulary and context."""
    vocab, context = (512, 32) if quick else (50257, 1024)
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        from bench_step import TinyLM

        width, layers, heads = (64, 2, 2) if quick else (768, 12, 12)
        torch.manual_seed(0)
        model: torch.nn.Module = TinyLM(vocab, width, layers, heads, context)
        source = f"built-in transformer ({layers} layers, width {width}; transformers is not importable)"
    else:
        sizes = {"n_layer": 2, "n_embd": 64, "n_head": 2} if quick else {}
        config = GPT2Config(vocab_size=vocab, n_positions=context, **sizes)
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config)
        source = f"transformers GPT2LMHeadModel ({config.n_layer} layers, width {config.n_embd})"
    params = sum(p.numel() for p in model.parameters())
    return model.to(device), f"{source}, {params / 1e6:.1f}M parameters", vocab, context


def lm_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens[:, :-1])
    logits = out.logits if hasattr(out, "logits") else out
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


STEP_VARIANTS = {
    # name: (fused AdamW, scaler kind, sync_free)
    "AdamW none": (False, "none", False),
    "AdamW torch": (False, "torch", False),
    "AdamW dls": (False, "dls", False),
    "AdamW dls sync_free": (False, "dls", True),
    "fused none": (True, "none", False),
    "fused none again": (True, "none", False),
    "fused torch": (True, "torch", False),
    "fused dls": (True, "dls", False),
}


def table_step(device: torch.device, args: argparse.Namespace) -> None:
    template, description, vocab, context = build_lm(args.quick, device)
    batch = 2 if args.quick else args.batch
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(vocab, (batch, context + 1), generator=gen).to(device)
    print(f"  step table: {description}; batch {batch} x {context} tokens; {amp_dtype} autocast")

    steps: dict[str, Callable[[], None]] = {}
    syncs: dict[str, int] = {}
    host_state: dict[str, bool] = {}  # the optimizer keeps state on the host (AdamW's step counts, not capturable)
    for name, (fused, kind, sync_free) in STEP_VARIANTS.items():
        model = copy.deepcopy(template)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
        scaler: Any = None
        if kind == "torch":
            scaler = torch.amp.GradScaler(device.type)
        elif kind == "dls":
            scaler = dls.GradScaler(device.type, sync_free=sync_free)

        def update_of(model: torch.nn.Module = model, opt: Any = opt, scaler: Any = scaler) -> None:
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()

        def step(model: torch.nn.Module = model, opt: Any = opt, scaler: Any = scaler, update: Any = update_of) -> None:
            with torch.autocast(device.type, dtype=amp_dtype):
                loss = lm_loss(model, tokens)
            (loss if scaler is None else scaler.scale(loss)).backward()
            update()
            opt.zero_grad(set_to_none=True)

        for _ in range(args.preroll):  # past log2(2**16) + 1 updates: the timed steps are those of a long run
            step()
        with torch.autocast(device.type, dtype=amp_dtype):
            loss = lm_loss(model, tokens)
        (loss if scaler is None else scaler.scale(loss)).backward()
        with counted_syncs(device) as found:
            update_of()
        opt.zero_grad(set_to_none=True)
        syncs[name] = len(found)
        host_state[name] = any(
            isinstance(v, torch.Tensor) and v.device.type == "cpu"
            for state in opt.state.values()
            for v in state.values()
        )
        steps[name] = step
    del template
    t = interleave({name: Case(run=fn) for name, fn in steps.items()}, device, args.reps, args.warmup)
    aa = AA()
    aa.add(t, "fused none again", "fused none")
    rows: list[list[Any]] = []
    for name, (fused, kind, sync_free) in STEP_VARIANTS.items():
        if kind != "dls":
            continue
        prefix = "fused" if fused else "AdamW"
        r_torch, r_none = ratio(t, name, f"{prefix} torch"), ratio(t, name, f"{prefix} none")
        # sync_free with state on the host decides the step there: 1 sync (0 with capturable state: masked).
        expected_syncs = 0 if fused or (sync_free and not (host_state[name] and device.type == "cuda")) else 1
        rows.append(
            [
                name,
                f"{median_ms(t[name]):.2f}",
                f"{median_ms(t[prefix + ' torch']):.2f}",
                f"{median_ms(t[prefix + ' none']):.2f}",
                f"{r_torch:.3f}",
                # sync_free with AdamW (not capturable) missed it on the first GPU run (1.065x): now host-decided.
                (r_torch, 1.00) if fused or sync_free else "info",
                f"{r_none:.3f}",
                (r_none, 1.01) if fused else "info",
                syncs[name] if device.type == "cuda" else "n/a",
                expected_syncs,
                ("ok" if syncs[name] == expected_syncs else "MISS") if device.type == "cuda" else "n/a",
            ]
        )
    header = ["variant", "ms", "torch ms", "none ms", "/torch", "<=1.00", "/none", "<=1.01", "syncs", "want", "verdict"]
    print_judged(
        "3. a whole training step: dls vs torch.amp and vs no scaler (A/A: fused none again / fused none)",
        header,
        rows,
        aa,
    )
    if device.type == "cuda":
        torch_syncs = ", ".join(f"{n}: {syncs[n]}" for n in STEP_VARIANTS if "torch" in n)
        print(f"   host syncs per step of torch.amp (for comparison): {torch_syncs}")


# ---------------------------------------------------------------------------------------------- 4. overhead
OVERHEAD_OPTIMIZERS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=1e-6),
    "SGD fused": lambda ps: torch.optim.SGD(ps, lr=1e-6, fused=True),
    "Adam fused": lambda ps: torch.optim.Adam(ps, lr=1e-6, fused=True),
}


def table_overhead(device: torch.device, args: argparse.Namespace) -> None:
    count = 50 if args.quick else 1000
    aa = AA()
    rows: list[list[Any]] = []
    for opt_name, make_opt in args.budget_of.points("overhead", list(OVERHEAD_OPTIMIZERS.items()), lambda p: p[0]):
        cases: dict[str, Case] = {}
        for name in ("dls", "torch", "torch again"):
            gen = torch.Generator().manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(64, generator=gen).to(device)) for _ in range(count)]
            for p in params:
                p.grad = torch.randn(64, generator=gen).to(device) * 1e-3
            opt = make_opt(params)
            scaler: Any = (
                dls.GradScaler(device.type, growth_interval=NO_GROWTH)
                if name == "dls"
                else torch.amp.GradScaler(device.type, growth_interval=NO_GROWTH)
            )
            loss = torch.ones((), device=device, requires_grad=True)

            def iteration(scaler: Any = scaler, opt: Any = opt, loss: torch.Tensor = loss) -> None:
                scaler.scale(loss)
                scaler.step(opt)
                scaler.update()

            cases[name] = Case(run=iteration)
        t = interleave(cases, device, args.reps, args.warmup)
        aa_value = aa.add(t, "torch again", "torch")
        value = ratio(t, "dls", "torch")
        lo, hi = spread(t, "dls", "torch")
        rows.append(
            [
                opt_name,
                count,
                f"{median_ms(t['dls']):.3f}",
                f"{median_ms(t['torch']):.3f}",
                f"{value:.3f}",
                f"[{lo:.2f},{hi:.2f}]",
                f"{aa_value:.3f}",
            ]
        )
    header = ["optimizer", "params", "dls ms", "torch ms", "dls/torch", "[iqr]", "A/A"]
    print_judged(
        "4. host overhead, launch-bound: scale + step + update of small parameters (no target: info)", header, rows, aa
    )


# ---------------------------------------------------------------------------------------------- 5. CUDA graphs
GRAPH_PATHS: dict[str, tuple[str, dict[str, Any], bool, bool]] = {
    # name: (optimizer, its arguments, dls sync_free, torch can capture it too)
    "Adam fused capturable": ("Adam", {"fused": True, "capturable": True}, False, True),
    "AdamW fused capturable": ("AdamW", {"fused": True, "capturable": True}, False, True),
    "Adam capturable sync_free": ("Adam", {"capturable": True}, True, False),
    "SGD sync_free": ("SGD", {"momentum": 0.9}, True, False),
}


def graph_setup(
    device: torch.device, opt_name: str, kwargs: dict[str, Any], scaler: Any, width: int, depth: int
) -> tuple[Callable[[], None], Callable[[], None] | str]:
    """(an eager step, a replay of the captured step or why it could not be captured) on a fresh MLP."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(device)
    opt = getattr(torch.optim, opt_name)(model.parameters(), lr=1e-4, **kwargs)
    x = torch.randn(64, width, device=device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        scaler.scale(model(x).float().pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()

    if device.type != "cuda":
        return step, "needs CUDA"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
    except Exception as error:  # a report, not a crash: what failed is the finding
        return step, f"capture failed: {type(error).__name__}: {str(error)[:80]}"
    return step, graph.replay


def table_graphs(device: torch.device, args: argparse.Namespace) -> None:
    width, depth = (32, 2) if args.quick else (512, 8)
    aa = AA()
    rows: list[list[Any]] = []
    for path, (opt_name, kwargs, sync_free, torch_too) in args.budget_of.points(
        "graphs", list(GRAPH_PATHS.items()), lambda p: p[0]
    ):
        cases: dict[str, Case] = {}
        notes: dict[str, str] = {}
        if device.type != "cuda":  # eager only (a smoke run): capturable optimizers need an accelerator
            kwargs = {k: v for k, v in kwargs.items() if k != "capturable"}
        scalers_for = {"dls": lambda free=sync_free: dls.GradScaler(device.type, sync_free=free)}
        if torch_too:
            scalers_for["torch"] = lambda: torch.amp.GradScaler(device.type)
            scalers_for["torch again"] = lambda: torch.amp.GradScaler(device.type)
        for name, make_scaler in scalers_for.items():
            eager, replay = graph_setup(device, opt_name, kwargs, make_scaler(), width, depth)
            cases[f"{name} eager"] = Case(run=eager)
            if isinstance(replay, str):
                notes[name] = replay
            else:
                cases[f"{name} graph"] = Case(run=replay)
        t = interleave(cases, device, args.reps, args.warmup)
        if torch_too:
            aa.add(t, "torch again eager", "torch eager")
        for name in ("dls", "torch"):
            if name not in scalers_for:
                continue
            eager_ms = f"{median_ms(t[f'{name} eager']):.3f}"
            if name in notes:
                rows.append([path, name, eager_ms, notes[name], "", ""])
                continue
            versus = ""
            if name == "dls" and torch_too and "torch" not in notes:
                versus = f"{ratio(t, 'dls graph', 'torch graph'):.3f}"
            rows.append(
                [
                    path,
                    name,
                    eager_ms,
                    f"{median_ms(t[f'{name} graph']):.3f}",
                    f"{ratio(t, f'{name} graph', f'{name} eager'):.3f}",
                    versus,
                ]
            )
    header = ["path", "scaler", "eager ms", "graph ms", "graph/eager", "dls/torch graph"]
    print_judged(
        "5. CUDA graphs: a whole step captured vs eager (info; A/A: torch eager again / torch eager)", header, rows, aa
    )


# ---------------------------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, reps=21, warmup=3)
    parser.set_defaults(device="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tables", nargs="+", choices=TABLES, default=list(TABLES), help="tables to run (default all)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repetitions: a smoke run (CPU too)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step in the step table (default 8)")
    parser.add_argument("--preroll", type=int, default=20, help="untimed steps per step-table variant (default 20)")
    parser.add_argument("--budget", type=float, help="seconds for the tables' points (default: no limit)")
    args = parser.parse_args(argv)
    args.budget_of = Budget(args.budget, args.tables)
    if args.quick:
        args.reps, args.warmup, args.preroll = min(args.reps, 3), min(args.warmup, 1), min(args.preroll, 2)
    device = setup(args)
    print(f"bench_gpu: {describe(device, args.threads)}")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        print(
            f"  {props.name}: {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; "
            f"driver CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}"
        )
    print("ratios: median over repetitions of time(A) / time(B) in the same round; ok = within target + A/A spread")
    for name in args.tables:
        globals()[f"table_{name}"](device, args)
        args.budget_of.report(name)
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
