"""The headline claim of dynamic loss scaling, measured: float16 + DLS trains as well as float32, faster and in less
memory (Cerebras' DLS guide), side by side with bfloat16, in one run (issue 37, item 1).

Runs with a plain ``python3`` that has torch and transformers (the GPU machine has no virtual environment): dls is
imported from ``src/`` beside this directory. Every run builds its model from the same seed (a transformers config,
random initialisation, on the device), trains it with fused AdamW (lr 3e-4 after a 20-step linear warm-up, betas
0.9/0.95, weight decay 0.1, no clipping) on the same synthetic tokens, and reads nothing on the host while it trains
(losses and CUDA events are read at the end):

1. ``headline`` -- GPT-2 small (124M parameters, ``GPT2LMHeadModel``, 4 x 1024 tokens a step) and a 1.1B-parameter
   Llama (TinyLlama-1.1B's sizes: 22 layers, width 2048, ``LlamaForCausalLM``, 2 x 512 tokens a step), 200 steps
   each, in float32 (torch's default: no TF32), bfloat16 autocast and float16 autocast with ``dls.GradScaler``:
   median step time, tokens/s, ``torch.cuda.max_memory_allocated``, the loss at steps 50, 100 and 200, skipped
   steps. Verdicts of the float16 + dls rows: *as well* = its loss at the last step within 5 % of float32's (the
   same batches: the batch-to-batch noise is common to all rows); *faster* = more tokens/s than float32; *less
   memory* = a lower peak than float32.
2. ``underflow`` -- the loss multiplied by 1e-5 (GPT-2 small, 2 x 512 tokens, 100 steps): float32, float16 autocast
   without a scaler, float16 autocast with dls. The gradients of float16's backward fall below its smallest
   subnormal (6e-8) and are lost without a scaler: its loss *stalls* (it falls by less than half as much as
   float32's); with dls it *matches* float32 (the last loss within 5 %).
3. ``masters`` -- float16 parameters with dls's float32 master weights (``dls.master_weights``, no autocast) against
   table 1's float32 parameters with float16 autocast + dls, both models, 50 steps: step time and peak memory (for
   information: masters save memory where activations dominate and cost it where parameters and optimizer state
   do, ``dls.master_weights``'s docstring).

The tokens: random walks on a fixed random graph over 1,024 of the vocabulary's tokens, 4 successors each (the
lowest loss reachable is ln 4 = 1.39; a model that learns only which tokens occur stays at ln 1024 = 6.93), drawn
once from the seed: every run sees the same batches in the same order.

``--budget SECONDS`` shares the time among the runs by their estimated cost (``estimate_seconds``: a run that
reaches its share stops there, its later losses shown as ``-``, so the runs after it keep theirs). The estimate
for an H100/H200 (printed at the start): 6 x parameters x tokens FLOPs a step at an effective 100 TFLOP/s in
float16/bfloat16 (GPT-2 small's whole step measured on the H200, benchmarks/RESULTS.md: 61.6 ms for 8 x 1024
tokens) and 35 TFLOP/s in float32 (no TF32: the datasheet's 67 TFLOP/s of float32 at about half), plus the model
builds: about 2 minutes for every run of the three tables.

    python3 benchmarks/claim_gpu.py                    # on CUDA (about 2 minutes on an H200, by the estimate)
    python3 benchmarks/claim_gpu.py --budget 130       # as scripts/gpu-check runs it
    python3 benchmarks/claim_gpu.py --quick            # tiny models, a few steps: the CPU too (no figure)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import _this_tree  # noqa: F401  (first: puts this tree's src/ on the path)
import torch
from bench_scaler import print_table

import dls

LR, WARMUP, BETAS, WEIGHT_DECAY = 3e-4, 20, (0.9, 0.95), 0.1
STATES, SUCCESSORS = 1024, 4  # the token graph: ln(4) is the lowest loss a model can reach on it
CHECKPOINTS = (50, 100, 200)  # the steps whose loss table 1 prints (scaled to --steps)
UNDERFLOW_FACTOR = 1e-5
TOLERANCE = 0.05  # "as well" / "matches": the last loss within 5 % of float32's
# The estimate's effective rates (FLOP/s of 6 x parameters x tokens a step) on an H100/H200.
RATES = {"float32": 35e12, "bfloat16": 100e12, "float16": 100e12}
BUILD_SECONDS_PER_BILLION = 4.0  # building a model on the device, its first step (cuBLAS, allocator) included


@dataclasses.dataclass(frozen=True)
class Spec:
    """A model: its transformers class and config, and the batch of one step."""

    label: str
    family: str  # "gpt2" or "llama"
    config: dict[str, Any]
    batch: int
    seq: int
    params: float  # parameters, for the estimate before the model is built

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


GPT2 = {"vocab_size": 50257, "n_positions": 1024, "n_layer": 12, "n_embd": 768, "n_head": 12}
TINYLLAMA = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
}
TINY_GPT2 = {"vocab_size": 2048, "n_positions": 64, "n_layer": 2, "n_embd": 64, "n_head": 2, "bos_token_id": 0,
             "eos_token_id": 0}  # fmt: skip
TINY_LLAMA = {
    "vocab_size": 2048,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def specs(quick: bool) -> dict[str, Spec]:
    """The models of each table: ``headline`` (and ``masters``) and ``underflow``."""
    if quick:
        gpt2 = Spec("GPT-2 small (tiny: --quick)", "gpt2", TINY_GPT2, 2, 32, 0.2e6)
        llama = Spec("Llama 1.1B (tiny: --quick)", "llama", TINY_LLAMA, 2, 32, 0.3e6)
        return {"gpt2": gpt2, "llama": llama, "underflow": gpt2}
    return {
        "gpt2": Spec("GPT-2 small", "gpt2", GPT2, 4, 1024, 124.4e6),
        "llama": Spec("Llama 1.1B", "llama", TINYLLAMA, 2, 512, 1.1e9),
        "underflow": Spec("GPT-2 small", "gpt2", GPT2, 2, 512, 124.4e6),
    }


def build(spec: Spec, device: torch.device, seed: int) -> torch.nn.Module:
    """The model, initialised from ``seed`` on ``device`` itself (a 1.1B model's initialisation on the host would
    take longer than its training here): the same seed and device give the same weights."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    config: Any
    if spec.family == "gpt2":
        config, model_class = GPT2Config(**spec.config), GPT2LMHeadModel
    else:
        config, model_class = LlamaConfig(**spec.config), LlamaForCausalLM
    config._attn_implementation = "sdpa"  # the same kernels on every machine and transformers version
    torch.manual_seed(seed)
    with device:
        model = model_class(config)
    return model


def token_walks(spec: Spec, steps: int, seed: int) -> torch.Tensor:
    """``steps`` batches of ``spec.batch`` sequences of ``spec.seq + 1`` tokens (int64, on the host): random walks
    on a graph of ``STATES`` tokens of the vocabulary, ``SUCCESSORS`` random successors each."""
    gen = torch.Generator().manual_seed(seed)
    vocab = spec.config["vocab_size"]
    states = min(STATES, vocab)
    token_of = torch.randperm(vocab, generator=gen)[:states]
    successors = torch.randint(states, (states, SUCCESSORS), generator=gen)
    count = steps * spec.batch
    walk = torch.empty(count, spec.seq + 1, dtype=torch.long)
    walk[:, 0] = torch.randint(states, (count,), generator=gen)
    choices = torch.randint(SUCCESSORS, (count, spec.seq), generator=gen)
    for t in range(spec.seq):
        walk[:, t + 1] = successors[walk[:, t], choices[:, t]]
    return token_of[walk].view(steps, spec.batch, spec.seq + 1)


# ---------------------------------------------------------------------------------------------- one run
@dataclasses.dataclass(frozen=True)
class Way:
    """How a run trains: the parameters' dtype, the autocast dtype, whether dls scales, whether masters."""

    name: str
    params: torch.dtype = torch.float32
    autocast: torch.dtype | None = None
    dls: bool = False
    masters: bool = False

    @property
    def rate_key(self) -> str:
        return "float32" if self.autocast is None and self.params == torch.float32 else "float16"


FLOAT32 = Way("float32")
BFLOAT16 = Way("bfloat16 autocast", autocast=torch.bfloat16)
FLOAT16_DLS = Way("float16 autocast + dls", autocast=torch.float16, dls=True)
FLOAT16_NONE = Way("float16 autocast, no scaler", autocast=torch.float16)
MASTERS = Way("float16 params + dls masters", params=torch.float16, dls=True, masters=True)


@dataclasses.dataclass
class Run:
    """What one run measured (``losses`` per step done; ``stopped``: the budget ended it early)."""

    spec: Spec
    way: Way
    steps: int
    losses: list[float] = dataclasses.field(default_factory=list)
    step_seconds: list[float] = dataclasses.field(default_factory=list)
    peak_bytes: int | None = None
    skipped: int | None = None
    stopped: bool = False
    params: int = 0
    seconds: float = 0.0

    def loss_at(self, step: int) -> float | None:
        return self.losses[step - 1] if 0 < step <= len(self.losses) else None

    @property
    def median_step(self) -> float | None:
        timed = self.step_seconds[min(10, len(self.step_seconds) // 4) :]
        return statistics.median(timed) if timed else None


def estimate_seconds(spec: Spec, way: Way, steps: int) -> float:
    """Seconds of a run on an H100/H200 by the module docstring's rates."""
    return 6 * spec.params * spec.tokens * steps / RATES[way.rate_key] + BUILD_SECONDS_PER_BILLION * max(
        spec.params / 1e9, 0.25
    )


def train(
    spec: Spec,
    way: Way,
    steps: int,
    data: torch.Tensor,
    device: torch.device,
    deadline: float,
    factor: float = 1.0,
    seed: int = 0,
) -> Run:
    """One run of ``steps`` steps (fewer when ``deadline`` passes first). The loss is multiplied by ``factor`` for
    the backward; the loss recorded is the model's, before it."""
    started = time.monotonic()
    run = Run(spec, way, steps)
    model = build(spec, device, seed).to(way.params)
    run.params = sum(p.numel() for p in model.parameters())
    opt: torch.optim.Optimizer = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, fused=True
    )
    if way.masters:
        opt = dls.master_weights(opt)
    scaler = dls.GradScaler(device.type) if way.dls else None
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    losses: list[torch.Tensor] = []
    events: list[tuple[Any, Any]] = []
    host_times: list[float] = []
    for step in range(steps):
        if time.monotonic() > deadline:
            run.stopped = True
            break
        for group in opt.param_groups:  # the warm-up by iteration (a host float: no read of the device)
            group["lr"] = LR * min(1.0, (step + 1) / WARMUP)
        tokens = data[step]
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        else:
            t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=way.autocast) if way.autocast else contextlib.nullcontext():
            logits = model(tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        scaled = loss * factor if factor != 1.0 else loss
        if scaler is None:
            scaled.backward()
            opt.step()
        else:
            scaler.scale(scaled).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if cuda:
            end.record()
            events.append((begin, end))
        else:
            host_times.append(time.perf_counter() - t0)
        del logits, loss, scaled
    if cuda:
        torch.cuda.synchronize(device)
        run.step_seconds = [b.elapsed_time(e) / 1e3 for b, e in events]
        run.peak_bytes = torch.cuda.max_memory_allocated(device)
    else:
        run.step_seconds = host_times
    run.losses = torch.stack(losses).float().tolist() if losses else []
    run.skipped = scaler.get_num_skipped_steps() if scaler is not None else None
    del model, opt, scaler
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    run.seconds = time.monotonic() - started
    return run


# ---------------------------------------------------------------------------------------------- the plan
@dataclasses.dataclass
class Planned:
    table: str
    spec: Spec
    way: Way
    steps: int
    factor: float = 1.0
    run: Run | None = None


def plan(quick: bool, steps: int) -> list[Planned]:
    """Every run, in the order they run: GPT-2 small first (its three tables), then the 1.1B model."""
    s = specs(quick)
    few = max(2, steps // 4)
    under = max(2, steps // 2)
    out = [Planned("headline", s["gpt2"], way, steps) for way in (FLOAT32, BFLOAT16, FLOAT16_DLS)]
    out.append(Planned("masters", s["gpt2"], MASTERS, few))
    out += [Planned("underflow", s["underflow"], way, under, UNDERFLOW_FACTOR) for way in (FLOAT32, FLOAT16_NONE)]
    out.append(Planned("underflow", s["underflow"], FLOAT16_DLS, under, UNDERFLOW_FACTOR))
    out += [Planned("headline", s["llama"], way, steps) for way in (FLOAT32, BFLOAT16, FLOAT16_DLS)]
    out.append(Planned("masters", s["llama"], MASTERS, few))
    return out


def deadlines(planned: Sequence[Planned], budget: float | None, start: float) -> list[float]:
    """Each run's deadline: ``start`` plus its share of ``budget`` and the shares before it (by the estimate)."""
    if budget is None:
        return [math.inf] * len(planned)
    costs = [estimate_seconds(p.spec, p.way, p.steps) for p in planned]
    total, spent, out = sum(costs), 0.0, []
    for cost in costs:
        spent += cost
        out.append(start + budget * spent / total)
    return out


# ---------------------------------------------------------------------------------------------- the tables
def fmt_loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def fmt_mib(run: Run) -> str:
    return "n/a" if run.peak_bytes is None else f"{run.peak_bytes / 2**20:.0f}"


def checkpoints(steps: int, marks: Sequence[int] = CHECKPOINTS) -> list[int]:
    """``marks`` (steps of a 200-step run) scaled to a run of ``steps``, after its first step."""
    return sorted({max(2, round(m * steps / marks[-1])) for m in marks})


def ratio_text(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.3f}"


def headline_rows(runs: list[Run]) -> list[list[str]]:
    rows = []
    marks = checkpoints(runs[0].steps)
    base = runs[0]  # float32
    for run in runs:
        step = run.median_step
        tps = f"{run.spec.tokens / step:,.0f}" if step else "-"
        last = run.loss_at(run.steps)
        verdicts = ["", "", ""]
        if run.way is FLOAT16_DLS:
            base_last, base_step = base.loss_at(base.steps), base.median_step
            verdicts = [
                judge(close_to(last, base_last)),
                judge(step is not None and base_step is not None and step < base_step),
                "n/a" if run.peak_bytes is None or base.peak_bytes is None else judge(run.peak_bytes < base.peak_bytes),
            ]
        rows.append(
            [
                run.spec.label,
                run.way.name,
                f"{len(run.losses)}{' (budget)' if run.stopped else ''}",
                f"{step * 1e3:.2f}" if step else "-",
                tps,
                ratio_text(base.median_step, step),
                fmt_mib(run),
                ratio_text(run.peak_bytes, base.peak_bytes),
                *(fmt_loss(run.loss_at(m)) for m in marks),
                "-" if run.skipped is None else str(run.skipped),
                *verdicts,
            ]
        )
    return rows


def judge(ok: bool) -> str:
    return "ok" if ok else "MISS"


def close_to(loss: float | None, reference: float | None) -> bool:
    """``loss`` within ``TOLERANCE`` of ``reference`` (relative): "as well", "matches"."""
    return loss is not None and reference is not None and abs(loss - reference) <= TOLERANCE * reference


def print_headline(groups: list[list[Run]]) -> None:
    marks = checkpoints(groups[0][0].steps)
    header = ["model", "precision", "steps", "step ms", "tokens/s", "speed-up", "peak MiB", "mem ratio"]
    header += [f"loss@{m}" for m in marks] + ["skipped", "as well", "faster", "less mem"]
    rows = [row for runs in groups for row in headline_rows(runs)]
    print_table(
        "1. the headline claim: float32 / bfloat16 / float16 + dls, the same seed, fused AdamW "
        "(speed-up and mem ratio against float32)",
        header,
        rows,
    )
    for runs in groups:
        print(f"   {runs[0].spec.label}: {runs[0].params / 1e6:.1f}M parameters, {runs[0].spec.batch} x "
              f"{runs[0].spec.seq} tokens a step")  # fmt: skip
    print("   as well: the last loss within 5 % of float32's; faster: a shorter step; less mem: a lower peak")


def print_underflow(runs: list[Run]) -> None:
    marks = checkpoints(runs[0].steps, (25, 50, 100))
    base = runs[0]
    base_drop, base_last = drop(base), base.loss_at(base.steps)
    rows = []
    for run in runs:
        d, last = drop(run), run.loss_at(run.steps)
        stalls = matches = ""
        if run.way is FLOAT16_NONE:
            stalls = judge(d is not None and base_drop is not None and base_drop > 0 and d < 0.5 * base_drop)
        elif run.way is FLOAT16_DLS:
            matches = judge(close_to(last, base_last))
        rows.append(
            [
                run.way.name,
                f"{len(run.losses)}{' (budget)' if run.stopped else ''}",
                fmt_loss(run.loss_at(1)),
                *(fmt_loss(run.loss_at(m)) for m in marks),
                "-" if d is None else f"{d:.4f}",
                "-" if run.skipped is None else str(run.skipped),
                stalls,
                matches,
            ]
        )
    header = ["precision", "steps", "loss@1", *(f"loss@{m}" for m in marks), "drop", "skipped", "stalls", "matches"]
    print_table(
        f"2. underflow: the loss x {UNDERFLOW_FACTOR:g} ({runs[0].spec.label}, {runs[0].spec.batch} x "
        f"{runs[0].spec.seq} tokens): float16 without a scaler stalls, with dls it matches float32",
        header,
        rows,
    )
    print("   drop: loss@1 - the last loss; stalls: a drop under half float32's (which must fall); matches: the last")
    print("   loss within 5 % of float32's")


def drop(run: Run) -> float | None:
    first, last = run.loss_at(1), run.loss_at(run.steps)
    return None if first is None or last is None else first - last


def print_masters(pairs: list[tuple[Run, Run]]) -> None:
    rows = []
    for autocast, masters in pairs:
        steps = len(masters.losses)
        for run in (autocast, masters):
            step = run.median_step
            rows.append(
                [
                    run.spec.label,
                    run.way.name if run is masters else "float32 params + float16 autocast + dls",
                    f"{step * 1e3:.2f}" if step else "-",
                    ratio_text(step, autocast.median_step),
                    fmt_mib(run),
                    ratio_text(run.peak_bytes, autocast.peak_bytes),
                    fmt_loss(run.loss_at(steps)),
                ]
            )
    print_table(
        "3. float16 parameters with dls's float32 master weights vs float32 parameters (float16 autocast + dls; info)",
        ["model", "parameters", "step ms", "time ratio", "peak MiB", "mem ratio", "loss@last"],
        rows,
    )
    print("   loss@last: at the masters run's last step, for both rows (table 1's run, the same batches)")


# ---------------------------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny models, a few steps: a smoke run (CPU too)")
    parser.add_argument("--steps", type=int, help="steps of table 1's runs (default 200, 4 with --quick)")
    parser.add_argument("--budget", type=float, help="seconds for all the runs (default: no limit)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch.cuda.is_available() is False")
    steps = args.steps or (4 if args.quick else CHECKPOINTS[-1])
    if steps < 2:
        raise SystemExit(f"--steps must be at least 2, got {steps}")
    if device.type == "cpu":
        torch.set_num_threads(1)
    started = time.monotonic()
    planned = plan(args.quick, steps)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    estimate = sum(estimate_seconds(p.spec, p.way, p.steps) for p in planned)
    print(f"claim_gpu: torch {torch.__version__} on {where}; {len(planned)} runs; estimated {estimate:.0f} s on an "
          f"H100/H200; budget {args.budget or 'none'}")  # fmt: skip
    data: dict[str, torch.Tensor] = {}  # per model and batch: the same tokens for every run of it
    for p, deadline in zip(planned, deadlines(planned, args.budget, started)):
        key = f"{p.spec.label} {p.spec.batch}x{p.spec.seq}"
        if key not in data:
            steps_of_spec = max(q.steps for q in planned if q.spec == p.spec)
            data[key] = token_walks(p.spec, steps_of_spec, args.seed).to(device)  # a few MB: no copy per step
        p.run = train(p.spec, p.way, p.steps, data[key], device, deadline, p.factor, args.seed)
        last = p.run.loss_at(len(p.run.losses))
        step = "-" if p.run.median_step is None else f"{p.run.median_step * 1e3:.2f}"
        print(f"  ... {p.table}: {p.spec.label}, {p.way.name}: {len(p.run.losses)} steps in {p.run.seconds:.1f} s, "
              f"{step} ms/step, last loss {fmt_loss(last)}", flush=True)  # fmt: skip

    def runs(table: str, spec_key: str | None = None) -> list[Run]:
        wanted = specs(args.quick)[spec_key] if spec_key else None
        return [p.run for p in planned if p.table == table and p.run and (wanted is None or p.spec == wanted)]

    print_headline([runs("headline", "gpt2"), runs("headline", "llama")])
    print_underflow(runs("underflow"))
    pairs = []
    for key in ("gpt2", "llama"):
        autocast = next(r for r in runs("headline", key) if r.way is FLOAT16_DLS)
        pairs.append((autocast, runs("masters", key)[0]))
    print_masters(pairs)
    print(f"\nclaim_gpu: {time.monotonic() - started:.0f} s in all (estimate {estimate:.0f} s)")


if __name__ == "__main__":
    main()
