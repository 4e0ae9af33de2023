"""The field's other loss scalers, as their own code runs them (``_field_peers``): Keras 3, jmp, fairseq, MXNet and
ColossalAI. The behaviours below are the ones dls follows and the documentation states (the switching guide), each
asserted on the real code so that a statement about a peer is checked where it is made; several are where a peer's
documentation and its code disagree, and the code is the reference.
"""

from __future__ import annotations

import functools
import itertools
import math
import zlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import _field_peers as field
import dls
from _field_peers import FLOAT32_MAX, drive
from _peers import field_traces
from dls.policy import PEERS
from dls.settings import ScalerSettings

INF, NAN = math.inf, math.nan
CLEAN = 0.0  # a zero gradient: finite at any finite scale


def _scales(steps: list[field.Step]) -> list[float]:
    return [after for _, _, after in steps]


def _skips(steps: list[field.Step]) -> list[bool]:
    return [skipped for _, skipped, _ in steps]


# ------------------------------------------------------------------------------------------------------- fairseq
def test_fairseq_grows_on_the_windowth_clean_step_since_the_last_overflow_and_stops_above_its_minimum() -> None:
    steps, stopped = drive(field.FairseqRun(init_scale=4.0, scale_window=2), [CLEAN, CLEAN, INF, CLEAN, CLEAN, CLEAN])
    assert _scales(steps) == [4, 8, 4, 4, 8, 8] and _skips(steps) == [False, False, True, False, False, False]
    assert stopped is None
    # min_loss_scale is not a floor: a back-off that would reach it stops training, the scale put back first.
    run = field.FairseqRun(init_scale=4.0, min_loss_scale=1.0)
    steps, stopped = drive(run, [INF, INF, INF])
    assert _scales(steps) == [2.0] and stopped is not None and "Minimum loss scale reached (1.0)" in stopped
    assert run.scaler.loss_scale == 2.0
    # threshold is the floor (a back-off below it stops there); min_loss_scale then never stops training.
    steps, stopped = drive(field.FairseqRun(init_scale=4.0, threshold=1.0, min_loss_scale=0.5), [INF] * 4)
    assert _scales(steps) == [2.0, 1.0, 1.0, 1.0] and stopped is None


def test_fairseq_tolerance_is_the_fraction_of_overflows_since_the_last_rescale_and_a_tolerated_one_restarts_growth():
    run = field.FairseqRun(init_scale=16.0, scale_window=10, tolerance=0.25)
    # Step 3 overflows: 1 overflow in the 4 iterations since the start (the last rescale counts as iteration -1):
    # 0.25 >= 0.25, back off. Step 5: 1 in the 2 iterations since that rescale: back off again.
    steps, _ = drive(run, [CLEAN, CLEAN, CLEAN, INF, CLEAN, INF])
    assert _scales(steps) == [16, 16, 16, 8, 8, 4]
    run = field.FairseqRun(init_scale=16.0, scale_window=4, tolerance=0.5)
    # Step 2 overflows: 1 in 3 < 0.5, tolerated (skipped, the scale kept), and growth counts from there: the 4th
    # clean step after it, not step 3 (the 4th since the start).
    steps, _ = drive(run, [CLEAN, CLEAN, INF, CLEAN, CLEAN, CLEAN, CLEAN])
    assert _scales(steps) == [16, 16, 16, 16, 16, 16, 32] and _skips(steps)[2:4] == [True, False]


def test_fairseq_scale_is_a_python_float_that_grows_past_float32() -> None:
    steps, _ = drive(field.FairseqRun(init_scale=2.0**127, scale_window=1), [CLEAN, CLEAN])
    assert steps[0][2] == 2.0**128 > FLOAT32_MAX
    assert steps[1] == (2.0**128, True, 2.0**127)  # inf as float32: every gradient is then inf or NaN


# --------------------------------------------------------------------------------------------------------- MXNet
def test_mxnet_commits_a_new_scale_one_iteration_late() -> None:
    """``has_overflow`` first commits the scale the previous call decided, then decides the next: the step after
    an overflow still runs at the old scale, and a growth due at an overflowing step is committed before it halves."""
    steps, _ = drive(field.MxnetRun(), [INF, INF, CLEAN, CLEAN])
    assert steps == [(2**16, True, 2**16), (2**16, True, 2**15), (2**15, False, 2**14), (2**14, False, 2**14)]
    run = field.MxnetRun(_scale_seq_len=2)  # its constants, set as attributes (the constructor takes none)
    steps, _ = drive(run, [CLEAN, CLEAN, INF, CLEAN])
    assert steps == [(2**16, False, 2**16), (2**16, False, 2**16), (2**16, True, 2**17), (2**17, False, 2**16)]
    steps, _ = drive(field.MxnetRun(_loss_scale=2.0**24, _next_loss_scale=2.0**24, _scale_seq_len=1), [CLEAN] * 2)
    assert _scales(steps) == [2**24, 2**24]  # its ceiling


# ---------------------------------------------------------------------------------------------------- ColossalAI
def test_colossalai_hysteresis_counts_up_and_is_reset_only_by_a_growth() -> None:
    run = field.ColossalaiRun(initial_scale=64.0, growth_interval=2, hysteresis=2)
    steps, _ = drive(run, [INF, INF, INF, CLEAN, INF, CLEAN, CLEAN, INF, INF])
    # The 2nd overflow backs off, and so does every later one (a clean step does not refill it) until the growth at
    # step 6; then the first overflow is absorbed again.
    assert _scales(steps) == [64, 32, 16, 16, 8, 8, 16, 16, 8]
    assert _skips(steps) == [True, True, True, False, True, False, False, True, True]
    steps, _ = drive(field.ColossalaiRun(initial_scale=64.0, hysteresis=0), [INF, INF])
    assert _scales(steps) == [32, 16]  # hysteresis=0 is accepted and acts as 1
    assert set(run.saved()) == {"scale", "growth_factor", "backoff_factor", "hysteresis"}  # no counters saved


def test_colossalai_without_max_scale_grows_to_inf_in_float32() -> None:
    steps, _ = drive(field.ColossalaiRun(initial_scale=2.0**127, growth_interval=1), [CLEAN, CLEAN])
    assert steps == [(2.0**127, False, INF), (INF, True, INF)]


# ------------------------------------------------------------------------------------------------------------ jmp
def test_jmp_drops_a_growth_to_inf_and_under_jit_its_min_loss_scale() -> None:
    steps, _ = drive(field.JmpRun(2.0**127, period=1), [CLEAN, CLEAN])
    assert _scales(steps) == [2.0**127, 2.0**127]  # first_finite(s * factor, s)
    kept, _ = drive(field.JmpRun(4.0, "jit", period=5, min_loss_scale=0.25), [INF] * 5)
    dropped, _ = drive(field.JmpRun(4.0, "pytree", period=5, min_loss_scale=0.25), [INF] * 5)
    assert _scales(kept) == [2, 1, 0.5, 0.25, 0.25]
    # Through jax.jit the scaler is flattened to (loss_scale, counter) and rebuilt with the default floor of 1.
    assert _scales(dropped) == [2, 1, 1, 1, 1]
    steps, _ = drive(field.JmpRun(8.0, period=3, counter=1), [CLEAN, CLEAN, NAN])
    assert _scales(steps) == [8, 16, 8]  # a starting counter counts towards the first growth


# ---------------------------------------------------------------------------------------------------------- Keras
def test_keras_has_no_floor_and_no_ceiling() -> None:
    steps, _ = drive(field.KerasRun(initial_scale=2.0**127, dynamic_growth_steps=1), [CLEAN, CLEAN])
    assert steps == [(2.0**127, False, INF), (INF, True, INF)]  # grown to inf, where every step overflows
    steps, _ = drive(field.KerasRun(initial_scale=2.0**-148), [INF, INF, CLEAN])
    assert _scales(steps) == [2.0**-149, 0.0, 0.0]  # below float32's normal range, down to 0
    with pytest.raises(ValueError, match="dynamic=False"):
        field.KerasRun(dynamic=False)


# ------------------------------------------------------------------------------------- dls against the real code
TALLY: dict[str, Counter[str]] = {}
WINDOWS = (1, 2, 3, 5, 7, 10)


@pytest.fixture(scope="module", autouse=True)
def _tally() -> Iterator[None]:
    """Per peer: the traces, the steps that were the same, and how each trace ended (printed with ``pytest -s``)."""
    yield
    for peer, counts in TALLY.items():
        ends = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k not in ("traces", "steps"))
        print(f"\n{peer}: {counts['traces']} traces, {counts['steps']} steps the same; ended: {ends}")


def _against(peer: str, make_peer: Any, make_ours: Any, traces: Any, factor: float = 2.0) -> list[str]:
    """``field.compare`` on each trace (a fresh peer and dls each time), tallied under ``peer``: the outcomes."""
    counts = TALLY.setdefault(peer, Counter())
    outcomes = []
    for _, trace in traces:
        outcome, same = field.compare(make_peer(), make_ours(), trace, factor)
        counts.update({"traces": 1, "steps": same, outcome: 1})
        outcomes.append(outcome)
    return outcomes


def _rule(settings: ScalerSettings) -> Any:
    """dls's rule for ``settings`` as the scaler runs it, the host knowing each flag on every other trace (the
    scaler's two update paths)."""
    paths = itertools.cycle([True, False])
    return lambda: field.DlsRule(settings, host_knows=next(paths))


def _seed(kwargs: dict[str, Any]) -> int:
    """A seed of the traces that depends on the configuration only (``hash`` of ``None`` is not stable)."""
    return zlib.crc32(repr(sorted(kwargs.items())).encode())


def _like(peer: str, **kwargs: Any) -> Any:
    """``dls.GradScaler.like(peer, "cpu", **kwargs)`` through its public API, end to end."""
    return lambda: field.DlsScaler(dls.GradScaler.like(peer, "cpu", **kwargs))


ENDS = {"same", "top", "bottom"}  # top and bottom: the peer's scale left float32's normal range, dls's did not


@pytest.mark.parametrize("window", WINDOWS)
def test_keras_every_step(window: int) -> None:
    for init in (2.0**15, 2.0**125, 2.0**-120):
        kwargs = {"initial_scale": init, "dynamic_growth_steps": window}
        ours = _rule(ScalerSettings.like("keras", **kwargs))
        traces = field_traces(window, 3, 30, window)
        assert set(_against("keras", functools.partial(field.KerasRun, **kwargs), ours, traces)) <= ENDS
    kwargs = {"initial_scale": 2.0**20, "dynamic_growth_steps": window}
    traces = field_traces(window + 100, 2, 30, window)
    assert set(_against("keras", functools.partial(field.KerasRun, **kwargs), _like("keras", **kwargs), traces)) <= ENDS


def test_keras_defaults_end_to_end_from_its_saved_variables() -> None:
    """``like("keras")`` with Keras' defaults, started from Keras' two variables as a checkpoint holds them (its
    step counter 5 short of its 2000-step growth), through two growths and back."""
    for counter in (1995,):
        trace = [CLEAN] * (2005 - counter) + [INF] * 3 + [2.0**-3] * 10

        def peer(counter: int = counter) -> field.KerasRun:
            run = field.KerasRun()
            run.opt.step_counter.assign(counter)
            return run

        def ours(counter: int = counter) -> field.DlsScaler:
            scaler = dls.GradScaler.like("keras", "cpu")
            scaler.load_state_dict(peer(counter).saved())
            return field.DlsScaler(scaler)

        assert _against("keras", peer, ours, [("long", trace)]) == ["same"]


FAIRSEQ_CONFIGS = [
    {"scale_window": w, "tolerance": tol, "threshold": thr, "min_loss_scale": stop, "scale_factor": f}
    for w in WINDOWS
    for tol, f in ((0.0, 2.0), (0.25, 2.0), (0.5, 2.0), (0.25, 4.0))
    for thr, stop in ((None, 1e-4), (0.5, 0.25), (None, 2.0**-130))
]


@pytest.mark.parametrize("window", WINDOWS)
def test_fairseq_every_step(window: int) -> None:
    outcomes = []
    for config in (c for c in FAIRSEQ_CONFIGS if c["scale_window"] == window):
        for init in (2.0**15, 2.0**120, 4.0):
            if init == 4.0 and config["threshold"] is not None:
                continue
            kwargs = {"init_scale": init, **config}
            ours = _rule(ScalerSettings.like("fairseq", **kwargs))
            traces = field_traces(_seed(kwargs), 2, 40, window)
            peer = functools.partial(field.FairseqRun, **kwargs)
            outcomes += _against("fairseq", peer, ours, traces, config["scale_factor"])
    assert set(outcomes) <= ENDS | {"stopped"} and "same" in outcomes
    kwargs = {"init_scale": 2.0**10, "scale_window": window, "tolerance": 0.25}
    traces = field_traces(window, 2, 30, window)
    outcomes = _against("fairseq", functools.partial(field.FairseqRun, **kwargs), _like("fairseq", **kwargs), traces)
    assert set(outcomes) <= ENDS | {"stopped"}


def test_fairseq_defaults_end_to_end() -> None:
    """``like("fairseq")`` with fairseq's defaults, from a run 1995 iterations in (no overflow yet: fairseq's
    iteration counter there, dls's counts loaded as its state dict holds them), through its 2000-step growth."""
    trace = [CLEAN] * 10 + [INF] * 3 + [2.0**-3] * 10

    def peer() -> field.FairseqRun:
        run = field.FairseqRun()
        run.scaler._iter = 1995
        return run

    def ours() -> field.DlsScaler:
        scaler = dls.GradScaler.like("fairseq", "cpu")
        scaler.load_state_dict({"steps_since_rescale": 1995, "iterations_since_rescale": 1995})
        return field.DlsScaler(scaler)

    assert _against("fairseq", peer, ours, [("long", trace)]) == ["same"]
    # Into its minimum: fairseq stops, dls skips at the scale fairseq put back, and its non-clamped scale says so.
    run = field.DlsScaler(dls.GradScaler.like("fairseq", "cpu", init_scale=4.0, min_loss_scale=1.0))
    assert field.compare(field.FairseqRun(init_scale=4.0, min_loss_scale=1.0), run, [INF] * 3) == ("stopped", 1)
    assert run.step(INF) == (2.0, True, 2.0) and run.run.scaler.get_non_clamped_scale() == 1.0


def _mxnet(init: float, window: int) -> Any:
    """MXNet's LossScaler with another start and window, set as its attributes (its constructor takes none), and
    dls's rule with the same constants."""
    peer = lambda: field.MxnetRun(_loss_scale=init, _next_loss_scale=init, _scale_seq_len=window)  # noqa: E731
    settings = ScalerSettings.mxnet().replace(init_scale=init, steps_per_increase=window)
    return peer, _rule(settings)


@pytest.mark.parametrize("window", WINDOWS)
def test_mxnet_every_step(window: int) -> None:
    for init in (2.0**16, 2.0**24, 2.0**-120):
        peer, ours = _mxnet(init, window)
        assert set(_against("mxnet", peer, ours, field_traces(window, 6, 50, window))) <= ENDS


def test_mxnet_as_it_is_end_to_end() -> None:
    """``GradScaler.like("mxnet")``, MXNet's constants (growth after 2000 clean steps, up to 2**24), from 5 steps
    before a growth (MXNet's counter, dls's loaded), and its ceiling."""
    trace = [CLEAN] * 10 + [INF] * 2 + [2.0**-3] * 10

    def peer() -> field.MxnetRun:
        return field.MxnetRun(_unskipped=1995)

    def ours() -> field.DlsScaler:
        scaler = dls.GradScaler.like("mxnet", "cpu")
        scaler.load_state_dict({"steps_since_rescale": 1995})
        return field.DlsScaler(scaler)

    assert _against("mxnet", peer, ours, [("growth", trace)]) == ["same"]
    peer_at_top, ours_at_top = _mxnet(2.0**23, 2000)
    top = [CLEAN] * 2000 * 3 + [INF] * 2  # one growth to 2**24, then held there
    assert _against("mxnet", peer_at_top, ours_at_top, [("top", top)]) == ["same"]


COLOSSALAI_CONFIGS = [
    {"growth_interval": w, "hysteresis": h, "growth_factor": g, "backoff_factor": b, **bounds}
    for w in WINDOWS
    for h in (0, 2, 3)
    for g, b in ((2.0, 0.5), (4.0, 0.25), (1.1, 0.3))
    for bounds in ({}, {"min_scale": 1.0, "max_scale": 2.0**32})
]


@pytest.mark.parametrize("window", WINDOWS)
def test_colossalai_every_step(window: int) -> None:
    outcomes = []
    for config in (c for c in COLOSSALAI_CONFIGS if c["growth_interval"] == window):
        for init in (2.0**16, 2.0**125, 2.0**-120):
            kwargs = {"initial_scale": init, **config}
            if not kwargs.get("min_scale", 0) <= init <= kwargs.get("max_scale", math.inf):
                continue
            ours = _rule(ScalerSettings.like("colossalai", **kwargs))
            traces = field_traces(_seed(kwargs), 3, 40, window)
            outcomes += _against(
                "colossalai", functools.partial(field.ColossalaiRun, **kwargs), ours, traces, config["growth_factor"]
            )
    assert set(outcomes) <= ENDS and "same" in outcomes
    kwargs = {"initial_scale": 2.0**12, "growth_interval": window, "min_scale": 1.0}
    traces = field_traces(window, 3, 40, window)
    assert (
        set(
            _against(
                "colossalai", functools.partial(field.ColossalaiRun, **kwargs), _like("colossalai", **kwargs), traces
            )
        )
        <= ENDS
    )


@pytest.mark.parametrize("window", WINDOWS)
def test_jmp_every_step(window: int) -> None:
    outcomes = []
    for factor in (2, 4):
        for floor in (1.0, 0.0):
            for init in (2.0**15, 2.0**125, 2.0**-5):
                if init < floor:
                    continue
                kwargs = {"period": window, "factor": factor, "min_loss_scale": floor}
                ours = _rule(ScalerSettings.like("jmp", loss_scale=init, **kwargs))
                traces = field_traces(_seed({"init": init, **kwargs}), 3, 40, window)
                outcomes += _against("jmp", functools.partial(field.JmpRun, init, **kwargs), ours, traces, factor)
    assert set(outcomes) <= ENDS and "same" in outcomes
    for counter in range(window):  # a starting counter, through GradScaler.like (which loads it)
        kwargs = {"loss_scale": 2.0**12, "counter": counter, "period": window}
        traces = field_traces(counter, 1, 30, window)
        assert _against("jmp", functools.partial(field.JmpRun, **kwargs), _like("jmp", **kwargs), traces) == ["same"]


def test_jmp_through_jit_keeps_the_floor_of_1() -> None:
    """jmp as a jitted training step passes it (its floor back at 1): dls's ``like("jmp", ...)`` defaults."""
    traces = list(field_traces(3, 5, 40, 3))
    peer = lambda: field.JmpRun(8.0, "pytree", period=3)  # noqa: E731
    assert set(_against("jmp", peer, _like("jmp", loss_scale=8.0, period=3), traces)) <= ENDS


# ---------------------------------------------------------------------------------------------------------- Apex
# Apex is not on the registry and left amp and fp16_utils out of its main branch in May 2025: its two rules are
# followed from tag 25.05's source, and these traces are worked by hand from it, line by line. T: the step's
# gradients overflow; each row: (arguments, flags, scale used at each step, scale after each step).
T, F = True, False
APEX_AMP = [  # apex/amp/scaler.py: __init__ 38-52, update_scale 197-217
    (  # 3 clean steps: _unskipped == scale_window, x2 (line 213-215); an overflow halves and resets (204-208)
        {"init_scale": 2.0**16, "scale_window": 3},
        [F, F, F, T, F, F, F, F, F, T, T],
        [2**16, 2**16, 2**16, 2**17, 2**16, 2**16, 2**16, 2**17, 2**17, 2**17, 2**16],
        [2**16, 2**16, 2**17, 2**16, 2**16, 2**16, 2**17, 2**17, 2**17, 2**16, 2**15],
    ),
    (  # min(max_loss_scale, scale * 2): the ceiling 2**24 (line 214)
        {"init_scale": 2.0**23, "scale_window": 1},
        [F, F, F, T, F],
        [2**23, 2**24, 2**24, 2**24, 2**23],
        [2**24, 2**24, 2**24, 2**23, 2**24],
    ),
    ({"init_scale": 2.0**30, "scale_window": 1}, [T, F], [2**24, 2**23], [2**23, 2**24]),  # min(max, init): line 47
    (  # max(min_loss_scale, scale / 2) (line 205)
        {"min_loss_scale": 2.0**14},
        [T, T, T, T],
        [2**16, 2**15, 2**14, 2**14],
        [2**15, 2**14, 2**14, 2**14],
    ),
    (
        {"init_scale": 4.0, "min_loss_scale": 0.0},
        [T, T, T],
        [4, 2, 1],
        [2, 1, 0.5],
    ),  # if(self._min_loss_scale): 0 is none
    (  # scale_factor is stored nowhere: x2 and /2 whatever it says
        {"scale_window": 1, "scale_factor": 3.0},
        [F, T, F],
        [2**16, 2**17, 2**16],
        [2**17, 2**16, 2**17],
    ),
]
APEX_FP16_UTILS = [  # apex/fp16_utils/loss_scaler.py: __init__ 75-83, update_scale 115-123
    (  # grows where (cur_iter - last_overflow_iter) % scale_window == 0: iterations 2, 5 (from -1), 9 (from 6)
        {"scale_window": 3},
        [F, F, F, F, F, F, T, F, F, F, F, T, T],
        [2**32, 2**32, 2**32, 2**33, 2**33, 2**33, 2**34, 2**33, 2**33, 2**33, 2**34, 2**34, 2**33],
        [2**32, 2**32, 2**33, 2**33, 2**33, 2**34, 2**33, 2**33, 2**33, 2**34, 2**34, 2**33, 2**32],
    ),
    ({"init_scale": 4.0}, [T, T, T, T], [4, 2, 1, 1], [2, 1, 1, 1]),  # max(cur_scale / scale_factor, 1)
    ({"init_scale": 4.0, "scale_factor": 4.0, "scale_window": 1}, [F, T, T, T, F], [4, 16, 4, 1, 1], [16, 4, 1, 1, 4]),
]


@pytest.mark.parametrize(("peer", "table"), [("apex", APEX_AMP), ("apex_fp16_utils", APEX_FP16_UTILS)])
def test_apex_traces_worked_by_hand_from_its_source(peer: str, table: list[Any]) -> None:
    for kwargs, flags, used, after in table:
        run = field.DlsScaler(dls.GradScaler.like(peer, "cpu", **kwargs))
        assert [run.step(INF if flag else CLEAN) for flag in flags] == list(zip(used, flags, after)), kwargs


def test_apex_static_scale_and_saved_state() -> None:
    static = field.DlsScaler(dls.GradScaler.like("apex", "cpu", loss_scale="128.0"))  # amp.initialize's float()
    # Apex in static mode neither checks nor skips (update_scale line 202: "and self.dynamic"); dls skips the
    # non-finite step and keeps the scale: no non-finite value is written into a weight.
    assert [static.step(m) for m in (CLEAN, INF)] == [(128.0, False, 128.0), (128.0, True, 128.0)]
    # amp.state_dict(): {"loss_scaler0": {"loss_scale", "unskipped"}} (apex/amp/frontend.py:365-374); 2 of 3
    # clean steps counted: the next clean step grows.
    for saved in ({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 2}}, {"loss_scale": 1024.0, "unskipped": 2}):
        scaler = dls.GradScaler.like("apex", "cpu", scale_window=3)
        scaler.load_state_dict(saved)
        assert field.DlsScaler(scaler).step(CLEAN) == (1024.0, False, 2048.0)
    # vars(DynamicLossScaler) of fp16_utils: 4 clean iterations since the overflow at 5: the 5th grows (window 5).
    scaler = dls.GradScaler.like("apex_fp16_utils", "cpu", scale_window=5)
    scaler.load_state_dict(
        {"cur_scale": 8.0, "cur_iter": 10, "last_overflow_iter": 5, "scale_factor": 2.0, "scale_window": 5}
    )
    assert field.DlsScaler(scaler).step(CLEAN) == (8.0, False, 16.0)


# ------------------------------------------------------------------------------------------- the saved states
def _hand_over(peer: str, make_peer: Any, make_ours: Any, load_peer: Any, trace: list[float], every: int) -> None:
    """After each ``every`` steps of ``trace``: the peer's state as it saves it (``saved()``), loaded back by the
    peer as it loads it (``load_peer(saved) -> a fresh run``) and by a fresh dls scaler; both go on the same."""
    for cut in range(0, len(trace), every):
        run = make_peer()
        for m in trace[:cut]:
            run.step(m)
        saved = run.saved()
        ours = make_ours()
        ours.run.scaler.load_state_dict(dict(saved))
        assert _against(peer, lambda saved=saved: load_peer(saved), lambda ours=ours: ours, [("", trace[cut:])]) == [
            "same"
        ], cut


def test_the_peers_saved_states_load_and_go_on_as_the_peer() -> None:
    trace = next(t for kind, t in field_traces(11, 2, 40, 3) if kind == "bursty")

    def fairseq_loads(saved: dict[str, Any]) -> field.FairseqRun:  # FP16Optimizer.load_state_dict: the scale
        run = field.FairseqRun(init_scale=2.0**10, scale_window=3)
        run.scaler.loss_scale = saved["loss_scale"]
        return run

    fairseq = functools.partial(field.FairseqRun, init_scale=2.0**10, scale_window=3)
    _hand_over("fairseq", fairseq, _like("fairseq", init_scale=2.0**10, scale_window=3), fairseq_loads, trace, 4)

    colossalai_kw = {"initial_scale": 2.0**10, "growth_interval": 3, "hysteresis": 2, "backoff_factor": 0.25}

    def colossalai_loads(saved: dict[str, Any]) -> field.ColossalaiRun:
        run = field.ColossalaiRun(**colossalai_kw)
        run.scaler.load_state_dict(saved)
        return run

    colossalai = functools.partial(field.ColossalaiRun, **colossalai_kw)
    _hand_over("colossalai", colossalai, _like("colossalai", **colossalai_kw), colossalai_loads, trace, 4)

    def jmp_loads(saved: dict[str, Any]) -> field.JmpRun:  # a train state restored: the scaler's two leaves
        return field.JmpRun(saved["loss_scale"], period=3, counter=saved["counter"])

    jmp = functools.partial(field.JmpRun, 2.0**10, period=3)
    _hand_over("jmp", jmp, _like("jmp", loss_scale=2.0**10, period=3), jmp_loads, trace, 4)

    def keras_loads(saved: dict[str, Any]) -> field.KerasRun:  # the optimizer's variables restored
        run = field.KerasRun(initial_scale=2.0**10, dynamic_growth_steps=3)
        run.opt.dynamic_scale.assign(saved["dynamic_scale"])
        run.opt.step_counter.assign(saved["step_counter"])
        return run

    keras = functools.partial(field.KerasRun, initial_scale=2.0**10, dynamic_growth_steps=3)
    _hand_over("keras", keras, _like("keras", initial_scale=2.0**10, dynamic_growth_steps=3), keras_loads, trace, 8)


@pytest.mark.parametrize(
    ("peer", "kwargs", "saved", "message"),
    [
        ("torch", {}, {"loss_scaler0": {"loss_scale": 8.0, "unskipped": 1}}, r"GradScaler\.like\('apex', \.\.\.\)"),
        ("apex", {}, {"loss_scaler0": {"loss_scale": 8.0}, "x": 1}, r"unknown keys \['x'\]"),
        ("apex", {}, {"loss_scaler0": [8.0]}, r"state_dict\['loss_scaler0'\] must be a dict"),
        ("apex", {}, {"loss_scaler0": {"loss_scale": -8.0}}, r"state_dict\['loss_scaler0'\]\['loss_scale'\] must be"),
        ("apex", {}, {"loss_scale": 8.0, "unskipped": 1.5}, r"state_dict\['unskipped'\] must be an integer"),
        ("colossalai", {}, {"scale": torch.tensor([8.0]), "hysteresis": 3}, r"this scaler's hysteresis is 2"),
        ("keras", {}, {"scale": 8.0, "hysteresis": 2}, r"GradScaler\.like\('colossalai', \.\.\.\)"),
        ("jmp", {"loss_scale": 8.0, "period": 4}, {"counter": 4}, r"state_dict\['counter'\] must be below .* \(4\)"),
        ("jmp", {"loss_scale": 8.0}, {"counter": 1, "steps_since_rescale": 1}, "mixes jmp's DynamicLossScale leaves"),
        ("keras", {}, {"dynamic_scale": math.nan}, r"state_dict\['dynamic_scale'\] must be a positive finite"),
        ("apex_fp16_utils", {}, {"cur_scale": 8.0, "scale_window": 7}, r"this scaler's scale_window is 1000"),
        ("apex_fp16_utils", {}, {"cur_iter": 3, "last_overflow_iter": 3}, r"must be below state_dict\['cur_iter'\]"),
        ("apex_fp16_utils", {}, {"cur_scale": 8.0, "cur_hysteresis": 2}, "mixes Apex fp16_utils' DynamicLossScaler"),
        ("deepspeed", {}, {"cur_scale": 8.0, "cur_iter": 3}, "without 'last_overflow_iter'"),  # DeepSpeed's own reader
    ],
)
def test_a_bad_saved_state_is_refused_naming_it_and_changes_nothing(
    peer: str, kwargs: dict[str, Any], saved: dict[str, Any], message: str
) -> None:
    scaler = dls.GradScaler.like(peer, "cpu", **kwargs)
    before = scaler.state_dict()
    with pytest.raises(ValueError, match=message):
        scaler.load_state_dict(saved)
    assert scaler.state_dict() == before


def test_every_dls_state_dict_of_the_new_rules_loads_back() -> None:
    for peer, kwargs in (("fairseq", {"scale_window": 3, "tolerance": 0.25}), ("mxnet", {})):
        for _, trace in field_traces(12, 5, 30, 3):
            run = field.DlsScaler(dls.GradScaler.like(peer, "cpu", **kwargs))
            for m in trace:
                run.step(m)
            again = dls.GradScaler.like(peer, "cpu", **kwargs)
            again.load_state_dict(run.run.state_dict())
            assert again.state_dict() == run.run.state_dict()
            follow = field.DlsScaler(again)
            assert [follow.step(m) for m in trace] == [run.step(m) for m in trace]


# ----------------------------------------------------------------------------------------------- like's arguments
def test_like_takes_each_peers_own_arguments_and_defaults() -> None:
    """The defaults of issue 41, each peer's own (its constructor's), and what they mean in dls's settings."""
    expected = {
        "keras": ({"initial_scale": 2.0**15, "dynamic_growth_steps": 2000}, (2.0**15, 2000, 2.0, 0.5)),
        "apex": (
            {
                "loss_scale": "dynamic",
                "init_scale": 2.0**16,
                "scale_factor": 2.0,
                "scale_window": 2000,
                "min_loss_scale": None,
                "max_loss_scale": 2.0**24,
            },
            (2.0**16, 2000, 2.0, 0.5),
        ),
        "apex_fp16_utils": (
            {"init_scale": 2.0**32, "scale_factor": 2.0, "scale_window": 1000},
            (2.0**32, 1000, 2.0, 0.5),
        ),
        "fairseq": (
            {
                "init_scale": 2.0**15,
                "scale_factor": 2.0,
                "scale_window": 2000,
                "tolerance": 0.0,
                "threshold": None,
                "min_loss_scale": 1e-4,
            },
            (2.0**15, 2000, 2.0, 0.5),
        ),
        "mxnet": ({}, (2.0**16, 2000, 2.0, 0.5)),
        "colossalai": (
            {
                "initial_scale": 2.0**16,
                "growth_factor": 2.0,
                "backoff_factor": 0.5,
                "growth_interval": 1000,
                "min_scale": None,
                "max_scale": None,
                "hysteresis": 2,
                "verbose": False,
            },
            (2.0**16, 1000, 2.0, 0.5),
        ),
        "jmp": ({"loss_scale": 2.0**15, "counter": 0, "period": 2000, "factor": 2, "min_loss_scale": 1.0}, None),
    }
    for peer, (defaults, settings) in expected.items():
        assert dict(PEERS[peer].defaults) == defaults, peer
        if settings is not None:
            s = dls.GradScaler.like(peer, "cpu").settings
            assert (s.dialect, s.init_scale, s.steps_per_increase, s.growth_factor, s.backoff_factor) == (
                peer,
                *settings,
            )
    bounds = {
        peer: (s.min_loss_scale, s.max_loss_scale, s.hysteresis, s.stop_loss_scale)
        for peer, s in ((p, ScalerSettings.like(p, **({"loss_scale": 8.0} if p == "jmp" else {}))) for p in expected)
    }
    tiny = torch.finfo(torch.float32).tiny
    assert bounds == {
        "keras": (tiny, FLOAT32_MAX, 1, None),
        "apex": (tiny, 2.0**24, 1, None),
        "apex_fp16_utils": (1.0, FLOAT32_MAX, 1, None),
        "fairseq": (tiny, FLOAT32_MAX, 1, 1e-4),
        "mxnet": (tiny, 2.0**24, 1, None),
        "colossalai": (tiny, FLOAT32_MAX, 2, None),
        "jmp": (1.0, FLOAT32_MAX, 1, None),
    }
    # The peers' meaning of their own values.
    assert ScalerSettings.like("colossalai", hysteresis=0).hysteresis == 1  # acts as 1 there
    assert ScalerSettings.like("colossalai", min_scale=0, max_scale=1e39).max_loss_scale == FLOAT32_MAX
    assert ScalerSettings.like("colossalai", growth_factor=1.1).growth_factor == float(torch.tensor(1.1))
    assert ScalerSettings.like("apex", init_scale=2.0**30).init_scale == 2.0**24  # min(max_loss_scale, init_scale)
    assert ScalerSettings.like("apex", max_loss_scale=math.inf).max_loss_scale == FLOAT32_MAX
    assert ScalerSettings.like("apex", loss_scale=512).mode == "static"
    assert ScalerSettings.like("jmp", loss_scale=8.0, min_loss_scale=0).min_loss_scale == tiny
    assert ScalerSettings.like("fairseq", threshold=0.5).min_loss_scale == 0.5
    assert (
        dls.GradScaler.like("jmp", "cpu", loss_scale=8.0, period=5, counter=3).state_dict()["steps_since_rescale"] == 3
    )
    # DeepSpeed: its fp16 section's keys, or its DynamicLossScaler's own arguments; Megatron's DynamicGradScaler's.
    by_class = ScalerSettings.like("deepspeed", init_scale=2.0**12, scale_window=7, min_scale=2, delayed_shift=3)
    by_keys = ScalerSettings.like(
        "deepspeed", initial_scale_power=12, loss_scale_window=7, min_loss_scale=2, hysteresis=3
    )
    assert by_class == by_keys
    assert ScalerSettings.like("deepspeed") == ScalerSettings.like("deepspeed", raise_error_at_min_scale=False)


@pytest.mark.parametrize(
    ("peer", "kwargs", "message"),
    [
        (
            "keras",
            {"dynamic_growth_step": 5},
            r"no argument 'dynamic_growth_step' \(did you mean 'dynamic_growth_steps'",
        ),
        ("keras", {"dynamic": False}, r"keras's scaler has no argument 'dynamic'"),
        ("keras", {"initial_scale": 0.0}, "^initial_scale must be a number from 2"),
        ("keras", {"dynamic_growth_steps": 0}, "^dynamic_growth_steps must be an integer from 1"),
        ("mxnet", {"init_scale": 2.0}, r"mxnet's scaler has no argument 'init_scale'; it takes no arguments"),
        ("jmp", {}, "^jmp's scaler requires loss_scale"),
        ("jmp", {"loss_scale": 8.0, "counter": 2000}, r"^counter must be an integer from 0 to period - 1"),
        ("jmp", {"loss_scale": 8.0, "factor": 1}, "^factor must be a number > 1"),
        ("jmp", {"loss_scale": 0.5}, r"^loss_scale \(0.5\) must not be below min_loss_scale \(1.0\)"),
        ("fairseq", {"tolerance": 1.0}, r"^tolerance must be a number in \[0, 1\)"),
        ("fairseq", {"threshold": 2.0**16}, r"^init_scale \(32768.0\) must not be below threshold"),
        ("fairseq", {"min_loss_scale": -1}, "^min_loss_scale must be a number from 0"),
        ("fairseq", {"scale_window": 2000.0}, "^scale_window must be an integer"),
        ("apex", {"loss_scale": "dynamc"}, "^loss_scale must be 'dynamic' or a static scale"),
        ("apex", {"min_loss_scale": 2.0**20}, r"^init_scale \(65536.0\) must not be below min_loss_scale"),
        ("apex", {"max_loss_scale": 0}, "^max_loss_scale must be a number from 2"),
        ("apex_fp16_utils", {"init_scale": 0.5}, r"^init_scale \(0.5\) must not be below its floor \(1.0\)"),
        ("apex_fp16_utils", {"scale_factor": 1.0}, "^scale_factor must be a number > 1"),
        ("colossalai", {"hysteresis": -1}, "^hysteresis must be an integer from 0"),
        ("colossalai", {"min_scale": 2.0**20}, r"^initial_scale \(65536.0\) must not be below min_scale"),
        ("colossalai", {"max_scale": 2.0**10}, r"^max_scale \(1024.0\) must not be below initial_scale"),
        ("colossalai", {"growth_factor": 1 + 1e-9}, r"^growth_factor is 1.0 in float32, as ColossalAI holds it"),
        ("deepspeed", {"scale_window": 10, "hysteresis": 2}, "not both: 'hysteresis' is a config key, 'scale_window'"),
        ("deepspeed", {"delayed_shift": 0}, "^delayed_shift must be an integer from 1"),
        ("deepspeed", {"dtype": "float16"}, "^dtype must be a torch dtype"),
        ("deepspeed", {"scale_windw": 3}, r"did you mean 'scale_window'\?"),
    ],
)
def test_like_refuses_what_the_peer_cannot_mean_naming_its_argument(peer: str, kwargs: dict[str, Any], message: str):
    with pytest.raises(ValueError, match=message):
        dls.GradScaler.like(peer, "cpu", **kwargs)


# ---------------------------------------------------------------------------------------------- the policy lab
NEW_PEERS = ("keras", "apex", "apex_fp16_utils", "fairseq", "mxnet", "colossalai", "jmp")


def test_the_policy_lab_replays_and_tunes_each_peer() -> None:
    from dls.diagnostics.policies import POLICIES, parse_policy
    from dls.diagnostics.replaying import replay
    from dls.diagnostics.tuning import tune
    from test_record import record_run

    trace, _ = record_run(dls.GradScaler("cpu", init_scale=2.0**16, growth_interval=5), 24, spikes={9: 1e30})
    specs = [
        "keras:dynamic_growth_steps=4",
        "apex:scale_window=4,min_loss_scale=2**-2",
        "apex_fp16_utils:scale_factor=4,scale_window=3",
        "fairseq:tolerance=0.25,scale_window=4,threshold=2**-3",
        "mxnet",
        "colossalai:hysteresis=3,growth_interval=4",
        "jmp:loss_scale=2**10,period=4",
    ]
    results = replay(trace, specs)
    assert [r.policy.kind for r in results] == list(NEW_PEERS)
    for r in results:
        assert r.policy.settings == ScalerSettings.like(r.policy.kind, **r.policy.values)
        assert r.final_scale is not None and r.skipped[0] <= r.skipped[2]
    with pytest.raises(ValueError, match=r"policy 'jmp' has no key 'counter'"):  # a starting state, not a policy
        parse_policy("jmp:counter=3")
    with pytest.raises(ValueError, match=r"policy 'mxnet': 'x' is not key=value \(e\.g\. mxnet:key=\.\.\.\)"):
        parse_policy("mxnet:x")
    with pytest.raises(ValueError, match=r"policy 'fairseq': tolerance must be a number in \[0, 1\)"):
        parse_policy("fairseq:tolerance=2")
    result = tune(trace, ["fairseq", "mxnet"], max_underflow=None)
    assert len(result.candidates) == len(list(itertools.product(*POLICIES["fairseq"].grid.values()))) + 1


def test_the_config_lines_are_each_peers_own_and_build_the_same_scaler() -> None:
    """Each peer's line, evaluated with its real code where it is here (Keras, jmp, ColossalAI, fairseq's flags as
    FP16Optimizer passes them), holds the policy's values; dls's line builds the same rule."""
    from dls.diagnostics.policies import config_lines, parse_policy

    keras = field.keras_module()
    _, jnp, jmp = field.jmp_modules()
    colossalai = field.colossalai_scaler()
    specs = {
        "keras": "keras:initial_scale=2**12,dynamic_growth_steps=500",
        "apex": "apex:init_scale=2**12,scale_window=500,min_loss_scale=1",
        "apex_fp16_utils": "apex_fp16_utils:init_scale=2**20,scale_factor=4,scale_window=250",
        "fairseq": "fairseq:init_scale=128,scale_window=256,tolerance=0.25,threshold=2**-4,min_loss_scale=2**-8",
        "mxnet": "mxnet",
        "colossalai": "colossalai:initial_scale=2**12,growth_interval=500,hysteresis=3,min_scale=1,max_scale=2**30",
        "jmp": "jmp:loss_scale=2**12,period=500,factor=4,min_loss_scale=2**-4",
    }
    for peer, spec in specs.items():
        settings = parse_policy(spec).settings
        lines = config_lines(settings)
        built = eval(lines["dls"].replace('"cuda"', '"cpu"'), {"dls": dls})
        assert built.settings == settings, peer
        assert set(lines) == {"dls", {"keras": "Keras", "apex": "Apex", "apex_fp16_utils": "Apex fp16_utils",
                                      "fairseq": "fairseq flags", "mxnet": "MXNet", "colossalai": "ColossalAI",
                                      "jmp": "jmp"}[peer]}  # fmt: skip
    optimizer = keras.optimizers.SGD()
    own = eval(config_lines(parse_policy(specs["keras"]).settings)["Keras"], {"keras": keras, "optimizer": optimizer})
    assert (own.initial_scale, own.dynamic_growth_steps) == (4096, 500)
    own = eval(config_lines(parse_policy(specs["jmp"]).settings)["jmp"], {"jmp": jmp, "jnp": jnp})
    assert (float(own.loss_scale), own.period, own.factor, float(own.min_loss_scale)) == (4096.0, 500, 4, 2.0**-4)
    line = config_lines(parse_policy(specs["colossalai"]).settings)["ColossalAI"]
    own = eval(line, {"DynamicGradScaler": colossalai.DynamicGradScaler})
    assert (own.scale.item(), own._growth_interval, own._hysteresis) == (4096.0, 500, 3)
    assert (own._min_scale.item(), own._max_scale.item()) == (1.0, 2.0**30)
    flags = config_lines(parse_policy(specs["fairseq"]).settings)["fairseq flags"].split()
    value = {flags[i]: flags[i + 1] for i in range(1, len(flags), 2)}
    scaler = field.fairseq_scaler().DynamicLossScaler(  # as FP16Optimizer builds it from these flags
        init_scale=int(value["--fp16-init-scale"]),
        scale_window=int(value["--fp16-scale-window"]),
        tolerance=float(value["--fp16-scale-tolerance"]),
        threshold=float(value["--threshold-loss-scale"]),
        min_loss_scale=float(value["--min-loss-scale"]),
    )
    assert (scaler.loss_scale, scaler.scale_window, scaler.tolerance, scaler.threshold, scaler.min_loss_scale) == (
        128,
        256,
        0.25,
        2.0**-4,
        2.0**-8,
    )


@pytest.mark.parametrize(
    ("peer", "kwargs"), [("mxnet", {}), ("fairseq", {"init_scale": 2.0**14, "scale_window": 3, "tolerance": 0.3})]
)
def test_a_trace_recorded_mid_run_replays_as_recorded_with_the_rules_own_counters(
    peer: str, kwargs: dict[str, Any]
) -> None:
    """The trace's header holds the rule's own counters (MXNet's decided rescale, fairseq's iterations), so the
    ``recorded`` policy starts where the run was: here MXNet has a back-off decided and not yet committed."""
    import io

    from dls.diagnostics.replaying import replay
    from dls.diagnostics.trace import read_trace
    from test_record import fp16_loss, mlp

    model, scaler = mlp(), dls.GradScaler.like(peer, "cpu", **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    spikes = {9: 1e30, 14: 1e30, 15: 1e30, 22: 1e30}

    def step(i: int) -> tuple[float, bool]:
        used = scaler.get_scale()
        scaler.scale(fp16_loss(model, i, spikes.get(i, 1.0))).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return used, scaler.step_was_skipped(opt)

    for i in range(10):
        step(i)
    buf = io.BytesIO()
    with scaler.record(buf, histogram_every=None, start_step=10):
        seen = [step(i) for i in range(10, 30)]
    (result,) = replay(read_trace(io.BytesIO(buf.getvalue())), ["recorded"])
    assert result.first_departure is None and list(zip(result.scales, result.skips)) == seen
    assert seen[0][0] != seen[1][0] if peer == "mxnet" else True  # the decided back-off committed at step 10
