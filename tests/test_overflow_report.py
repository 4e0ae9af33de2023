"""``scaler.watch(model)`` and ``scaler.overflow_report()``: where an overflowing step started, through the scaler's
default, fused and sync-free paths, at no kernel's cost on clean steps."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import dls
from conftest import OpLog


def _deep(depth: int = 6) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(depth)])


def _make(model: torch.nn.Module, path: str) -> tuple[torch.optim.Optimizer, dls.GradScaler]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=path == "fused")
    return opt, dls.GradScaler("dynamic", sync_free=path == "sync_free")


def _iteration(
    model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: dls.GradScaler, inject_at: int | None
) -> None:
    handle = None
    if inject_at is not None:  # inf in the gradient arriving at module inject_at
        handle = model[inject_at].register_full_backward_pre_hook(lambda m, g: (g[0] * math.inf,))
    scaler.scale(model(torch.randn(4, 8, requires_grad=True)).sum()).backward()
    if handle is not None:
        handle.remove()
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("path", ["default", "fused", "sync_free"])
@pytest.mark.parametrize("k", [0, 2, 5])
def test_the_report_names_the_module_where_the_overflow_entered_backward(path: str, k: int):
    model = _deep()
    opt, scaler = _make(model, path)
    with scaler.watch(model):
        _iteration(model, opt, scaler, None)  # a real step first: state exists, the paths are the steady ones
        opt.zero_grad()
        assert scaler.overflow_report() is None
        before = [p.detach().clone() for p in model.parameters()]
        _iteration(model, opt, scaler, k)
        report = scaler.overflow_report()  # readable after update()
        assert scaler.step_was_skipped(opt) and report is not None
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        assert report.first_module == f"{k}.0" and report.forward is False
        modules = {name.rsplit(".", 1)[0] for name in report.parameters}
        assert modules == {f"{i}.0" for i in range(k + 1)}  # k and everything before it, nothing after
        assert report.parameters[:2] in ((f"{k}.0.bias", f"{k}.0.weight"), (f"{k}.0.weight", f"{k}.0.bias"))
        assert str(k) in str(report)
        opt.zero_grad()
        _iteration(model, opt, scaler, None)
        assert scaler.overflow_report() is None  # a clean iteration: no report


def test_a_non_finite_loss_is_reported_as_a_forward_overflow():
    model = _deep(2)
    opt, scaler = _make(model, "default")
    scaler.watch(model)
    scaler.scale(model(torch.full((2, 8), math.inf)).sum()).backward()
    scaler.step(opt)
    report = scaler.overflow_report()
    assert report is not None and report.forward is True


def test_without_a_watch_there_is_no_report_and_removed_watches_stop_reporting():
    model = _deep(2)
    opt, scaler = _make(model, "default")
    _iteration(model, opt, scaler, 1)
    assert scaler.step_was_skipped(opt) and scaler.overflow_report() is None
    watch = scaler.watch(model)
    watch.remove()
    opt.zero_grad()
    _iteration(model, opt, scaler, 1)
    assert scaler.overflow_report() is None


def _ops_of_clean_iteration(watch: bool, path: str) -> dict[str, list[str]]:
    model = _deep(3)
    opt, scaler = _make(model, path)
    if watch:
        scaler.watch(model)
    for _ in range(2):  # the second iteration is the steady state
        loss = scaler.scale(model(torch.ones(4, 8)).sum())
        phases: dict[str, Callable[[], Any]] = {
            "backward": loss.backward,
            "step": lambda: scaler.step(opt),
            "update": scaler.update,
        }
        ops = {}
        for name, run in phases.items():
            with OpLog() as log:
                run()
            ops[name] = log.ops
        opt.zero_grad()
    return ops


@pytest.mark.parametrize("path", ["default", "fused", "sync_free"])
def test_clean_steps_run_the_same_kernels_with_and_without_a_watch(path: str):
    watched, plain = _ops_of_clean_iteration(True, path), _ops_of_clean_iteration(False, path)
    assert watched["backward"] == plain["backward"]
    # update() runs the same kernels, or fewer where the watch made the flag known on the host (fused, sync-free):
    # a rule whose flag is known skips the skip count and the clamps that cannot bind.
    assert watched["update"] == plain["update"] or len(watched["update"]) < len(plain["update"])
    if path == "default":  # the flag is read there anyway
        assert watched["step"] == plain["step"]
    else:  # the fused and sync-free paths read the flag once while a watch is active: no kernel besides that read
        extra = list(watched["step"])
        extra.remove("aten._local_scalar_dense.default")
        assert extra == plain["step"]
