"""``GradScaler``: dynamic loss scaling with the surface of ``cstorch.amp.GradScaler`` and ``torch.amp.GradScaler``.

Per iteration each optimizer moves READY → UNSCALED (or CLIPPED) → STEPPED, and ``update()`` brings every optimizer
back to READY. The scale and its counters live on the device in a ``policy.ScaleState``; the update rule comes from
``dls.settings`` / ``dls.policy``, the passes over gradients from ``dls.kernels``, the checkpoint format from
``dls.scaler_state``, sync-free steps from ``dls.sync_free``.

Overflow: a step is skipped when some gradient, *as the optimizer would receive it* (unscaled, and clipped when the
scaler clips), is inf/NaN in the gradient's dtype. A finite scaled gradient can still overflow when it is unscaled
by a scale below 1; the scaler keeps a host-side lower bound of the scale (exact after every host read, halved by
every ``update()``) and checks the unscaled values too while that bound is below 1: one extra pass over the
gradients on the unfused path, none on accelerators for fused optimizers.

Host synchronisation: ``scale``, ``unscale_``, ``clip_gradients_and_return_isfinite`` and ``update`` never read
a tensor back. ``step`` reads the overflow flag once per optimizer (with the scale in the same read while the scale
may be below 1), except for optimizers that take the flag themselves (torch's fused Adam/AdamW/SGD/Adagrad) and
with ``sync_free=True``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import warnings
import weakref
from collections.abc import Iterable, Sequence
from types import EllipsisType
from typing import Any, TypeVar, overload

import torch

from dls import distributed, kernels, sync_free
from dls.policy import FLOAT32_MAX, FLOAT32_TINY, ScaleState, assign_, initial_state, scale_problem
from dls.scaler_state import STATE_KEYS, parse_state_dict, to_state_dict
from dls.settings import CBFLOAT16_MAX_LOSS_SCALE, DEFAULT_STEPS_PER_INCREASE, TORCH_INIT_SCALE, ScalerSettings
from dls.settings import CEREBRAS_MAX_LOSS_SCALE as DEFAULT_MAX_LOSS_SCALE

__all__ = ["CBFLOAT16_MAX_LOSS_SCALE", "DEFAULT_MAX_LOSS_SCALE", "GradScaler", "Stage", "optimizer_list"]

_T = TypeVar("_T")


class Stage(enum.Enum):
    """Where an optimizer is in the current iteration (``GradScaler.stage``)."""

    READY = "ready"  # gradients still scaled
    UNSCALED = "unscaled"  # unscale_() ran: gradients unscaled, overflow flag recorded
    CLIPPED = "clipped"  # unscaled and clipped by the scaler (clip_gradients_and_return_isfinite, or step())
    STEPPED = "stepped"  # step() ran (or skipped); update() starts the next iteration


@dataclasses.dataclass
class _OptimizerState:
    stage: Stage = Stage.READY
    flag: torch.Tensor | None = None  # float32 0-dim on the scale's device; read it through found_inf
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

    Two dialects, chosen by whether a device is given (see ``dls.settings`` for every default):

    * ``GradScaler("cuda", init_scale=2.**16, growth_factor=2., backoff_factor=.5, growth_interval=2000,
      enabled=True)`` — torch.amp's signature and defaults: a ``torch.amp.GradScaler`` line swapped verbatim trains
      bit-identically. ``device=`` selects it too.
    * ``GradScaler(loss_scale=None, init_scale=None, steps_per_increase=None, min_loss_scale=None,
      max_loss_scale=None, overflow_tolerance=0.0, max_gradient_norm=None)`` — cstorch.amp's signature and
      defaults. Note the positional difference: ``GradScaler(65536.)`` is a *static* scale of 65536.

    Args (both dialects accept every knob by keyword):
        loss_scale: ``"dynamic"``, a number (a static scale: fixed, overflowing steps still skipped), or ``None``
            (Cerebras dialect: dynamic for float16 and cbfloat16, no scaling for bfloat16).
        init_scale: the first dynamic scale. Above the default ``max_loss_scale`` it raises the maximum.
        steps_per_increase / growth_interval: clean steps after which the scale grows.
        min_loss_scale, max_loss_scale: bounds of the dynamic scale (normal float32 numbers).
        overflow_tolerance: fraction of overflowing steps since the last rescale tolerated before backing off.
        max_gradient_norm: if set, ``step`` also clips all gradients to this global L2 norm (after unscaling).
        growth_factor, backoff_factor: multiply the scale on growth / back-off.
        hysteresis: number of (non-tolerated) overflows needed for one back-off (DeepSpeed/Megatron).
        enabled: ``False`` makes every method a pass-through, as in torch.
        half_dtype: the half format the defaults are chosen for; ``None``: ``dls.get_half_dtype_str()`` at
            construction (cstorch.amp's ``set_half_dtype``).
        sync_free: keep ``step`` on the device for optimizers that cannot take the flag themselves: the step
            always runs and parameters and optimizer state are restored where it overflowed (``dls.sync_free``).
        process_group: the group whose ranks must agree on overflow; default: the world group when
            ``torch.distributed`` is initialised, nothing otherwise.
        gradients_sharded: whether each rank holds a disjoint slice of the gradients, so the global norm for
            ``max_gradient_norm`` sums squared norms across ranks. ``None`` (default): ``DTensor`` gradients
            (FSDP2, tensor parallel) by their placements, plain gradients as replicated (DDP).
        device: where the scale lives before the first ``scale()`` (after that it follows the loss). A CUDA device
            on a machine without CUDA disables the scaler with a warning, as torch does.

    Bad arguments raise ``ValueError`` naming the argument (``dls.settings.SettingsError`` lists every problem).
    """

    @overload
    def __init__(
        self,
        device: str | torch.device,
        init_scale: float = TORCH_INIT_SCALE,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = DEFAULT_STEPS_PER_INCREASE,
        enabled: bool = True,
        *,
        loss_scale: str | float = "dynamic",
        min_loss_scale: float | None = None,
        max_loss_scale: float | None = None,
        overflow_tolerance: float = 0.0,
        hysteresis: int = 1,
        max_gradient_norm: float | None = None,
        half_dtype: str | torch.dtype | None = None,
        sync_free: bool = False,
        process_group: Any = None,
        gradients_sharded: bool | None = None,
    ) -> None: ...

    @overload
    def __init__(
        self,
        loss_scale: str | float | None = None,
        init_scale: float | None = None,
        steps_per_increase: int | None = None,
        min_loss_scale: float | None = None,
        max_loss_scale: float | None = None,
        overflow_tolerance: float = 0.0,
        max_gradient_norm: float | None = None,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        hysteresis: int = 1,
        enabled: bool = True,
        *,
        half_dtype: str | torch.dtype | None = None,
        growth_interval: int | None = None,
        sync_free: bool = False,
        process_group: Any = None,
        gradients_sharded: bool | None = None,
    ) -> None: ...

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("device") is not None and args and not _is_device(args[0]):
            raise ValueError(
                f"device={kwargs['device']!r} selects torch.amp's arguments (device, init_scale, growth_factor, "
                f"backoff_factor, growth_interval, enabled), whose first is the device; got {args[0]!r} first: pass "
                "it by keyword (e.g. loss_scale='dynamic')"
            )
        if kwargs.get("device") is not None or (args and _is_device(args[0])):
            runtime, settings = _torch_dialect(*args, **kwargs)
            device = _parse_device(args[0] if args else kwargs["device"])
        else:
            runtime, settings = _cerebras_dialect(*args, **kwargs)
            device = None
        self._setup(settings, device=device, **runtime)

    @classmethod
    def from_settings(
        cls,
        settings: ScalerSettings,
        *,
        enabled: bool = True,
        device: str | torch.device | None = None,
        sync_free: bool = False,
        process_group: Any = None,
        gradients_sharded: bool | None = None,
    ) -> GradScaler:
        """A scaler with ``settings`` as they are (the trainer builds them from its YAML config)."""
        if not isinstance(settings, ScalerSettings):
            raise ValueError(f"settings must be a dls.settings.ScalerSettings; got {type(settings).__name__}")
        scaler = cls.__new__(cls)
        scaler._setup(
            settings,
            enabled=enabled,
            device=None if device is None else _parse_device(device),
            sync_free=sync_free,
            process_group=process_group,
            gradients_sharded=gradients_sharded,
        )
        return scaler

    def _setup(
        self,
        settings: ScalerSettings,
        *,
        enabled: bool,
        device: torch.device | None,
        sync_free: bool,
        process_group: Any,
        gradients_sharded: bool | None,
    ) -> None:
        for name, value in (("enabled", enabled), ("sync_free", sync_free)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False; got {value!r}")
        if gradients_sharded is not None and not isinstance(gradients_sharded, bool):
            raise ValueError(f"gradients_sharded must be True, False or None; got {gradients_sharded!r}")
        self._settings = settings
        self._rule = settings.rule()
        self._enabled = enabled and settings.mode != "off"
        if device is not None and device.type not in ("cpu", "meta") and not _available(device):
            # torch.amp.GradScaler("cuda", enabled=use_amp) on a machine without CUDA: warn and disable, as torch.
            if self._enabled:
                warnings.warn(
                    f"dls.GradScaler is enabled, but {_device_kind(device)} is not available. Disabling.", stacklevel=3
                )
                self._enabled = False
            device = None
        self._sync_free = sync_free
        self._process_group = process_group
        self._gradients_sharded = gradients_sharded
        self._state: ScaleState = initial_state(settings.init_scale, device=device)
        # A lower bound of the scale known on the host without reading the device: below 1, unscaling may
        # overflow finite gradients, and the passes check the unscaled values too.
        self._scale_at_least = settings.init_scale
        self._rejected_scales: torch.Tensor | None = None  # update(new_scale=tensor) values not taken (device)
        self._rejected_warned = 0
        self._per_optimizer: dict[int, _OptimizerState] = {}
        self._index_cache: weakref.WeakKeyDictionary[torch.optim.Optimizer, _OptimizerIndex] = (
            weakref.WeakKeyDictionary()
        )
        self._last_steps: weakref.WeakKeyDictionary[torch.optim.Optimizer, _LastStep] = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------ queries
    @property
    def settings(self) -> ScalerSettings:
        """The scaler's settings (frozen; the growth setters and ``load_state_dict`` replace them)."""
        return self._settings

    def is_enabled(self) -> bool:
        """Whether the scaler scales and skips (``False`` when disabled or when the mode is no scaling)."""
        return self._enabled

    @property
    def mode(self) -> str:
        """``"dynamic"``, ``"static"`` or ``"off"`` (``"off"`` also when disabled)."""
        return self._settings.mode if self._enabled else "off"

    @property
    def max_gradient_norm(self) -> float | None:
        return self._settings.max_gradient_norm

    def get_scale(self) -> float:
        """The current loss scale (1.0 when disabled). Reads the device value back: not for the hot path."""
        if not self._enabled:
            return 1.0
        self._warn_rejected_scales()
        self._scale_at_least = float(self._state.loss_scale.item())
        return self._scale_at_least

    def get_non_clamped_scale(self) -> float:
        """The scale after the last update before the ``min_loss_scale`` clamp: below ``get_scale()`` means the
        scale is pinned at its floor and gradients still overflow."""
        return float(self._state.non_clamped_scale.item()) if self._enabled else 1.0

    def get_num_skipped_steps(self) -> int:
        """Iterations whose gradients overflowed (their optimizer steps were skipped)."""
        return int(self._state.num_skipped_steps.item()) if self._enabled else 0

    def get_scale_tensor(self) -> torch.Tensor:
        """The scale as a 0-dim float32 device tensor (no host sync), e.g. for logging inside compiled code."""
        return self._state.loss_scale

    def stage(self, optimizer: torch.optim.Optimizer) -> Stage:
        """Where ``optimizer`` is in the current iteration."""
        return self._optimizer_state(optimizer).stage

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
        _check_optimizer(optimizer)
        last = self._last_steps.get(optimizer)
        if last is None:
            raise RuntimeError("step_was_skipped(): this optimizer has not stepped through this scaler yet")
        return last

    def get_growth_factor(self) -> float:
        return self._settings.growth_factor

    def get_backoff_factor(self) -> float:
        return self._settings.backoff_factor

    def get_growth_interval(self) -> int:
        return self._settings.steps_per_increase

    def set_growth_factor(self, new_factor: float) -> None:
        self._replace_settings(growth_factor=new_factor)

    def set_backoff_factor(self, new_factor: float) -> None:
        self._replace_settings(backoff_factor=new_factor)

    def set_growth_interval(self, new_interval: int) -> None:
        self._replace_settings(steps_per_increase=new_interval)

    def _replace_settings(self, **changes: Any) -> None:
        self._settings = self._settings.replace(**changes)  # validates
        self._rule = self._settings.rule()

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
        if state.stage in (Stage.UNSCALED, Stage.CLIPPED):
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state.stage is Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        self._unscale_and_check([optimizer], [state])

    def clip_gradients_and_return_isfinite(
        self,
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        *,
        max_gradient_norm: float | EllipsisType | None = ...,
        return_norm: bool = False,
    ) -> Any:
        """Unscale the optimizers' gradients, clip them together to ``max_gradient_norm`` (one global norm over
        all their gradients) and return whether that norm is finite, as a bool tensor on the device.

        The result decides the skip for all of them. ``max_gradient_norm`` defaults to the scaler's own; ``None``
        unscales and checks without clipping. With ``return_norm=True`` the result is ``(isfinite, norm)``, the
        norm being the global L2 norm of the unscaled gradients before clipping (a float32 device tensor; one
        extra read pass when nothing is clipped).
        """
        max_norm = self._settings.max_gradient_norm if max_gradient_norm is ... else max_gradient_norm
        if max_norm is not None and not (isinstance(max_norm, (int, float)) and 0 < max_norm < math.inf):
            raise ValueError(f"max_gradient_norm must be a positive finite number or None; got {max_norm!r}")
        isfinite, norm = self._clip_and_check(optimizer_list(optimizers, "optimizers"), max_norm, return_norm)
        return (isfinite, norm) if return_norm else isfinite

    def _clip_and_check(
        self, optimizers: list[torch.optim.Optimizer], max_norm: float | None, want_norm: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        norm: torch.Tensor | None
        states = [self._optimizer_state(opt) for opt in optimizers]
        if any(s.stage is Stage.STEPPED for s in states):
            raise RuntimeError("gradients cannot be clipped after step() on the same optimizer before update().")
        if not self._enabled:
            # Nothing to unscale or skip; clipping still applies, and the flag still tells the truth.
            if max_norm is None and not want_norm:
                return torch.ones((), dtype=torch.bool, device=self._state.loss_scale.device), None
            found_inf, norm = self._clip([], optimizers, max_norm, want_norm)
            for state in states:
                state.stage = Stage.CLIPPED if max_norm is not None else state.stage
            return found_inf == 0, norm
        ready = [(o, s) for o, s in zip(optimizers, states) if s.stage is Stage.READY]
        done = [o for o, s in zip(optimizers, states) if s.stage is not Stage.READY]
        if max_norm is None and not want_norm:
            if ready:
                self._unscale_and_check([o for o, _ in ready], [s for _, s in ready])
            found_inf, norm = _max_flag([s.found_inf for s in states]), None
        else:
            found_inf, norm = self._clip([o for o, _ in ready], done, max_norm, want_norm)
            found_inf = _max_flag([found_inf, *(s.found_inf for s in states if s.stage is not Stage.READY)])
            found_inf = distributed.agree_on_overflow(found_inf, self._process_group)
        for state in states:
            state.stage = Stage.CLIPPED if max_norm is not None else Stage.UNSCALED
            state.found_inf = found_inf
        return found_inf == 0, norm

    def _unscale_and_check(self, optimizers: list[torch.optim.Optimizer], states: list[_OptimizerState]) -> None:
        """Unscale each optimizer's gradients and set its agreed overflow flag (stage → UNSCALED)."""
        inv_scale = self._inv_scale()
        for optimizer, state in zip(optimizers, states):
            groups = self._grads(optimizer)
            devices = {device for device, _ in groups}
            found = _zero_flags(devices)
            kernels.mul_and_check_(groups, kernels.per_device(inv_scale, devices), found, self._scale_may_be_below_one)
            # Across ranks the flag is agreed asynchronously: reading state.found_inf waits for the all-reduce.
            flag = self._combine(found)
            state.flag, state.agreement = flag, distributed.start_agreement(flag, self._process_group)
            state.stage = Stage.UNSCALED

    def _clip(
        self,
        scaled: list[torch.optim.Optimizer],
        unscaled: list[torch.optim.Optimizer],
        max_norm: float | None,
        want_norm: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Unscale ``scaled`` and clip all gradients of both lists to ``max_norm`` (``None``: unscale only), in two
        passes: one read for the global norm (of still-scaled gradients times 1/scale), one read+write multiplying
        by ``clip_coef / scale`` (``clip_coef`` alone for already unscaled gradients). Returns the overflow flag
        (the norm is inf/NaN exactly when an element is) and the norm."""
        home = self._state.loss_scale.device
        inv_scale = self._inv_scale() if self._enabled else torch.ones((), device=home)
        one = torch.ones((), dtype=torch.float32, device=home)
        parts = [(self._grads_of(scaled), inv_scale), (self._grads_of(unscaled), one)]
        if distributed.norm_is_sharded(scaled + unscaled, self._gradients_sharded, self._process_group):
            # Each rank holds a slice of the gradients: squared norms are summed across ranks.
            opts = [(scaled, inv_scale), (unscaled, one)]
            sharded = self._gradients_sharded is True
            total_norm = distributed.global_norm(opts, home, self._process_group, plain_sharded=sharded)
        else:
            norms = [kernels.global_norm(g, kernels.per_device(f, {d for d, _ in g}), home) for g, f in parts]
            total_norm = torch.linalg.vector_norm(torch.stack(norms))
        found = (~torch.isfinite(total_norm)).float()
        coef = one if max_norm is None else kernels.clip_coefficient(total_norm, max_norm)
        # A finite norm bounds every clipped element by max_norm: only a max_norm near a gradient dtype's largest
        # value (or an unscale by more than 1 without clipping) can make a product overflow.
        for groups, factor in parts:
            if not groups or (factor is one and max_norm is None):
                continue
            dtypes_max = min(torch.finfo(dtype).max for _, dtype in groups)
            check = (max_norm is None and self._scale_may_be_below_one) or (max_norm or 0) >= dtypes_max / 2
            devices = {d for d, _ in groups}
            flags = {d: found.to(d) for d in devices} if check else None
            kernels.mul_(groups, kernels.per_device(factor * coef, devices), flags)
            if flags is not None:
                found = _max_flag([found, *(f.to(home) for f in flags.values())])
        return found, total_norm

    @property
    def _scale_may_be_below_one(self) -> bool:
        return self._scale_at_least < 1.0

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
        max_norm = self._settings.max_gradient_norm
        if not self._enabled:
            # No scaling, no skipping; max_gradient_norm still clips (bfloat16 runs use it too).
            if max_norm is not None and self._optimizer_state(optimizer).stage is not Stage.CLIPPED:
                self._clip([], [optimizer], max_norm, want_norm=False)
            self._last_steps[optimizer] = _LastStep(None, False)
            return optimizer.step(*args, **kwargs)
        _reject_closure(args, kwargs)
        state = self._optimizer_state(optimizer)
        if state.stage is Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if max_norm is not None and state.stage is not Stage.CLIPPED:
            others = (s for key, s in self._per_optimizer.items() if key != id(optimizer))
            if any(s.stage in (Stage.CLIPPED, Stage.STEPPED) for s in others):
                warnings.warn(
                    "step() clips each optimizer by the norm of its own gradients; for one global norm over "
                    "several optimizers call clip_gradients_and_return_isfinite([...]) with all of them before "
                    "step(), or use dls.optimizer_step with the list.",
                    stacklevel=2,
                )
            self._clip_and_check([optimizer], max_norm)
        elif state.stage is Stage.READY:
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
        if state.stage is Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state.stage is Stage.READY:
            raise RuntimeError(
                "step_if_finite() needs the overflow flag: call unscale_() or "
                "clip_gradients_and_return_isfinite() first, or use step()."
            )
        return self._step_if_finite(optimizer, state, args, kwargs)

    def _step_if_finite(
        self, optimizer: torch.optim.Optimizer, state: _OptimizerState, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        found_inf = state.found_inf
        assert found_inf is not None
        if _takes_scale_and_flag(optimizer):
            return self._fused_step(optimizer, state, args, kwargs)
        state.stage = Stage.STEPPED
        if self._sync_free and self._has_stepped(optimizer):
            self._last_steps[optimizer] = _LastStep(found_inf, None)
            return sync_free.masked_step(optimizer, found_inf, args, kwargs)
        skipped = self._read_flag(found_inf)
        self._last_steps[optimizer] = _LastStep(found_inf, skipped)
        if skipped:
            return None
        result = optimizer.step(*args, **kwargs)
        self._mark_stepped(optimizer)
        return result

    def _read_flag(self, found_inf: torch.Tensor) -> bool:
        """Read the overflow flag (the one host read of the default path); while the scale may be below 1, read
        the scale in the same transfer to tighten the host's bound on it."""
        if not self._scale_may_be_below_one:
            return bool(found_inf.item())
        flag, scale = torch.stack([found_inf.float(), self._state.loss_scale]).tolist()
        self._scale_at_least = scale
        return bool(flag)

    def _fused_step(
        self, optimizer: torch.optim.Optimizer, state: _OptimizerState, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Hand the scale and the flag to an optimizer whose kernel unscales and skips by itself (no sync).

        A parameter's first step is decided on the host (one read): some fused kernels allocate state
        uninitialised and return early on overflow (torch's fused SGD with momentum), which would leave garbage
        behind after an overflowing first step.
        """
        grad_scale: torch.Tensor | None = None
        if state.stage is Stage.READY:
            # Only a read pass for the flag: the optimizer kernel divides by grad_scale while it updates.
            groups = self._grads(optimizer)
            devices = {d for d, _ in groups}
            found = _zero_flags(devices)
            inv = kernels.per_device(self._inv_scale(), devices)
            kernels.check_unscaled_(groups, inv, found, self._scale_may_be_below_one)
            state.found_inf = distributed.agree_on_overflow(self._combine(found), self._process_group)
            grad_scale = self._state.loss_scale
        found_inf = state.found_inf
        assert found_inf is not None
        first_step = not self._has_stepped(optimizer)
        state.stage = Stage.STEPPED
        if first_step and self._read_flag(found_inf):
            self._last_steps[optimizer] = _LastStep(found_inf, True)
            return None
        self._last_steps[optimizer] = _LastStep(found_inf, False if first_step else None)
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            result = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
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
        ``new_scale``, then start the next iteration.

        ``new_scale`` must be a normal float32 (2**-126 to float32's max): a float outside that range raises
        ``ValueError``; a tensor is checked on the device (no host read): a bad value (NaN, inf, 0, negative,
        subnormal) keeps the previous scale, is counted, and the next ``get_scale()`` or ``state_dict()`` warns.
        """
        if not self._enabled:
            self._per_optimizer.clear()  # only clipping was recorded
            return
        if new_scale is not None:
            scale = self._checked_new_scale(new_scale)
            flags = [s.found_inf for s in self._per_optimizer.values() if s.found_inf is not None]
            skipped = (_max_flag(flags) > 0).long() if flags else 0
            assign_(
                self._state,
                self._state._replace(
                    loss_scale=scale, non_clamped_scale=scale, num_skipped_steps=self._state.num_skipped_steps + skipped
                ),
            )
        else:
            self._apply_rule(list(self._per_optimizer.values()))
        self._per_optimizer.clear()

    def _checked_new_scale(self, new_scale: float | torch.Tensor) -> torch.Tensor:
        device = self._state.loss_scale.device
        if not isinstance(new_scale, torch.Tensor):
            problem = scale_problem("new_scale", new_scale)
            if problem:
                raise ValueError(problem)
            self._scale_at_least = float(new_scale)
            return torch.tensor(float(new_scale), device=device)
        if new_scale.numel() != 1 or new_scale.requires_grad or not new_scale.is_floating_point():
            raise ValueError(
                "new_scale must be a float or a 1-element floating-point tensor without grad; "
                f"got a tensor of shape {tuple(new_scale.shape)} and dtype {new_scale.dtype}"
            )
        value = new_scale.detach().reshape(()).to(device=device, dtype=torch.float32)
        ok = torch.isfinite(value) & (value >= FLOAT32_TINY) & (value <= FLOAT32_MAX)
        if self._rejected_scales is None:
            self._rejected_scales = torch.zeros((), dtype=torch.int64, device=device)
        self._rejected_scales.add_((~ok).to(torch.int64))
        self._scale_at_least = min(self._scale_at_least, FLOAT32_TINY)  # unknown until the next read
        return torch.where(ok, value, self._state.loss_scale)

    def _warn_rejected_scales(self) -> None:
        if self._rejected_scales is None:
            return
        count = int(self._rejected_scales.item())
        if count > self._rejected_warned:
            warnings.warn(
                f"update(new_scale=tensor) was given {count - self._rejected_warned} value(s) that are not a normal "
                "float32 (NaN, inf, 0, negative or below 2**-126); the scale kept its previous value each time",
                stacklevel=3,
            )
            self._rejected_warned = count

    def update_scale(self, optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> None:
        """Apply the scale rule to the flags of ``optimizers`` without starting a new iteration
        (``update()`` is ``update_scale`` over every optimizer of the iteration, then the reset)."""
        if not self._enabled:
            return
        opts = optimizer_list(optimizers, "optimizers")
        self._apply_rule([self._per_optimizer.get(id(o), _OptimizerState()) for o in opts])

    def _apply_rule(self, states: list[_OptimizerState]) -> None:
        flags = [s.found_inf for s in states if s.found_inf is not None]
        if not flags:
            raise RuntimeError(
                "No inf checks were recorded prior to update(): call step() (or unscale_()) on the "
                "optimizers of this iteration first."
            )
        self._rule.update_(self._state, _max_flag(flags))
        if self._settings.mode == "dynamic":  # at most one back-off per update, then the clamps
            s = self._settings
            bound = max(self._scale_at_least * s.backoff_factor, s.min_loss_scale)
            self._scale_at_least = min(bound, s.max_loss_scale)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The scale, its counters and torch's settings as Python numbers, under dls's and torch.amp's names
        (``dls.scaler_state``): ``torch.amp.GradScaler.load_state_dict`` accepts it. ``{}`` when disabled."""
        if not self._enabled:
            return {}
        self._warn_rejected_scales()
        self._scale_at_least = float(self._state.loss_scale.item())
        counters = torch.stack([getattr(self._state, k).long() for k in STATE_KEYS[1:]]).tolist()
        values = {"loss_scale": self._scale_at_least, **dict(zip(STATE_KEYS[1:], counters))}
        return to_state_dict(values, self._settings)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dls or a ``torch.amp.GradScaler`` state dict: keys present replace, missing keys keep their
        values; torch's settings (growth factor, backoff factor, interval) are applied as torch does; a scale
        outside this scaler's bounds is clamped into them, with a warning. Nothing changes on a bad value."""
        if not self._enabled:
            return
        loaded = parse_state_dict(state_dict, self._settings)
        if loaded.clamped is not None:
            warnings.warn(
                f"the loaded loss scale {loaded.clamped!r} is outside [min_loss_scale, max_loss_scale] = "
                f"[{self._settings.min_loss_scale!r}, {self._settings.max_loss_scale!r}]; clamped to "
                f"{loaded.values['loss_scale']!r}",
                stacklevel=2,
            )
        self._settings, self._rule = loaded.settings, loaded.settings.rule()
        values = dict(loaded.values)
        if "loss_scale" in values:
            values["non_clamped_scale"] = values["loss_scale"]
            self._scale_at_least = float(values["loss_scale"])
        current = self._state._asdict()
        new = {k: torch.tensor(v, dtype=current[k].dtype, device=current[k].device) for k, v in values.items()}
        assign_(self._state, self._state._replace(**new))

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
        _check_optimizer(optimizer)
        return self._per_optimizer.setdefault(id(optimizer), _OptimizerState())

    def __repr__(self) -> str:
        s = self._settings
        return (
            f"GradScaler(mode={self.mode!r}, dialect={s.dialect!r}, init_scale={s.init_scale}, steps_per_increase="
            f"{s.steps_per_increase}, min_loss_scale={s.min_loss_scale}, max_loss_scale={s.max_loss_scale}, "
            f"max_gradient_norm={s.max_gradient_norm})"
        )


# ---------------------------------------------------------------------- construction
def _torch_dialect(
    device: Any = None,
    init_scale: float | None = None,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int | None = None,
    enabled: bool = True,
    *,
    loss_scale: str | float | None = "dynamic",
    steps_per_increase: int | None = None,
    min_loss_scale: float | None = None,
    max_loss_scale: float | None = None,
    overflow_tolerance: float = 0.0,
    hysteresis: int = 1,
    max_gradient_norm: float | None = None,
    half_dtype: Any = None,
    sync_free: bool = False,
    process_group: Any = None,
    gradients_sharded: bool | None = None,
) -> tuple[dict[str, Any], ScalerSettings]:
    interval = _one_of(growth_interval, steps_per_increase)
    settings = ScalerSettings.torch(
        TORCH_INIT_SCALE if init_scale is None else init_scale,
        growth_factor,
        backoff_factor,
        DEFAULT_STEPS_PER_INCREASE if interval is None else interval,
        loss_scale=loss_scale if loss_scale is not None else "dynamic",
        min_loss_scale=min_loss_scale,
        max_loss_scale=max_loss_scale,
        overflow_tolerance=overflow_tolerance,
        hysteresis=hysteresis,
        max_gradient_norm=max_gradient_norm,
        half_dtype=half_dtype,
    )
    runtime = {"enabled": enabled, "sync_free": sync_free, "process_group": process_group}
    return runtime | {"gradients_sharded": gradients_sharded}, settings


def _cerebras_dialect(
    loss_scale: str | float | None = None,
    init_scale: float | None = None,
    steps_per_increase: int | None = None,
    min_loss_scale: float | None = None,
    max_loss_scale: float | None = None,
    overflow_tolerance: float = 0.0,
    max_gradient_norm: float | None = None,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    hysteresis: int = 1,
    enabled: bool = True,
    *,
    growth_interval: int | None = None,
    half_dtype: Any = None,
    sync_free: bool = False,
    process_group: Any = None,
    gradients_sharded: bool | None = None,
    device: None = None,
) -> tuple[dict[str, Any], ScalerSettings]:
    settings = ScalerSettings.cerebras(
        loss_scale,
        init_scale,
        _one_of(steps_per_increase, growth_interval),
        min_loss_scale,
        max_loss_scale,
        overflow_tolerance,
        max_gradient_norm,
        growth_factor,
        backoff_factor,
        hysteresis,
        half_dtype=half_dtype,
    )
    runtime = {"enabled": enabled, "sync_free": sync_free, "process_group": process_group}
    return runtime | {"gradients_sharded": gradients_sharded}, settings


def _one_of(steps_per_increase: int | None, growth_interval: int | None) -> int | None:
    if steps_per_increase is not None and growth_interval is not None:
        raise ValueError("give steps_per_increase or its torch name growth_interval, not both")
    return steps_per_increase if steps_per_increase is not None else growth_interval


def _is_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return True
    if not isinstance(value, str) or value == "dynamic":
        return False
    try:
        torch.device(value)
    except (RuntimeError, ValueError):
        return False
    return True


def _parse_device(value: Any) -> torch.device:
    if isinstance(value, torch.device):
        return value
    if isinstance(value, str):
        try:
            return torch.device(value)
        except (RuntimeError, ValueError):
            pass
    raise ValueError(
        f"device must be a device name such as 'cuda', 'cuda:1' or 'cpu', or a torch.device; got {value!r}"
    )


def _device_kind(device: torch.device) -> str:
    return "CUDA" if device.type == "cuda" else device.type


def _available(device: torch.device) -> bool:
    module = getattr(torch, device.type, None)
    is_available = getattr(module, "is_available", None)
    return bool(is_available()) if callable(is_available) else True


# ---------------------------------------------------------------------- module helpers
def _check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")


def _zero_flags(devices: Iterable[torch.device]) -> dict[torch.device, torch.Tensor]:
    """A clean overflow flag (float32 0-dim, as torch's AMP kernels take) on each device."""
    return {d: torch.zeros((), dtype=torch.float32, device=d) for d in set(devices)}


def _max_flag(flags: Iterable[torch.Tensor | None]) -> torch.Tensor:
    present = [f for f in flags if f is not None]
    if len(present) == 1:
        return present[0]
    return torch.stack(present).amax()


def optimizer_list(
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], name: str
) -> list[torch.optim.Optimizer]:
    """``optimizers`` (one or a sequence) as a list without repeats; ``ValueError`` naming ``name`` otherwise."""
    items = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
    if not items or not all(isinstance(o, torch.optim.Optimizer) for o in items):
        raise ValueError(f"{name} must be a torch.optim.Optimizer or a non-empty list of them; got {optimizers!r}")
    return list({id(o): o for o in items}.values())  # an optimizer listed twice is still unscaled once


def _reject_closure(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if "closure" in kwargs or (args and callable(args[0])):
        raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")


def _takes_scale_and_flag(optimizer: torch.optim.Optimizer) -> bool:
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def _rebuild_tuple(original: tuple[Any, ...], items: list[Any]) -> tuple[Any, ...]:
    if hasattr(original, "_fields"):  # named tuple
        return type(original)(*items)
    return type(original)(items)
