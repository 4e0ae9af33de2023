"""Recording a scaler's rule steps (``scaler.record``, ``dls.diagnostics.record``): what each line holds, measured
independently; that the model hooks' overflow scales decide where a step overflows; no host read on the fused and
sync-free paths; the file format (versioned, readable by pandas, resume). Every trace recorded here is read back by
the reader that checks the format (``dls.diagnostics.trace``, whose own tests are ``test_trace.py``)."""

from __future__ import annotations

import copy
import io
import json
import math
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import dls
from conftest import from_dls, host_reads
from dls.diagnostics.record import recording
from dls.diagnostics.trace import TRACE_VERSION, read_trace


def mlp(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
        torch.nn.Linear(64, 4),
    )  # fmt: skip


def data(step: int, scale_x: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(256, 16, generator=gen) * scale_x, torch.randn(256, 4, generator=gen)


def fp16_loss(model: torch.nn.Module, step: int, spike: float = 1.0) -> torch.Tensor:
    x, y = data(step)
    device = next(model.parameters()).device
    with torch.autocast(device.type, dtype=torch.float16):
        out = model(x.to(device))
    return torch.nn.functional.mse_loss(out.float(), y.to(device)) * spike


def record_run(
    scaler: dls.GradScaler,
    steps: int,
    *,
    model: torch.nn.Module | None = None,
    spikes: dict[int, float] | None = None,
    hooks: bool = True,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    observe: Callable[[int, dls.GradScaler, torch.nn.Module, torch.optim.Optimizer], None] | None = None,
    **record: Any,
) -> tuple[Any, list[dict[str, Any]]]:
    """Train ``model`` (default ``mlp()``) in float16 autocast for ``steps`` steps while recording; returns the trace
    and, per step, what the scaler saw: the scale used, whether skipped."""
    model = mlp() if model is None else model
    opt = (optimizer or (lambda p: torch.optim.Adam(p, lr=1e-3)))(model.parameters())
    buf = io.BytesIO()
    seen = []
    with scaler.record(buf, model=model if hooks else None, **record):
        for step in range(steps):
            scale = scaler.get_scale()
            scaler.scale(fp16_loss(model, step, (spikes or {}).get(step, 1.0))).backward()
            scaler.step(opt)
            seen.append({"scale": scale, "skipped": scaler.step_was_skipped(opt)})
            if observe is not None:
                observe(step, scaler, model, opt)
            scaler.update()
            opt.zero_grad()
    buf.seek(0)
    return read_trace(buf), seen


def test_each_line_holds_the_scale_used_and_the_skip_decision() -> None:
    scaler = dls.GradScaler("cpu", init_scale=2.0**16, growth_interval=5)
    trace, seen = record_run(scaler, 40, spikes={12: 2.0**20, 13: 2.0**20}, flush_every=7, histogram_every=5)
    header = trace.segments[0].header
    assert header["format"] == "dls-trace" and header["version"] == TRACE_VERSION
    assert header["settings"]["steps_per_increase"] == 5 and header["settings"]["dialect"] == "torch"
    assert header["state"]["loss_scale"] == 2.0**16
    steps = trace.steps
    assert [r["step"] for r in steps] == list(range(1, 41))
    assert [r["scale"] for r in steps] == [s["scale"] for s in seen]
    assert [r["overflow"] for r in steps] == [s["skipped"] for s in seen]
    assert sum(r["overflow"] for r in steps) >= 3  # the start at 2**16, the spikes
    assert all(r["grad_amax"] is None for r in steps if r["overflow"])
    assert [r["step"] for r in steps if "exponents" in r] == list(range(5, 41, 5))


def test_grad_amax_and_histogram_match_the_gradients_and_leave_them_bit_identical() -> None:
    expected: dict[int, tuple[float, dict[int, int]]] = {}
    after: dict[int, list[torch.Tensor]] = {}

    def observe(step: int, scaler: dls.GradScaler, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        grads = [p.grad for p in model.parameters()]
        amax = max(float(g.abs().max()) for g in grads)
        values = torch.cat([g.flatten() for g in grads]).abs()
        values = values[values >= 2.0**-126]
        exponents = torch.frexp(values).exponent - 1
        expected[step + 1] = (amax, dict(zip(*[t.tolist() for t in torch.unique(exponents, return_counts=True)])))
        after[step + 1] = [g.clone() for g in grads]

    scaler = dls.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    model = mlp()
    trace, _ = record_run(scaler, 6, model=model, observe=observe, histogram_every=2, hooks=False)
    for row in trace.steps:
        amax, histogram = expected[row["step"]]
        assert row["grad_amax"] == amax
        if "exponents" in row:
            low, counts = row["exponents"]["min"], row["exponents"]["counts"]
            assert {low + i: c for i, c in enumerate(counts) if c} == histogram
    # update(), where the recorder reads the gradients (negating them in place and back on a CPU), leaves them
    # as they were, bit for bit
    model2 = mlp()
    opt = torch.optim.SGD(model2.parameters(), lr=0.0)
    scaler = dls.GradScaler("cpu", init_scale=2.0**10)
    with scaler.record(io.BytesIO(), histogram_every=1):
        scaler.scale(fp16_loss(model2, 0)).backward()
        scaler.step(opt)
        before = [p.grad.clone() for p in model2.parameters()]
        scaler.update()
    for a, b in zip(before, [p.grad for p in model2.parameters()]):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def overflows_at(model: torch.nn.Module, step: int, scale: float, loss: Callable[..., torch.Tensor]) -> bool:
    m = copy.deepcopy(model)
    (loss(m, step) * scale).backward()
    return not all(bool(torch.isfinite(p.grad).all()) for p in m.parameters() if p.grad is not None)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_model_hooks_overflow_scale_decides_where_a_step_overflows(seed: int) -> None:
    """The smallest ``module_overflow_scale`` of a clean step is where it starts to overflow: at every power of two
    from 2**0 to 2**40, the same step (same weights, same batch) overflows exactly above it. The overflow arises in
    the float16 weight gradients of autocast's matmuls, which no module output carries."""
    model = mlp(seed)
    copy_ = copy.deepcopy(model)
    scaler = dls.GradScaler("cpu", init_scale=2.0**4)
    trace, _ = record_run(scaler, 1, model=copy_, optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
    row = trace.steps[0]
    assert not row["overflow"]
    bound = min(v for v in row["module_overflow_scale"] if v is not None)
    assert bound > row["scale"]
    for k in range(0, 41):
        assert overflows_at(model, 0, 2.0**k, fp16_loss) == (2.0**k > bound), k


def test_the_model_hooks_decide_on_a_small_gpt() -> None:
    train = pytest.importorskip("dls.train.config")
    from dls.train import data as train_data

    cfg = train.load_config(Path(__file__).resolve().parents[1] / "configs" / "transformer_lm_fp16_dls.yaml")
    batches = train_data.build_batches(cfg.data, 0, "train")
    torch.manual_seed(0)
    model = train_data.build_model(cfg.model, batches.dataset.info)
    batch = batches.next()

    def loss(m: torch.nn.Module, step: int) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return m.loss(batch)

    scaler = dls.GradScaler("cpu", init_scale=2.0**4)
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    buf = io.BytesIO()
    with scaler.record(buf, model=m):
        scaler.scale(loss(m, 0)).backward()
        scaler.step(opt)
        scaler.update()
    buf.seek(0)
    row = read_trace(buf).steps[0]
    bound = min(v for v in row["module_overflow_scale"] if v is not None)
    first = math.floor(math.log2(bound)) + 1
    for k in (first - 2, first - 1, first, first + 1):
        assert overflows_at(model, 0, 2.0**k, loss) == (k >= first), k


@pytest.mark.parametrize("path", ["fused", "sync_free"])
def test_recording_adds_no_host_read_on_the_fused_and_sync_free_paths(path: str, device: torch.device) -> None:
    def run(record: bool) -> int:
        model = mlp().to(device)
        fused = path == "fused"
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused)
        scaler = dls.GradScaler(device.type, init_scale=2.0**8, sync_free=not fused)
        recorder = scaler.record(io.BytesIO(), histogram_every=3, flush_every=50) if record else None
        for step in range(2):  # state exists (the first step reads the flag on these paths)
            scaler.scale(fp16_loss(model, step)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        with host_reads() as calls:
            for step in range(2, 12):
                scaler.scale(fp16_loss(model, step)).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
        if recorder is not None:
            recorder.close()
        return len(from_dls(calls))

    assert run(record=True) == run(record=False)


def test_rows_are_buffered_and_written_every_flush_every_steps() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = dls.GradScaler("cpu", init_scale=2.0**8)
    buf = io.BytesIO()
    recorder = scaler.record(buf, flush_every=4, histogram_every=None)

    def lines() -> int:
        return len([line for line in buf.getvalue().decode().splitlines() if '"step"' in line])

    written = []
    for step in range(9):
        scaler.scale(fp16_loss(model, step)).backward()
        scaler.step(opt)
        scaler.update()
        written.append(lines())
    # the rows of a full buffer are copied at once and written at the next flush (no wait on an accelerator)
    assert written == [0, 0, 0, 0, 0, 0, 0, 4, 4]
    recorder.flush()
    assert lines() == 9
    recorder.close()
    assert recording(scaler) is None
    recorder.close()  # again: nothing happens


def test_record_refuses_bad_arguments_before_anything_changes(tmp_path: Path) -> None:
    scaler = dls.GradScaler("cpu")
    with pytest.raises(ValueError, match="flush_every must be an integer from 1"):
        scaler.record(tmp_path / "t.jsonl", flush_every=0)
    with pytest.raises(ValueError, match="histogram_every must be an integer from 1"):
        scaler.record(tmp_path / "t.jsonl", histogram_every=-1)
    with pytest.raises(ValueError, match=r"model must be a torch\.nn\.Module"):
        scaler.record(tmp_path / "t.jsonl", model="model")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="model_format must be None or one of"):
        scaler.record(tmp_path / "t.jsonl", model=mlp(), model_format="float17")
    with pytest.raises(ValueError, match="file must be a path or a binary file object"):
        scaler.record(42)  # type: ignore[arg-type]
    assert not (tmp_path / "t.jsonl").exists() and recording(scaler) is None
    with pytest.raises(ValueError, match="the scaler is disabled"):
        dls.GradScaler("cpu", enabled=False).record(tmp_path / "t.jsonl")
    with scaler.record(tmp_path / "t.jsonl"), pytest.raises(ValueError, match="already recording into"):
        scaler.record(tmp_path / "u.jsonl")


def test_a_recording_scaler_pickles_without_its_recorder(tmp_path: Path) -> None:
    scaler = dls.GradScaler("cpu")
    with scaler.record(tmp_path / "t.jsonl"):
        clone = pickle.loads(pickle.dumps(scaler))
        assert recording(clone) is None
        assert recording(copy.deepcopy(scaler)) is None


def test_the_model_hooks_are_removed_and_a_paused_recorder_measures_nothing() -> None:
    model = mlp()
    forward_hooks = sum(len(m._forward_hooks) for m in model.modules())
    scaler = dls.GradScaler("cpu", init_scale=2.0**4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    buf = io.BytesIO()
    with scaler.record(buf, model=model) as recorder:
        with recorder.paused():
            scaler.scale(fp16_loss(model, 0)).backward()
        scaler.step(opt)
        scaler.update()
    assert sum(len(m._forward_hooks) for m in model.modules()) == forward_hooks
    buf.seek(0)
    assert read_trace(buf).steps[0]["module_overflow_scale"] == [None] * len(list(model.modules()))


def test_a_trace_reads_back_with_pandas_and_line_by_line(tmp_path: Path) -> None:
    pandas = pytest.importorskip("pandas")
    scaler = dls.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    path = tmp_path / "trace.jsonl"
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with scaler.record(path, model=model, histogram_every=2):
        for step in range(5):
            scaler.scale(fp16_loss(model, step)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    frame = pandas.read_json(path, lines=True)
    steps = frame[frame["format"].isna()]
    assert list(steps["step"]) == [1, 2, 3, 4, 5]
    assert list(steps["scale"]) == [r["scale"] for r in read_trace(path).steps]
    for line in path.read_text().splitlines():
        json.loads(line)  # plain JSON: no NaN or Infinity
