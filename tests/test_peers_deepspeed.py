"""``dls.GradScaler.from_deepspeed`` against DeepSpeed's own ``DynamicLossScaler`` (deepspeed, installed by ``make
test`` through the ``peers`` extra with its compiled ops disabled), built by DeepSpeed's ``CreateLossScaler`` from
the ``fp16`` config section as DeepSpeed's own config model reads it: the same gradient traces step by step (scale
and skip decision, DeepSpeed's growth timing included), the config keys and defaults, and the scaler state handed
over both ways.

``update_scale`` asks ``deepspeed.comm`` for the rank only to decide who logs; the tests answer 0 rather than start a
process group in the test process. Intended differences, each asserted where it happens: at the minimum scale
DeepSpeed raises (``raise_error_at_min_scale``, on as ``CreateLossScaler`` builds it) where dls keeps skipping; and
DeepSpeed's Python-float scale can grow past float32's range (every step then overflows) where dls drops that growth.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

import dls
from _peers import FLOAT32_MAX, DlsRun, overflows, traces

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    loss_scaler = pytest.importorskip(
        "deepspeed.runtime.fp16.loss_scaler",
        reason="deepspeed is not installed: DS_BUILD_OPS=0 pip install -e '.[peers]' (make test installs it)",
    )
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config


@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda: 0)


def deepspeed(fp16: dict[str, Any], raise_at_min: bool = True) -> Any:
    """DeepSpeed's loss scaler for the ``fp16`` section, built as its ZeRO optimizers build it."""
    config = DeepSpeedFP16Config(**fp16)
    scaler = loss_scaler.CreateLossScaler(
        torch.float16, config.loss_scale, config.loss_scale == 0, config.dynamic_loss_scale_args()
    )
    if not raise_at_min:
        scaler.raise_error_at_min_scale = False  # DynamicLossScaler's own argument
    return scaler


def dls_run(fp16: dict[str, Any]) -> DlsRun:
    return DlsRun(dls.GradScaler.from_deepspeed(fp16, device="cpu"))


def _compare(peer: Any, ours: DlsRun, trace: list[float], start: int = 0) -> str:
    """Step both through ``trace``: ``"same"``; ``"minimum"`` where DeepSpeed raised at its minimum scale, ``"top"``
    where its scale left float32's range (each asserted to be the one difference). Anything else fails."""
    for i, m in enumerate(trace, start):
        before = peer.cur_scale
        skip = overflows(m, before)
        budget = ours.state_dict()["hysteresis_tracker"]
        try:
            peer.update_scale(skip)
        except Exception as exc:
            assert "Current loss scale already at minimum" in str(exc)
            # dls at its floor with the budget spent: it skips and stays there, and goes on.
            assert (skip, before, budget) == (True, ours.scaler.settings.min_loss_scale, 1), (i, trace)
            assert ours.step(m) == (True, before)
            return "minimum"
        got = ours.step(m)
        if peer.cur_scale > FLOAT32_MAX:
            assert got == (False, before) and before * 2 > FLOAT32_MAX, (i, trace)  # the growth dls drops
            return "top"
        assert got == (skip, peer.cur_scale), (i, trace)
        assert ours.state_dict()["hysteresis_tracker"] == peer.cur_hysteresis, (i, trace)
    return "same"


CONFIGS = [
    {"enabled": True},  # DeepSpeed's defaults: 2**16, window 1000, hysteresis 2, min 1
    {"enabled": True, "loss_scale_window": 1, "hysteresis": 1, "initial_scale_power": 20},
    {"enabled": True, "loss_scale_window": 2, "hysteresis": 2, "initial_scale_power": 8},
    {"enabled": True, "loss_scale_window": 3, "hysteresis": 3, "consecutive_hysteresis": True},
    {"enabled": True, "loss_scale_window": 5, "hysteresis": 2, "consecutive_hysteresis": True, "min_loss_scale": 4},
    {"enabled": True, "loss_scale_window": 7, "hysteresis": 1, "initial_scale_power": 12, "min_loss_scale": 2},
]


@pytest.mark.parametrize("raise_at_min", [True, False], ids=["as-created", "no-raise"])
@pytest.mark.parametrize(
    "fp16", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items() if k != "enabled") or "defaults"
)
def test_every_step_is_deepspeeds(fp16: dict[str, Any], raise_at_min: bool) -> None:
    window = fp16.get("loss_scale_window", 1000)
    outcomes = [
        (kind, _compare(deepspeed(fp16, raise_at_min), dls_run(fp16), trace)) for kind, trace in traces(window, 16, 80)
    ]
    growths = 127 - fp16.get("initial_scale_power", 16)
    to_the_top = [0.0] * min(window * (growths + 2) + 1, 2002) + [math.inf] * 3
    top = _compare(deepspeed(fp16, raise_at_min), dls_run(fp16), to_the_top)
    assert top == ("top" if window * (growths + 2) < 2002 else "same")
    for kind, outcome in outcomes:  # DeepSpeed raises at its minimum as created, wherever a trace gets there
        expected = ("minimum",) if kind == "minimum" and raise_at_min else ("same", "minimum")[: 1 + raise_at_min]
        assert outcome in expected, kind


def test_the_fp16_section_takes_deepspeeds_defaults_and_names_its_keys() -> None:
    ours = dls.GradScaler.from_deepspeed({"enabled": True}, device="cpu").settings
    theirs = deepspeed({"enabled": True})
    assert (ours.dialect, ours.mode, ours.init_scale) == ("deepspeed", "dynamic", theirs.cur_scale)
    assert (ours.steps_per_increase, ours.hysteresis, ours.min_loss_scale) == (
        theirs.scale_window,
        theirs.delayed_shift,
        theirs.min_scale,
    )
    assert (ours.consecutive_hysteresis, ours.growth_factor, 1 / ours.backoff_factor) == (False, 2.0, 2.0)
    assert not dls.GradScaler.from_deepspeed({}, device="cpu").is_enabled()  # DeepSpeed's default: fp16 off
    assert not dls.GradScaler.from_deepspeed({"enabled": False, "loss_scale": 0}, device="cpu").is_enabled()
    static = dls.GradScaler.from_deepspeed({"enabled": True, "loss_scale": 128}, device="cpu")
    assert (static.mode, static.get_scale()) == ("static", 128.0)
    with pytest.warns(UserWarning, match="ignored here: auto_cast, fp16_master_weights_and_grads$"):
        dls.GradScaler.from_deepspeed(
            {"enabled": True, "auto_cast": True, "fp16_master_weights_and_grads": False}, device="cpu"
        )


@pytest.mark.parametrize(
    ("fp16", "message"),
    [
        ({"loss_scale_windw": 10}, r"unknown key 'loss_scale_windw' \(did you mean 'loss_scale_window'\?\)"),
        ({"fp16": {"enabled": True}, "train_batch_size": 8}, r"a whole DeepSpeed config: pass its 'fp16' section"),
        ({"enabled": "auto"}, r"fp16_config\['enabled'\] is 'auto', a placeholder"),
        ({"enabled": 1}, r"fp16_config\['enabled'\] must be true or false"),
        ({"loss_scale": -1}, "^loss_scale must be 0"),
        ({"initial_scale_power": 16.0}, "^initial_scale_power must be an integer"),
        ({"initial_scale_power": 128}, "^initial_scale_power must be an integer from -126 to 127"),
        ({"loss_scale_window": 1000.0}, "^loss_scale_window must be an integer"),
        ({"loss_scale_window": 0}, "^loss_scale_window must be an integer"),
        ({"hysteresis": 0}, "^hysteresis must be an integer"),
        ({"consecutive_hysteresis": 1}, "^consecutive_hysteresis must be True or False"),
        ({"min_loss_scale": 0}, "^min_loss_scale must be a number"),
        ({"initial_scale_power": 2, "min_loss_scale": 8}, r"initial_scale_power \(4.0\) must not be below"),
    ],
)
def test_bad_fp16_keys_are_errors_naming_the_key(fp16: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dls.GradScaler.from_deepspeed({"enabled": True, **fp16}, device="cpu")


def test_deepspeeds_state_as_its_attributes_loads_and_continues_as_deepspeed() -> None:
    """Hand-over DeepSpeed → dls with ``vars(loss_scaler)`` after every few steps of several traces: mid-window,
    right after a growth (DeepSpeed's count runs on past it), during a spent hysteresis budget."""
    fp16 = {"enabled": True, "loss_scale_window": 3, "hysteresis": 2, "initial_scale_power": 10}
    counts = set()
    for _, trace in traces(seed=8, count=8, steps=40):
        for cut in range(0, len(trace), 3):
            peer = deepspeed(fp16, raise_at_min=False)
            for m in trace[:cut]:
                peer.update_scale(overflows(m, peer.cur_scale))
            counts.add(peer.cur_iter - peer.last_overflow_iter - 1)
            ours = dls_run(fp16)
            ours.scaler.load_state_dict(vars(peer))
            assert ours.scaler.get_scale() == peer.cur_scale
            assert _compare(peer, ours, trace[cut:], start=cut) == "same"
    assert max(counts) > 3  # states past a growth (beyond one window) were handed over


def test_dls_state_continues_in_deepspeed_with_its_attributes_set() -> None:
    """Hand-over dls → DeepSpeed (which has no load_state_dict: its scaler is pickled with the optimizer): the
    attributes from dls's state dict, ``last_overflow_iter = cur_iter - 1 - steps_since_rescale``."""
    fp16 = {"enabled": True, "loss_scale_window": 4, "hysteresis": 3, "initial_scale_power": 12}
    for _, trace in traces(seed=9, count=8, steps=40):
        for cut in range(1, len(trace), 4):
            ours = dls_run(fp16)
            for m in trace[:cut]:
                ours.step(m)
            sd = ours.state_dict()
            peer = deepspeed(fp16, raise_at_min=False)
            peer.cur_scale, peer.cur_hysteresis, peer.cur_iter = sd["loss_scale"], sd["hysteresis_tracker"], cut
            peer.last_overflow_iter = cut - 1 - sd["steps_since_rescale"]
            assert _compare(peer, ours, trace[cut:], start=cut) == "same"


def test_a_deepspeed_dialect_state_dict_round_trips() -> None:
    fp16 = {"enabled": True, "loss_scale_window": 3, "hysteresis": 2, "consecutive_hysteresis": True}
    for _, trace in traces(seed=10, count=4, steps=30):
        ours = dls_run(fp16)
        for m in trace:
            ours.step(m)
        again = dls_run(fp16)
        again.scaler.load_state_dict(ours.state_dict())
        assert again.state_dict() == ours.state_dict()
        assert [again.step(m) for m in trace] == [ours.step(m) for m in trace]


def test_deepspeeds_attributes_must_be_this_scalers_settings_and_load_only_into_its_dialect() -> None:
    peer = deepspeed({"enabled": True, "loss_scale_window": 3})
    ours = dls.GradScaler.from_deepspeed({"enabled": True, "loss_scale_window": 4}, device="cpu")
    before = ours.state_dict()
    with pytest.raises(ValueError, match=r"state_dict\['scale_window'\] is 3, this scaler's loss_scale_window is 4"):
        ours.load_state_dict(vars(peer))
    with pytest.raises(ValueError, match=r"only a scaler built with GradScaler\.from_deepspeed"):
        dls.GradScaler("cpu").load_state_dict(vars(peer))
    with pytest.raises(ValueError, match="mixes DeepSpeed's loss scaler attributes"):
        ours.load_state_dict({"cur_scale": 8.0, "loss_scale": 8.0})
    with pytest.raises(ValueError, match="'cur_iter' without 'last_overflow_iter'"):
        ours.load_state_dict({"cur_iter": 8})
    with pytest.raises(ValueError, match=r"last_overflow_iter'\] \(9\) must be below"):
        ours.load_state_dict({"cur_iter": 8, "last_overflow_iter": 9})
    with pytest.raises(ValueError, match=r"^state_dict\['cur_scale'\] must be a positive finite number; got nan"):
        ours.load_state_dict({"cur_scale": math.nan})
    with pytest.raises(ValueError, match=r"^state_dict\['cur_hysteresis'\] must be an integer"):
        ours.load_state_dict({"cur_hysteresis": 1.5})
    with pytest.raises(ValueError, match=r"unknown keys.*did you mean 'cur_hysteresis'"):
        ours.load_state_dict({"cur_hystersis": 1})
    assert ours.state_dict() == before
