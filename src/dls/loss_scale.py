"""The loss scale a ``GradScaler`` holds: its rule's state on the device (``dls.policy``), the one place that state
changes, and what the host knows of it without reading the device (``Known``).

The state is updated in place (graphs that captured its buffers see new values), by the rule once per ``update()``,
by ``update(new_scale)``, by a load. Nothing here reads the device except ``read``, ``read_flag`` and the checkpoint
values, which say so.

Why the host needs to know anything: a finite scaled gradient can overflow when unscaled only while the scale is
below 1, and then the gradient passes must check the unscaled values too (one more read pass). A read of the scale
per step would cost a synchronisation; the host keeps a lower bound instead (``Known.scale_at_least``). So that the
bound does not fall by one back-off per update on paths that never read the device (fused optimizers,
``sync_free``) and cost the extra pass on every step after a few dozen, every update that may have moved the scale
*publishes* it to host memory without waiting: a CPU scale is read where it lies, a CUDA scale is copied to pinned
memory asynchronously with an event behind the copy; when the bound is next needed and the event has completed, the
host reads the copy (no synchronisation) and the bound is exact again. Inside ``torch.compile`` or CUDA-graph capture
nothing is published, and the bound decays as described (correct, one pass dearer). The alternative without a bound
(that extra pass wherever the settings let the scale go below 1: torch's and cstorch.amp's defaults) is measured in
``benchmarks/bench_scale_below_one.py``.
"""

from __future__ import annotations

import ctypes
import warnings
from typing import Any

import torch

from dls.checks import FLOAT32_MAX, FLOAT32_TINY, INT64_MAX, scale_problem
from dls.policy import assign_, count_skip
from dls.settings import ScalerSettings


class HostCopy:
    """A small float tensor made readable on the host later without a synchronisation: a CPU tensor is read where it
    lies, a CUDA one is copied to pinned memory asynchronously with an event behind the copy; ``read()`` gives its
    values once the copy has arrived, else ``None`` (and ``None`` for good inside ``torch.compile`` or CUDA-graph
    capture, where nothing is copied). Read through the memory itself (``ctypes``), not a tensor method: no
    synchronisation, and none of the reads ``tests/conftest.host_reads`` counts."""

    __slots__ = ("_copy", "_event")

    def __init__(self, values: torch.Tensor) -> None:
        self._copy: torch.Tensor | None = None
        self._event: Any = None
        if torch.compiler.is_compiling():
            return
        if values.device.type == "cpu":  # host memory already: read where it lies (no op for a float32 scale)
            ready = values.dtype == torch.float32 and values.is_contiguous()
            self._copy = values if ready else values.detach().float().contiguous()
        elif values.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            copy = torch.empty(values.shape, dtype=torch.float32, pin_memory=True)  # copy_ converts the dtype
            copy.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            self._copy = copy

    def read(self) -> list[float] | None:
        if self._copy is None or torch.compiler.is_compiling():
            return None
        if self._event is not None and not self._event.query():
            return None  # still in flight
        n = self._copy.numel()
        return list((ctypes.c_float * n).from_address(self._copy.data_ptr())) if n else []


class Known:
    """What the host knows of the device state without reading it: bounds that hold at every moment.

    * ``scale_at_least`` is at most the scale.
    * ``skips_at_most`` is at least ``num_skipped_steps`` (while it is far from 2**63 - 1 the count needs no
      saturation).
    * ``non_clamped_is_scale``: when true, the non-clamped scale is the scale itself (an update known clean on the
      host does not write ``non_clamped_scale``, which is then stale).
    * ``counters_in_range``: when true, the rule's counters are within what it holds; else ``normalise_`` runs
      before the next update (loaded counters, a shortened interval).

    Each path that changes the device state moves these with it, in ``LossScale``: a read makes the scale's bound
    exact; an update moves it as far as the rule says an update can (``lowest_after``); ``update(new_scale)`` sets
    it (a float: exact; a tensor: the smallest normal float32, until the next read); a load sets all four; the
    published copy (module docstring) makes the scale's bound exact. ``tests/test_loss_scale.py`` checks each path.
    """

    __slots__ = ("_published", "counters_in_range", "non_clamped_is_scale", "scale_at_least", "skips_at_most")

    def __init__(self, scale: float) -> None:
        self.scale_at_least = scale
        self.skips_at_most = 0
        self.non_clamped_is_scale = False
        self.counters_in_range = True
        self._published: HostCopy | None = None  # the latest scale, on its way to the host

    def publish(self, scale: torch.Tensor) -> None:
        """Make the current ``scale`` readable on the host later without a synchronisation (module docstring)."""
        self._published = None if torch.compiler.is_compiling() else HostCopy(scale)

    def scale_may_be_below_one(self) -> bool:
        """Whether the scale may be below 1: only then can unscaling overflow a finite gradient."""
        if self.scale_at_least < 1.0 and self._published is not None:
            values = self._published.read()
            if values is not None:  # else the copy is still in flight: keep the bound
                self.scale_at_least = values[0]
                self._published = None
        return self.scale_at_least < 1.0


class LossScale:
    """The scale and counters of one scaler, and what the host knows of them (see the module docstring)."""

    def __init__(self, settings: ScalerSettings, device: torch.device | None) -> None:
        self.settings = settings
        self.rule = settings.rule()
        self.state: Any = self.rule.initial_state(settings.init_scale, device)
        self.known = Known(settings.init_scale)
        self._rejected: torch.Tensor | None = None  # update(new_scale=tensor) values not taken, on the device
        self._rejected_warned = 0

    @property
    def device(self) -> torch.device:
        return self.state.loss_scale.device

    def inverse(self) -> torch.Tensor:
        """``1 / scale``, one float32 operator: the same bits as torch's ``double().reciprocal().float()`` (three
        operators, three kernel launches on a GPU). A float32 division is correctly rounded (IEEE 754; CUDA without
        fast math too), and rounding a float64 quotient to float32 is too, since 53 >= 2 * 24 + 2 (double rounding
        is innocuous for division then: Figueroa, 1995); ``tests/test_loss_scale.py`` compares them bit for bit."""
        return torch.reciprocal(self.state.loss_scale)

    def replace_settings(self, settings: ScalerSettings) -> None:
        """New settings (the growth setters, a load); the counters are brought within what the new rule holds at
        the next update (``dls.scaler_state``)."""
        self.settings, self.rule = settings, settings.rule()
        self.known.counters_in_range = False

    def follow(self, device: torch.device) -> None:
        """Move the state to ``device`` (the loss's, before an iteration has started)."""
        if self.state.loss_scale.device != device:
            self.state = type(self.state)(*(t.to(device) for t in self.state))
            self.known._published = None

    # ------------------------------------------------------------------ reads
    def read(self) -> float:
        """The scale, read from the device (and the host's bound made exact)."""
        self.warn_rejected()
        self.known.scale_at_least = float(self.state.loss_scale.item())
        return self.known.scale_at_least

    def read_flag(self, found_inf: torch.Tensor) -> bool:
        """Read an overflow flag; while the scale may be below 1, read the scale in the same transfer."""
        if not self.known.scale_may_be_below_one():
            return bool(found_inf.item())
        flag, scale = torch.stack([found_inf.float(), self.state.loss_scale]).tolist()
        self.known.scale_at_least = scale
        return bool(flag)

    def read_flags(self, found_inf: torch.Tensor, other: torch.Tensor) -> tuple[bool, bool]:
        """``read_flag`` of ``found_inf`` and a second 0-dim flag on the same device, in one transfer."""
        stacked = [found_inf.float().reshape(()), other.to(found_inf.device, torch.float32).reshape(())]
        if not self.known.scale_may_be_below_one():
            flag, second = torch.stack(stacked).tolist()
        else:
            flag, second, scale = torch.stack([*stacked, self.state.loss_scale]).tolist()
            self.known.scale_at_least = scale
        return bool(flag), bool(second)

    def values(self) -> dict[str, Any]:
        """The scale and the rule's counters (its state's fields but ``non_clamped_scale``) as Python numbers, in
        the state's order (two reads)."""
        scale = self.read()
        names = [k for k in self.state._fields if k not in ("loss_scale", "non_clamped_scale")]
        counters = dict(zip(names, torch.stack([getattr(self.state, k).long() for k in names]).tolist()))
        return {k: scale if k == "loss_scale" else counters[k] for k in self.state._fields if k != "non_clamped_scale"}

    def skipped_steps(self) -> int:
        return int(self.state.num_skipped_steps.item())

    def non_clamped(self) -> float:
        stale = self.known.non_clamped_is_scale or not hasattr(self.state, "non_clamped_scale")
        return float((self.state.loss_scale if stale else self.state.non_clamped_scale).item())

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
    def update(self, found_inf: torch.Tensor, overflow: bool | None = None) -> None:
        """The rule on this iteration's flag: **the one place the rule runs**. ``overflow``: the flag's value when
        the host knows it (no read here)."""
        known, settings, rule = self.known, self.settings, self.rule
        if not known.counters_in_range:
            rule.normalise_(self.state)
            known.counters_in_range = True
        clean = overflow is False and known.scale_at_least >= settings.min_loss_scale
        if clean:
            rule.update_(self.state, found_inf, known_clean=True)
            known.non_clamped_is_scale = True
        else:
            known.skips_at_most = min(known.skips_at_most + 1, INT64_MAX)
            rule.update_(self.state, found_inf, saturate=known.skips_at_most == INT64_MAX)
            known.non_clamped_is_scale = False
        known.scale_at_least = rule.lowest_after(known.scale_at_least, clean)
        if not clean and settings.mode == "dynamic":  # the scale may have moved: publish it
            known.publish(self.state.loss_scale)

    def count_skipped(self, skipped: torch.Tensor) -> None:
        """One more skipped step where ``skipped`` (a 0-dim bool on the device): a step the optimizer declined
        though the gradients were clean (``dls.optimizers.RefusesSteps``); the rule's other counters stay."""
        known = self.known
        known.skips_at_most = min(known.skips_at_most + 1, INT64_MAX)
        self.state.num_skipped_steps.copy_(count_skip(self.state.num_skipped_steps, skipped))

    def set(self, new_scale: float | torch.Tensor, found_inf: torch.Tensor | None) -> None:
        """``update(new_scale)``: a float must be a normal float32 (else ``ValueError``); a tensor is checked on the
        device, and a bad value keeps the old scale and is counted (warned at the next read)."""
        value = self._checked(new_scale)
        s, known = self.state, self.known
        known.skips_at_most = min(known.skips_at_most + 1, INT64_MAX)
        skips = s.num_skipped_steps if found_inf is None else count_skip(s.num_skipped_steps, found_inf)
        changes = {"loss_scale": value, "num_skipped_steps": skips}
        if hasattr(s, "non_clamped_scale"):
            changes["non_clamped_scale"] = value
        assign_(s, s._replace(**changes))
        known.non_clamped_is_scale = False
        known.publish(s.loss_scale)

    def _checked(self, new_scale: float | torch.Tensor) -> torch.Tensor:
        if not isinstance(new_scale, torch.Tensor):
            problem = scale_problem("new_scale", new_scale)
            if problem:
                raise ValueError(problem)
            self.known.scale_at_least = float(new_scale)
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
        self.known.scale_at_least = min(self.known.scale_at_least, FLOAT32_TINY)  # unknown until the next read
        return torch.where(ok, value, self.state.loss_scale)

    def load(self, values: dict[str, float | int], settings: ScalerSettings) -> None:
        """Take validated checkpoint values (``dls.scaler_state.parse_state_dict``) and settings."""
        self.replace_settings(settings)
        values = dict(values)
        known = self.known
        if "num_skipped_steps" in values:
            known.skips_at_most = int(values["num_skipped_steps"])
        if "loss_scale" in values:
            if hasattr(self.state, "non_clamped_scale"):
                values["non_clamped_scale"] = values["loss_scale"]
            known.scale_at_least = float(values["loss_scale"])
            known.non_clamped_is_scale = False
            known._published = None
        current = self.state._asdict()
        new = {k: torch.tensor(v, dtype=current[k].dtype, device=current[k].device) for k, v in values.items()}
        assign_(self.state, self.state._replace(**new))
