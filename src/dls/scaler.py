"""``GradScaler``: dynamic loss scaling with the surface of ``cstorch.amp.GradScaler`` and ``torch.amp.GradScaler``.

One step, read top to bottom: ``scale`` multiplies the loss; ``unscale_`` / ``clip_gradients_and_return_isfinite``
unscale, clip and raise the overflow flag with the passes of ``dls.kernels``; ``step`` takes or skips the
optimizer's step — ``GradScaler._step_if_finite``, **the one place a step is skipped**; ``update`` applies the rule
of ``dls.policy`` to the flag (``dls.loss_scale`` holds the scale) — **the one place the scale changes**. Per
iteration each optimizer moves READY → UNSCALED (or CLIPPED) → STEPPED (``Stage``); ``update()`` brings every
optimizer back to READY. The checkpoint format: ``dls.scaler_state``.

A step is skipped when some gradient *as the optimizer would receive it* (unscaled, and clipped when the scaler
clips) is inf/NaN in its dtype. Only ``step`` reads a tensor back (the flag), and not for optimizers that take the
flag themselves (torch's fused optimizers) nor with ``sync_free=True``, except at a parameter's first step after
each reset of the optimizer's state: state that does not exist yet cannot be protected on the device. Optimizers
holding their gradients elsewhere (``dls.master_weights``) hook in through ``dls_collect_gradients``,
``dls_gradients_unscaled`` and ``dls_state_restored``.
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

from dls import distributed, kernels, sync_free
from dls.arguments import device_kind, is_available, parse_device, read_arguments
from dls.checks import count_problem, flag_problem, limit_problem, python_number
from dls.loss_scale import LossScale
from dls.policy import PEERS
from dls.scaler_state import TORCH_KEYS, parse_state_dict, state_keys, to_state_dict
from dls.settings import MEGATRON, ScalerSettings, interval_name

if TYPE_CHECKING:
    from dls.diagnostics.record import Recorder
    from dls.diagnostics.watch import OverflowReport, OverflowWatch, Watches

__all__ = ["GradScaler", "Stage", "optimizer_list"]


# ------------------------------------------------------------- per optimizer: the state machine and the gradient index
class Stage(enum.Enum):
    """Where an optimizer is in the current iteration (``GradScaler.stage``)."""

    READY = "ready"  # gradients still scaled
    UNSCALED = "unscaled"  # unscale_() ran: gradients unscaled, overflow flag recorded
    CLIPPED = "clipped"  # unscaled and clipped by the scaler (clip_gradients_and_return_isfinite, or step())
    STEPPED = "stepped"  # step() ran (or skipped); update() starts the next iteration


@dataclasses.dataclass
class IterationState:
    """One optimizer in the current iteration; after its step, also how the step ended (``step_was_skipped``)."""

    stage: Stage = Stage.READY
    flag: torch.Tensor | None = None  # float32 0-dim on the scale's device; read it through found_inf
    agreement: distributed.Agreement | None = None  # the flag's all-reduce across ranks while in flight
    collected: bool = False  # dls_collect_gradients() was called this iteration
    skipped: bool | None = None  # how step() ended, when the host knows (update() then takes its cheap path)

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
class _Index:
    """What is cached per optimizer, valid while its param groups hold the same parameters (an identity check of
    the lists per step: a parameter swapped into an existing list re-indexes)."""

    signature: tuple[tuple[int, ...], ...]
    grads: kernels.GradIndex  # holds the parameters, so the ids in the signature cannot be reused
    has_dtensors: bool
    # Parameters stepped through this scaler (id → parameter) since the optimizer's state was last reset (a new
    # state object, or a shorter one): see Tracker.has_stepped.
    stepped: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    state: Any = None  # the optimizer.state object the stepped record refers to
    state_len: int = 0  # its length when last marked
    # Other optimizers of this scaler sharing a parameter with this one: (optimizer ref, where, where theirs).
    shared: list[tuple[weakref.ref[torch.optim.Optimizer], str, str, tuple[int, ...]]] = dataclasses.field(
        default_factory=list
    )


class Tracker:
    """Per-optimizer bookkeeping of one scaler. Optimizers are keyed weakly (or by id within an iteration, as
    torch does), so tracking never keeps an optimizer alive."""

    def __init__(self) -> None:
        self.iteration: dict[int, IterationState] = {}
        self._indexes: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Index] = weakref.WeakKeyDictionary()
        self.last: weakref.WeakKeyDictionary[torch.optim.Optimizer, IterationState] = weakref.WeakKeyDictionary()

    def state(self, optimizer: torch.optim.Optimizer) -> IterationState:
        check_optimizer(optimizer)
        return self.iteration.setdefault(id(optimizer), IterationState())

    def new_iteration(self) -> None:
        self.iteration.clear()

    # ------------------------------------------------------------------ gradients
    def grads(self, optimizer: torch.optim.Optimizer) -> kernels.Groups:
        """The optimizer's gradients grouped by (device, dtype); ``DTensor`` gradients (FSDP2) as their local
        shards, which in-place passes reach through."""
        state = self.state(optimizer)
        index = self._index(optimizer)
        if index.shared:
            self.check_disjoint([optimizer])
        if not state.collected:
            state.collected = True
            collect = getattr(optimizer, "dls_collect_gradients", None)
            if collect is not None:
                collect()
        groups = index.grads.groups()
        return distributed.local_shards(groups) if index.has_dtensors else groups

    def grads_of(self, optimizers: list[torch.optim.Optimizer]) -> kernels.Groups:
        merged: kernels.Groups = {}
        for optimizer in optimizers:
            for key, grads in self.grads(optimizer).items():
                merged.setdefault(key, []).extend(grads)
        return merged

    def _index(self, optimizer: torch.optim.Optimizer) -> _Index:
        signature = tuple(tuple(map(id, g["params"])) for g in optimizer.param_groups)
        index = self._indexes.get(optimizer)
        if index is None or index.signature != signature:
            where = _positions(optimizer)
            params = [p for _, p in where.values()]
            index = _Index(signature, kernels.GradIndex(params), distributed.has_dtensors(params))
            self._link_shared(optimizer, index, where)
            self._indexes[optimizer] = index
        return index

    def _link_shared(self, optimizer: torch.optim.Optimizer, index: _Index, where: dict[int, Any]) -> None:
        """Record which other optimizers of this scaler hold a parameter of ``optimizer`` (both ways): unscaling
        both in one iteration would unscale that gradient twice (``check_disjoint``)."""
        for other, other_index in list(self._indexes.items()):
            other_index.shared = [s for s in other_index.shared if s[0]() not in (None, optimizer)]
            if other is optimizer:
                continue
            theirs = _positions(other, own=False)
            common = where.keys() & theirs.keys()
            if common:
                pid = next(iter(common))
                shape = tuple(where[pid][1].shape)
                index.shared.append((weakref.ref(other), where[pid][0], theirs[pid][0], shape))
                other_index.shared.append((weakref.ref(optimizer), theirs[pid][0], where[pid][0], shape))

    def check_disjoint(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Refuse, before anything changes, to unscale ``optimizers`` together or after other optimizers of this
        iteration when they share a parameter: its gradient would be unscaled (and counted in a norm) twice."""
        indexes = [self._index(optimizer) for optimizer in optimizers]  # built first: building links them
        for i, index in enumerate(indexes):
            for ref, mine, theirs, shape in index.shared:
                other = ref()
                if other is None:
                    continue
                j = next((k for k, o in enumerate(optimizers) if o is other), None)
                if j is not None and j > i:
                    raise ValueError(
                        f"optimizers[{i}].{mine} (shape {shape}) is also optimizers[{j}].{theirs}: a parameter in "
                        "two optimizers would have its gradient unscaled twice; give each parameter to one optimizer"
                    )
                stage = self.iteration.get(id(other))
                if j is None and stage is not None and stage.stage is not Stage.READY:
                    name = "optimizer" if len(optimizers) == 1 else f"optimizers[{i}]"
                    raise ValueError(
                        f"{name}.{mine} (shape {shape}) is also {theirs} of another optimizer already unscaled or "
                        "stepped in this iteration: its gradient would be unscaled twice; give each parameter to one "
                        "optimizer"
                    )

    # ------------------------------------------------------------------ steps
    def has_stepped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether every parameter with a gradient has stepped through this scaler since the optimizer's state was
        last reset (``load_state_dict``, ``state.clear()``): only then does all the state a step touches exist, so
        that the step can be skipped or masked on the device. O(1) once every parameter has stepped."""
        index = self._index(optimizer)
        state = optimizer.state
        if state is not index.state or len(state) < index.state_len:
            index.stepped.clear()  # reset (load_state_dict, state.clear(), del state[p]): look again
            index.state, index.state_len = state, len(state)
        if len(index.stepped) == len(index.grads.params):
            return True
        return all(id(p) in index.stepped for p in index.grads.params if p.grad is not None)

    def mark_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        index = self._index(optimizer)
        if len(index.stepped) < len(index.grads.params):
            index.stepped.update((id(p), p) for p in index.grads.params if p.grad is not None)
        index.state, index.state_len = optimizer.state, len(optimizer.state)


def _positions(optimizer: torch.optim.Optimizer, own: bool = True) -> dict[int, tuple[str, torch.Tensor]]:
    """Where each parameter is in ``optimizer.param_groups``. In the optimizer being indexed (``own``) a parameter
    listed twice (an in-place edit of the groups) would be unscaled twice and raises."""
    where: dict[int, tuple[str, torch.Tensor]] = {}
    for g, group in enumerate(optimizer.param_groups):
        for k, p in enumerate(group["params"]):
            here = f"param_groups[{g}]['params'][{k}]"
            if own and id(p) in where:
                raise ValueError(
                    f"optimizer.{here} (shape {tuple(p.shape)}) is also optimizer.{where[id(p)][0]}: a parameter "
                    "listed twice would have its gradient unscaled twice"
                )
            where[id(p)] = (here, p)
    return where


def check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")


def takes_scale_and_flag(optimizer: torch.optim.Optimizer) -> bool:
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


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

    DeepSpeed's and Megatron-LM's scalers have their own constructors: ``from_deepspeed`` and ``from_megatron``.

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
            always runs and parameters and optimizer state are restored where it overflowed (``dls.sync_free``).
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
        ValueError: a bad argument, named ([`dls.settings.SettingsError`][dls.settings.SettingsError] lists every
            problem).
    """

    # The two signatures, as dls.arguments declares them (tests/test_settings.py compares them).
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
        from dls.arguments import read_deepspeed

        settings, enabled = read_deepspeed(fp16_config)
        return cls.from_settings(settings, enabled=enabled, device=device)

    @classmethod
    def from_megatron(
        cls,
        device: str | torch.device = "cuda",
        *,
        initial_scale: float,
        min_scale: float,
        growth_factor: float = MEGATRON["growth_factor"],
        backoff_factor: float = MEGATRON["backoff_factor"],
        growth_interval: int = MEGATRON["growth_interval"],
        hysteresis: int = MEGATRON["hysteresis"],
    ) -> GradScaler:
        """A scaler that follows Megatron-LM's ``DynamicGradScaler(initial_scale, min_scale, growth_factor,
        backoff_factor, growth_interval, hysteresis)`` step by step, from its own arguments (the last four default
        to Megatron's command-line defaults). One difference: Megatron multiplies without a finite check, so its
        scale can grow to inf and then skip every step; dls drops a growth that would reach inf.
        ``load_state_dict`` takes ``DynamicGradScaler.state_dict()`` as saved (``dls.scaler_state``).

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
        settings = ScalerSettings.megatron(
            initial_scale=initial_scale,
            min_scale=min_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
        )
        return cls.from_settings(settings, device=device)

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
        if gradients_sharded is not None and not isinstance(gradients_sharded, bool):
            raise ValueError(f"gradients_sharded must be True, False or None; got {gradients_sharded!r}")
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
        self._extra_state: dict[str, Any] = {}  # register_state
        self._wire()

    def _wire(self) -> None:
        """The per-process parts, built anew after unpickling: the per-optimizer bookkeeping and the watches."""
        from dls.diagnostics.watch import Watches  # the diagnostics are imported with a scaler, not with dls

        self._tracker = Tracker()
        self._reports: Watches = Watches()
        self._recorder: Recorder | None = None  # record(): the trace of this process's rule steps
        self.register_state("kept_in_float32", self._reports.kept)  # registered first: loads may precede a watch

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
        """The global gradient-norm limit ``step()`` clips to (``None``: no clipping)."""
        return self._scale.settings.max_gradient_norm

    def get_scale(self) -> float:
        """The current loss scale (1.0 when disabled). Reads the device value back: not for the hot path."""
        return self._scale.read() if self._enabled else 1.0

    def get_non_clamped_scale(self) -> float:
        """The scale after the last update before the ``min_loss_scale`` clamp: below ``get_scale()`` means the
        scale is pinned at its floor and gradients still overflow."""
        return self._scale.non_clamped() if self._enabled else 1.0

    def get_num_skipped_steps(self) -> int:
        """Iterations whose gradients overflowed (their optimizer steps were skipped)."""
        return self._scale.skipped_steps() if self._enabled else 0

    def get_scale_tensor(self) -> torch.Tensor:
        """The scale as a 0-dim float32 device tensor (no host sync), e.g. for logging inside compiled code."""
        return self._scale.state.loss_scale

    def stage(self, optimizer: torch.optim.Optimizer) -> Stage:
        """Where ``optimizer`` is in the current iteration.

        Args:
            optimizer: an optimizer of this iteration (one the scaler has not seen yet is ``Stage.READY``).
        """
        return self._tracker.state(optimizer).stage

    def step_was_skipped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the last ``step(optimizer)`` (or ``step_if_finite``) through this scaler was skipped because the
        gradients overflowed; valid until the next step of that optimizer, so LR schedulers, EMA and step counters
        can follow real updates (``dls.skip_aware``). Free where ``step`` decided on the host; after a fused or
        ``sync_free`` step one read of the flag. ``RuntimeError`` before the optimizer's first step.

        Args:
            optimizer: the optimizer whose last step is asked about.

        Raises:
            RuntimeError: ``optimizer`` has not stepped through this scaler yet.
        """
        last = self._last_step(optimizer)
        if last.skipped is None:  # the fused and sync-free paths did not read the flag
            assert last.flag is not None
            last.skipped = bool(last.flag.item())
        return last.skipped

    def _last_step(self, optimizer: torch.optim.Optimizer) -> IterationState:
        check_optimizer(optimizer)
        last = self._tracker.last.get(optimizer)
        if last is None:
            raise RuntimeError("step_was_skipped(): this optimizer has not stepped through this scaler yet")
        return last

    def _stepped_optimizers(self) -> list[torch.optim.Optimizer]:
        """The live optimizers that have stepped through this scaler (``dls.skip_aware`` binds to a single one)."""
        return list(self._tracker.last.keys())

    def step_was_skipped_tensor(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """``step_was_skipped`` as a 0-dim bool tensor on the scale's device, never read back to the host: to
        select on the device (``torch.where(skipped, old, new)``) in sync-free loops.

        Args:
            optimizer: the optimizer whose last step is asked about.

        Raises:
            RuntimeError: ``optimizer`` has not stepped through this scaler yet.
        """
        last = self._last_step(optimizer)
        if last.flag is None:
            return torch.tensor(bool(last.skipped), device=self._scale.device)
        return last.flag > 0

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
        if isinstance(outputs, torch.Tensor) and not self._tracker.iteration:
            self._scale.follow(outputs.device)
        if self._reports.watches or self._reports.report is not None:
            self._reports.new_loss(outputs)
        cache: dict[torch.device, torch.Tensor] = {}

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if value.device not in cache:
                    cache[value.device] = self._scale.state.loss_scale.to(value.device, non_blocking=True)
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
        state = self._tracker.state(optimizer)
        if state.stage in (Stage.UNSCALED, Stage.CLIPPED):
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state.stage is Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        self._unscale_and_check([optimizer], [state])
        _tell_unscaled(optimizer)

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
            _tell_unscaled(opt)
        return (isfinite, norm) if return_norm else isfinite

    # The passes (unscale, check, clip; pure in dls.kernels) and the skip decision.
    def _flag_pass(
        self, optimizer: torch.optim.Optimizer, run: Callable[..., None], inv_scale: torch.Tensor
    ) -> torch.Tensor:
        """``run`` (``kernels.mul_and_check_`` or ``kernels.check_unscaled_``) over the optimizer's gradients, factor
        ``inv_scale``; returns the flag on the scale's device (not yet agreed across ranks)."""
        groups = self._tracker.grads(optimizer)
        devices = {d for d, _ in groups}
        found = kernels.zero_flags(devices)
        run(groups, kernels.per_device(inv_scale, devices), found, self._scale.known.scale_may_be_below_one())
        return kernels.gather_flags(found, self._scale.device)

    def _unscale_and_check(self, optimizers: list[torch.optim.Optimizer], states: list[IterationState]) -> None:
        """Unscale each optimizer's gradients and set its agreed overflow flag (stage → UNSCALED)."""
        inv_scale = self._scale.inverse()
        for optimizer, state in zip(optimizers, states):
            flag = self._flag_pass(optimizer, kernels.mul_and_check_, inv_scale)
            # Across ranks the flag is agreed asynchronously: reading state.found_inf waits for the all-reduce.
            agreement = distributed.start_agreement(flag, self._process_group) if _distributed() else None
            state.flag, state.agreement = flag, agreement
            state.stage = Stage.UNSCALED

    def _check_scaled(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """The agreed flag of ``optimizer``'s still-scaled gradients, without unscaling them (one read pass)."""
        flag = self._flag_pass(optimizer, kernels.check_unscaled_, self._scale.inverse())
        return distributed.agree_on_overflow(flag, self._process_group) if _distributed() else flag

    def _clip_and_check(
        self, optimizers: list[torch.optim.Optimizer], max_norm: float | None, want_norm: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        norm: torch.Tensor | None
        states = [self._tracker.state(opt) for opt in optimizers]
        if any(s.stage is Stage.STEPPED for s in states):
            raise RuntimeError("gradients cannot be clipped after step() on the same optimizer before update().")
        if not self._enabled:
            # Nothing to unscale or skip; clipping still applies, and the flag still tells the truth.
            if max_norm is None and not want_norm:
                return torch.ones((), dtype=torch.bool, device=self._scale.device), None
            found_inf, norm = self._clip([], optimizers, max_norm, want_norm)
            for state in states:
                state.stage = Stage.CLIPPED if max_norm is not None else state.stage
            return found_inf == 0, norm
        ready = [(o, s) for o, s in zip(optimizers, states) if s.stage is Stage.READY]
        done = [o for o, s in zip(optimizers, states) if s.stage is not Stage.READY]
        if max_norm is None and not want_norm:
            if ready:
                self._unscale_and_check([o for o, _ in ready], [s for _, s in ready])
            found_inf, norm = kernels.max_flag([s.found_inf for s in states]), None
        else:
            found_inf, norm = self._clip([o for o, _ in ready], done, max_norm, want_norm)
            found_inf = kernels.max_flag([found_inf, *(s.found_inf for s in states if s.stage is not Stage.READY)])
            if _distributed():
                found_inf = distributed.agree_on_overflow(found_inf, self._process_group)
        for state in states:
            state.stage = Stage.CLIPPED if max_norm is not None else Stage.UNSCALED
            state.found_inf = found_inf
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
        inv_scale = self._scale.inverse() if self._enabled else torch.ones((), device=home)
        one = torch.ones((), dtype=torch.float32, device=home)
        parts = [(self._tracker.grads_of(scaled), inv_scale), (self._tracker.grads_of(unscaled), one)]
        sharded = self._gradients_sharded
        if _distributed() and distributed.norm_is_sharded(scaled + unscaled, sharded, self._process_group):
            # Each rank holds a slice of the gradients: squared norms are summed across ranks.
            opts = [(scaled, inv_scale), (unscaled, one)]
            total_norm = distributed.global_norm(opts, home, self._process_group, plain_sharded=sharded is True)
        else:
            norms = [kernels.global_norm(g, kernels.per_device(f, {d for d, _ in g}), home) for g, f in parts]
            total_norm = torch.linalg.vector_norm(torch.stack(norms))
        found = (~torch.isfinite(total_norm)).float()
        coef = one if max_norm is None else kernels.clip_coefficient(total_norm, max_norm)
        # A finite norm bounds every clipped element by max_norm: only a max_norm near a gradient dtype's largest
        # value (or an unscale by more than 1 without clipping) can make a product overflow.
        for groups, factor in parts:
            if groups and (factor is not one or max_norm is not None):
                dtypes_max = min(torch.finfo(dtype).max for _, dtype in groups)
                below_one = max_norm is None and self._scale.known.scale_may_be_below_one()
                check = below_one or (max_norm or 0) >= dtypes_max / 2
                found = kernels.mul_and_raise(groups, factor * coef, found, check)
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
            if max_norm is not None and self._tracker.state(optimizer).stage is not Stage.CLIPPED:
                self._clip_and_check([optimizer], max_norm, want_norm=False)
            return self._step_unchecked(optimizer, args, kwargs)
        state = self._state_to_step(optimizer, args, kwargs)
        if max_norm is not None and state.stage is not Stage.CLIPPED:
            others = (s for key, s in self._tracker.iteration.items() if key != id(optimizer))
            if any(s.stage in (Stage.CLIPPED, Stage.STEPPED) for s in others):
                warnings.warn(
                    "step() clips each optimizer by the norm of its own gradients; for one global norm over "
                    "several optimizers call clip_gradients_and_return_isfinite([...]) with all of them before "
                    "step(), or use dls.optimizer_step with the list.",
                    stacklevel=2,
                )
            self._clip_and_check([optimizer], max_norm)
        return self._step_if_finite(optimizer, state, args, kwargs)

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
        state = self._state_to_step(optimizer, args, kwargs)
        if state.stage is Stage.READY:
            raise RuntimeError(
                "step_if_finite() needs the overflow flag: call unscale_() or "
                "clip_gradients_and_return_isfinite() first, or use step()."
            )
        return self._step_if_finite(optimizer, state, args, kwargs)

    def _state_to_step(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: Any) -> IterationState:
        if "closure" in kwargs or (args and callable(args[0])):
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        state = self._tracker.state(optimizer)
        if state.stage is Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        return state

    def _step_if_finite(
        self, optimizer: torch.optim.Optimizer, state: IterationState, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The step, skipped where the flag says so; the one place the path is chosen: the optimizer's own kernel
        when it takes the flag (from READY: it unscales, too), else on the device (sync-free) or on the host."""
        if takes_scale_and_flag(optimizer):
            return self._step_fused(optimizer, state, args, kwargs)
        if state.stage is Stage.READY:
            self._unscale_and_check([optimizer], [state])
        found_inf = state.found_inf
        assert found_inf is not None
        state.stage = Stage.STEPPED
        if self._sync_free and self._tracker.has_stepped(optimizer):
            self._record(optimizer, state, found_inf, None)
            return sync_free.masked_step(optimizer, found_inf, args, kwargs)
        if self._record(optimizer, state, found_inf, self._scale.read_flag(found_inf)):
            return None
        result = optimizer.step(*args, **kwargs)
        self._tracker.mark_stepped(optimizer)
        return result

    def _step_fused(
        self, optimizer: torch.optim.Optimizer, state: IterationState, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Hand the scale and the flag to an optimizer whose kernel unscales and skips by itself (no sync)."""
        grad_scale: torch.Tensor | None = None
        if state.stage is Stage.READY:
            # Only a read pass for the flag: the optimizer kernel divides by grad_scale while it updates.
            state.found_inf = self._check_scaled(optimizer)
            grad_scale = self._scale.state.loss_scale
        found_inf = state.found_inf
        assert found_inf is not None
        first_step = not self._tracker.has_stepped(optimizer)
        state.stage = Stage.STEPPED
        if first_step and self._scale.read_flag(found_inf):
            self._record(optimizer, state, found_inf, True)
            return None
        if self._record(optimizer, state, found_inf, False if first_step else None):
            return None  # known on the host (a watch read it): nothing for the kernel to do
        result = sync_free.fused_step(optimizer, grad_scale, found_inf, args, kwargs)
        if first_step:
            self._tracker.mark_stepped(optimizer)
        return result

    def _record(
        self, optimizer: torch.optim.Optimizer, state: IterationState, found_inf: torch.Tensor, skipped: bool | None
    ) -> bool:
        """Remember how the step ended; while a watch is active, know it now (one read on the fused and sync-free
        paths) and build the overflow report from the gradients, which still exist. Returns whether skipped."""
        # Watches.active() inlined: a step without watches enters no diagnostics file (tests/test_layout.py).
        watches = [w for w in self._reports.watches if w.active]
        if skipped is None and watches:
            skipped = self._scale.read_flag(found_inf)
        state.skipped, self._tracker.last[optimizer] = skipped, state
        if skipped and watches:
            # The overflow path: one more read is fine.
            self._reports.overflowed(watches, float(self._scale.state.loss_scale))
        return bool(skipped)

    def _step_unchecked(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A disabled scaler's step: never skipped (closures pass through, as in torch)."""
        self._tracker.last[optimizer] = IterationState(skipped=False)
        return optimizer.step(*args, **kwargs)

    # ------------------------------------------------------------------ diagnostics
    def watch(self, model: torch.nn.Module, *, fallback: bool = False) -> OverflowWatch:
        """Name ``model``'s parameters and modules and record the order backward produces their gradients, so that
        after an overflowing step ``overflow_report()`` says where it started (``dls.diagnostics.watch``).

        ``fallback=True``: modules whose half-precision output overflows are found and kept in float32 from then on
        (``dls.diagnostics.fallback``; ``watch.kept_in_float32``, carried by the scaler's state dict). Clean steps
        cost no kernel: a Python hook per parameter in backward (about 1 µs each on a CPU); on the fused and
        sync-free paths ``step`` reads the flag while a watch is active. ``watch(...).remove()`` takes it out.

        Args:
            model: the model whose backward to follow.
            fallback: also keep in float32 the modules whose half-precision output overflows.

        Returns:
            The [`OverflowWatch`][dls.diagnostics.OverflowWatch] (a handle: ``remove()``, or a ``with`` block).
        """
        return self._reports.watch(model, fallback, self._process_group)

    def record(
        self,
        file: str | os.PathLike[str] | IO[bytes],
        *,
        model: torch.nn.Module | None = None,
        histogram_every: int | None = 100,
        flush_every: int = 100,
        start_step: int = 0,
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
            start_step: the step before the first recorded one (the trainer's global step when it resumes).
            append: with a path, add a segment to an existing trace instead of replacing it.
            model_format: with ``model``, the format whose largest finite value float32 tensors stand for (a name
                of ``dls.formats``); default: each tensor's own dtype.

        Raises:
            ValueError: an argument outside what is allowed (named), a disabled scaler, or one already recording.
        """
        from dls.diagnostics.record import Recorder

        return Recorder(
            self, file, model=model, histogram_every=histogram_every, flush_every=flush_every,
            start_step=start_step, append=append, model_format=model_format,
        )  # fmt: skip

    def overflow_report(self) -> OverflowReport | None:
        """Where this iteration's overflow started (first module in backward order, the parameters with inf/NaN
        gradients, whether the loss itself was non-finite), once ``step()`` found it; readable after ``update()``
        until the next iteration's ``scale()``. ``None`` after a clean step or without a ``watch``."""
        return self._reports.report

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
            self._tracker.new_iteration()  # only clipping was recorded
            return
        if new_scale is not None:
            flags = [s.found_inf for s in self._tracker.iteration.values() if s.found_inf is not None]
            self._scale.set(new_scale, kernels.max_flag(flags) if flags else None)
        else:
            self._apply_rule(list(self._tracker.iteration.values()))
        self._tracker.new_iteration()
        self._reports.stale = True

    def update_scale(self, optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> None:
        """Apply the scale rule to the flags of ``optimizers`` without starting a new iteration
        (``update()`` is ``update_scale`` over every optimizer of the iteration, then the reset).

        Args:
            optimizers: one optimizer or a list of them, stepped in this iteration.
        """
        if not self._enabled:
            return
        opts = optimizer_list(optimizers, "optimizers")
        self._apply_rule([self._tracker.iteration.get(id(o), IterationState()) for o in opts])

    def _apply_rule(self, states: list[IterationState]) -> None:
        states = [s for s in states if s.flag is not None or s.agreement is not None]
        if not states:
            raise RuntimeError(
                "No inf checks were recorded prior to update(): call step() (or unscale_()) on the "
                "optimizers of this iteration first."
            )
        # Where step() decided on the host (the default path), the rule knows the flag's value too.
        known = None if any(s.skipped is None for s in states) else any(s.skipped for s in states)
        found_inf = kernels.max_flag([s.found_inf for s in states])
        if self._recorder is not None:
            self._recorder.rule_step(found_inf)  # what the rule is about to see, on the device
        self._scale.update(found_inf, known)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The scale, its counters and torch's settings as Python numbers, under dls's and torch.amp's names
        (``dls.scaler_state``): ``torch.amp.GradScaler.load_state_dict`` accepts it. ``{}`` when disabled."""
        if not self._enabled:
            return {}
        values = self._scale.values()
        extra = {name: owner.state_dict() for name, owner in self._extra_state.items()}
        return to_state_dict(values, self._scale.settings) | {k: v for k, v in extra.items() if v is not None}

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
        values; torch's settings (growth factor, backoff factor, interval) are applied as torch does; a scale
        outside this scaler's bounds is clamped into them, with a warning. Nothing changes on a bad value.

        Args:
            state_dict: what a dls or a ``torch.amp`` scaler's ``state_dict()`` returned.

        Raises:
            ValueError: a key holds a bad value, or the state dict is of a newer format; nothing is loaded.
        """
        if not self._enabled:
            return
        loaded = parse_state_dict(state_dict, self._scale.settings, extra=tuple(self._extra_state))
        for name, value in loaded.extra.items():
            self._extra_state[name].check_state(value)
        if loaded.clamped is not None:
            warnings.warn(
                f"the loaded loss scale {loaded.clamped!r} is outside [min_loss_scale, max_loss_scale] = "
                f"[{self._scale.settings.min_loss_scale!r}, {self._scale.settings.max_loss_scale!r}]; clamped to "
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
        # A disabled scaler records only clipping. Watches and registered owners belong to this process; the
        # modules the watches keep are this scaler's state: the next fallback watch keeps them.
        parts = ("_tracker", "_reports", "_extra_state", "_recorder")
        state = {k: v for k, v in self.__dict__.items() if k not in parts}
        state["_process_group"] = None
        state["_kept_in_float32"] = self._reports.kept.state_dict()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        kept = state.pop("_kept_in_float32", None)
        self.__dict__.update(state)
        self._extra_state = {}
        self._wire()
        self._reports.kept.loaded = kept

    # ------------------------------------------------------------------ helpers
    def __repr__(self) -> str:
        s = self._scale.settings
        return (
            f"GradScaler(mode={self.mode!r}, dialect={s.dialect!r}, init_scale={s.init_scale}, steps_per_increase="
            f"{s.steps_per_increase}, min_loss_scale={s.min_loss_scale}, max_loss_scale={s.max_loss_scale}, "
            f"max_gradient_norm={s.max_gradient_norm})"
        )


# ---------------------------------------------------------------------- module helpers


def _user_stacklevel() -> int:
    """The ``stacklevel`` of a warning raised in this module that points at the first caller outside it (the
    constructors reach ``_setup`` through one or two frames here)."""
    level, frame = 1, sys._getframe(1)  # the warning's frame
    while frame.f_back is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    return level


def _distributed() -> bool:
    """Whether ranks may have to agree (``dls.distributed`` decides per group); the default path never enters it."""
    return dist.is_available() and dist.is_initialized()


def optimizer_list(
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], name: str
) -> list[torch.optim.Optimizer]:
    """``optimizers`` (one or a sequence) as a list without repeats; ``ValueError`` naming ``name`` otherwise."""
    if isinstance(optimizers, torch.optim.Optimizer):
        items = [optimizers]
    else:
        items = list(optimizers) if isinstance(optimizers, Iterable) and not isinstance(optimizers, str) else []
    if not items or not all(isinstance(o, torch.optim.Optimizer) for o in items):
        raise ValueError(f"{name} must be a torch.optim.Optimizer or a non-empty list of them; got {optimizers!r}")
    return list({id(o): o for o in items}.values())  # an optimizer listed twice is still unscaled once


def _tell_unscaled(optimizer: torch.optim.Optimizer) -> None:
    """User code runs next and may read or clip the gradients it knows (``dls.master_weights``)."""
    hook = getattr(optimizer, "dls_gradients_unscaled", None)
    if hook is not None:
        hook()
