"""How ``GradScaler``'s arguments are read: torch.amp's signature or cstorch.amp's, chosen by the arguments given.

The dialect of a call (``dialect_of``), first match wins:

1. a device first (``"cuda"``, ``"cpu"``, a ``torch.device``) or ``device=``: **torch**;
2. a first positional argument that is not a device (cstorch.amp's ``loss_scale``), or any Cerebras-only argument
   by keyword (``SELECTS_CEREBRAS``: ``loss_scale``, ``steps_per_increase``, ``min_loss_scale``, ``max_loss_scale``,
   ``overflow_tolerance``, ``max_gradient_norm``): **cerebras**;
3. anything else, ``GradScaler()`` included: **torch**, on torch's default device ``"cuda"`` — where CUDA is absent
   the scaler warns and disables itself, as ``torch.amp.GradScaler()`` does there.

``GradScaler(device="cuda", init_scale, growth_factor, backoff_factor, growth_interval, enabled)`` is torch.amp's
positional signature and defaults; ``GradScaler(loss_scale, init_scale, steps_per_increase, min_loss_scale,
max_loss_scale, overflow_tolerance, max_gradient_norm)`` is cstorch.amp's. Every other knob is accepted by keyword in
both. Each signature is derived from its dialect's ``ScalerSettings`` constructor (declared once, there; the
``@overload``s of ``GradScaler.__init__`` are tested against ``TORCH_SIGNATURE`` and ``CEREBRAS_SIGNATURE``).
Unknown keywords are Python's usual ``TypeError``; bad values are ``ValueError`` naming the argument
(``dls.settings.SettingsError``). DeepSpeed's ``fp16`` config section is read by ``read_deepspeed``.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Any

import torch

from dls.checks import unknown_names
from dls.peer_settings import DEEPSPEED
from dls.settings import ScalerSettings, SettingsError

# Arguments of GradScaler that are not settings: where the scaler runs, and torch's name for the growth interval
# in the Cerebras dialect (and the reverse).
_RUNTIME = ("sync_free", "process_group", "gradients_sharded")
_RUNTIME_DEFAULTS: dict[str, Any] = {
    "enabled": True,
    "sync_free": False,
    "process_group": None,
    "gradients_sharded": None,
}
# Arguments only cstorch.amp's GradScaler has: one of them by keyword selects the Cerebras dialect. (What the trainer's
# config accepts and ignores off Cerebras hardware is another thing: dls.train.config.layouts.IGNORED_OFF_CEREBRAS.)
SELECTS_CEREBRAS = (
    "loss_scale",
    "steps_per_increase",
    "min_loss_scale",
    "max_loss_scale",
    "overflow_tolerance",
    "max_gradient_norm",
)
TORCH_DEFAULT_DEVICE = "cuda"  # torch.amp.GradScaler's
# Where dls's scale and kernels run (torch.device types).
SUPPORTED_DEVICES = ("cpu", "cuda")


def _signature(
    settings_method: Any, positional: int, leading: dict[str, Any], alias: str, device_default: Any
) -> inspect.Signature:
    """GradScaler's signature in a dialect, derived from the dialect's ``ScalerSettings`` constructor (declared once,
    there): ``leading`` first (torch's ``device`` and its default), then that constructor's first ``positional``
    parameters, then ``enabled``; everything else keyword-only, with ``alias`` (the other dialect's name of the
    growth interval), ``device`` unless it leads, and the runtime arguments."""
    P = inspect.Parameter
    own = list(inspect.signature(settings_method).parameters.values())
    params = [P(name, P.POSITIONAL_OR_KEYWORD, default=default) for name, default in leading.items()]
    params += [p.replace(kind=P.POSITIONAL_OR_KEYWORD) for p in own[:positional]]
    params.append(P("enabled", P.POSITIONAL_OR_KEYWORD, default=True))
    params += [p.replace(kind=P.KEYWORD_ONLY) for p in own[positional:]]
    params.append(P(alias, P.KEYWORD_ONLY, default=None))
    if "device" not in leading:
        params.append(P("device", P.KEYWORD_ONLY, default=device_default))
    params += [P(name, P.KEYWORD_ONLY, default=_RUNTIME_DEFAULTS[name]) for name in _RUNTIME]
    return inspect.Signature(params)


TORCH_SIGNATURE = _signature(ScalerSettings.torch, 4, {"device": TORCH_DEFAULT_DEVICE}, "steps_per_increase", None)
CEREBRAS_SIGNATURE = _signature(ScalerSettings.cerebras, 10, {}, "growth_interval", None)


def dialect_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """``"torch"`` or ``"cerebras"``: the dialect a ``GradScaler(*args, **kwargs)`` call speaks (module docstring)."""
    if kwargs.get("device") is not None or (args and _is_device(args[0])):
        return "torch"
    if args or any(name in kwargs for name in SELECTS_CEREBRAS):
        return "cerebras"
    return "torch"


def read_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[ScalerSettings, dict[str, Any]]:
    """``(settings, runtime)``: the scaler's settings, and ``enabled``, ``device`` (a ``torch.device`` or ``None``),
    ``sync_free``, ``process_group``, ``gradients_sharded``."""
    if kwargs.get("device") is not None and args and not _is_device(args[0]):
        raise ValueError(
            f"device={kwargs['device']!r} selects torch.amp's arguments (device, init_scale, growth_factor, "
            f"backoff_factor, growth_interval, enabled), whose first is the device; got {args[0]!r} first: pass "
            "it by keyword (e.g. loss_scale='dynamic')"
        )
    is_torch = dialect_of(args, kwargs) == "torch"
    signature = TORCH_SIGNATURE if is_torch else CEREBRAS_SIGNATURE
    try:
        given = signature.bind(*args, **kwargs).arguments
    except TypeError as exc:
        raise TypeError(f"GradScaler(): {exc}") from None
    runtime = {name: given.pop(name, _RUNTIME_DEFAULTS[name]) for name in ("enabled", *_RUNTIME)}
    device = given.pop("device", None)
    runtime["device"] = parse_device(TORCH_DEFAULT_DEVICE if device is None else device) if is_torch else None
    own, other = ("growth_interval", "steps_per_increase") if is_torch else ("steps_per_increase", "growth_interval")
    interval = _one_of(given.get(own), given.pop(other, None))
    if interval is not None:
        given[own] = interval
    given = {k: v for k, v in given.items() if v is not None or k in _NONE_MEANS_SOMETHING}
    make = ScalerSettings.torch if is_torch else ScalerSettings.cerebras
    try:
        return make(**given), runtime
    except SettingsError as exc:
        if other not in kwargs:
            raise
        # The interval was given under the other dialect's name: the message names it as written.
        raise SettingsError(
            [(field, m.replace(own, other, 1) if field == "steps_per_increase" else m) for field, m in exc.problems]
        ) from None


# Arguments where an explicit None is a choice, not "the default": a gradient norm of None clips nothing; the
# Cerebras loss_scale None is "dynamic unless bfloat16". Every other None takes the dialect's default.
_NONE_MEANS_SOMETHING = ("max_gradient_norm", "loss_scale")


def _one_of(steps_per_increase: int | None, growth_interval: int | None) -> int | None:
    if steps_per_increase is not None and growth_interval is not None:
        raise ValueError("give steps_per_increase or its torch name growth_interval, not both")
    return steps_per_increase if steps_per_increase is not None else growth_interval


def _is_device(value: Any) -> bool:
    """Whether ``value`` names a device (any torch knows: a supported one is checked by ``parse_device``)."""
    if isinstance(value, torch.device):
        return True
    if not isinstance(value, str) or value == "dynamic":
        return False
    try:
        torch.device(value)
    except (RuntimeError, ValueError):
        return False
    return True


def parse_device(value: Any) -> torch.device:
    """``value`` as a ``torch.device`` of a supported type; ``ValueError`` naming ``device`` otherwise."""
    device: torch.device | None = None
    if isinstance(value, torch.device):
        device = value
    elif isinstance(value, str):
        with contextlib.suppress(RuntimeError, ValueError):
            device = torch.device(value)
    if device is not None and device.type in SUPPORTED_DEVICES:
        return device
    raise ValueError(
        f"device must be 'cpu', 'cuda', 'cuda:N' or a torch.device of those types (dls's scale and kernels run on "
        f"CPU and CUDA devices); got {value!r}"
    )


def device_kind(device: torch.device) -> str:
    return "CUDA" if device.type == "cuda" else device.type


def is_available(device: torch.device) -> bool:
    return device.type != "cuda" or torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------- DeepSpeed
# DeepSpeed's fp16 section (deepspeed.runtime.precision_config.DeepSpeedFP16Config): its switch (off by default in
# DeepSpeed), the keys of the loss scaler (their defaults: DeepSpeed's row of dls.policy.PEERS), and those that
# configure something else.
DEEPSPEED_DEFAULTS: dict[str, Any] = {"enabled": False, **DEEPSPEED.defaults}
DEEPSPEED_OTHER_KEYS = ("auto_cast", "fp16_master_weights_and_grads")


def read_deepspeed(fp16_config: Any) -> tuple[ScalerSettings, bool]:
    """``(settings, enabled)`` of DeepSpeed's ``fp16`` config section as written in ds_config.json: missing keys
    take DeepSpeed's defaults (``enabled`` is ``False`` there, as in DeepSpeed); keys of the section that configure
    something other than the loss scaler are named in one warning; unknown keys, and the Hugging Face
    integration's ``"auto"`` placeholders, are errors naming the key."""
    if not isinstance(fp16_config, dict):
        raise ValueError(
            "fp16_config must be a dict: the 'fp16' section of a DeepSpeed config; got " + type(fp16_config).__name__
        )
    known = (*DEEPSPEED_DEFAULTS, *DEEPSPEED_OTHER_KEYS)
    problems = []
    unknown = [key for key in fp16_config if key not in known]
    if unknown:
        count = f"{len(unknown):,} unknown keys:" if len(unknown) > 1 else "an unknown key"
        problems.append(
            (
                str(unknown[0]),
                f"fp16_config has {count} {unknown_names(unknown, known)}; DeepSpeed's fp16 keys: {', '.join(known)}",
            )
        )
    for key in fp16_config:
        if key in known and isinstance(fp16_config[key], str) and fp16_config[key] == "auto":
            problems.append(
                (
                    key,
                    f"fp16_config[{key!r}] is 'auto', a placeholder the Hugging Face integration fills in before "
                    "DeepSpeed reads the config: give the value",
                )
            )
    if problems and "fp16" in fp16_config:
        raise ValueError("fp16_config is a whole DeepSpeed config: pass its 'fp16' section, ds_config['fp16']")
    if problems:
        raise SettingsError(problems)
    ignored = [key for key in DEEPSPEED_OTHER_KEYS if key in fp16_config]
    if ignored:
        warnings.warn(
            f"fp16_config keys that configure DeepSpeed's engine, not its loss scaler, are ignored here: "
            f"{', '.join(ignored)}",
            stacklevel=3,
        )
    values = {**DEEPSPEED_DEFAULTS, **{k: v for k, v in fp16_config.items() if k in DEEPSPEED_DEFAULTS}}
    enabled = values.pop("enabled")
    if not isinstance(enabled, bool):
        raise ValueError(f"fp16_config['enabled'] must be true or false; got {enabled!r}")
    return ScalerSettings.deepspeed(**values), enabled
