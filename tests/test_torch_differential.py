"""dls.GradScaler against torch.amp.GradScaler on the same model, data and overflows: scales, parameters and
optimizer state equal bit for bit, over 200 steps with injected overflows, and over a float16 autocast run whose
first steps overflow by themselves. On the ``device`` of the run (``--device cuda``: against
``torch.amp.GradScaler("cuda")``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch

import dls
from conftest import INF, NAN, assert_same, dls_scaler, snapshot, tiny_model, torch_scaler, train

STEPS = 200
# Overflows isolated, in bursts, at the start, and at a growth boundary.
INJECT = {0, 3, 4, 50, 51, 52, 53, 99, 120, 121, 180}


def _train(
    scaler: Any, make_opt: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], device: torch.device
) -> tuple[Any, ...]:
    """The scales after every step, and the final parameters and optimizer state."""
    model = tiny_model(device=device)
    opt = make_opt(list(model.parameters()))
    states = train(scaler, model, opt, range(STEPS), {i: INF if i % 2 else NAN for i in INJECT})
    return [sd["scale"] for sd in states], snapshot(model, opt)


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
}


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_same_scales_parameters_and_state_as_torch(opt_name: str, device: torch.device) -> None:
    ref_scales, ref_state = _train(torch_scaler(2.0**12, 10, device), OPTIMIZERS[opt_name], device)
    scales, state = _train(dls_scaler(2.0**12, 10), OPTIMIZERS[opt_name], device)
    assert scales == ref_scales
    assert len(set(scales)) > 3  # the sequence really grows and backs off
    assert_same(state, ref_state)


def _autocast_run(scaler: Any, device: torch.device, steps: int = 60) -> tuple[list[float], list[torch.Tensor]]:
    """A float16 autocast MLP whose first steps overflow by themselves (no injection) at torch's 2**16."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(3)
    scales = []
    for _ in range(steps):
        x = (torch.randn(64, 16, generator=data) * 30).to(device)
        with torch.autocast(device.type, dtype=torch.float16):
            loss = model(x).float().pow(2).mean() * 50
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "args",
    [(), (2.0**16, 2.0, 0.5, 15), (2.0**20,), (1e38, 16.0, 0.5, 3)],
    ids=["defaults", "interval", "high", "huge"],
)
def test_a_torch_line_swapped_verbatim_trains_bit_identically(args: tuple[Any, ...], device: torch.device) -> None:
    ref_scales, ref_params = _autocast_run(torch.amp.GradScaler(device.type, *args), device)
    scales, params = _autocast_run(dls.GradScaler(device.type, *args), device)
    assert scales == ref_scales
    assert any(b < a for a, b in itertools.pairwise(scales))  # overflows happened and were skipped alike
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)
