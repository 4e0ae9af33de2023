"""The loss scale a ``GradScaler`` holds: its value and counters on the device, the rule that updates them, and
what the host knows of the scale without reading the device.

The device state is a ``policy.ScaleState`` updated in place (graphs that captured its buffers see new values).
The host keeps ``at_least``, a lower bound of the scale: exact after every read, the new value after a float
``new_scale``, at most one back-off lower after each rule update, the smallest normal float32 after a tensor
``new_scale``. Only while that bound is below 1 can a finite scaled gradient overflow when unscaled, so only then
do the gradient passes check the unscaled values too.

Left alone, the bound would fall by one back-off per update on paths that never read the device (fused optimizers,
``sync_free``) and cost the extra check on every step after a few dozen. So every change of the scale is also
*published* to host memory without waiting: a CPU scale is read where it lies, a CUDA scale is copied to pinned
memory asynchronously with an event behind the copy; when the bound is next needed and the event has completed, the
host reads the copy (no synchronisation) and the bound is exact again. Inside ``torch.compile`` or CUDA-graph
capture nothing is published, and the bound decays as described (correct, one pass dearer).
"""

from __future__ import annotations

import ctypes
import warnings
from typing import Any

import torch

from dls.policy import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    INT64_MAX,
    ScaleState,
    assign_,
    count_skip,
    initial_state,
    scale_problem,
)
from dls.scaler_state import STATE_KEYS
from dls.settings import ScalerSettings


class LossScale:
    """The scale and counters of one scaler (see the module docstring)."""

    def __init__(self, settings: ScalerSettings, device: torch.device | None) -> None:
        self.settings = settings
        self.rule = settings.rule()
        self.state: ScaleState = initial_state(settings.init_scale, settings.hysteresis, device=device)
        self.at_least = settings.init_scale
        self.skips_at_most = 0  # a bound of num_skipped_steps: far from its maximum, counting needs no saturation
        # Counters may be at or past the growth interval (loaded, or the interval shortened): clamp before the rule.
        self.clamp_counters = False
        # Where step() decided on the host, update() knows the flag: skips are counted here (added to the device
        # count when read), the scale is known to be within its bounds unless a new_scale put it outside, and
        # after a clean update the non-clamped scale is the scale itself (not written).
        self.host_skips = 0
        self.in_bounds = True
        self.non_clamped_is_scale = False
        self._rejected: torch.Tensor | None = None  # update(new_scale=tensor) values not taken, on the device
        self._rejected_warned = 0
        self._published: tuple[torch.Tensor, Any] | None = None  # (host copy, event or None) of the latest scale

    @property
    def tensor(self) -> torch.Tensor:
        return self.state.loss_scale

    @property
    def device(self) -> torch.device:
        return self.state.loss_scale.device

    @property
    def may_be_below_one(self) -> bool:
        if self.at_least < 1.0 and self._published is not None and not torch.compiler.is_compiling():
            self._take_published()
        return self.at_least < 1.0

    def _publish(self) -> None:
        """Make the current scale readable on the host later without a synchronisation (see module docstring)."""
        self._published = None
        if torch.compiler.is_compiling():
            return
        scale = self.state.loss_scale
        if scale.device.type == "cpu":
            self._published = (scale, None)  # host memory already: read where it lies
        elif scale.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            copy = torch.empty((), dtype=torch.float32, pin_memory=True)
            copy.copy_(scale, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._published = (copy, event)

    def _take_published(self) -> None:
        assert self._published is not None
        copy, event = self._published
        if event is not None and not event.query():
            return  # the copy is still in flight: keep the bound
        # Read the float32 in host memory directly: no tensor method, hence no device synchronisation.
        self.at_least = float(ctypes.c_float.from_address(copy.data_ptr()).value)
        self._published = None

    def inverse(self) -> torch.Tensor:
        """``1 / scale`` in float64 then rounded once, as torch does: exact for the usual powers of two."""
        return self.state.loss_scale.double().reciprocal().float()

    def replace_settings(self, settings: ScalerSettings) -> None:
        """New settings; the counters are brought within what the new rule can hold (see ``dls.scaler_state``)."""
        old, self.settings, self.rule = self.settings, settings, settings.rule()
        self.clamp_counters |= settings.growth_interval < old.growth_interval
        if settings.hysteresis != old.hysteresis:
            self.state.hysteresis_tracker.clamp_(min=1, max=settings.hysteresis)

    def follow(self, device: torch.device) -> None:
        """Move the state to ``device`` (the loss's, before an iteration has started)."""
        if self.device != device:
            self.state = ScaleState(*(t.to(device) for t in self.state))
            self._published = None

    # ------------------------------------------------------------------ reads
    def read(self) -> float:
        """The scale, read from the device (and the host's bound made exact)."""
        self.warn_rejected()
        self.at_least = float(self.state.loss_scale.item())
        return self.at_least

    def read_flag(self, found_inf: torch.Tensor) -> bool:
        """Read an overflow flag; while the scale may be below 1, read the scale in the same transfer."""
        if not self.may_be_below_one:
            return bool(found_inf.item())
        flag, scale = torch.stack([found_inf.float(), self.state.loss_scale]).tolist()
        self.at_least = scale
        return bool(flag)

    def values(self) -> dict[str, Any]:
        """The ``STATE_KEYS`` as Python numbers (two reads)."""
        scale = self.read()
        counters = dict(
            zip(STATE_KEYS[1:], torch.stack([getattr(self.state, k).long() for k in STATE_KEYS[1:]]).tolist())
        )
        counters["num_skipped_steps"] = min(counters["num_skipped_steps"] + self.host_skips, INT64_MAX)
        return {"loss_scale": scale, **counters}

    def skipped_steps(self) -> int:
        return min(int(self.state.num_skipped_steps.item()) + self.host_skips, INT64_MAX)

    def non_clamped(self) -> float:
        tensor = self.state.loss_scale if self.non_clamped_is_scale else self.state.non_clamped_scale
        return float(tensor.item())

    def warn_rejected(self) -> None:
        if self._rejected is None:
            return
        count = int(self._rejected.item())
        if count > self._rejected_warned:
            warnings.warn(
                f"update(new_scale=tensor) was given {count - self._rejected_warned} value(s) that are not a normal "
                "float32 (NaN, inf, 0, negative or below 2**-126); the scale kept its previous value each time",
                stacklevel=4,
            )
            self._rejected_warned = count

    # ------------------------------------------------------------------ changes
    def apply_rule(self, found_inf: torch.Tensor, overflow: bool | None = None) -> None:
        """The rule on this iteration's flag; ``overflow``: its value when the host knows it (no read here)."""
        if self.clamp_counters:
            most = self.settings.growth_interval - 1
            self.state.steps_since_rescale.clamp_(max=most)
            self.state.overflows_since_rescale.clamp_(max=most)
            self.clamp_counters = False
        rule, dynamic = self.rule, self.settings.mode == "dynamic"
        if overflow is not None and (not dynamic or self.in_bounds):
            self.host_skips += overflow
            if not dynamic:
                return
            rule.update_known_(self.state, found_inf, overflow)  # type: ignore[union-attr]  # dynamic here
            self.non_clamped_is_scale = not overflow
            if not overflow:
                return  # the scale did not fall: the host's bound holds
        else:
            self.skips_at_most = min(self.skips_at_most + 1, INT64_MAX)
            rule.update_(self.state, found_inf, saturate=self.skips_at_most == INT64_MAX)
            self.non_clamped_is_scale, self.in_bounds = False, True
        if dynamic:  # at most one back-off per update, then the clamps
            s = self.settings
            self.at_least = min(max(self.at_least * s.backoff_factor, s.min_loss_scale), s.max_loss_scale)
            self._publish()

    def set(self, new_scale: float | torch.Tensor, found_inf: torch.Tensor | None) -> None:
        """``update(new_scale)``: a float must be a normal float32 (else ``ValueError``); a tensor is checked on the
        device, and a bad value keeps the old scale and is counted (warned at the next read)."""
        value = self._checked(new_scale)
        s = self.state
        self.skips_at_most = min(self.skips_at_most + 1, INT64_MAX)
        skips = s.num_skipped_steps if found_inf is None else count_skip(s.num_skipped_steps, found_inf)
        assign_(s, s._replace(loss_scale=value, non_clamped_scale=value, num_skipped_steps=skips))
        self.non_clamped_is_scale = False
        bounds = self.settings.min_loss_scale, self.settings.max_loss_scale
        self.in_bounds = not isinstance(new_scale, torch.Tensor) and bounds[0] <= float(new_scale) <= bounds[1]
        self._publish()

    def _checked(self, new_scale: float | torch.Tensor) -> torch.Tensor:
        if not isinstance(new_scale, torch.Tensor):
            problem = scale_problem("new_scale", new_scale)
            if problem:
                raise ValueError(problem)
            self.at_least = float(new_scale)
            return torch.tensor(float(new_scale), device=self.device)
        if new_scale.numel() != 1 or new_scale.requires_grad or new_scale.dtype == torch.bool or new_scale.is_complex():
            raise ValueError(
                "new_scale must be a number or a 1-element real tensor without grad; "
                f"got a tensor of shape {tuple(new_scale.shape)} and dtype {new_scale.dtype}"
            )
        value = new_scale.detach().reshape(()).to(device=self.device, dtype=torch.float32)
        ok = torch.isfinite(value) & (value >= FLOAT32_TINY) & (value <= FLOAT32_MAX)
        if self._rejected is None:
            self._rejected = torch.zeros((), dtype=torch.int64, device=self.device)
        self._rejected.add_((~ok).to(torch.int64))
        self.at_least = min(self.at_least, FLOAT32_TINY)  # unknown until the next read
        return torch.where(ok, value, self.state.loss_scale)

    def load(self, values: dict[str, float | int], settings: ScalerSettings) -> None:
        """Take validated checkpoint values (``dls.scaler_state.parse_state_dict``) and settings."""
        self.replace_settings(settings)
        values = dict(values)
        if "num_skipped_steps" in values:
            self.skips_at_most, self.host_skips = int(values["num_skipped_steps"]), 0
        self.clamp_counters |= "steps_since_rescale" in values or "overflows_since_rescale" in values
        if "loss_scale" in values:
            values["non_clamped_scale"] = values["loss_scale"]
            self.at_least = float(values["loss_scale"])
            self.non_clamped_is_scale = False
            self.in_bounds = (
                settings.mode != "dynamic" or settings.min_loss_scale <= self.at_least <= settings.max_loss_scale
            )
        current = self.state._asdict()
        new = {k: torch.tensor(v, dtype=current[k].dtype, device=current[k].device) for k, v in values.items()}
        assign_(self.state, self.state._replace(**new))
