"""``GradScaler``: dynamic loss scaling with the surface of ``cstorch.amp.GradScaler`` and ``torch.amp.GradScaler``.

One iteration, top to bottom:

1. ``scale(loss)``: the loss times the scale (float32 for half losses); the scale follows the loss's device.
2. ``unscale_(optimizer)`` / ``clip_gradients_and_return_isfinite(optimizers)``: the passes of ``dls.kernels`` (the
   unscale fused with the inf/NaN check; the global norm and the clip) raise the optimizer's overflow flag, agreed
   across ranks (``dls.distributed``). Each optimizer moves READY → UNSCALED (or CLIPPED) → STEPPED (``Stage``).
3. ``step(optimizer)``: unscales (and clips, with ``max_gradient_norm``) what is still READY, then
   ``_step_if_finite``: **the one place a step is skipped**, on one of three paths (the table in its docstring).
4. ``update()``: the rule of ``dls.policy`` on the iteration's flag, in ``dls.loss_scale``: **the one place the
   scale changes**; every optimizer back to READY.

A step is skipped when some gradient *as the optimizer would receive it* (unscaled, and clipped when the scaler
clips) is inf/NaN in its dtype. Only ``step`` reads a tensor back (the flag), and not for optimizers that take the
flag themselves (torch's fused optimizers) nor with ``sync_free=True``, except at a parameter's first step after
each reset of the optimizer's state: state that does not exist yet cannot be protected on the device.

What the scaler talks to, each through a declared seam: optimizer wrappers that hold their gradients elsewhere
(``dls.optimizers.HoldsGradients``: ``dls.master_weights``); observers of its iterations (``StepObserver``,
attached with ``observe``); the diagnostics, which give ``watch``, ``record`` and ``overflow_report`` their bodies
(``Diagnostics``: ``dls.diagnostics`` registers itself when imported, which ``import dls`` does; the core imports
nothing of it): both protocols in ``dls.observers``. The checkpoint format: ``dls.scaler_state``.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from types import EllipsisType
from typing import IO, TYPE_CHECKING, Any, TypeVar, overload

import torch
import torch.distributed as dist

from dls import device_step, distributed, kernels
from dls.arguments import device_kind, is_available, parse_device, read_arguments, read_deepspeed
from dls.checks import count_problem, flag_problem, limit_problem, python_flag, python_number
from dls.deprecated import warn_renamed
from dls.handles import Removable
from dls.loss_scale import LossScale
from dls.observers import Diagnostics, Observation, StepObserver, diagnostics
from dls.optimizers import HoldsGradients, OptimizerIndex, build_index, optimizer_list, refuse_shared
from dls.policy import PEERS
from dls.scaler_state import TORCH_KEYS, parse_state_dict, state_keys, to_state_dict
from dls.settings import ScalerSettings, interval_name

if TYPE_CHECKING:  # annotations only: the diagnostics plug in through Diagnostics
    from dls.diagnostics.record import Recorder
    from dls.diagnostics.watch import OverflowReport, OverflowWatch

__all__ = ["GradScaler", "Stage"]


# ------------------------------------------------------------------------------ per optimizer: where it is, what it has
class Stage(enum.Enum):
    """Where an optimizer is in the current iteration (``GradScaler.stage``)."""

    READY = "ready"  # gradients still scaled
    UNSCALED = "unscaled"  # unscale_() ran: gradients unscaled, overflow flag recorded
    CLIPPED = "clipped"  # unscaled and clipped by the scaler (clip_gradients_and_return_isfinite, or step())
    STEPPED = "stepped"  # step() ran (or skipped); update() starts the next iteration


@dataclasses.dataclass
class Progress:
    """One optimizer in the current iteration; after its step, also how the step ended (``skipped``)."""

    stage: Stage = Stage.READY
    flag: torch.Tensor | None = None  # float32 0-dim on the scale's device; read it through found_inf
    agreement: distributed.Agreement | None = None  # the flag's all-reduce across ranks while in flight
    collected: bool = False  # the optimizer's HoldsGradients.dls_collect_gradients() ran this iteration
    skipped: bool | None = None  # how step() ended, when the host knows (update() then takes its cheap path)
    # The optimizer declined a step the gradients allowed (dls.optimizers.RefusesSteps), 0-dim bool on the device;
    # and its value once read (step_was_skipped).
    refused: torch.Tensor | None = None
    refused_read: bool | None = None

    @property
    def found_inf(self) -> torch.Tensor | None:
        """The overflow flag, agreed across ranks: waits for its all-reduce if one is in flight."""
        if self.agreement is not None:
            self.flag, self.agreement = self.agreement.wait(), None
        return self.flag

    @found_inf.setter
    def found_inf(self, value: torch.Tensor | None) -> None:
        self.flag, self.agreement = value, None


class Tracker:
    """Per-optimizer bookkeeping of one scaler: this iteration's ``Progress``, and each optimizer's index
    (``dls.OptimizerIndex``, built there). Optimizers are keyed weakly (or by id within an iteration, as
    torch does), so tracking never keeps an optimizer alive."""

    def __init__(self) -> None:
        self.iteration: dict[int, Progress] = {}
        self.indexes: weakref.WeakKeyDictionary[torch.optim.Optimizer, OptimizerIndex] = weakref.WeakKeyDictionary()
        self.last: weakref.WeakKeyDictionary[torch.optim.Optimizer, Progress] = weakref.WeakKeyDictionary()

    def progress(self, optimizer: torch.optim.Optimizer) -> Progress:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
        return self.iteration.setdefault(id(optimizer), Progress())

    def index(self, optimizer: torch.optim.Optimizer) -> OptimizerIndex:
        sig = tuple(tuple(map(id, g["params"])) for g in optimizer.param_groups)  # what an index is valid for
        index = self.indexes.get(optimizer)
        if index is None or index.signature != sig:
            index = self.indexes[optimizer] = build_index(optimizer, sig, list(self.indexes.items()))
        return index

    def grads(self, optimizer: torch.optim.Optimizer, progress: Progress) -> kernels.Groups:
        """The optimizer's gradients grouped by (device, dtype); ``DTensor`` gradients (FSDP2) as their local
        shards, which in-place passes reach through."""
        index = self.index(optimizer)
        if index.shared:
            self.check_disjoint([optimizer])
        if not progress.collected:
            progress.collected = True
            if index.hooks is not None:
                index.hooks.dls_collect_gradients()
        groups = index.grads.groups()
        return distributed.local_shards(groups) if index.has_dtensors else groups

    def grads_of(self, opts: list[torch.optim.Optimizer]) -> kernels.Groups:
        merged: kernels.Groups = {}
        for optimizer in opts:
            for key, grads in self.grads(optimizer, self.progress(optimizer)).items():
                merged.setdefault(key, []).extend(grads)
        return merged

    def check_disjoint(self, opts: list[torch.optim.Optimizer]) -> None:
        indexes = [self.index(optimizer) for optimizer in opts]  # built first: building links them
        started = (key for key, progress in self.iteration.items() if progress.stage is not Stage.READY)
        refuse_shared(opts, indexes, started)

    def has_stepped(self, optimizer: torch.optim.Optimizer, index: OptimizerIndex) -> bool:
        """Whether every parameter with a gradient has stepped through this scaler since the optimizer's state was
        last reset (``load_state_dict``, ``state.clear()``): only then does all the state a step touches exist, so
        that the step can be skipped or masked on the device. O(1) once every parameter has stepped."""
        state = optimizer.state
        if state is not index.optimizer_state or len(state) < index.state_len:
            index.stepped.clear()  # reset (load_state_dict, state.clear(), del state[p]): look again
            index.optimizer_state, index.state_len = state, len(state)
        if len(index.stepped) == len(index.grads.params):
            return True
        return all(id(p) in index.stepped for p in index.grads.params if p.grad is not None)

    def mark_stepped(self, optimizer: torch.optim.Optimizer, index: OptimizerIndex) -> None:
        if len(index.stepped) < len(index.grads.params):
            index.stepped.update((id(p), p) for p in index.grads.params if p.grad is not None)
        index.optimizer_state, index.state_len = optimizer.state, len(optimizer.state)


def _distributed() -> bool:
    """Whether ranks may have to agree (``dls.distributed`` decides per group); the default path never enters it."""
    return dist.is_available() and dist.is_initialized()


def _user_stacklevel() -> int:
    """The ``stacklevel`` of a warning raised in this module that points at the first caller outside it (the
    constructors reach ``_setup`` through one or two frames here)."""
    level, frame = 1, sys._getframe(1)  # the warning's frame
    while frame.f_back is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    return level


# ---------------------------------------------------------------------------------------------------------- the scaler

_T = TypeVar("_T")


class GradScaler:
    """Scales the loss so half-precision gradients neither underflow nor overflow, and skips overflowing steps.

    Two dialects, chosen by the arguments given (``dls.arguments``; every default: ``dls.settings``):

    * ``GradScaler(device="cuda", init_scale=2.**16, growth_factor=2., backoff_factor=.5, growth_interval=2000,
      enabled=True)`` — torch.amp's signature and defaults: a ``torch.amp.GradScaler`` line swapped verbatim trains
      bit-identically. A device (first, or ``device=``) selects it, and so does a call without a Cerebras-only
      argument: ``GradScaler()`` is torch's ``GradScaler()``, on ``"cuda"`` (without CUDA: a warning and a
      disabled scaler, as in torch).
    * ``GradScaler(loss_scale=None, init_scale=None, steps_per_increase=None, min_loss_scale=None,
      max_loss_scale=None, overflow_tolerance=0.0, max_gradient_norm=None)`` — cstorch.amp's signature and
      defaults, selected by any of those Cerebras-only arguments (``init_scale`` is torch's too) or a first
      positional argument that is not a device. Note the positional difference: ``GradScaler(65536.)`` is a
      *static* scale of 65536.

    DeepSpeed's and Megatron-LM's scalers have their own constructors, ``from_deepspeed`` and ``from_megatron``, and
    every peer of ``dls.policy.PEERS`` its own arguments: ``like``.

    Both dialects accept every argument below by keyword.

    Args:
        loss_scale: ``"dynamic"``, a number (a static scale: fixed, overflowing steps still skipped), or ``None``
            (Cerebras dialect: dynamic for float16 and cbfloat16, no scaling for bfloat16).
        init_scale: the first dynamic scale. Above the default ``max_loss_scale`` it raises the maximum.
        steps_per_increase: when the scale grows (an integer). The dialect picks the rule, not the name: the torch
            dialect grows on the interval-th clean step (torch.amp), the Cerebras dialect when more than
            ``steps_per_increase`` updates passed since the last rescale (cstorch.amp); see ``dls.policy``.
        growth_interval: the same as ``steps_per_increase``, by torch.amp's name.
        min_loss_scale: the lower bound of the dynamic scale (a normal float32 number).
        max_loss_scale: the upper bound of the dynamic scale (a normal float32 number).
        overflow_tolerance: fraction of overflowing steps since the last rescale tolerated before backing off.
        max_gradient_norm: if set, ``step`` also clips all gradients to this global L2 norm (after unscaling).
        growth_factor: multiplies the scale on growth.
        backoff_factor: multiplies the scale on back-off.
        hysteresis: Megatron-LM's and DeepSpeed's: the scale backs off on the ``hysteresis``-th (non-tolerated)
            overflow, then on every further one until the next growth refills the budget.
        consecutive_hysteresis: DeepSpeed's: the budget also refills after every clean step.
        enabled: ``False`` makes every method a pass-through, as in torch.
        half_dtype: the half format the defaults are chosen for; ``None``: ``dls.get_half_dtype_str()`` at
            construction (cstorch.amp's ``set_half_dtype``).
        sync_free: keep ``step`` on the device for optimizers that cannot take the flag themselves: the step
            always runs and parameters and optimizer state are restored where it overflowed (``dls.device_step``),
            at the price of a copy of both and two foreach passes over them per step. An optimizer that keeps state
            on the host (AdamW and Adam without ``capturable=True`` on CUDA: their step counts) cannot be restored
            without reading the flag, so its steps are decided on the host (one read, as without ``sync_free``;
            said once): use ``fused=True`` (no read, no copy) or ``capturable=True`` there.
        process_group: the group whose ranks must agree on overflow; default: the world group when
            ``torch.distributed`` is initialised, nothing otherwise.
        gradients_sharded: whether each rank holds a disjoint slice of the gradients, so the global norm for
            ``max_gradient_norm`` sums squared norms across ranks. ``None`` (default): ``DTensor`` gradients
            (FSDP2, tensor parallel) by their placements, plain gradients as replicated (DDP).
        device: where the scale lives before the first ``scale()`` (after that it follows the loss): a CPU or CUDA
            device. A CUDA device on a machine without CUDA disables the scaler with a warning, as torch does.

    A number may be a Python number, a NumPy scalar or 0-dim array, or a 0-dim tensor; a count
    (``growth_interval``, ``hysteresis``) must be an integer.

    Raises:
        ValueError: a bad argument, named ([`dls.settings.SettingsError`][dls.checks.SettingsError] lists every
            problem).
    """

    # The two signatures, as dls.arguments declares them (tests/test_settings.py compares them, and their defaults
    # with the peers' table, dls.policy.PEERS): written out, so that the reference and an editor show them.
    @overload
    def __init__(
        self,
        device: str | torch.device = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        loss_scale: str | float = "dynamic",
        min_loss_scale: float | None = None,
        max_loss_scale: float | None = None,
        overflow_tolerance: float = 0.0,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        max_gradient_norm: float | None = None,
        half_dtype: str | torch.dtype | None = None,
        steps_per_increase: int | None = None,
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
        consecutive_hysteresis: bool = False,
        device: str | torch.device | None = None,
        sync_free: bool = False,
        process_group: Any = None,
        gradients_sharded: bool | None = None,
    ) -> None: ...

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        settings, runtime = read_arguments(args, kwargs)
        self._setup(settings, **runtime)

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
        """A scaler with ``settings`` as they are (the trainer builds them from its YAML config).

        Args:
            settings: the validated settings ([`ScalerSettings`][dls.settings.ScalerSettings]), used unchanged.
            enabled: as the constructor's ``enabled``.
            device: as the constructor's ``device`` (``None``: the scale follows the first loss).
            sync_free: as the constructor's ``sync_free``.
            process_group: as the constructor's ``process_group``.
            gradients_sharded: as the constructor's ``gradients_sharded``.

        Raises:
            ValueError: ``settings`` is not a ``ScalerSettings``, or another argument is invalid.
        """
        if not isinstance(settings, ScalerSettings):
            raise ValueError(f"settings must be a dls.settings.ScalerSettings; got {type(settings).__name__}")
        scaler = cls.__new__(cls)
        scaler._setup(
            settings,
            enabled=enabled,
            device=None if device is None else parse_device(device),
            sync_free=sync_free,
            process_group=process_group,
            gradients_sharded=gradients_sharded,
        )
        return scaler

    @classmethod
    def from_deepspeed(cls, fp16_config: dict[str, Any], device: str | torch.device = "cuda") -> GradScaler:
        """A scaler that follows DeepSpeed's ``DynamicLossScaler`` step by step (its scale, its skip decisions, its
        growth timing: ``dls.policy``), built from the ``fp16`` section of a DeepSpeed config as written in
        ds_config.json (``json.load(f)["fp16"]``).

        ``loss_scale`` 0 is dynamic scaling (a positive number: a static scale), from ``2**initial_scale_power``;
        ``loss_scale_window``, ``hysteresis``, ``consecutive_hysteresis`` and ``min_loss_scale`` are DeepSpeed's.
        Missing keys take DeepSpeed's defaults (``enabled`` is ``False`` there: a disabled scaler, as DeepSpeed
        would not scale); ``auto_cast`` and ``fp16_master_weights_and_grads`` configure DeepSpeed's engine and are
        named in a warning; an unknown key is an error naming it. Differences: no error at the minimum scale (dls
        keeps skipping overflowing steps) and no growth past float32's largest power of two.
        ``load_state_dict(vars(loss_scaler))`` continues a DeepSpeed run (``dls.scaler_state``).

        Args:
            fp16_config: the ``fp16`` section of a DeepSpeed config, a dict.
            device: where the scale lives (``"cpu"`` or a CUDA device).

        Raises:
            ValueError: an unknown key or a bad value, named.
        """
        settings, enabled = read_deepspeed(fp16_config)
        return cls.from_settings(settings, enabled=enabled, device=device)

    @classmethod
    def from_megatron(
        cls,
        device: str | torch.device = "cuda",
        *,
        initial_scale: float,
        min_scale: float,
        growth_factor: float = PEERS["megatron"].defaults["growth_factor"],
        backoff_factor: float = PEERS["megatron"].defaults["backoff_factor"],
        growth_interval: int = PEERS["megatron"].defaults["growth_interval"],
        hysteresis: int = PEERS["megatron"].defaults["hysteresis"],
    ) -> GradScaler:
        """A scaler that follows Megatron-LM's ``DynamicGradScaler(initial_scale, min_scale, growth_factor,
        backoff_factor, growth_interval, hysteresis)`` step by step, from its own arguments (the last four default
        to Megatron's command-line defaults, ``dls.policy.PEERS``); the same as ``GradScaler.like("megatron",
        device, ...)``, kept as DeepSpeed's ``from_deepspeed`` is, under the name a Megatron user looks for. One
        difference: Megatron multiplies without a finite check, so its scale can grow to inf and then skip every
        step; dls drops a growth that would reach inf. ``load_state_dict`` takes ``DynamicGradScaler.state_dict()``
        as saved (``dls.scaler_state``).

        Args:
            device: where the scale lives (``"cpu"`` or a CUDA device).
            initial_scale: the first scale.
            min_scale: the scale never backs off below it.
            growth_factor: the factor of a growth.
            backoff_factor: the factor of a back-off.
            growth_interval: clean steps before the scale grows.
            hysteresis: overflows tolerated before a back-off (refilled by a growth).

        Raises:
            ValueError: a bad argument, named.
        """
        arguments = dict(initial_scale=initial_scale, min_scale=min_scale, growth_factor=growth_factor)
        arguments |= dict(backoff_factor=backoff_factor, growth_interval=growth_interval, hysteresis=hysteresis)
        return cls.like("megatron", device, **arguments)

    @classmethod
    def like(cls, peer: str, device: str | torch.device = "cuda", **arguments: Any) -> GradScaler:
        """A scaler whose scale and skip decisions are ``peer``'s, step by step, configured with the peer's own
        argument names and defaults: ``GradScaler.like("megatron", "cpu", initial_scale=2.0**16, min_scale=1.0)``.
        The peers and what dls does differently: ``dls.policy.PEERS`` and the switching guide.

        Args:
            peer: ``"torch"``, ``"cerebras"``, ``"deepspeed"`` (its ``fp16`` config keys, or its
                ``DynamicLossScaler``'s arguments), ``"megatron"``, ``"keras"``, ``"apex"``, ``"apex_fp16_utils"``,
                ``"fairseq"``, ``"mxnet"``, ``"colossalai"``, ``"jmp"`` (``dls.settings.ScalerSettings.<peer>``
                says what each argument means there).
            device: where the scale lives (``"cpu"`` or a CUDA device).
            **arguments: the peer's own constructor arguments; those that set its starting state (jmp's
                ``counter``) are loaded as the peer's saved state.

        Raises:
            ValueError: an unknown peer or argument (with the closest name), or a bad value, named.
        """
        settings = ScalerSettings.like(peer, **arguments)  # every argument checked, the starting state's too
        scaler = cls.from_settings(settings, device=device)
        start = {name: arguments[name] for name in PEERS[peer].state_arguments if name in arguments}
        if start:
            scaler.load_state_dict(start)
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
            if problem := flag_problem(name, value):
                raise ValueError(problem)
        if gradients_sharded is not None and python_flag(gradients_sharded) is None:
            raise ValueError(f"gradients_sharded must be True, False or None; got {gradients_sharded!r}")
        enabled, sync_free = bool(python_flag(enabled)), bool(python_flag(sync_free))  # NumPy's bools as bools
        gradients_sharded = None if gradients_sharded is None else python_flag(gradients_sharded)
        self._enabled = enabled and settings.mode != "off"
        if device is not None and not is_available(device):
            # torch.amp.GradScaler("cuda", enabled=use_amp) on a machine without CUDA: warn and disable, as torch.
            if self._enabled:
                warnings.warn(
                    f"dls.GradScaler is enabled, but {device_kind(device)} is not available. Disabling.",
                    stacklevel=_user_stacklevel(),
                )
                self._enabled = False
            device = None
        self._sync_free, self._gradients_sharded = sync_free, gradients_sharded
        self._process_group = process_group
        self._scale = LossScale(settings, device)
        self._wire()

    def _wire(self) -> None:
        """The per-process parts, built anew after unpickling: the per-optimizer bookkeeping, the observers, the
        state other objects keep in this scaler's checkpoint (the diagnostics' first: loads may precede a watch)."""
        self._tracker = Tracker()
        self._observers: list[StepObserver] = []
        self._extra_state: dict[str, Any] = {}  # register_state
        if (provider := diagnostics()) is not None:
            provider.new_scaler(self)
        self._born_with = tuple(self._extra_state)  # what a pickled scaler carries along

    # ------------------------------------------------------------------ queries
    @property
    def settings(self) -> ScalerSettings:
        """The scaler's settings (frozen; the growth setters and ``load_state_dict`` replace them)."""
        return self._scale.settings

    def is_enabled(self) -> bool:
        """Whether the scaler scales and skips (``False`` when disabled or when the mode is no scaling)."""
        return self._enabled

    @property
    def mode(self) -> str:
        """``"dynamic"``, ``"static"`` or ``"off"`` (``"off"`` also when disabled)."""
        return self._scale.settings.mode if self._enabled else "off"

    @property
    def max_gradient_norm(self) -> float | None:
        """Deprecated: ``scaler.settings.max_gradient_norm`` (cstorch.amp keeps it private too); this name goes in
        the next release."""
        warn_renamed("GradScaler.max_gradient_norm", "GradScaler.settings.max_gradient_norm")
        return self._scale.settings.max_gradient_norm

    def get_scale(self) -> float:
        """The current loss scale (1.0 when disabled). Reads the device value back: not for the hot path."""
        return self._scale.read() if self._enabled else 1.0

    def get_non_clamped_scale(self) -> float:
        """The scale after the last update before the ``min_loss_scale`` clamp: below ``get_scale()`` means the
        scale is pinned at its floor and gradients still overflow."""
        return self._scale.non_clamped() if self._enabled else 1.0

    def get_num_skipped_steps(self) -> int:
        """Iterations whose gradients overflowed (their optimizer steps were skipped), and those in which an optimizer
        refused a step the gradients allowed (``dls.optimizers.RefusesSteps``: ``dls.master_weights``)."""
        return self._scale.skipped_steps() if self._enabled else 0

    def get_scale_tensor(self) -> torch.Tensor:
        """The scale as a 0-dim float32 device tensor (no host sync), e.g. for logging inside compiled code."""
        return self._scale.state.loss_scale

    def stage(self, optimizer: torch.optim.Optimizer) -> Stage:
        """Where ``optimizer`` is in the current iteration.

        Args:
            optimizer: an optimizer of this iteration (one the scaler has not seen yet is ``Stage.READY``).
        """
        return self._tracker.progress(optimizer).stage

    def step_was_skipped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the last ``step(optimizer)`` (or ``step_if_finite``) through this scaler was skipped because the
        gradients overflowed, or refused by the optimizer (``dls.optimizers.RefusesSteps``); valid until the next
        step of that optimizer, so LR schedulers, EMA and step counters can follow real updates
        (``dls.skip_aware``). Free where ``step`` decided on the host; after a fused or ``sync_free`` step one read
        of the flag. ``RuntimeError`` before the optimizer's first step. A refusal the default path put back on the
        device without a read (``RefusesSteps.dls_may_refuse`` false: a weight moved by half its format's range at
        once) reads as applied here; ``step_was_skipped_tensor`` and ``get_num_skipped_steps`` count it.

        Args:
            optimizer: the optimizer whose last step is asked about.

        Raises:
            RuntimeError: ``optimizer`` has not stepped through this scaler yet.
        """
        last = self._last_step(optimizer)
        if last.skipped is None:  # the fused and sync-free paths did not read the flag
            assert last.flag is not None
            last.skipped = bool(last.flag.item())
        if last.skipped or last.refused is None:
            return last.skipped
        if last.refused_read is None:  # the optimizer declined the step (dls.optimizers.RefusesSteps)
            last.refused_read = bool(last.refused.item())
        return last.refused_read

    def step_was_skipped_tensor(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """``step_was_skipped`` as a 0-dim bool tensor on the scale's device, never read back to the host: to
        select on the device (``torch.where(skipped, old, new)``) in sync-free loops.

        Args:
            optimizer: the optimizer whose last step is asked about.

        Raises:
            RuntimeError: ``optimizer`` has not stepped through this scaler yet.
        """
        last = self._last_step(optimizer)
        skipped = torch.tensor(bool(last.skipped), device=self._scale.device) if last.flag is None else last.flag > 0
        return skipped if last.refused is None else skipped | last.refused.to(skipped.device)

    def stepped_optimizers(self) -> list[torch.optim.Optimizer]:
        """The live optimizers that have stepped through this scaler, in the order of their first step (each one's
        last step: ``step_was_skipped``)."""
        return list(self._tracker.last.keys())

    def _last_step(self, optimizer: torch.optim.Optimizer) -> Progress:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
        last = self._tracker.last.get(optimizer)
        if last is None:
            raise RuntimeError("step_was_skipped(): this optimizer has not stepped through this scaler yet")
        return last

    def get_growth_factor(self) -> float:
        """torch.amp's accessor: the factor the scale grows by."""
        return self._scale.settings.growth_factor

    def get_backoff_factor(self) -> float:
        """torch.amp's accessor: the factor the scale backs off by."""
        return self._scale.settings.backoff_factor

    def get_growth_interval(self) -> int:
        """torch.amp's meaning in both dialects: the scale grows after this many updates without a (counted)
        overflow; ``steps_per_increase + 1`` in the Cerebras dialect."""
        return self._scale.settings.growth_interval

    def set_growth_factor(self, new_factor: float) -> None:
        """torch.amp's setter: validated like the constructor's ``growth_factor``.

        Args:
            new_factor: the factor the scale grows by (greater than 1).
        """
        self._replace_settings(growth_factor=new_factor)

    def set_backoff_factor(self, new_factor: float) -> None:
        """torch.amp's setter: validated like the constructor's ``backoff_factor``.

        Args:
            new_factor: the factor the scale backs off by (between 0 and 1).
        """
        self._replace_settings(backoff_factor=new_factor)

    def set_growth_interval(self, new_interval: int) -> None:
        """torch.amp's meaning (see ``get_growth_interval``).

        Args:
            new_interval: updates without a counted overflow before the scale grows (at least 2 in the Cerebras
                and DeepSpeed dialects).
        """
        offset = self._scale.settings.growth_offset
        if problem := count_problem("new_interval", new_interval):
            raise ValueError(problem)
        interval = int(python_number(new_interval))  # type: ignore[arg-type]  # an integer: checked above
        if interval <= offset:
            dialect = self._scale.settings.dialect
            raise ValueError(
                f"new_interval must be at least 2 for a {dialect}-dialect scaler (it grows after "
                f"{interval_name(dialect)} + 1 updates, {interval_name(dialect)} >= 1); got {new_interval!r}"
            )
        self._replace_settings(steps_per_increase=interval - offset)

    def _replace_settings(self, **changes: Any) -> None:
        self._scale.replace_settings(self._scale.settings.replace(**changes))  # validates

    # ------------------------------------------------------------------ scale
    def scale(self, outputs: _T) -> _T:
        """Multiply a loss (or nested lists/tuples of them) by the scale. Half-precision losses are scaled in float32
        (a float16 loss times ``2**15`` would overflow); the scale moves to the loss's device on first use.

        Args:
            outputs: a loss tensor, or a list, tuple or other iterable of them (nested).

        Returns:
            ``outputs`` times the scale, in the same structure (float32 for half-precision losses); ``outputs``
            unchanged when the scaler is disabled.
        """
        if not self._enabled:
            return outputs
        scale = self._scale.state.loss_scale
        if isinstance(outputs, torch.Tensor) and not self._tracker.iteration and outputs.device != scale.device:
            self._scale.follow(outputs.device)
            scale = self._scale.state.loss_scale
        for observer in self._observers:
            observer.loss_scaled(outputs)
        cache: dict[torch.device, torch.Tensor] = {}

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if value.device not in cache:
                    cache[value.device] = scale.to(value.device, non_blocking=True)
                if value.dtype in (torch.float16, torch.bfloat16):
                    value = value.float()
                return value * cache[value.device]
            if isinstance(value, (list, tuple)):
                scaled = [apply(v) for v in value]
                return type(value)(*scaled) if hasattr(value, "_fields") else type(value)(scaled)  # named tuples
            if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
                return map(apply, value)
            raise ValueError(f"outputs must be a Tensor or an iterable of Tensors; got {type(value).__name__}")

        result: _T = apply(outputs)
        return result

    # ------------------------------------------------------------------ unscale / clip
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and record whether any is inf/NaN (one fused pass
        per device and dtype, no host sync). At most once per optimizer per iteration, before ``step``.

        Args:
            optimizer: the optimizer whose gradients to unscale.

        Raises:
            RuntimeError: ``unscale_`` or ``step`` was already called for ``optimizer`` in this iteration.
        """
        if not self._enabled:
            return
        progress = self._tracker.progress(optimizer)
        if progress.stage in (Stage.UNSCALED, Stage.CLIPPED):
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if progress.stage is Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        self._unscale_and_check([optimizer], [progress])
        self._tell_unscaled(optimizer)

    def clip_gradients_and_return_isfinite(
        self,
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        *,
        max_gradient_norm: float | EllipsisType | None = ...,
        return_norm: bool = False,
    ) -> Any:
        """Unscale the optimizers' gradients, clip them together to ``max_gradient_norm`` (one global norm over
        all their gradients; default: the scaler's own; ``None``: no clipping) and return whether that norm is
        finite, as a bool tensor on the device: the skip decision for all of them. ``return_norm=True`` returns
        ``(isfinite, norm)``, the float32 L2 norm of the unscaled gradients before clipping.

        Args:
            optimizers: one optimizer or a list of them; their gradients are clipped together.
            max_gradient_norm: the global L2 norm to clip to; default: the scaler's own; ``None``: no clipping.
            return_norm: also return the norm.

        Returns:
            A 0-dim bool tensor, true when the gradients are finite; ``(isfinite, norm)`` with ``return_norm=True``.
        """
        max_norm = self._scale.settings.max_gradient_norm if max_gradient_norm is ... else max_gradient_norm
        if problem := limit_problem("max_gradient_norm", max_norm):
            raise ValueError(problem)
        max_norm = None if max_norm is None else float(python_number(max_norm))  # type: ignore[arg-type]
        opts = optimizer_list(optimizers, "optimizers")
        self._tracker.check_disjoint(opts)
        isfinite, norm = self._clip_and_check(opts, max_norm, return_norm)
        for opt in opts:
            self._tell_unscaled(opt)
        return (isfinite, norm) if return_norm else isfinite

    def check_disjoint(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Raise, changing nothing, what unscaling ``optimizers`` now would raise for a parameter they share with
        each other or with an optimizer already unscaled or stepped in this iteration (its gradient would be
        unscaled twice): ``dls.optimizer_step`` checks before the backward pass.

        Args:
            optimizers: the optimizers to be unscaled together.

        Raises:
            ValueError: a shared parameter, named by where it is in each optimizer.
        """
        self._tracker.check_disjoint(optimizer_list(optimizers, "optimizers"))

    def _tell_unscaled(self, optimizer: torch.optim.Optimizer) -> None:
        """User code runs next and may read or clip the gradients a wrapper knows (``dls.master_weights``)."""
        index = self._tracker.indexes.get(optimizer)  # what the index found: a protocol's isinstance is slow
        hooks = index.hooks if index is not None else optimizer if isinstance(optimizer, HoldsGradients) else None
        if hooks is not None:
            hooks.dls_gradients_unscaled()

    # The passes (unscale, check, clip; pure in dls.kernels).
    def _flag_pass(
        self,
        optimizer: torch.optim.Optimizer,
        progress: Progress,
        run: Callable[..., None],
        inv_scale: torch.Tensor | None,
        below_one: bool,
    ) -> torch.Tensor:
        """``run`` (``kernels.mul_and_check_`` or ``kernels.check_unscaled_``) over the optimizer's gradients, factor
        ``inv_scale`` (``None``: a check that needs none); returns the flag on the scale's device (not yet agreed
        across ranks). A fresh flag per pass (one operator), not a buffer reused across calls: a flag outlives its
        iteration (``step_was_skipped`` reads it until the optimizer's next step, the recorder keeps it)."""
        groups = self._tracker.grads(optimizer, progress)
        devices = {d for d, _ in groups}
        found = kernels.zero_flags(devices)
        run(groups, None if inv_scale is None else kernels.per_device(inv_scale, devices), found, below_one)
        return kernels.gather_flags(found, self._scale.device)

    def _unscale_and_check(self, opts: list[torch.optim.Optimizer], progresses: list[Progress]) -> None:
        """Unscale each optimizer's gradients and set its agreed overflow flag (stage → UNSCALED)."""
        inv_scale, below_one = self._scale.inverse(), self._scale.known.scale_may_be_below_one()
        for optimizer, progress in zip(opts, progresses):
            flag = self._flag_pass(optimizer, progress, kernels.mul_and_check_, inv_scale, below_one)
            # Across ranks the flag is agreed asynchronously: reading progress.found_inf waits for the all-reduce.
            agreement = distributed.start_agreement(flag, self._process_group) if _distributed() else None
            progress.flag, progress.agreement = flag, agreement
            progress.stage = Stage.UNSCALED

    def _check_scaled(self, optimizer: torch.optim.Optimizer, progress: Progress) -> torch.Tensor:
        """The agreed flag of ``optimizer``'s still-scaled gradients, without unscaling them (one read pass)."""
        # At a scale of at least 1 the check reads the gradients alone: no inverse scale to compute.
        below_one = self._scale.known.scale_may_be_below_one()
        inv_scale = self._scale.inverse() if below_one else None
        flag = self._flag_pass(optimizer, progress, kernels.check_unscaled_, inv_scale, below_one)
        return distributed.agree_on_overflow(flag, self._process_group) if _distributed() else flag

    def _clip_and_check(
        self, opts: list[torch.optim.Optimizer], max_norm: float | None, want_norm: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        norm: torch.Tensor | None
        progresses = [self._tracker.progress(opt) for opt in opts]
        if any(p.stage is Stage.STEPPED for p in progresses):
            raise RuntimeError("gradients cannot be clipped after step() on the same optimizer before update().")
        if not self._enabled:
            # Nothing to unscale or skip; clipping still applies, and the flag still tells the truth.
            if max_norm is None and not want_norm:
                return torch.ones((), dtype=torch.bool, device=self._scale.device), None
            found_inf, norm = self._clip([], opts, max_norm, want_norm)
            for progress in progresses:
                progress.stage = Stage.CLIPPED if max_norm is not None else progress.stage
            return found_inf == 0, norm
        ready = [(o, p) for o, p in zip(opts, progresses) if p.stage is Stage.READY]
        done = [o for o, p in zip(opts, progresses) if p.stage is not Stage.READY]
        if max_norm is None and not want_norm:
            if ready:
                self._unscale_and_check([o for o, _ in ready], [p for _, p in ready])
            found_inf, norm = kernels.max_flag([p.found_inf for p in progresses]), None
        else:
            found_inf, norm = self._clip([o for o, _ in ready], done, max_norm, want_norm)
            found_inf = kernels.max_flag([found_inf, *(p.found_inf for p in progresses if p.stage is not Stage.READY)])
            if _distributed():
                found_inf = distributed.agree_on_overflow(found_inf, self._process_group)
        for progress in progresses:
            progress.stage = Stage.CLIPPED if max_norm is not None else Stage.UNSCALED
            progress.found_inf = found_inf
        return found_inf == 0, norm

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
        home = self._scale.device
        inv_scale = self._scale.inverse() if self._enabled else None
        both = ((self._tracker.grads_of(scaled), inv_scale), (self._tracker.grads_of(unscaled), None))
        parts = [(groups, factor) for groups, factor in both if groups]  # factor None: already unscaled
        found = torch.zeros((), dtype=torch.float32, device=home)
        sharded = self._gradients_sharded
        if _distributed() and distributed.norm_is_sharded(scaled + unscaled, sharded, self._process_group):
            # Each rank holds a slice of the gradients: squared norms are summed across ranks.
            one = torch.ones((), dtype=torch.float32, device=home)
            opts = [(scaled, one if inv_scale is None else inv_scale), (unscaled, one)]
            total_norm = distributed.global_norm(opts, home, self._process_group, plain_sharded=sharded is True)
            kernels.check_nonfinite([total_norm], found)
        elif len(parts) == 1 and parts[0][1] is not None:
            # Nearly always: the AMP kernel unscales the norm of the still-scaled gradients and raises the flag
            # where it is not finite, two operators (a check after it too while the scale may be below 1).
            total_norm = kernels.global_norm(parts[0][0], None, home)
            below_one = self._scale.known.scale_may_be_below_one()
            kernels.mul_and_check_({(home, torch.float32): [total_norm]}, {home: parts[0][1]}, {home: found}, below_one)
        else:
            norms = [kernels.global_norm(g, None if f is None else kernels.per_device(f, {d for d, _ in g}), home)
                     for g, f in parts]  # fmt: skip
            if not norms:  # no gradient at all (a frozen model): a norm of 0, as torch's clip_grad_norm_ gives
                total_norm = torch.zeros((), dtype=torch.float32, device=home)
            else:
                total_norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
            kernels.check_nonfinite([total_norm], found)
        coef = None if max_norm is None else kernels.clip_coefficient(total_norm, max_norm)
        # A finite norm bounds every clipped element by max_norm: only a max_norm near a gradient dtype's largest
        # value (or an unscale by more than 1 without clipping) can make a product overflow.
        for groups, factor in parts:
            if factor is None and coef is None:
                continue  # already unscaled, and not clipped
            dtypes_max = min(torch.finfo(dtype).max for _, dtype in groups)
            below_one = max_norm is None and self._scale.known.scale_may_be_below_one()
            check = below_one or (max_norm or 0) >= dtypes_max / 2
            multiplier = coef if factor is None else factor if coef is None else factor * coef
            assert multiplier is not None
            found = kernels.mul_and_raise(groups, multiplier, found, check)
        return found, total_norm

    # ------------------------------------------------------------------ step
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (and clip, with ``max_gradient_norm``) if not done yet, then ``optimizer.step(*args,
        **kwargs)`` unless the gradients overflowed. Returns what ``optimizer.step`` returned, or ``None`` when
        the step was skipped.

        Args:
            optimizer: the optimizer to step.
            *args: passed to ``optimizer.step`` (no closure while the scaler is enabled).
            **kwargs: passed to ``optimizer.step``.

        Returns:
            What ``optimizer.step`` returned, or ``None`` when the step was skipped.

        Raises:
            RuntimeError: ``step`` was already called for ``optimizer`` in this iteration, or a closure was given.
        """
        max_norm = self._scale.settings.max_gradient_norm
        if not self._enabled:
            # No scaling, no skipping; max_gradient_norm still clips (bfloat16 runs use it too).
            if max_norm is not None and self._tracker.progress(optimizer).stage is not Stage.CLIPPED:
                self._clip_and_check([optimizer], max_norm, want_norm=False)
            return self._step_unchecked(optimizer, args, kwargs)
        progress = self._progress_to_step(optimizer, args, kwargs)
        if max_norm is not None and progress.stage is not Stage.CLIPPED:
            others = (p for key, p in self._tracker.iteration.items() if key != id(optimizer))
            if any(p.stage in (Stage.CLIPPED, Stage.STEPPED) for p in others):
                warnings.warn(
                    "step() clips each optimizer by the norm of its own gradients; for one global norm over "
                    "several optimizers call clip_gradients_and_return_isfinite([...]) with all of them before "
                    "step(), or use dls.optimizer_step with the list.",
                    stacklevel=2,
                )
            self._clip_and_check([optimizer], max_norm)
        return self._step_if_finite(optimizer, progress, args, kwargs)

    def step_if_finite(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step(*args, **kwargs)`` if the flag recorded by ``unscale_`` or
        ``clip_gradients_and_return_isfinite`` is clean; returns its value, or ``None`` when skipped.

        Args:
            optimizer: the optimizer to step, unscaled or clipped in this iteration.
            *args: passed to ``optimizer.step``.
            **kwargs: passed to ``optimizer.step``.

        Returns:
            What ``optimizer.step`` returned, or ``None`` when the step was skipped.

        Raises:
            RuntimeError: no overflow flag was recorded for ``optimizer`` in this iteration.
        """
        if not self._enabled:
            return self._step_unchecked(optimizer, args, kwargs)
        progress = self._progress_to_step(optimizer, args, kwargs)
        if progress.stage is Stage.READY:
            raise RuntimeError(
                "step_if_finite() needs the overflow flag: call unscale_() or "
                "clip_gradients_and_return_isfinite() first, or use step()."
            )
        return self._step_if_finite(optimizer, progress, args, kwargs)

    def _progress_to_step(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: Any) -> Progress:
        if "closure" in kwargs or (args and callable(args[0])):
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        progress = self._tracker.progress(optimizer)
        if progress.stage is Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        return progress

    def _step_if_finite(
        self, optimizer: torch.optim.Optimizer, progress: Progress, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The step, taken or skipped as the flag says: the one place that decides, on one of three paths.

        ====== ============================================ =========================== ===========================
        path   when                                          the flag                    a skipped step
        ====== ============================================ =========================== ===========================
        host   the default                                  read here, once (one sync)  ``optimizer.step`` not run
        fused  the optimizer takes the scale and the flag   handed to its kernel        its kernel changes nothing
               (``_step_supports_amp_scaling``: torch's     (from READY: a read-only
               ``fused=True``; it unscales too)             check pass, no unscale)
        masked ``sync_free=True``, once every parameter     not read                    the step runs; parameters
               has stepped (``Tracker.has_stepped``)                                    and state are put back on
                                                                                        the device
        ====== ============================================ =========================== ===========================

        A parameter's first step (state that does not exist yet cannot be protected on the device) is decided on
        the host on the fused and masked paths too; so is every step of an optimizer that keeps state on the host
        while the flag is on a device (AdamW without ``capturable=True``): putting that state back would read the
        flag anyway, and one read costs less than the masked step around it (``benchmarks/RESULTS.md`` §13).
        """
        index = self._tracker.index(optimizer)
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._step_fused(optimizer, index, progress, args, kwargs)
        if progress.stage is Stage.READY:
            self._unscale_and_check([optimizer], [progress])
        found_inf = progress.found_inf
        assert found_inf is not None
        progress.stage = Stage.STEPPED
        if self._sync_free and self._tracker.has_stepped(optimizer, index):
            masked = device_step.masked_snapshot(optimizer, found_inf, index.restorable)
            if masked is not None:
                snapshot, restorable = masked
                if restorable is not index.restorable:
                    index.restorable = restorable
                self._decided(optimizer, progress, found_inf, None)
                if index.refuses is not None:  # it may decline the step too: it puts it back on the device
                    index.refuses.dls_next_step()
                result = optimizer.step(*args, **kwargs)
                snapshot.restore()
                if index.hooks is not None:  # e.g. master weights: re-derive what the step wrote from restored state
                    index.hooks.dls_state_restored()
                self._note_refusal(index, progress, found_inf)
                return result
            if not index.warned_host_state:
                index.warned_host_state = True
                warnings.warn(
                    f"sync_free=True: {type(optimizer).__name__} keeps optimizer state on the host (AdamW and Adam "
                    "without capturable=True keep their step counts there), so its steps are decided on the host, "
                    "one read of the flag each, as without sync_free; fused=True or capturable=True keep them on "
                    "the device",
                    stacklevel=3,
                )
        may_refuse = None if index.refuses is None else index.refuses.dls_may_refuse()
        if may_refuse is None:
            skipped, refusal_on_host = self._scale.read_flag(found_inf), True
        else:  # whether the optimizer may well decline the step, in the same transfer (RefusesSteps)
            skipped, refusal_on_host = self._scale.read_flags(found_inf, may_refuse)
        if self._decided(optimizer, progress, found_inf, skipped):
            return None
        if not refusal_on_host:
            assert index.refuses is not None
            index.refuses.dls_next_step()  # a refusal (a weight moved by half its range at once) put back on the device
        result = optimizer.step(*args, **kwargs)
        self._note_refusal(index, progress, found_inf)
        if not refusal_on_host and progress.refused is not None:
            progress.refused_read = False  # as dls_may_refuse said; the device still counts a refusal as skipped
        self._mark_stepped(optimizer, index, progress)
        return result

    def _step_fused(
        self,
        optimizer: torch.optim.Optimizer,
        index: OptimizerIndex,
        progress: Progress,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Hand the scale and the flag to an optimizer whose kernel unscales and skips by itself (no sync)."""
        grad_scale: torch.Tensor | None = None
        if progress.stage is Stage.READY:
            # Only a read pass for the flag: the optimizer kernel divides by grad_scale while it updates.
            progress.found_inf = self._check_scaled(optimizer, progress)
            grad_scale = self._scale.state.loss_scale
        found_inf = progress.found_inf
        assert found_inf is not None
        first_step = not self._tracker.has_stepped(optimizer, index)
        progress.stage = Stage.STEPPED
        if first_step and self._scale.read_flag(found_inf):
            self._decided(optimizer, progress, found_inf, True)
            return None
        if self._decided(optimizer, progress, found_inf, False if first_step else None):
            return None  # known on the host (an observer wanted it read): nothing for the kernel to do
        if index.refuses is not None:
            index.refuses.dls_next_step()
        result = device_step.fused_step(optimizer, grad_scale, found_inf, args, kwargs)
        self._note_refusal(index, progress, found_inf)
        if first_step:
            self._mark_stepped(optimizer, index, progress)
        return result

    def _mark_stepped(self, optimizer: torch.optim.Optimizer, index: OptimizerIndex, progress: Progress) -> None:
        """The optimizer's parameters have taken a real step, unless it refused this one (``RefusesSteps``: it left
        no state, so the next step is a first step again, decided on the host). Read only while some parameter has
        not stepped yet: afterwards marking changes nothing."""
        if progress.refused is not None and not self._tracker.has_stepped(optimizer, index):
            if progress.refused_read is None:
                progress.refused_read = bool(progress.refused.item())
            if progress.refused_read:
                return
        self._tracker.mark_stepped(optimizer, index)

    @staticmethod
    def _note_refusal(index: OptimizerIndex, progress: Progress, found_inf: torch.Tensor | None) -> None:
        """Record whether an optimizer that may decline a step (``RefusesSteps``) declined one the gradients allowed
        (on the device: where the gradients overflowed the step was skipped for that)."""
        if index.refuses is None:
            return
        progress.refused = index.refuses.dls_step_refused(found_inf)
        if progress.skipped is False:  # the gradients known clean: what the optimizer read of its refusal, if it did
            progress.refused_read = index.refuses.dls_refusal_read()

    def _decided(
        self, optimizer: torch.optim.Optimizer, progress: Progress, found_inf: torch.Tensor, skipped: bool | None
    ) -> bool:
        """Remember how the step ended and tell the observers; while one wants the outcome, know it now (one read
        on the fused and sync-free paths). Returns whether skipped."""
        if skipped is None:
            for observer in self._observers:
                if observer.wants_outcome:
                    skipped = self._scale.read_flag(found_inf)
                    break
        progress.skipped, self._tracker.last[optimizer] = skipped, progress
        for observer in self._observers:
            observer.step_decided(optimizer, skipped)
        return bool(skipped)

    def _step_unchecked(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A disabled scaler's step: never skipped for the gradients (closures pass through, as in torch); an
        optimizer may still decline it (``RefusesSteps``)."""
        progress = self._tracker.last[optimizer] = Progress(skipped=False)
        result = optimizer.step(*args, **kwargs)
        # The protocol's method looked up, not the index built: a disabled scaler indexes no optimizer.
        refused = getattr(optimizer, "dls_step_refused", None)
        if refused is not None:
            progress.refused = refused(None)
        return result

    # ------------------------------------------------------------------ observers and diagnostics
    def observe(self, observer: StepObserver) -> Removable:
        """Tell ``observer`` (a ``dls.observers.StepObserver``) of this scaler's iterations until the
        returned handle's ``remove()``. Observers belong to this process: a copy or a pickled scaler has none.

        Args:
            observer: what to call at each point of an iteration.

        Returns:
            A handle: ``remove()``, or a ``with`` block.
        """
        self._observers.append(observer)
        return Observation(self._observers, observer)

    def _diagnostics(self) -> Diagnostics:
        provider = diagnostics()
        if provider is None:  # import dls imports dls.diagnostics, which registers itself
            raise RuntimeError("dls.diagnostics is not imported: import dls first")
        return provider

    def watch(self, model: torch.nn.Module, *, fallback: bool = False) -> OverflowWatch:
        """Name ``model``'s parameters and modules and record the order backward produces their gradients, so that
        after an overflowing step ``overflow_report()`` says where it started (``dls.diagnostics.watch``).

        ``fallback=True``: modules whose half-precision output overflows are found and kept in float32 from then on
        (``dls.diagnostics.fallback``; ``watch.kept_in_float32``, carried by the scaler's state dict). Clean steps
        cost no kernel: a Python hook per parameter in backward (about 1 µs each on a CPU); on the fused and
        sync-free paths ``step`` reads the flag while a watch is active (the watches observe the scaler,
        ``observe``). ``watch(...).remove()`` takes it out.

        Args:
            model: the model whose backward to follow.
            fallback: also keep in float32 the modules whose half-precision output overflows.

        Returns:
            The [`OverflowWatch`][dls.diagnostics.OverflowWatch] (a handle: ``remove()``, or a ``with`` block).
        """
        return self._diagnostics().watch(self, model, fallback, self._process_group)

    def record(
        self,
        file: str | os.PathLike[str] | IO[bytes],
        *,
        model: torch.nn.Module | None = None,
        histogram_every: int | None = 100,
        flush_every: int = 100,
        start_step: int | None = None,
        append: bool = False,
        model_format: str | None = None,
    ) -> Recorder:
        """Write a trace of this scaler's rule steps into ``file`` (JSON lines, ``dls.diagnostics.record``): per
        ``update()`` the scale used, whether the step overflowed and the largest unscaled gradient magnitude; every
        ``histogram_every`` steps a histogram of the gradients' exponents; with ``model``, per module the scale at
        which its backward tensors would overflow. ``dls replay`` / ``dls tune`` (``dls.diagnostics.replaying``) run
        every policy over it. Statistics stay on the device and are written every ``flush_every`` steps: no host
        synchronisation on any path. Returns the recorder; ``close()`` it (or use it as a context manager).

        Args:
            file: a path (created, or replaced unless ``append``) or a binary file object opened for writing.
            model: add the per-module overflow scales (hooks on every module of ``model`` that runs).
            histogram_every: a histogram of the gradients' exponents every this many steps, or ``None`` for none.
            flush_every: rows buffered on the device between writes.
            start_step: the step before the first recorded one (the trainer's global step when it resumes);
                default: 0, or, with ``append``, the existing trace's last step.
            append: with a path, add a segment to an existing trace instead of replacing it (a file that is not a
                trace, or a ``start_step`` before its last step, is refused before anything is written).
            model_format: with ``model``, the format whose largest finite value float32 tensors stand for (a name
                of ``dls.formats``); default: each tensor's own dtype.

        Raises:
            ValueError: an argument outside what is allowed (named), a disabled scaler, or one already recording.
        """
        return self._diagnostics().record(
            self, file, model=model, histogram_every=histogram_every, flush_every=flush_every,
            start_step=start_step, append=append, model_format=model_format,
        )  # fmt: skip

    def overflow_report(self) -> OverflowReport | None:
        """Where this iteration's overflow started (first module in backward order, the parameters with inf/NaN
        gradients, whether the loss itself was non-finite), once ``step()`` found it; readable after ``update()``
        until the next iteration's ``scale()``. ``None`` after a clean step or without a ``watch``."""
        return self._diagnostics().overflow_report(self)

    # ------------------------------------------------------------------ update
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Apply the scale rule (``dls.policy``) to this iteration's overflow flag, or set ``new_scale``, then start
        the next iteration. ``new_scale`` must be a normal float32: a float outside raises ``ValueError``; a tensor
        is checked on the device (no host read): a bad value (NaN, inf, 0, negative, subnormal) keeps the previous
        scale, is counted, and the next ``get_scale()`` or ``state_dict()`` warns.

        Args:
            new_scale: ``None``: apply the scale rule; a float or a 0-dim tensor: the new scale.

        Raises:
            ValueError: ``new_scale`` is a float that is not a normal float32 number.
            RuntimeError: no optimizer of this iteration was unscaled or stepped.
        """
        if not self._enabled:
            self._tracker.iteration.clear()  # only clipping was recorded
            return
        if new_scale is not None:
            flags = [p.found_inf for p in self._tracker.iteration.values() if p.found_inf is not None]
            found_inf = kernels.max_flag(flags) if flags else None
            self._scale.set(new_scale, found_inf)
            self._count_refusals(self._tracker.iteration, found_inf)
        else:
            self._apply_rule(self._tracker.iteration)
        self._tracker.iteration.clear()
        for observer in self._observers:
            observer.iteration_ended()

    def update_scale(self, optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> None:
        """Apply the scale rule to the flags of ``optimizers`` without starting a new iteration
        (``update()`` is ``update_scale`` over every optimizer of the iteration, then the reset).

        Args:
            optimizers: one optimizer or a list of them, stepped in this iteration.
        """
        if not self._enabled:
            return
        iteration = self._tracker.iteration
        self._apply_rule({id(o): iteration.get(id(o), Progress()) for o in optimizer_list(optimizers, "optimizers")})

    def _apply_rule(self, progresses: dict[int, Progress]) -> None:
        flags: list[torch.Tensor] = []
        known: bool | None = False
        for progress in progresses.values():
            if progress.flag is None and progress.agreement is None:
                continue
            flags.append(progress.found_inf)  # type: ignore[arg-type]  # a flag or its all-reduce is there
            # Where step() decided on the host (the default path), the rule knows the flag's value too.
            if known is not None:
                known = None if progress.skipped is None else known or progress.skipped
        if not flags:
            raise RuntimeError(
                "No inf checks were recorded prior to update(): call step() (or unscale_()) on the "
                "optimizers of this iteration first."
            )
        found_inf = flags[0] if len(flags) == 1 else kernels.max_flag(flags)
        if self._observers:  # what the rule is about to see, on the device: the iteration's unscaled gradients
            flagged = {k for k, p in self._tracker.iteration.items() if p.flag is not None or p.agreement is not None}
            opts = [o for o in self._tracker.indexes if id(o) in flagged]
            for observer in self._observers:
                observer.before_rule(found_inf, lambda: self._tracker.grads_of(opts))
        self._scale.update(found_inf, known)
        self._count_refusals(progresses, found_inf)

    def _count_refusals(self, progresses: dict[int, Progress], found_inf: torch.Tensor | None) -> None:
        """A step an optimizer declined though the gradients were clean counts as skipped, once per iteration (not
        again where the iteration overflowed). The rule saw the gradients' flag: the scale is not backed off for a
        weight its format cannot hold, which no loss scale changes (the guarantees page)."""
        refusals = [p.refused for p in progresses.values() if p.refused is not None]
        if refusals:
            refused = torch.stack([r.to(self._scale.device) for r in refusals]).any()
            self._scale.count_skipped(refused if found_inf is None else refused & (found_inf == 0))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The scale, its counters and torch's settings as Python numbers, under dls's and torch.amp's names
        (``dls.scaler_state``): ``torch.amp.GradScaler.load_state_dict`` accepts it. ``{}`` when disabled."""
        if not self._enabled:
            return {}
        extra = {name: owner.state_dict() for name, owner in self._extra_state.items()}
        values = to_state_dict(self._scale.values(), self._scale.settings)
        return values | {k: v for k, v in extra.items() if v is not None}

    def register_state(self, name: str, owner: Any) -> None:
        """Keep ``owner``'s state in this scaler's checkpoint under ``name``. ``owner`` has ``state_dict()``
        (``None``: no key), ``check_state(value)`` (raises ``ValueError``; called before anything changes) and
        ``load_state_dict(value)``.

        Args:
            name: a key not yet in the state dict.
            owner: the object whose state travels under ``name``.

        Raises:
            ValueError: ``name`` is not a new key.
        """
        if not isinstance(name, str) or name in self.state_dict_keys():
            raise ValueError(f"name must be a new state dict key; got {name!r}")
        self._extra_state[name] = owner

    def state_dict_keys(self) -> tuple[str, ...]:
        """Every key this scaler's state dict may hold (its own, torch's, registered ones)."""
        return (*state_keys(self._scale.settings), "format_version", *TORCH_KEYS, *self._extra_state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dls or a ``torch.amp.GradScaler`` state dict: keys present replace, missing keys keep their
        values; torch's settings (growth factor, backoff factor, interval) are applied as torch does, checked as
        the constructor checks them (``growth_interval`` an int: ``10.0`` is refused). A scale must be a normal
        float32 (``2**-126`` to float32's max), as ``init_scale``; one outside this dynamic scaler's
        ``[min_loss_scale, max_loss_scale]`` is clamped into them, with a warning (as ``init_scale`` is clamped to
        ``max_loss_scale``: torch.amp's ``2**16`` loads into a scaler with a lower maximum). Every value is a number or
        a 1-element real tensor (not on the meta device). Nothing changes on a bad value.

        Args:
            state_dict: what a dls or a ``torch.amp`` scaler's ``state_dict()`` returned.

        Raises:
            ValueError: a key holds a bad value, or the state dict is of a newer format; nothing is loaded.
        """
        if not self._enabled:
            return
        settings = self._scale.settings
        loaded = parse_state_dict(state_dict, settings, extra=tuple(self._extra_state))
        for name, value in loaded.extra.items():
            self._extra_state[name].check_state(value)
        if loaded.clamped is not None:
            warnings.warn(
                f"the loaded loss scale {loaded.clamped!r} is outside [min_loss_scale, max_loss_scale] = "
                f"[{settings.min_loss_scale!r}, {settings.max_loss_scale!r}]; clamped to "
                f"{loaded.values['loss_scale']!r}",
                stacklevel=2,
            )
        self._scale.load(loaded.values, loaded.settings)
        for name, value in loaded.extra.items():
            self._extra_state[name].load_state_dict(value)

    def __getstate__(self) -> dict[str, Any]:
        if self._enabled and self._tracker.iteration:
            raise RuntimeError(
                "A GradScaler may only be pickled at the beginning of an iteration, or after scaler.update()."
            )
        # A disabled scaler records only clipping. Observers and owners registered later belong to this process;
        # the state of those registered with the scaler (the modules its fallback watches keep) travels with it.
        kept = {k: v for k, v in self.__dict__.items() if k not in ("_tracker", "_observers", "_extra_state")}
        kept["_process_group"] = None
        kept["_born_state"] = {name: self._extra_state[name].state_dict() for name in self._born_with}
        return kept

    def __setstate__(self, pickled: dict[str, Any]) -> None:
        born = pickled.pop("_born_state", {})
        self.__dict__.update(pickled)
        self._wire()
        for name, value in born.items():
            if name in self._extra_state and value is not None:
                self._extra_state[name].load_state_dict(value)

    def __repr__(self) -> str:
        s = self._scale.settings
        return (
            f"GradScaler(mode={self.mode!r}, dialect={s.dialect!r}, init_scale={s.init_scale}, steps_per_increase="
            f"{s.steps_per_increase}, min_loss_scale={s.min_loss_scale}, max_loss_scale={s.max_loss_scale}, "
            f"max_gradient_norm={s.max_gradient_norm})"
        )
