"""dls.GradScaler against torch.amp.GradScaler on the same model, data and injected overflows."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch

import dls

STEPS = 200
# Overflows isolated, in bursts, at the start, and at a growth boundary.
INJECT = {0, 3, 4, 50, 51, 52, 53, 99, 120, 121, 180}


def _train(
    make_scaler: Callable[[], object], make_opt: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
) -> tuple[list[float], list[torch.Tensor], dict[str, object]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = make_opt(list(model.parameters()))
    scaler = make_scaler()
    data = torch.Generator().manual_seed(1)
    scales = []
    for i in range(STEPS):
        x = torch.randn(32, 8, generator=data)
        y = torch.randn(32, 1, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()  # type: ignore[attr-defined]
        if i in INJECT:
            grad = model[2].weight.grad
            assert grad is not None
            grad[0, i % 16] = float("inf") if i % 2 else float("nan")
        scaler.step(opt)  # type: ignore[attr-defined]
        scaler.update()  # type: ignore[attr-defined]
        opt.zero_grad()
        scales.append(scaler.get_scale())  # type: ignore[attr-defined]
    return scales, [p.detach().clone() for p in model.parameters()], opt.state_dict()


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
}


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_same_scales_and_parameters_as_torch(opt_name: str) -> None:
    make_opt = OPTIMIZERS[opt_name]
    ref_scales, ref_params, ref_state = _train(
        lambda: torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=10), make_opt
    )
    scales, params, state = _train(
        lambda: dls.GradScaler("dynamic", init_scale=2.0**12, steps_per_increase=10, max_loss_scale=2.0**40),
        make_opt,
    )
    assert scales == ref_scales
    assert len(set(scales)) > 3  # the sequence really grows and backs off
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)
    for key, value in ref_state["state"].items():  # type: ignore[attr-defined]
        for name, tensor in value.items():
            assert torch.equal(state["state"][key][name], tensor), (key, name)  # type: ignore[index]


def test_torch_state_dict_loads_and_continues_identically() -> None:
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        torch_scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        torch_scaler.step(opt)
        torch_scaler.update()
    scaler = dls.GradScaler("dynamic", max_loss_scale=2.0**30)
    scaler.load_state_dict(torch_scaler.state_dict())
    assert scaler.get_scale() == torch_scaler.get_scale()
    assert scaler.get_growth_interval() == 3
    assert scaler.state_dict()["steps_since_rescale"] == torch_scaler._get_growth_tracker()
    for _ in range(4):
        for s in (torch_scaler, scaler):
            s.scale(model(torch.ones(2, 4)).sum()).backward()
            s.unscale_(opt)
            opt.zero_grad()
            s.update()
        assert scaler.get_scale() == torch_scaler.get_scale()


def _autocast_run(make_scaler: Callable[[], object], steps: int = 60) -> tuple[list[float], list[torch.Tensor]]:
    """A float16 autocast MLP whose first steps overflow by themselves (no injection) at torch's 2**16."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = make_scaler()
    data = torch.Generator().manual_seed(3)
    scales = []
    for _ in range(steps):
        x = torch.randn(64, 16, generator=data) * 30
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean() * 50
        scaler.scale(loss).backward()  # type: ignore[attr-defined]
        scaler.step(opt)  # type: ignore[attr-defined]
        scaler.update()  # type: ignore[attr-defined]
        opt.zero_grad()
        scales.append(scaler.get_scale())  # type: ignore[attr-defined]
    return scales, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "args",
    [(), (2.0**16, 2.0, 0.5, 15), (2.0**20,), (1e38, 16.0, 0.5, 3)],
    ids=["defaults", "interval", "high", "huge"],
)
def test_a_torch_line_swapped_verbatim_trains_bit_identically(args: tuple) -> None:
    ref_scales, ref_params = _autocast_run(lambda: torch.amp.GradScaler("cpu", *args))
    scales, params = _autocast_run(lambda: dls.GradScaler("cpu", *args))
    assert scales == ref_scales
    assert any(b < a for a, b in itertools.pairwise(scales))  # overflows happened and were skipped alike
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)
