"""``GradScaler``: dynamic loss scaling with the surface of ``cstorch.amp.GradScaler`` and ``torch.amp.GradScaler``.

Per iteration each optimizer moves READY → UNSCALED → STEPPED, and ``update()`` brings every optimizer back
to READY. The scale and its counters live on the device in a ``policy.ScaleState``; the update rule is a pure
function from ``dls.policy``, the passes over gradients come from ``dls.kernels``.

Host synchronisation: ``scale``, ``unscale_``, ``clip_gradients_and_return_isfinite`` and ``update`` never read
a tensor back. ``step`` reads the overflow flag once per optimizer (``if not found_inf.item()``), except for
optimizers that take the flag themselves (torch's fused Adam/AdamW/SGD/Adagrad) and with ``sync_free=True``.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
import warnings
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import torch

from dls import distributed, kernels
from dls.formats import get_half_dtype_str
from dls.policy import DynamicRule, ScaleState, StaticRule, assign_, initial_state

_T = TypeVar("_T")

DEFAULT_MAX_LOSS_SCALE = 2.0**15
CBFLOAT16_MAX_LOSS_SCALE = 2.0**31
STATE_KEYS = (
    "loss_scale",
    "steps_since_rescale",
    "overflows_since_rescale",
    "num_skipped_steps",
    "hysteresis_hits",
)
# torch.amp.GradScaler.state_dict() keys and the dls names they translate to.
TORCH_STATE_KEYS = {
    "scale": "loss_scale",
    "_growth_tracker": "steps_since_rescale",
    "growth_factor": "growth_factor",
    "backoff_factor": "backoff_factor",
    "growth_interval": "steps_per_increase",
}
_DEVICE_NAMES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla", "meta")


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclasses.dataclass
class _OptimizerState:
    stage: _Stage = _Stage.READY
    flag: torch.Tensor | None = None  # float32 0-dim on the scale's device; read it through found_inf
    clipped: bool = False
    clipped_by_step: bool = False
    agreement: distributed.Agreement | None = None  # the flag's all-reduce across ranks while in flight

    @property
    def found_inf(self) -> torch.Tensor | None:
        """The overflow flag, agreed across ranks: waits for its all-reduce if one is in flight."""
        if self.agreement is not None:
            self.flag, self.agreement = self.agreement.wait(), None
        return self.flag

    @found_inf.setter
    def found_inf(self, value: torch.Tensor | None) -> None:
        self.flag, self.agreement = value, None


@dataclasses.dataclass
class _LastStep:
    """How the last ``step()`` of an optimizer ended: ``skipped`` when decided on the host, else read lazily from
    ``found_inf`` (the fused and sync-free paths never read it themselves)."""

    found_inf: torch.Tensor | None
    skipped: bool | None

    def was_skipped(self) -> bool:
        if self.skipped is None:
            assert self.found_inf is not None
            self.skipped = bool(self.found_inf.item())
        return self.skipped


@dataclasses.dataclass
class _OptimizerIndex:
    """What the scaler caches per optimizer, valid while its param groups keep the same lists and lengths."""

    signature: tuple[tuple[int, int], ...]
    param_lists: list[list[Any]]  # held so the ids in the signature cannot be reused by new lists
    grads: kernels.GradIndex
    has_dtensors: bool
    # Parameters that have taken a step through this scaler (id → parameter, held so ids stay unique): only for
    # them does all the state a step touches exist, so that their step can be skipped or masked on the device.
    stepped: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)


class GradScaler:
    """Scales the loss so half-precision gradients neither underflow nor overflow, and skips overflowing steps.

    Args:
        loss_scale: ``"dynamic"``, a number (a static scale: fixed, overflowing steps still skipped), or
            ``None`` for the default of the half dtype chosen by ``dls.set_half_dtype``: dynamic for float16 and
            cbfloat16, no scaling for bfloat16.
        init_scale: the first scale of dynamic scaling; default ``max_loss_scale``. Clamped to
            ``max_loss_scale``; below ``min_loss_scale`` is an error.
        steps_per_increase: clean steps after which the scale grows (torch's ``growth_interval``).
        min_loss_scale, max_loss_scale: bounds of the dynamic scale. ``max_loss_scale`` defaults to 2**15, or
            2**31 when the half dtype is cbfloat16.
        overflow_tolerance: fraction of overflowing steps since the last rescale tolerated before backing off.
        max_gradient_norm: if set, ``step`` also clips all gradients to this global L2 norm (after unscaling).
        growth_factor, backoff_factor: multiply the scale on growth / back-off.
        hysteresis: number of (non-tolerated) overflows needed for one back-off (DeepSpeed/Megatron).
        enabled: ``False`` makes every method a pass-through, as in torch.
        sync_free: keep ``step`` on the device for optimizers that cannot take the flag themselves: the step
            always runs and parameters and optimizer state are restored where it overflowed. Costs a copy of
            parameters and state per step; the default reads one flag back per optimizer instead.
        process_group: the group whose ranks must agree on overflow; default: the world group when
            ``torch.distributed`` is initialised, nothing otherwise.
        gradients_sharded: whether each rank holds a disjoint slice of the gradients, so the global norm for
            ``max_gradient_norm`` sums squared norms across ranks. ``None`` (default): ``DTensor`` gradients
            (FSDP2, tensor parallel) by their placements, plain gradients as replicated (DDP); ``True``: plain
            gradients too are shards across ``process_group`` (a ZeRO-style optimizer that owns a slice);
            ``False``: every rank clips by its local norm.
        device: accepted for ``torch.amp.GradScaler(device=...)`` compatibility: where the scale lives before
            the first ``scale()`` call (after that it follows the loss).
        growth_interval: torch's name for ``steps_per_increase``.
    """

    def __init__(
        self,
        loss_scale: str | float | None = None,
        init_scale: float | None = None,
        steps_per_increase: int | None = None,
        min_loss_scale: float = 2.0**-14,
        max_loss_scale: float | None = None,
        overflow_tolerance: float = 0.0,
        max_gradient_norm: float | None = None,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        hysteresis: int = 1,
        enabled: bool = True,
        *,
        sync_free: bool = False,
        process_group: Any = None,
        gradients_sharded: bool | None = None,
        device: str | torch.device | None = None,
        growth_interval: int | None = None,
    ) -> None:
        if not isinstance(enabled, bool):
            raise ValueError(f"enabled must be True or False; got {enabled!r}")
        if not isinstance(sync_free, bool):
            raise ValueError(f"sync_free must be True or False; got {sync_free!r}")
        if gradients_sharded is not None and not isinstance(gradients_sharded, bool):
            raise ValueError(f"gradients_sharded must be True, False or None; got {gradients_sharded!r}")
        if steps_per_increase is not None and growth_interval is not None:
            raise ValueError("give steps_per_increase or its torch name growth_interval, not both")
        steps = steps_per_increase if steps_per_increase is not None else growth_interval
        if max_gradient_norm is not None and not _is_positive_number(max_gradient_norm):
            raise ValueError(f"max_gradient_norm must be a positive number or None; got {max_gradient_norm!r}")
        mode = _resolve_mode(loss_scale)
        if max_loss_scale is None:
            is_cb = get_half_dtype_str() == "cbfloat16"
            max_loss_scale = CBFLOAT16_MAX_LOSS_SCALE if is_cb else DEFAULT_MAX_LOSS_SCALE
        # The rule validates every numeric knob, whichever mode runs, so a typo never waits for a mode switch.
        rule = DynamicRule(
            steps_per_increase=2000 if steps is None else steps,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            overflow_tolerance=overflow_tolerance,
            hysteresis=hysteresis,
            min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale,
        )
        if mode == "static":
            if init_scale is not None:
                raise ValueError("init_scale applies to dynamic loss scaling only; a static loss_scale is fixed")
            assert isinstance(loss_scale, (int, float))
            start = float(loss_scale)
        else:
            start = max_loss_scale if init_scale is None else init_scale
            if not _is_positive_number(start):
                raise ValueError(f"init_scale must be a positive number or None; got {init_scale!r}")
            if start < min_loss_scale:
                raise ValueError(f"init_scale ({start!r}) must not be below min_loss_scale ({min_loss_scale!r})")
            start = min(float(start), max_loss_scale)

        self._enabled = enabled and mode != "off"
        self._mode = mode if enabled else "off"
        self._rule: DynamicRule | StaticRule = rule if mode == "dynamic" else StaticRule()
        self._dynamic_rule = rule  # kept for getters and torch state dicts, whatever the mode
        self._init_scale = start
        self._max_gradient_norm = None if max_gradient_norm is None else float(max_gradient_norm)
        self._sync_free = sync_free
        self._process_group = process_group
        self._gradients_sharded = gradients_sharded
        if device is not None and torch.device(device).type == "cuda" and not torch.cuda.is_available():
            # torch.amp.GradScaler("cuda", enabled=use_amp) on a machine without CUDA: warn and disable, as torch.
            if self._enabled:
                warnings.warn("dls.GradScaler is enabled, but CUDA is not available. Disabling.", stacklevel=2)
                self._enabled, self._mode = False, "off"
            device = None
        self._state: ScaleState = initial_state(start, device=device)
        self._per_optimizer: dict[int, _OptimizerState] = {}
        self._index_cache: weakref.WeakKeyDictionary[torch.optim.Optimizer, _OptimizerIndex] = (
            weakref.WeakKeyDictionary()
        )
        self._last_steps: weakref.WeakKeyDictionary[torch.optim.Optimizer, _LastStep] = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------ queries
    def is_enabled(self) -> bool:
        """Whether the scaler scales and skips (``False`` when disabled or when the mode is no scaling)."""
        return self._enabled

    @property
    def mode(self) -> str:
        """``"dynamic"``, ``"static"`` or ``"off"``."""
        return self._mode

    @property
    def max_gradient_norm(self) -> float | None:
        return self._max_gradient_norm

    def get_scale(self) -> float:
        """The current loss scale (1.0 when disabled). Reads the device value back: not for the hot path."""
        return float(self._state.loss_scale.item()) if self._enabled else 1.0

    def get_non_clamped_scale(self) -> float:
        """The scale after the last update before the ``min_loss_scale`` clamp: below ``get_scale()`` means the
        scale is pinned at its floor and gradients still overflow."""
        return float(self._state.non_clamped_scale.item()) if self._enabled else 1.0

    def get_num_skipped_steps(self) -> int:
        """Iterations whose gradients overflowed (their optimizer steps were skipped)."""
        return int(self._state.num_skipped_steps.item()) if self._enabled else 0

    def step_was_skipped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the last ``step(optimizer)`` (or ``step_if_finite``) through this scaler was skipped because the
        gradients overflowed. Stays valid after ``update()`` until the next step of that optimizer, so LR
        schedulers, EMA and step counters can follow real updates (``dls.skip_aware`` does this for you).

        Costs nothing where ``step`` decided on the host (the default path); after a fused-optimizer or
        ``sync_free`` step it reads the flag once (then remembers it). Raises ``RuntimeError`` before the
        optimizer's first step through this scaler. A disabled scaler never skips.
        """
        return self._last_step(optimizer).was_skipped()

    def step_was_skipped_tensor(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """``step_was_skipped`` as a 0-dim bool tensor on the scale's device, never read back to the host: to
        select on the device (``torch.where(skipped, old, new)``) in sync-free loops."""
        last = self._last_step(optimizer)
        if last.found_inf is None:
            return torch.tensor(bool(last.skipped), device=self._state.loss_scale.device)
        return last.found_inf > 0

    def _last_step(self, optimizer: torch.optim.Optimizer) -> _LastStep:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
        last = self._last_steps.get(optimizer)
        if last is None:
            raise RuntimeError("step_was_skipped(): this optimizer has not stepped through this scaler yet")
        return last

    def get_scale_tensor(self) -> torch.Tensor:
        """The scale as a 0-dim float32 device tensor (no host sync), e.g. for logging inside compiled code."""
        return self._state.loss_scale

    def get_growth_factor(self) -> float:
        return self._dynamic_rule.growth_factor

    def get_backoff_factor(self) -> float:
        return self._dynamic_rule.backoff_factor

    def get_growth_interval(self) -> int:
        return self._dynamic_rule.steps_per_increase

    def set_growth_factor(self, new_factor: float) -> None:
        self._replace_rule(growth_factor=new_factor)

    def set_backoff_factor(self, new_factor: float) -> None:
        self._replace_rule(backoff_factor=new_factor)

    def set_growth_interval(self, new_interval: int) -> None:
        self._replace_rule(steps_per_increase=new_interval)

    def _replace_rule(self, **changes: Any) -> None:
        self._dynamic_rule = dataclasses.replace(self._dynamic_rule, **changes)  # validates
        if self._mode == "dynamic":
            self._rule = self._dynamic_rule

    # ------------------------------------------------------------------ scale
    def scale(self, outputs: _T) -> _T:
        """Multiply a loss (or nested lists/tuples of them) by the scale.

        Half-precision losses are scaled in float32 (a float16 loss times 2**15 would overflow in float16);
        other tensors keep their dtype. The scale moves to the loss's device on first use.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            self._follow_device(outputs.device)
        cache: dict[torch.device, torch.Tensor] = {}

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if value.device not in cache:
                    cache[value.device] = self._state.loss_scale.to(value.device, non_blocking=True)
                if value.dtype in (torch.float16, torch.bfloat16):
                    value = value.float()
                return value * cache[value.device]
            if isinstance(value, (list, tuple)):
                scaled = [apply(v) for v in value]
                return type(value)(scaled) if isinstance(value, list) else _rebuild_tuple(value, scaled)
            if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
                return map(apply, value)
            raise ValueError(f"outputs must be a Tensor or an iterable of Tensors; got {type(value).__name__}")

        result: _T = apply(outputs)
        return result

    def _follow_device(self, device: torch.device) -> None:
        if self._state.loss_scale.device != device and not self._per_optimizer:
            self._state = ScaleState(*(t.to(device) for t in self._state))

    # ------------------------------------------------------------------ unscale / clip
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and record whether any is inf/NaN.

        One fused pass per device and dtype, no host sync. At most once per optimizer per iteration, before
        ``step``; ``step`` calls it if you did not.
        """
        if not self._enabled:
            return
        state = self._optimizer_state(optimizer)
        if state.stage is _Stage.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state.stage is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        self._unscale_and_check([optimizer], [state])

    def clip_gradients_and_return_isfinite(
        self, optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]
    ) -> torch.Tensor:
        """Unscale the optimizers' gradients, clip them together to ``max_gradient_norm`` (one global norm over
        all their gradients) and return whether that norm is finite, as a bool tensor on the device.

        The result decides the skip for all of them. Without ``max_gradient_norm`` the gradients are unscaled
        but not clipped and the returned flag is shared all the same.
        """
        return self._clip_and_check(_as_optimizer_list(optimizers, "optimizers"), self._max_gradient_norm)

    def _clip_and_check(self, optimizers: list[torch.optim.Optimizer], max_norm: float | None) -> torch.Tensor:
        if not self._enabled:
            # Nothing to unscale or skip; clipping still applies, and the flag still tells the truth.
            if max_norm is None:
                return torch.ones((), dtype=torch.bool, device=self._state.loss_scale.device)
            for opt in optimizers:
                self._optimizer_state(opt).clipped = True
            return self._clip([], optimizers, max_norm) == 0
        states = [self._optimizer_state(opt) for opt in optimizers]
        if any(s.stage is _Stage.STEPPED for s in states):
            raise RuntimeError("gradients cannot be clipped after step() on the same optimizer before update().")
        ready = [(o, s) for o, s in zip(optimizers, states) if s.stage is _Stage.READY]
        done = [(o, s) for o, s in zip(optimizers, states) if s.stage is _Stage.UNSCALED]
        if max_norm is None:
            if ready:
                self._unscale_and_check([o for o, _ in ready], [s for _, s in ready])
            found_inf = _max_flag([s.found_inf for s in states])
        else:
            found_inf = self._clip([o for o, _ in ready], [o for o, _ in done], max_norm)
            found_inf = _max_flag([found_inf, *(s.found_inf for _, s in done)])
            found_inf = distributed.agree_on_overflow(found_inf, self._process_group)
        for state in states:
            state.stage = _Stage.UNSCALED
            state.found_inf = found_inf
            state.clipped = True
        return found_inf == 0

    def _unscale_and_check(self, optimizers: list[torch.optim.Optimizer], states: list[_OptimizerState]) -> None:
        """Unscale each optimizer's gradients and set its agreed overflow flag (stage → UNSCALED)."""
        inv_scale = self._inv_scale()
        for optimizer, state in zip(optimizers, states):
            groups = self._grads(optimizer)
            devices = {device for device, _ in groups}
            found = _zero_flags(devices)
            kernels.mul_and_check_(groups, kernels.per_device(inv_scale, devices), found)
            # Across ranks the flag is agreed asynchronously: reading state.found_inf waits for the all-reduce.
            flag = self._combine(found)
            state.flag, state.agreement = flag, distributed.start_agreement(flag, self._process_group)
            state.stage = _Stage.UNSCALED

    def _clip(
        self, scaled: list[torch.optim.Optimizer], unscaled: list[torch.optim.Optimizer], max_norm: float
    ) -> torch.Tensor:
        """Unscale ``scaled`` and clip all gradients of both lists to ``max_norm``, in two passes: one read for
        the global norm (of still-scaled gradients times 1/scale), one read+write multiplying by
        ``clip_coef / scale`` (``clip_coef`` alone for already unscaled gradients). Returns the overflow flag.
        """
        home = self._state.loss_scale.device
        inv_scale = self._inv_scale()
        one = torch.ones((), dtype=torch.float32, device=home)
        parts = [(self._grads_of(scaled), inv_scale), (self._grads_of(unscaled), one)]
        if distributed.norm_is_sharded(scaled + unscaled, self._gradients_sharded, self._process_group):
            # Each rank holds a slice of the gradients: squared norms are summed across ranks.
            opts = [(scaled, inv_scale), (unscaled, one)]
            sharded = self._gradients_sharded is True
            total_norm = distributed.global_norm(opts, home, self._process_group, plain_sharded=sharded)
        else:
            norms = []
            for groups, factor in parts:
                norms.append(kernels.global_norm(groups, kernels.per_device(factor, {d for d, _ in groups}), home))
            total_norm = torch.linalg.vector_norm(torch.stack(norms))
        coef = kernels.clip_coefficient(total_norm, max_norm)
        # An inf/NaN element makes the norm inf/NaN: the norm is the overflow flag, the multiply needs no check.
        found = (~torch.isfinite(total_norm)).float()
        for groups, factor in parts:
            kernels.mul_(groups, kernels.per_device(factor * coef, {d for d, _ in groups}))
        return found

    def _inv_scale(self) -> torch.Tensor:
        # The reciprocal in float64 then rounded once, as torch does: exact for the usual powers of two.
        return self._state.loss_scale.double().reciprocal().float()

    def _combine(self, found: dict[torch.device, torch.Tensor]) -> torch.Tensor:
        home = self._state.loss_scale.device
        flags = [f.to(home, non_blocking=True) for f in found.values()]
        return _max_flag(flags) if flags else torch.zeros((), dtype=torch.float32, device=home)

    def _grads_of(self, optimizers: list[torch.optim.Optimizer]) -> kernels.Groups:
        merged: kernels.Groups = {}
        for optimizer in optimizers:
            for key, grads in self._grads(optimizer).items():
                merged.setdefault(key, []).extend(grads)
        return merged

    def _index(self, optimizer: torch.optim.Optimizer) -> _OptimizerIndex:
        signature = tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)
        index = self._index_cache.get(optimizer)
        if index is None or index.signature != signature:
            lists = [g["params"] for g in optimizer.param_groups]
            params = [p for ps in lists for p in ps]
            index = _OptimizerIndex(signature, lists, kernels.GradIndex(params), distributed.has_dtensors(params))
            self._index_cache[optimizer] = index
        return index

    def _grads(self, optimizer: torch.optim.Optimizer) -> kernels.Groups:
        index = self._index(optimizer)
        groups = index.grads.groups()
        # DTensor (FSDP2) gradients are checked, unscaled and clipped through their local shards.
        return distributed.local_shards(groups) if index.has_dtensors else groups

    # ------------------------------------------------------------------ step
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (and clip, with ``max_gradient_norm``) if not done yet, then ``optimizer.step(*args,
        **kwargs)`` unless the gradients overflowed. Returns what ``optimizer.step`` returned, or ``None`` when
        the step was skipped."""
        if not self._enabled:
            # No scaling, no skipping; max_gradient_norm still clips (bfloat16 runs use it too).
            if self._max_gradient_norm is not None and not self._optimizer_state(optimizer).clipped:
                self._clip([], [optimizer], self._max_gradient_norm)
            self._last_steps[optimizer] = _LastStep(None, False)
            return optimizer.step(*args, **kwargs)
        _reject_closure(args, kwargs)
        state = self._optimizer_state(optimizer)
        if state.stage is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if self._max_gradient_norm is not None and not state.clipped:
            if any(s.clipped_by_step for s in self._per_optimizer.values()):
                warnings.warn(
                    "step() clips each optimizer by the norm of its own gradients; for one global norm over "
                    "several optimizers call clip_gradients_and_return_isfinite([...]) with all of them before "
                    "step(), or use dls.optimizer_step with the list.",
                    stacklevel=2,
                )
            self._clip_and_check([optimizer], self._max_gradient_norm)
            state.clipped_by_step = True
        elif state.stage is _Stage.READY:
            if _takes_scale_and_flag(optimizer):
                return self._fused_step(optimizer, state, args, kwargs)
            self._unscale_and_check([optimizer], [state])
        return self._step_if_finite(optimizer, state, args, kwargs)

    def step_if_finite(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step(*args, **kwargs)`` if the flag recorded by ``unscale_`` or
        ``clip_gradients_and_return_isfinite`` is clean; returns its value, or ``None`` when skipped."""
        if not self._enabled:
            self._last_steps[optimizer] = _LastStep(None, False)
            return optimizer.step(*args, **kwargs)
        _reject_closure(args, kwargs)
        state = self._optimizer_state(optimizer)
        if state.stage is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state.stage is _Stage.READY:
            raise RuntimeError(
                "step_if_finite() needs the overflow flag: call unscale_() or "
                "clip_gradients_and_return_isfinite() first, or use step()."
            )
        return self._step_if_finite(optimizer, state, args, kwargs)

    def _step_if_finite(
        self,
        optimizer: torch.optim.Optimizer,
        state: _OptimizerState,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        assert state.found_inf is not None
        if _takes_scale_and_flag(optimizer):
            return self._fused_step(optimizer, state, args, kwargs)
        state.stage = _Stage.STEPPED
        if self._sync_free and self._has_stepped(optimizer):
            self._last_steps[optimizer] = _LastStep(state.found_inf, None)
            return _masked_step(optimizer, state.found_inf, args, kwargs)
        skipped = bool(state.found_inf.item())
        self._last_steps[optimizer] = _LastStep(state.found_inf, skipped)
        if skipped:
            return None
        result = optimizer.step(*args, **kwargs)
        self._mark_stepped(optimizer)
        return result

    def _fused_step(
        self,
        optimizer: torch.optim.Optimizer,
        state: _OptimizerState,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Hand the scale and the flag to an optimizer whose kernel unscales and skips by itself (no sync).

        A parameter's first step is decided on the host (one read): some fused kernels allocate state
        uninitialised and return early on overflow (torch's fused SGD with momentum), which would leave garbage
        behind after an overflowing first step.
        """
        grad_scale: torch.Tensor | None = None
        if state.stage is _Stage.READY:
            # Only a read pass for the flag: the optimizer kernel divides by grad_scale while it updates.
            groups = self._grads(optimizer)
            found = _zero_flags(d for d, _ in groups)
            for (device, _dtype), grads in groups.items():
                kernels.check_nonfinite(grads, found[device])
            state.found_inf = distributed.agree_on_overflow(self._combine(found), self._process_group)
            grad_scale = self._state.loss_scale
        assert state.found_inf is not None
        first_step = not self._has_stepped(optimizer)
        if first_step and state.found_inf.item():
            state.stage = _Stage.STEPPED
            self._last_steps[optimizer] = _LastStep(state.found_inf, True)
            return None
        self._last_steps[optimizer] = _LastStep(state.found_inf, None if not first_step else False)
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = state.found_inf  # type: ignore[attr-defined]
        try:
            result = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        state.stage = _Stage.STEPPED
        if first_step:
            self._mark_stepped(optimizer)
        return result

    def _has_stepped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether every parameter with a gradient has taken a step through this scaler: only then does all the
        state a step touches exist, so that the step can be skipped or masked on the device. O(1) once every
        parameter of the optimizer has stepped; a scan over parameters before that."""
        index = self._index(optimizer)
        if len(index.stepped) == len(index.grads.params):
            return True
        return all(id(p) in index.stepped for p in index.grads.params if p.grad is not None)

    def _mark_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        index = self._index(optimizer)
        if len(index.stepped) < len(index.grads.params):
            index.stepped.update((id(p), p) for p in index.grads.params if p.grad is not None)

    # ------------------------------------------------------------------ update
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Apply the scale rule to this iteration's overflow flag (any optimizer overflowed → back off), or set
        ``new_scale``, then start the next iteration."""
        if not self._enabled:
            self._per_optimizer.clear()  # only clipping was recorded
            return
        if new_scale is not None:
            scale = _validated_new_scale(new_scale, self._state.loss_scale.device)
            flags = [s.found_inf for s in self._per_optimizer.values() if s.found_inf is not None]
            skipped = (_max_flag(flags) > 0).long() if flags else 0
            assign_(
                self._state,
                self._state._replace(
                    loss_scale=scale,
                    non_clamped_scale=scale,
                    num_skipped_steps=self._state.num_skipped_steps + skipped,
                ),
            )
        else:
            self._apply_rule(list(self._per_optimizer.values()))
        self._per_optimizer.clear()

    def update_scale(self, optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> None:
        """Apply the scale rule to the flags of ``optimizers`` without starting a new iteration
        (``update()`` is ``update_scale`` over every optimizer of the iteration, then the reset)."""
        if not self._enabled:
            return
        opts = _as_optimizer_list(optimizers, "optimizers")
        self._apply_rule([self._per_optimizer.get(id(o), _OptimizerState()) for o in opts])

    def _apply_rule(self, states: list[_OptimizerState]) -> None:
        flags = [s.found_inf for s in states if s.found_inf is not None]
        if not flags:
            raise RuntimeError(
                "No inf checks were recorded prior to update(): call step() (or unscale_()) on the "
                "optimizers of this iteration first."
            )
        self._rule.update_(self._state, _max_flag(flags))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``{loss_scale, steps_since_rescale, overflows_since_rescale, num_skipped_steps, hysteresis_hits}`` as
        Python numbers; ``{}`` when disabled, as in torch."""
        if not self._enabled:
            return {}
        s = self._state
        return {
            "loss_scale": float(s.loss_scale.item()),
            "steps_since_rescale": int(s.steps_since_rescale.item()),
            "overflows_since_rescale": int(s.overflows_since_rescale.item()),
            "num_skipped_steps": int(s.num_skipped_steps.item()),
            "hysteresis_hits": int(s.hysteresis_hits.item()),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dls state dict (keys present replace, missing keys keep their values) or a
        ``torch.amp.GradScaler`` one (``scale``, ``_growth_tracker`` and its growth settings)."""
        if not self._enabled:
            return
        if not isinstance(state_dict, dict):
            raise ValueError(f"state_dict must be a dict; got {type(state_dict).__name__}")
        if not state_dict:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled GradScaler."
            )
        values = {TORCH_STATE_KEYS.get(k, k): v for k, v in state_dict.items()}
        allowed = set(STATE_KEYS) | set(TORCH_STATE_KEYS)
        unknown = sorted(set(state_dict) - allowed)
        if unknown:
            raise ValueError(f"state_dict has unknown keys {unknown}; allowed keys: {sorted(allowed)}")
        settings = {k: values.pop(k) for k in ("growth_factor", "backoff_factor", "steps_per_increase") if k in values}
        rule = dataclasses.replace(self._dynamic_rule, **{k: _number(k, v) for k, v in settings.items()})  # type: ignore[arg-type]
        updates: dict[str, torch.Tensor] = {}
        for key, value in values.items():
            number = _number(key, value)
            if key == "loss_scale":
                if not _is_positive_number(number):
                    raise ValueError(f"state_dict['loss_scale'] must be a positive finite number; got {value!r}")
                if self._mode == "dynamic":  # as init_scale: a scale from elsewhere fits this scaler's bounds
                    number = min(max(float(number), rule.min_loss_scale), rule.max_loss_scale)
                updates["loss_scale"] = updates["non_clamped_scale"] = torch.tensor(float(number))
            else:
                if number != int(number) or number < 0:
                    raise ValueError(f"state_dict[{key!r}] must be a non-negative integer; got {value!r}")
                updates[key] = torch.tensor(int(number))
        # Everything validated: now change state.
        self._dynamic_rule = rule
        if self._mode == "dynamic":
            self._rule = rule
        assign_(
            self._state, self._state._replace(**{k: v.to(self._state.loss_scale.device) for k, v in updates.items()})
        )

    def __getstate__(self) -> dict[str, Any]:
        if self._enabled and self._per_optimizer:
            raise RuntimeError(
                "A GradScaler may only be pickled at the beginning of an iteration, or after scaler.update()."
            )
        state = self.__dict__.copy()
        state["_index_cache"] = None
        state["_last_steps"] = None
        state["_per_optimizer"] = {}  # a disabled scaler records only clipping; nothing to carry over
        state["_process_group"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._index_cache = weakref.WeakKeyDictionary()
        self._last_steps = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------ helpers
    def _optimizer_state(self, optimizer: torch.optim.Optimizer) -> _OptimizerState:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
        return self._per_optimizer.setdefault(id(optimizer), _OptimizerState())

    def __repr__(self) -> str:
        rule = self._dynamic_rule
        return (
            f"GradScaler(mode={self._mode!r}, init_scale={self._init_scale}, steps_per_increase="
            f"{rule.steps_per_increase}, min_loss_scale={rule.min_loss_scale}, max_loss_scale={rule.max_loss_scale}, "
            f"max_gradient_norm={self._max_gradient_norm})"
        )


# ---------------------------------------------------------------------- module helpers
def _resolve_mode(loss_scale: Any) -> str:
    if loss_scale is None:
        return "off" if get_half_dtype_str() == "bfloat16" else "dynamic"
    if isinstance(loss_scale, str):
        if loss_scale == "dynamic":
            return "dynamic"
        is_device = loss_scale.split(":")[0] in _DEVICE_NAMES
        hint = f" ({loss_scale!r} looks like a device: pass device={loss_scale!r})" if is_device else ""
        raise ValueError(f"loss_scale must be 'dynamic', a positive number or None; got {loss_scale!r}{hint}")
    if not _is_positive_number(loss_scale):
        raise ValueError(f"loss_scale must be 'dynamic', a positive number or None; got {loss_scale!r}")
    return "static"


def _is_positive_number(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 < value <= torch.finfo(torch.float32).max
    )


def _number(key: str, value: Any) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"state_dict[{key!r}] must be a number; got {value!r}")
    return value


def _zero_flags(devices: Iterable[torch.device]) -> dict[torch.device, torch.Tensor]:
    """A clean overflow flag (float32 0-dim, as torch's AMP kernels take) on each device."""
    return {d: torch.zeros((), dtype=torch.float32, device=d) for d in set(devices)}


def _max_flag(flags: Iterable[torch.Tensor | None]) -> torch.Tensor:
    present = [f for f in flags if f is not None]
    if len(present) == 1:
        return present[0]
    return torch.stack(present).amax()


def _as_optimizer_list(
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], name: str
) -> list[torch.optim.Optimizer]:
    items = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
    if not items or not all(isinstance(o, torch.optim.Optimizer) for o in items):
        raise ValueError(f"{name} must be a torch.optim.Optimizer or a non-empty list of them; got {optimizers!r}")
    return list({id(o): o for o in items}.values())  # an optimizer listed twice is still unscaled once


def _reject_closure(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if "closure" in kwargs or (args and callable(args[0])):
        raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")


def _takes_scale_and_flag(optimizer: torch.optim.Optimizer) -> bool:
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def _validated_new_scale(new_scale: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(new_scale, torch.Tensor):
        if new_scale.numel() != 1 or new_scale.requires_grad or not new_scale.is_floating_point():
            raise ValueError(
                "new_scale must be a float or a 1-element floating-point tensor without grad; "
                f"got a tensor of shape {tuple(new_scale.shape)} and dtype {new_scale.dtype}"
            )
        return new_scale.detach().reshape(()).to(device=device, dtype=torch.float32)
    if not _is_positive_number(new_scale):
        raise ValueError(f"new_scale must be a positive finite number or a 1-element tensor; got {new_scale!r}")
    return torch.tensor(float(new_scale), device=device)


def _rebuild_tuple(original: tuple[Any, ...], items: list[Any]) -> tuple[Any, ...]:
    if hasattr(original, "_fields"):  # named tuple
        return type(original)(*items)
    return type(original)(items)


def _masked_step(
    optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run the step unconditionally, then put back parameters and optimizer state where it overflowed.

    Only called once every parameter with a gradient has stepped (``GradScaler._has_stepped``), so the state the
    step touches exists before it. Exact: ``torch.where`` selects the old bits. The state must live on the flag's
    device (e.g. ``capturable=True`` for Adam on CUDA), or each ``torch.where`` copies the flag over. State that
    is not a tensor (a custom optimizer's Python step count) cannot be selected on the device: when the step
    changed some, the flag is read once and the old values are put back on overflow.

    This is a loop over parameters (the opt-in price of no sync for optimizers without a fused kernel), plus a
    copy of parameters and state.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    before_params = [p.detach().clone() for p in params]
    before_state = {
        p: {k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in optimizer.state[p].items()}
        for p in params
        if p in optimizer.state
    }
    result = optimizer.step(*args, **kwargs)
    overflow = found_inf > 0
    host_values: list[tuple[dict[str, Any], str, Any]] = []
    with torch.no_grad():
        for p, old in zip(params, before_params):
            p.copy_(torch.where(overflow.to(p.device), old, p))
        for p in params:
            new_state = optimizer.state.get(p)
            if not new_state:
                continue
            old_state = before_state.get(p, {})
            for key, value in new_state.items():
                old_value = old_state.get(key)
                if not isinstance(value, torch.Tensor):
                    if key in old_state and old_value != value:
                        host_values.append((new_state, key, old_value))
                    continue
                if not isinstance(old_value, torch.Tensor):
                    # A state entry this step created for a parameter that had stepped: zero is what the
                    # optimizers that create entries lazily start from.
                    old_value = torch.zeros_like(value)
                value.copy_(torch.where(overflow.to(value.device), old_value, value))
    if host_values and overflow.item():
        for state, key, old_value in host_values:
            state[key] = old_value
    return result
