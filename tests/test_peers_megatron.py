"""``dls.GradScaler.from_megatron`` against Megatron-LM's own ``DynamicGradScaler`` (megatron-core, installed by
``make test`` through the ``peers`` extra): the same gradient traces step by step (scale and skip decision), and
the scaler state handed over both ways, as Megatron saves and loads it.

Megatron builds its tensors with ``device='cuda'`` hard-coded; on a machine without CUDA the tests build them on the
CPU, as a CPU user of Megatron has to (``megatron`` below). The one intended difference: Megatron multiplies the
scale without a finite check, so a long clean run grows it to inf, after which every step overflows; dls drops a
growth that would reach inf. Traces that reach it are asserted to differ exactly there and nowhere before.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import dls
from _peers import FLOAT32_MAX, DlsRun, overflows, traces

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed": megatron's own fallbacks
    grad_scaler = pytest.importorskip(
        "megatron.core.optimizer.grad_scaler",
        reason="megatron-core is not installed: pip install -e '.[peers]' (make test installs it)",
    )


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Megatron's ``torch.tensor(..., device='cuda')`` and ``load_state_dict``'s ``.cuda(current_device())`` made
    to stay on the CPU where CUDA is absent (with CUDA, Megatron runs as written)."""
    if not torch.cuda.is_available():
        tensor = torch.tensor

        def cpu_tensor(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
            return tensor(*args, **kwargs)

        monkeypatch.setattr(grad_scaler.torch, "tensor", cpu_tensor)
        monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    yield


# What Megatron's get_megatron_optimizer passes for the arguments from_megatron has defaults for.
MEGATRON_DEFAULTS = {"growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 1000, "hysteresis": 2}


def megatron(**kwargs: Any) -> Any:
    """Megatron's ``DynamicGradScaler(**kwargs)`` (inside the ``on_cpu`` fixture)."""
    return grad_scaler.DynamicGradScaler(**{**MEGATRON_DEFAULTS, **kwargs})


def dls_run(**kwargs: Any) -> DlsRun:
    return DlsRun(dls.GradScaler.from_megatron("cpu", **kwargs))


def _scale(peer: Any) -> float:
    return float(peer.scale.item())


def _compare(peer: Any, ours: DlsRun, trace: list[float], start: int = 0) -> str:
    """Step both through ``trace``; ``"same"``, or ``"inf"`` when Megatron's scale reached inf (then asserted to be
    the one difference). Any other difference fails, naming the step."""
    for i, m in enumerate(trace, start):
        before = _scale(peer)
        skip = overflows(m, before)
        peer.update(skip)
        got = ours.step(m)
        if math.isinf(_scale(peer)):
            # Megatron grew to inf; dls dropped that growth and keeps its largest finite scale.
            assert got == (skip, before) and skip is False and math.isfinite(before), (i, trace)
            assert before * float(peer.growth_factor) > FLOAT32_MAX  # the growth from here leaves float32
            return "inf"
        assert got == (skip, _scale(peer)), (i, trace)
    return "same"


CONFIGS = [
    {"initial_scale": 2.0**32, "min_scale": 1.0},  # Megatron's command-line defaults
    {"initial_scale": 2.0**16, "min_scale": 1.0, "growth_interval": 1, "hysteresis": 1},
    {"initial_scale": 2.0**10, "min_scale": 2.0**-2, "growth_interval": 3, "hysteresis": 3},
    {"initial_scale": 2.0**20, "min_scale": 4.0, "growth_interval": 2, "hysteresis": 2},
    {"initial_scale": 2.0**12, "min_scale": 1.0, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 5},
    {"initial_scale": 1000.0, "min_scale": 1.0, "growth_factor": 1.5, "backoff_factor": 0.75, "growth_interval": 2},
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}={v:g}" for k, v in c.items()))
def test_every_step_is_megatrons_except_growth_to_inf(config: dict[str, Any], on_cpu: None) -> None:
    interval = config.get("growth_interval", 1000)
    growths = math.log(FLOAT32_MAX / config["initial_scale"], config.get("growth_factor", 2.0))
    # A clean run to the maximum (to inf in Megatron) where it is in reach, else two growths; then a burst.
    to_the_top = [0.0] * min(interval * (int(growths) + 3), 2100) + [math.inf] * 3
    outcomes = [
        (kind, _compare(megatron(**config), dls_run(**config), trace)) for kind, trace in traces(interval, 16, 80)
    ]
    top = _compare(megatron(**config), dls_run(**config), to_the_top)
    assert top == ("inf" if interval * (growths + 3) < 2100 else "same")  # the documented difference, asserted
    assert outcomes == [(kind, "same") for kind, _ in outcomes]


def test_megatrons_state_as_saved_loads_and_continues_as_megatron(on_cpu: None) -> None:
    """Hand-over Megatron → dls after every prefix of bursty traces: negative hysteresis trackers (Megatron lowers
    them without a floor), growth trackers mid-interval, scales as 1-element float32 tensors."""
    config = {"initial_scale": 2.0**14, "min_scale": 1.0, "growth_interval": 4, "hysteresis": 3}
    trackers = set()
    for _, trace in traces(seed=5, count=8, steps=40):
        for cut in range(0, len(trace), 3):
            peer = megatron(**config)
            for m in trace[:cut]:
                peer.update(overflows(m, _scale(peer)))
            saved = peer.state_dict()
            assert set(saved) == {"scale", "growth_tracker", "hysteresis_tracker"}
            trackers.add(saved["hysteresis_tracker"])
            ours = dls_run(**config)
            ours.scaler.load_state_dict(saved)
            assert ours.scaler.get_scale() == _scale(peer)
            assert _compare(peer, ours, trace[cut:], start=cut) == "same"
    assert min(trackers) < 0 < max(trackers)  # spent and negative trackers were loaded as saved


def test_dls_state_loads_into_megatron_and_continues_as_dls(on_cpu: None) -> None:
    """Hand-over dls → Megatron with Megatron's own ``load_state_dict``: the three values under its names."""
    config = {"initial_scale": 2.0**14, "min_scale": 1.0, "growth_interval": 4, "hysteresis": 2}
    for _, trace in traces(seed=6, count=8, steps=40):
        for cut in range(1, len(trace), 4):
            ours = dls_run(**config)
            for m in trace[:cut]:
                ours.step(m)
            sd = ours.state_dict()
            peer = megatron(**config)
            peer.load_state_dict(
                {
                    "scale": torch.tensor([sd["loss_scale"]]),
                    "growth_tracker": sd["steps_since_rescale"],
                    "hysteresis_tracker": sd["hysteresis_tracker"],
                }
            )
            assert _compare(peer, ours, trace[cut:], start=cut) == "same"


def test_from_megatron_takes_megatrons_arguments_and_names_them_in_errors() -> None:
    s = dls.GradScaler.from_megatron("cpu", initial_scale=2.0**32, min_scale=1.0).settings
    assert (s.dialect, s.init_scale, s.min_loss_scale, s.max_loss_scale) == ("megatron", 2.0**32, 1.0, FLOAT32_MAX)
    assert (s.growth_factor, s.backoff_factor, s.steps_per_increase, s.hysteresis) == (2.0, 0.5, 1000, 2)
    with pytest.raises(TypeError, match="initial_scale"):
        dls.GradScaler.from_megatron("cpu", min_scale=1.0)  # type: ignore[call-arg]  # required, as in Megatron
    for kwargs, message in [
        ({"initial_scale": 0.0}, "initial_scale must"),
        ({"min_scale": 2.0**20}, r"min_scale \(1048576.0\) must not exceed initial_scale"),
        ({"growth_factor": 1.0}, "growth_factor must"),
        ({"backoff_factor": 1.0}, "backoff_factor must"),
        ({"growth_interval": 100.0}, "growth_interval must be an integer"),
        ({"hysteresis": 0}, "hysteresis must"),
        ({"backoff_factor": 1 - 1e-12}, r"backoff_factor is 1.0 in float32, as Megatron holds it \(given 0.99"),
    ]:
        with pytest.raises(ValueError, match=f"^{message}"):
            dls.GradScaler.from_megatron("cpu", **{"initial_scale": 2.0**16, "min_scale": 1.0, **kwargs})


def test_factors_round_to_float32_as_megatron_holds_them(on_cpu: None) -> None:
    config = {"initial_scale": 1000.0, "min_scale": 1.0, "growth_factor": 1.1, "backoff_factor": 0.3}
    config |= {"growth_interval": 1, "hysteresis": 1}
    trace = [0.0] * 30 + [math.inf] * 5 + [0.0] * 10
    assert _compare(megatron(**config), dls_run(**config), trace) == "same"
