"""A stateful property test of GradScaler: random sequences of backward / unscale_ / clip / step / update /
state_dict / load_state_dict / optimizer-state resets / a parameter swapped into the optimizer's list in place, with
inf, NaN and overflowing-once-unscaled gradients injected, over half dtypes and optimizers (fused ones included).

Invariants checked after every rule:
- an optimizer never applies a non-finite or overflowing gradient (a fused kernel receives it with the flag and applies
  nothing; sync-free steps run and are undone);
- parameters and optimizer state change only on a step whose unscaled gradients were finite;
- the scale is a normal float32 (so its inverse is finite) and, after the rule, within its bounds;
- every exception is dls's (ValueError / RuntimeError) and carries a message.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import dls
from conftest import assert_same, snapshot

TINY = torch.finfo(torch.float32).tiny
FLOAT32_MAX = torch.finfo(torch.float32).max
MIN_SCALE, MAX_SCALE = 2.0**-10, 2.0**16
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=0.01, fused=True),
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.5, fused=True),
}


class ScalerMachine(RuleBasedStateMachine):
    @initialize(
        dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
        opt_name=st.sampled_from(sorted(OPTIMIZERS)),
        sync_free=st.booleans(),
        max_norm=st.sampled_from([None, 1.0]),
        init=st.sampled_from([2.0**-3, 1.0, 2.0**10]),
    )
    def setup(self, dtype: torch.dtype, opt_name: str, sync_free: bool, max_norm: float | None, init: float) -> None:
        torch.manual_seed(0)
        self.dtype = dtype
        self.params = [torch.nn.Parameter(torch.randn(3).to(dtype)), torch.nn.Parameter(torch.randn(2, 2).to(dtype))]
        self.opt = OPTIMIZERS[opt_name](self.params)
        self.opt.register_step_pre_hook(self._check_received)
        self.fresh_state = self.opt.state_dict()
        self.kwargs = {
            "init_scale": init,
            "min_loss_scale": MIN_SCALE,
            "max_loss_scale": MAX_SCALE,
            "steps_per_increase": 2,
            "sync_free": sync_free,
            "max_gradient_norm": max_norm,
        }
        self.scaler = dls.GradScaler("dynamic", **self.kwargs)
        self.stage = "ready"  # ready → backward → (unscaled) → stepped → ready
        self.clean: bool | None = None  # whether this iteration's unscaled gradients are finite (None: unknown)
        self.set_scale: float | None = None  # a scale given by update(new_scale=...), maybe outside the bounds

    # ------------------------------------------------------------------ the optimizer's view
    def _check_received(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        grad_scale = getattr(opt, "grad_scale", None)
        found_inf = getattr(opt, "found_inf", None)
        if found_inf is not None and found_inf.item():
            return  # a fused kernel told to skip: it applies nothing
        if self.kwargs["sync_free"] and self.clean is not True:
            return  # a sync-free step runs and is undone on the device (checked in step())
        divisor = 1.0 if grad_scale is None else float(grad_scale)
        for p in self.params:
            g = p.grad.double() / divisor
            assert torch.isfinite(g).all() and g.abs().max() <= torch.finfo(self.dtype).max

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: self.stage == "ready")
    @rule(
        inject=st.sampled_from(["none", "none", "inf", "nan", "big"]),
        weight=st.floats(0.25, 4.0),
    )
    def backward(self, inject: str, weight: float) -> None:
        loss = sum((p.float() * weight).sum() for p in self.params)
        self.scaler.scale(loss).backward()
        scale = self.scaler.get_scale()
        grad = self.params[0].grad
        assert grad is not None
        if inject == "inf":
            grad[0] = math.inf
        elif inject == "nan":
            grad[0] = math.nan
        elif inject == "big":
            # 1e6 once unscaled: beyond float16, fine for bfloat16/float32; stored scaled, so finite if it fits.
            stored = 1e6 * scale
            if stored < torch.finfo(self.dtype).max / 2:
                grad[0] = stored
            else:
                inject = "none"
        self.clean = self._predict_clean(scale)
        self.stage = "backward"

    def _predict_clean(self, scale: float) -> bool | None:
        """Whether the gradients the optimizer would receive are finite, computed independently in float64 from
        the stored (scaled) gradients; ``None`` within half a unit of the dtype's largest value (rounding decides)."""
        grads = [p.grad.double() for p in self.params]  # type: ignore[union-attr]
        if not all(torch.isfinite(g).all() for g in grads):
            return False
        unscaled = [g / scale for g in grads]
        if self.kwargs["max_gradient_norm"] is not None:  # clipped before the optimizer sees it
            norm = math.sqrt(sum(float((u * u).sum()) for u in unscaled))
            return norm < FLOAT32_MAX / 2 if not FLOAT32_MAX / 2 <= norm <= FLOAT32_MAX * 2 else None
        largest = max(float(u.abs().max()) for u in unscaled)
        limit = torch.finfo(self.dtype).max
        if 0.999 * limit <= largest <= 1.001 * limit:
            return None
        return largest < limit

    @precondition(lambda self: self.stage == "backward")
    @rule()
    def unscale(self) -> None:
        self.scaler.unscale_(self.opt)
        self.stage = "unscaled"

    @precondition(lambda self: self.stage == "backward")
    @rule()
    def clip(self) -> None:
        self.scaler.clip_gradients_and_return_isfinite(self.opt)
        self.stage = "unscaled"

    @precondition(lambda self: self.stage in ("backward", "unscaled"))
    @rule()
    def step(self) -> None:
        before = snapshot(self.params, self.opt)
        self.scaler.step(self.opt)
        skipped = self.scaler.step_was_skipped(self.opt)
        if self.clean is not None:
            assert skipped == (not self.clean)
        if skipped:
            assert_same(before, snapshot(self.params, self.opt), "skipped step")
        for p in self.params:
            assert torch.isfinite(p).all()
        self.stage = "stepped"

    @precondition(lambda self: self.stage in ("unscaled", "stepped"))
    @rule()
    def misuse(self) -> None:
        before = self.scaler.get_scale()
        with pytest.raises(RuntimeError, match=r"already been called|after step"):
            self.scaler.unscale_(self.opt)
        if self.stage == "stepped":
            with pytest.raises(RuntimeError, match="already been called"):
                self.scaler.step(self.opt)
        assert self.scaler.get_scale() == before

    @precondition(lambda self: self.stage == "stepped")
    @rule(
        new_scale=st.sampled_from([None, None, None, 0.5, 2.0**20, math.nan, 0.0, -1.0, 1e-300]),
        as_tensor=st.booleans(),
    )
    def update(self, new_scale: float | None, as_tensor: bool) -> None:
        valid = new_scale is not None and math.isfinite(new_scale) and TINY <= new_scale <= FLOAT32_MAX
        previous = self.scaler.get_scale()
        if new_scale is None:
            self.scaler.update()
            self.set_scale = None
        elif as_tensor:
            self.scaler.update(new_scale=torch.tensor(new_scale))
            with pytest.warns(UserWarning) if not valid else _no_warning():
                now = self.scaler.get_scale()
            assert now == (new_scale if valid else previous)
            self.set_scale = now
        elif valid:
            self.scaler.update(new_scale=new_scale)
            self.set_scale = new_scale
        else:
            with pytest.raises(ValueError, match="new_scale"):
                self.scaler.update(new_scale=new_scale)
            self.scaler.update()
            self.set_scale = None
        self.opt.zero_grad()
        self.stage = "ready"

    @precondition(lambda self: self.stage == "ready")
    @rule()
    def round_trip(self) -> None:
        saved = self.scaler.state_dict()
        fresh = dls.GradScaler("dynamic", **self.kwargs)
        fresh.load_state_dict(saved)
        assert fresh.state_dict() == saved or self.set_scale is not None  # a set scale may be clamped on load
        if self.set_scale is None:
            self.scaler = fresh

    @precondition(lambda self: self.stage == "ready")
    @rule(
        key=st.sampled_from(["loss_scale", "steps_since_rescale", "num_skipped_steps", "scale", "growth_interval"]),
        value=st.sampled_from([math.nan, math.inf, -1.0, 2**70, 1.5, "x", 0.0]),
    )
    def bad_load(self, key: str, value: Any) -> None:
        valid = {"loss_scale": (2**70,), "scale": (), "growth_interval": ()}.get(key, (0.0,))
        if value in valid:
            return
        before = self.scaler.state_dict()
        with pytest.raises((ValueError, RuntimeError)) as info:
            self.scaler.load_state_dict({**before, key: value})
        assert str(info.value)
        assert self.scaler.state_dict() == before

    @precondition(lambda self: self.stage == "ready")
    @rule(how=st.sampled_from(["load_state_dict", "state.clear"]))
    def reset_optimizer_state(self, how: str) -> None:
        if how == "state.clear":
            self.opt.state.clear()
        else:
            self.opt.load_state_dict(self.fresh_state)

    @precondition(lambda self: self.stage == "ready")
    @rule(index=st.sampled_from([0, 1]))
    def swap_parameter_in_place(self, index: int) -> None:
        q = torch.nn.Parameter(self.params[index].detach().clone())
        self.opt.param_groups[0]["params"][index] = q  # the same list, the same length
        if self.opt.defaults.get("fused") and "momentum_buffer" in self.opt.state.get(self.params[index], {}):
            # torch's fused SGD itself fails on a group mixing parameters with and without momentum buffers (a
            # TypeError without any scaler): the replacement takes over the old parameter's state.
            self.opt.state[q] = self.opt.state.pop(self.params[index])
        self.params[index] = q

    # ------------------------------------------------------------------ invariants
    @invariant()
    def scale_is_a_normal_float32_within_bounds(self) -> None:
        if not hasattr(self, "scaler"):
            return
        scale = self.scaler.get_scale_tensor()
        assert scale.dtype == torch.float32
        value = float(scale)
        assert math.isfinite(value) and TINY <= value <= FLOAT32_MAX
        assert math.isfinite(1.0 / value)
        if self.set_scale is None:
            assert MIN_SCALE <= value <= MAX_SCALE


class _no_warning:
    def __enter__(self) -> None:
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc: object) -> None:
        self._catch.__exit__(*exc)


TestScalerMachine = ScalerMachine.TestCase
TestScalerMachine.settings = settings(
    max_examples=20, stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
