"""OverflowWatch: where a step's gradients overflowed, in backward order, at no cost to clean steps.

Overflows are injected with a full backward pre-hook that puts an inf into the gradient arriving at one module's
output; the report must name that module first, list its parameters, and none of the modules between it and the
loss (whose gradients backward produced before the inf existed).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import OrderedDict
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dls
from conftest import OpLog
from dls.diagnostics import OverflowReport, OverflowWatch

DEPTH = 6


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x))


def deep_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        OrderedDict(
            embed=nn.Linear(4, 8),
            blocks=nn.Sequential(*[Block(8) for _ in range(DEPTH)]),
            head=nn.Linear(8, 1),
        )
    )


def batch(seed: int = 1) -> torch.Tensor:
    return torch.randn(16, 4, generator=torch.Generator().manual_seed(seed))


def inject_inf(module: nn.Module) -> Any:
    """Make the gradient arriving at ``module``'s output hold one inf."""

    def pre_hook(_module: nn.Module, grad_output: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        g = grad_output[0].clone()
        g[0, 0] = math.inf
        return (g, *grad_output[1:])

    return module.register_full_backward_pre_hook(pre_hook)


def module_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


@pytest.mark.parametrize("emulated", [False, True], ids=["float32", "emulated-float16"])
@pytest.mark.parametrize("k", [0, 2, DEPTH - 1])
def test_report_names_the_injected_module_first(k: int, emulated: bool) -> None:
    model = deep_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = copy.deepcopy(model.state_dict())
    scaler = dls.GradScaler(loss_scale="dynamic", init_scale=2.0**10)
    watch = OverflowWatch(model)
    target = f"blocks.{k}.lin"
    handle = inject_inf(model.get_submodule(target))
    emulation = dls.emulate(model, "float16") if emulated else None
    loss = loss_of(model, batch())
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    if emulation is not None:
        emulation.remove()
    handle.remove()
    # the scaler skipped the step ...
    assert all(torch.equal(v, before[key]) for key, v in model.state_dict().items())
    report = watch.build_report(loss.detach())
    # ... and the report says where it started
    assert report.first_module == target
    assert report.first_module_type == "Linear"
    assert report.forward is False
    assert {f"{target}.weight", f"{target}.bias"} <= set(report.parameters)
    assert report.parameters[0].startswith(target + ".")
    after = {f"blocks.{j}.lin" for j in range(k + 1, DEPTH)} | {"head"}
    assert not after & set(report.modules)
    # every module between the input and the injection point received the inf (or the NaN it makes)
    assert set(report.modules) == {f"blocks.{j}.lin" for j in range(k + 1)} | {"embed"}
    assert list(report.modules) == [f"blocks.{j}.lin" for j in range(k, -1, -1)] + ["embed"]
    assert [g.name for g in report.gradients] == list(report.parameters)
    assert report.gradients[0].inf >= 1
    text = str(report)
    assert target in text and "Forward pass: the loss was finite" in text
    watch.remove()


def test_overflow_in_a_module_without_parameters_names_the_nearest_module_before_it() -> None:
    model = deep_model()
    watch = OverflowWatch(model)
    handle = inject_inf(model.blocks[3].act)
    loss_of(model, batch()).backward()
    handle.remove()
    report = watch.build_report()
    assert report.first_module == "blocks.3.lin"  # the Tanh has no parameters; its Linear runs just before it
    assert report.forward is None
    assert "not checked" in str(report)


def test_backward_order_is_recorded_as_the_engine_ran_it() -> None:
    model = deep_model()
    watch = OverflowWatch(model)
    assert watch.backward_order() == ()
    loss_of(model, batch()).backward()
    order = watch.backward_order()
    assert sorted(order) == sorted(name for name, _ in model.named_parameters())
    modules = list(dict.fromkeys(module_of(name) for name in order))
    assert modules == ["head", *[f"blocks.{j}.lin" for j in range(DEPTH - 1, -1, -1)], "embed"]
    assert watch.owner("blocks.2.lin.weight") == "blocks.2.lin"


def test_gradient_accumulation_keeps_an_early_overflow_and_the_latest_order() -> None:
    model = deep_model()
    watch = OverflowWatch(model)
    handle = inject_inf(model.blocks[1].lin)
    loss_of(model, batch(1)).backward()  # first micro-batch overflows
    handle.remove()
    loss_of(model, batch(2)).backward()  # second one is clean; accumulation keeps the inf
    report = watch.build_report([loss_of(model, batch(1)).detach(), loss_of(model, batch(2)).detach()])
    assert report.first_module == "blocks.1.lin"
    assert report.forward is False
    assert len(watch.backward_order()) == len(list(model.parameters()))


def test_forward_overflow_is_told_apart_by_the_loss() -> None:
    model = deep_model()
    watch = OverflowWatch(model)
    with torch.no_grad():
        model.head.weight.fill_(1e30)
    loss = loss_of(model, batch())  # (1e30-sized output)**2 overflows float32
    assert torch.isinf(loss)
    loss.backward()
    report = watch.build_report(loss.detach(), loss_scale=2.0**15)
    assert report.forward is True
    # head's own gradient (about 1e29) is finite; the one it sends back (times its 1e30 weights) is not
    assert report.first_module == f"blocks.{DEPTH - 1}.lin"
    text = str(report)
    assert "2^15" in text and "no loss scale can fix" in text


def test_clean_gradients_give_an_empty_report() -> None:
    model = deep_model()
    watch = OverflowWatch(model)
    loss = loss_of(model, batch())
    loss.backward()
    report = watch.build_report(loss)
    assert report.first_module is None and report.parameters == () and report.forward is False
    assert report.watched == len(list(model.parameters()))
    assert "No watched parameter" in str(report)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_sparse_gradients_are_scanned() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(embed=nn.Embedding(10, 4, sparse=True), lin=nn.Linear(4, 1)))
    watch = OverflowWatch(model)
    handle = inject_inf(model.embed)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    handle.remove()
    assert model.embed.weight.grad is not None and model.embed.weight.grad.is_sparse
    report = watch.build_report()
    assert report.first_module == "embed" and report.parameters == ("embed.weight",)


def test_report_is_immutable() -> None:
    model = deep_model()
    report = OverflowWatch(model).build_report()
    assert isinstance(report, OverflowReport)
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.first_module = "x"  # type: ignore[misc]


def test_remove_takes_every_hook_out_and_is_idempotent() -> None:
    model = deep_model()
    params = list(model.parameters())
    with OverflowWatch(model) as watch:
        assert watch.active
        assert all(len(p._post_accumulate_grad_hooks or {}) == 1 for p in params)
    assert not watch.active
    assert all(not p._post_accumulate_grad_hooks for p in params)
    watch.remove()
    watch.remove()
    loss_of(model, batch()).backward()
    assert watch.backward_order() == ()  # nothing recorded any more
    assert "removed" in repr(watch)


def test_bad_arguments_raise_value_errors() -> None:
    with pytest.raises(ValueError, match="model"):
        OverflowWatch("not a module")  # type: ignore[arg-type]
    watch = OverflowWatch(deep_model())
    with pytest.raises(ValueError, match="loss"):
        watch.build_report("nan")
    with pytest.raises(ValueError, match="loss_scale"):
        watch.build_report(None, loss_scale=-1.0)
    with pytest.raises(ValueError, match="parameter_name"):
        watch.owner("nope")


def backward_ops(model: nn.Module, x: torch.Tensor) -> list[str]:
    loss = loss_of(model, x)
    with OpLog() as log:
        loss.backward()
    return log.ops


@pytest.mark.parametrize("emulated", [False, True], ids=["float32", "emulated-float16"])
def test_clean_backward_runs_exactly_the_same_ops_with_the_watch(emulated: bool) -> None:
    plain, watched = deep_model(), deep_model()
    watch = OverflowWatch(watched)
    handles = [dls.emulate(m, "float16") for m in (plain, watched)] if emulated else []
    x = batch()
    fresh = (backward_ops(plain, x), backward_ops(watched, x))  # gradients created
    accumulated = (backward_ops(plain, x), backward_ops(watched, x))  # gradients accumulated into
    for h in handles:
        h.remove()
    assert fresh[0] and fresh[0] == fresh[1]
    assert accumulated[0] and accumulated[0] == accumulated[1]
    assert fresh[0] != accumulated[0]  # the log sees the difference between creating and accumulating
    assert len(watch.backward_order()) == len(list(watched.parameters()))  # and the hooks did run


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed+gloo")
def test_ddp_names_the_wrapped_module_and_removes_while_wrapped() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = deep_model()
        ddp = nn.parallel.DistributedDataParallel(model)
        watch = OverflowWatch(ddp)
        assert watch.parameter_names == tuple(name for name, _ in model.named_parameters())
        handle = inject_inf(model.blocks[2].lin)
        loss_of(ddp, batch()).backward()
        handle.remove()
        report = watch.build_report()
        assert report.first_module == "blocks.2.lin"
        assert not {"head", "blocks.3.lin"} & set(report.modules)
        watch.remove()
        assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
        ddp.zero_grad(set_to_none=True)
        loss_of(ddp, batch(3)).backward()  # DDP still trains after the hooks are gone
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    finally:
        dist.destroy_process_group()
