"""The field's other loss scalers, as their own code runs them (``_field_peers``): Keras 3, jmp, fairseq, MXNet and
ColossalAI. The behaviours below are the ones dls follows and the documentation states (the switching guide), each
asserted on the real code so that a statement about a peer is checked where it is made; several are where a peer's
documentation and its code disagree, and the code is the reference.
"""

from __future__ import annotations

import math

import pytest

import _field_peers as field
from _field_peers import FLOAT32_MAX, drive

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
    eager, _ = drive(field.JmpRun(4.0, period=5, min_loss_scale=0.25), [INF] * 5)
    jitted, _ = drive(field.JmpRun(4.0, jit=True, period=5, min_loss_scale=0.25), [INF] * 5)
    assert _scales(eager) == [2, 1, 0.5, 0.25, 0.25]
    # Through jax.jit the scaler is flattened to (loss_scale, counter) and rebuilt with the default floor of 1.
    assert _scales(jitted) == [2, 1, 1, 1, 1]
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
