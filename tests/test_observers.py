"""The seams a scaler talks through (``dls.observers``, ``dls.optimizers``): what observes its iterations
(``StepObserver``, ``GradScaler.observe``), and what an optimizer wrapper holding its gradients elsewhere is told
(``HoldsGradients``): each called at the points its protocol names, in order, and nothing else."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch

import dls
from conftest import INF, host_reads
from dls.observers import StepObserver
from dls.optimizers import HoldsGradients


class Log:
    """A ``StepObserver`` that writes down what it is told."""

    def __init__(self, wants_outcome: bool = False) -> None:
        self.wants_outcome = wants_outcome
        self.events: list[tuple[Any, ...]] = []

    def loss_scaled(self, outputs: Any) -> None:
        self.events.append(("loss_scaled",))

    def step_decided(self, optimizer: torch.optim.Optimizer, skipped: bool | None) -> None:
        self.events.append(("step_decided", type(optimizer).__name__, skipped))

    def before_rule(self, found_inf: torch.Tensor, gradients: Any) -> None:
        groups = gradients()
        self.events.append(("before_rule", float(found_inf), sum(len(g) for g in groups.values())))

    def iteration_ended(self) -> None:
        self.events.append(("iteration_ended",))


def _iteration(scaler: dls.GradScaler, model: torch.nn.Module, opt: torch.optim.Optimizer, overflow: bool) -> None:
    loss = model(torch.ones(2, 4)).sum()
    scaler.scale(loss * (INF if overflow else 1.0)).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def test_an_observer_hears_each_point_of_an_iteration_in_order_until_removed() -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dls.GradScaler("cpu")
    log = Log()
    _: StepObserver = log  # the protocol, checked by mypy
    handle = scaler.observe(log)
    _iteration(scaler, model, opt, overflow=False)
    _iteration(scaler, model, opt, overflow=True)
    assert log.events == [
        ("loss_scaled",), ("step_decided", "SGD", False), ("before_rule", 0.0, 2), ("iteration_ended",),
        ("loss_scaled",), ("step_decided", "SGD", True), ("before_rule", 1.0, 2), ("iteration_ended",),
    ]  # fmt: skip
    assert handle.active
    handle.remove()
    handle.remove()  # again: nothing happens
    _iteration(scaler, model, opt, overflow=False)
    assert len(log.events) == 8 and not handle.active


@pytest.mark.parametrize("wants_outcome", [False, True])
def test_on_the_fused_path_the_flag_is_read_only_for_an_observer_that_wants_it(wants_outcome: bool) -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = dls.GradScaler("cpu")
    _iteration(scaler, model, opt, overflow=False)  # the first step is decided on the host
    log = Log(wants_outcome)
    scaler.observe(log)
    with host_reads() as reads:
        _iteration(scaler, model, opt, overflow=False)
    assert ("step_decided", "AdamW", False if wants_outcome else None) in log.events
    assert bool([r for r in reads if "dls" in r[1]]) == wants_outcome


def test_observers_belong_to_the_process_a_copy_has_none() -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = dls.GradScaler("cpu")
    log = Log()
    scaler.observe(log)
    clones = [pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler)]
    for clone in clones:
        _iteration(clone, model, opt, overflow=False)
    assert log.events == []


class Wrapper(torch.optim.SGD):
    """An optimizer that holds its gradients elsewhere, as master weights do: it writes down what it is told."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.1)
        self.told: list[str] = []

    def dls_collect_gradients(self) -> None:
        self.told.append("collect")

    def dls_gradients_unscaled(self) -> None:
        self.told.append("unscaled")

    def dls_state_restored(self) -> None:
        self.told.append("restored")


def test_a_wrapper_holding_its_gradients_is_told_at_each_point_of_its_protocol() -> None:
    model = torch.nn.Linear(4, 2)
    opt = Wrapper(model.parameters())
    assert isinstance(opt, HoldsGradients)
    scaler = dls.GradScaler("cpu", sync_free=True)
    _iteration(scaler, model, opt, overflow=False)  # the first step: decided on the host
    assert opt.told == ["collect"]
    _iteration(scaler, model, opt, overflow=True)  # masked on the device, then restored
    assert opt.told == ["collect", "collect", "restored"]
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.unscale_(opt)
    assert opt.told[-2:] == ["collect", "unscaled"]
    scaler.step(opt)
    scaler.update()
    assert opt.told.count("collect") == 3  # once per iteration


def test_a_plain_optimizer_is_no_wrapper() -> None:
    assert not isinstance(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), HoldsGradients)
    assert isinstance(dls.master_weights(torch.optim.SGD(torch.nn.Linear(2, 2).half().parameters(), lr=0.1)),
                      HoldsGradients)  # fmt: skip
