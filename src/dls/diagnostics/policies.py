"""The policy lab's table of peers' loss-scaling policies: what ``dls replay --policy`` and ``dls tune`` accept.

Each row of ``POLICIES`` is one peer, in one place: its own argument names and defaults, how they build a
``dls.settings.ScalerSettings``, the grid ``dls tune`` searches, and the lines that configure a rule in dls and in
the peer's own system (``config_lines``). ``parse_policy`` reads ``NAME:key=value,...`` against a row;
``recorded`` (the recorded run's own settings and starting state) is the one policy not in the table. A peer is
added as one row.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dls.arguments import read_deepspeed
from dls.checks import FLOAT32_MAX, FLOAT32_TINY, shown
from dls.diagnostics.trace import Trace, settings_of
from dls.policy import PEERS
from dls.settings import ScalerSettings, SettingsError

__all__ = ["POLICIES", "RECORDED", "Policy", "PolicyKind", "buildable", "config_lines", "config_number", "parse_policy"]

RECORDED = "recorded"


def _no_line(settings: ScalerSettings) -> str | None:
    return None


@dataclass(frozen=True)
class PolicyKind:
    """One row of ``POLICIES``: a peer's dynamic loss-scaling policy.

    Attributes:
        name: the name given on the command line.
        summary: what it is, in a line.
        defaults: the peer's own argument names and defaults (``None``: the peer derives it).
        build: ``(values, half_dtype) -> ScalerSettings`` with ``values`` the defaults, overridden.
        grid: for ``dls tune``: the values tried per argument (the others keep their defaults).
        labels: the peer's name of a ``ScalerSettings`` argument whose name differs (for error messages).
        dls_line: the dls call that builds settings of this peer's kind (``None``: settings of another kind).
        system: the peer's own configuration, as ``config_lines`` names it (``None``: none of its own).
        line: settings as ``system`` writes them (``None``: that system cannot express them exactly).
    """

    name: str
    summary: str
    defaults: dict[str, Any]
    build: Callable[[dict[str, Any], str], ScalerSettings]
    grid: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)  # a ScalerSettings argument -> this peer's key
    dls_line: Callable[[ScalerSettings], str | None] = _no_line
    system: str | None = None
    line: Callable[[ScalerSettings], str | None] = _no_line


# ------------------------------------------------------------------------------------------------ each peer
def config_number(value: float) -> str:
    """A number as a config file (and ``NAME:key=value``) holds it: ``2**k`` powers as plain integers or ``2**-k``
    decimals; a flag as ``True``/``False``.

    Args:
        value: the number.
    """
    if isinstance(value, bool):
        return str(value)
    if value == int(value) and abs(value) < 2**63:
        return str(int(value))
    return repr(float(value))


def _dynamic(s: ScalerSettings, *dialects: str) -> bool:
    return s.mode == "dynamic" and s.dialect in dialects


def _no_ceiling(s: ScalerSettings) -> bool:
    return s.max_loss_scale >= FLOAT32_MAX


def _extras(s: ScalerSettings) -> list[str]:
    """The rule's arguments beyond torch's, where they are not their defaults (dls's names)."""
    out = [f"hysteresis={s.hysteresis}"] if s.hysteresis != 1 else []
    if s.consecutive_hysteresis:
        out.append("consecutive_hysteresis=True")
    if s.overflow_tolerance:
        out.append(f"overflow_tolerance={config_number(s.overflow_tolerance)}")
    return out


def _factors(s: ScalerSettings) -> list[str]:
    return [f"growth_factor={config_number(s.growth_factor)}", f"backoff_factor={config_number(s.backoff_factor)}"]


def _default_factors(s: ScalerSettings) -> bool:
    return (s.growth_factor, s.backoff_factor) == (2.0, 0.5)


def _torch(v: dict[str, Any], half: str) -> ScalerSettings:
    return ScalerSettings.torch(**v, half_dtype=half)


def _torch_dls(s: ScalerSettings) -> str | None:
    if not _dynamic(s, "torch"):
        return None
    args = ['"cuda"', f"init_scale={config_number(s.init_scale)}", *_factors(s), f"growth_interval={s.growth_interval}"]
    extras = _extras(s)
    if s.min_loss_scale > FLOAT32_TINY:
        extras.append(f"min_loss_scale={config_number(s.min_loss_scale)}")
    if not _no_ceiling(s):
        extras.append(f"max_loss_scale={config_number(s.max_loss_scale)}")
    return f"dls.GradScaler({', '.join(args + extras)})"


def _torch_amp(s: ScalerSettings) -> str | None:
    if not _dynamic(s, "torch", "cerebras", "megatron"):
        return None
    if s.hysteresis != 1 or s.overflow_tolerance or not _no_ceiling(s) or s.min_loss_scale > FLOAT32_TINY:
        return None
    args = [f"init_scale={config_number(s.init_scale)}", *_factors(s), f"growth_interval={s.growth_interval}"]
    return f'torch.amp.GradScaler("cuda", {", ".join(args)})'


def _cerebras(v: dict[str, Any], half: str) -> ScalerSettings:
    given = {k: value for k, value in v.items() if value is not None}
    return ScalerSettings.cerebras(loss_scale="dynamic", half_dtype=half, **given)


def _cerebras_dls(s: ScalerSettings) -> str | None:
    if not _dynamic(s, "cerebras"):
        return None
    args = [
        'loss_scale="dynamic"',
        f"init_scale={config_number(s.init_scale)}",
        f"steps_per_increase={s.steps_per_increase}",
        f"min_loss_scale={config_number(s.min_loss_scale)}",
        f"max_loss_scale={config_number(s.max_loss_scale)}",
    ]
    if not _default_factors(s):
        args += _factors(s)
    return f"dls.GradScaler({', '.join(args + _extras(s))})"


def _model_zoo_yaml(s: ScalerSettings) -> str | None:
    """Model Zoo YAML, the keys of dls's trainer and cstorch's (``steps_per_increase`` one below the interval)."""
    if s.mode == "static":
        return f"optimizer:\n  loss_scaling_factor: {config_number(s.init_scale)}"
    if not _dynamic(s, "torch", "cerebras", "megatron") or s.growth_interval < 2:
        return None
    yaml = [
        "optimizer:",
        "  loss_scaling_factor: dynamic",
        f"  initial_loss_scale: {config_number(s.init_scale)}",
        f"  steps_per_increase: {s.growth_interval - 1}",
        f"  min_loss_scale: {config_number(s.min_loss_scale)}",
        f"  max_loss_scale: {config_number(s.max_loss_scale)}",
    ]
    if not _default_factors(s):
        yaml += [
            f"  growth_factor: {config_number(s.growth_factor)}",
            f"  backoff_factor: {config_number(s.backoff_factor)}",
        ]
    if s.overflow_tolerance:
        yaml.append(f"  overflow_tolerance: {config_number(s.overflow_tolerance)}")
    if s.hysteresis != 1:
        yaml.append(f"  hysteresis: {s.hysteresis}")
    if s.consecutive_hysteresis:
        yaml.append("  consecutive_hysteresis: true")
    return "\n".join(yaml)


def _megatron(v: dict[str, Any], half: str) -> ScalerSettings:
    return ScalerSettings.megatron(**v)


def _megatron_dls(s: ScalerSettings) -> str | None:
    if not _dynamic(s, "megatron"):
        return None
    args = [
        '"cuda"',
        f"initial_scale={config_number(s.init_scale)}",
        f"min_scale={config_number(s.min_loss_scale)}",
        *_factors(s),
        f"growth_interval={s.growth_interval}",
        f"hysteresis={s.hysteresis}",
    ]
    return f"dls.GradScaler.from_megatron({', '.join(args)})"


def _megatron_flags(s: ScalerSettings) -> str | None:
    if not _dynamic(s, "torch", "cerebras", "megatron") or not _default_factors(s) or not _no_ceiling(s):
        return None
    if s.overflow_tolerance or s.consecutive_hysteresis:
        return None
    return (
        f"--fp16 --initial-loss-scale {config_number(s.init_scale)} --min-loss-scale {config_number(s.min_loss_scale)} "
        f"--loss-scale-window {s.growth_interval} --hysteresis {s.hysteresis}"
    )


def _deepspeed(v: dict[str, Any], half: str) -> ScalerSettings:
    return read_deepspeed({"enabled": True, "loss_scale": 0, **v})[0]  # as GradScaler.from_deepspeed reads it


def _deepspeed_fp16(s: ScalerSettings) -> str:
    return (
        f'{{"enabled": true, "loss_scale": 0, "initial_scale_power": {int(math.log2(s.init_scale))}, '
        f'"loss_scale_window": {s.steps_per_increase}, "hysteresis": {s.hysteresis}, "consecutive_hysteresis": '
        f'{str(s.consecutive_hysteresis).lower()}, "min_loss_scale": {config_number(s.min_loss_scale)}}}'
    )


def _deepspeed_dls(s: ScalerSettings) -> str | None:
    if not _dynamic(s, "deepspeed"):
        return None
    return f"dls.GradScaler.from_deepspeed({_deepspeed_fp16(s).replace('true', 'True').replace('false', 'False')})"


def _deepspeed_json(s: ScalerSettings) -> str | None:
    if s.mode == "static":
        return f'"fp16": {{"enabled": true, "loss_scale": {config_number(s.init_scale)}}}'
    return f'"fp16": {_deepspeed_fp16(s)}' if _dynamic(s, "deepspeed") else None


def _static(v: dict[str, Any], half: str) -> ScalerSettings:
    return ScalerSettings.torch(loss_scale=v["loss_scale"], half_dtype=half)


def _static_dls(s: ScalerSettings) -> str | None:
    return f"dls.GradScaler(loss_scale={config_number(s.init_scale)})" if s.mode == "static" else None


# ------------------------------------------------------------------------ the field's other peers (issue 41)
def _like(name: str, v: dict[str, Any], half: str) -> ScalerSettings:
    return ScalerSettings.like(name, **v)  # these peers scale float16: their defaults are float16's


def _args(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v if isinstance(v, str) else config_number(v)}" for k, v in values.items())


def _like_line(name: str, own: Callable[[ScalerSettings], dict[str, Any]]) -> Callable[[ScalerSettings], str | None]:
    """The dls line of a peer's settings: ``GradScaler.like`` with the peer's own arguments (``own``)."""

    def line(s: ScalerSettings) -> str | None:
        if not _dynamic(s, name):
            return None
        values = own(s)
        return f'dls.GradScaler.like("{name}", "cuda"{", " if values else ""}{_args(values)})'

    return line


def _own_line(name: str, write: Callable[[ScalerSettings], str | None]) -> Callable[[ScalerSettings], str | None]:
    return lambda s: write(s) if _dynamic(s, name) else None


def _keras_args(s: ScalerSettings) -> dict[str, Any]:
    return {"initial_scale": s.init_scale, "dynamic_growth_steps": s.steps_per_increase}


def _apex_args(s: ScalerSettings) -> dict[str, Any]:
    v: dict[str, Any] = {"init_scale": s.init_scale, "scale_window": s.steps_per_increase}
    if s.min_loss_scale > FLOAT32_TINY:
        v["min_loss_scale"] = s.min_loss_scale
    return {**v, "max_loss_scale": s.max_loss_scale}


def _apex_fp16_utils_args(s: ScalerSettings) -> dict[str, Any]:
    return {"init_scale": s.init_scale, "scale_factor": s.growth_factor, "scale_window": s.steps_per_increase}


def _fairseq_args(s: ScalerSettings) -> dict[str, Any]:
    v: dict[str, Any] = {"init_scale": s.init_scale, "scale_factor": s.growth_factor}
    v |= {"scale_window": s.steps_per_increase, "tolerance": s.overflow_tolerance}
    if s.min_loss_scale > FLOAT32_TINY:
        v["threshold"] = s.min_loss_scale
    return {**v, "min_loss_scale": 0.0 if s.stop_loss_scale is None else s.stop_loss_scale}


def _fairseq_flags(s: ScalerSettings) -> str | None:
    """Fairseq's command line (FP16Optimizer's flags): it takes an integer start and the factor 2 only."""
    if s.growth_factor != 2.0 or s.init_scale != int(s.init_scale):
        return None
    v = _fairseq_args(s)
    flags = (
        f"--fp16 --fp16-init-scale {config_number(s.init_scale)} --fp16-scale-window {s.steps_per_increase} "
        f"--fp16-scale-tolerance {config_number(s.overflow_tolerance)} --min-loss-scale "
        f"{config_number(v['min_loss_scale'])}"
    )
    return flags + (f" --threshold-loss-scale {config_number(v['threshold'])}" if "threshold" in v else "")


def _colossalai_args(s: ScalerSettings) -> dict[str, Any]:
    v: dict[str, Any] = {"initial_scale": s.init_scale, "growth_factor": s.growth_factor}
    v |= {"backoff_factor": s.backoff_factor, "growth_interval": s.steps_per_increase}
    if s.min_loss_scale > FLOAT32_TINY:
        v["min_scale"] = s.min_loss_scale
    if s.max_loss_scale < FLOAT32_MAX:
        v["max_scale"] = s.max_loss_scale
    return {**v, "hysteresis": s.hysteresis}


def _jmp_args(s: ScalerSettings) -> dict[str, Any]:
    floor = 0.0 if s.min_loss_scale <= FLOAT32_TINY else s.min_loss_scale
    v = {"loss_scale": s.init_scale, "period": s.steps_per_increase, "factor": s.growth_factor}
    return {**v, "min_loss_scale": floor}


def _jmp_line(s: ScalerSettings) -> str:
    v = _jmp_args(s)
    return (
        f"jmp.DynamicLossScale(jnp.float32({config_number(s.init_scale)}), period={s.steps_per_increase}, "
        f"factor={config_number(s.growth_factor)}, min_loss_scale=jnp.float32({config_number(v['min_loss_scale'])}))"
    )


def _field_peer(
    name: str,
    grid: dict[str, tuple[Any, ...]],
    own: Callable[[ScalerSettings], dict[str, Any]],
    system: str,
    write: Callable[[ScalerSettings], str | None],
) -> PolicyKind:
    """A row for one of the field's peers: its own arguments and defaults from ``dls.policy.PEERS`` (a starting
    state such as jmp's ``counter`` is not a policy's), its dls line, and its own (``system``, ``write``)."""
    row = PEERS[name]
    defaults = {k: v for k, v in row.defaults.items() if k not in row.state_arguments}
    return PolicyKind(
        name,
        row.summary,
        defaults,
        lambda v, half: _like(name, v, half),
        grid,
        dls_line=_like_line(name, own),
        system=system,
        line=_own_line(name, write),
    )


POWERS = tuple(2.0**k for k in (8, 12, 16, 20, 24))
INTERVALS = (100, 250, 500, 1000, 2000)
FIELD_PEERS = (
    _field_peer(
        "keras",
        {"initial_scale": POWERS, "dynamic_growth_steps": INTERVALS},
        _keras_args,
        "Keras",
        lambda s: f"keras.optimizers.LossScaleOptimizer(optimizer, {_args(_keras_args(s))})",
    ),
    _field_peer(
        "apex",
        {"init_scale": POWERS, "scale_window": INTERVALS},
        _apex_args,
        "Apex",
        lambda s: f'apex.amp.scaler.LossScaler("dynamic", {_args(_apex_args(s))})',
    ),
    _field_peer(
        "apex_fp16_utils",
        {"init_scale": (2.0**16, 2.0**24, 2.0**32), "scale_window": (250, 500, 1000)},
        _apex_fp16_utils_args,
        "Apex fp16_utils",
        lambda s: f"apex.fp16_utils.DynamicLossScaler({_args(_apex_fp16_utils_args(s))})",
    ),
    _field_peer(
        "fairseq",
        {"init_scale": (2.0**7, 2.0**15), "scale_window": (128, 512, 2000), "tolerance": (0.0, 0.05, 0.25)},
        _fairseq_args,
        "fairseq flags",
        _fairseq_flags,
    ),
    _field_peer(
        "mxnet", {}, lambda s: {}, "MXNet", lambda s: "amp.init(); amp.init_trainer(trainer)  # LossScaler() takes none"
    ),
    _field_peer(
        "colossalai",
        {"initial_scale": (2.0**16, 2.0**24, 2.0**32), "growth_interval": (250, 500, 1000), "hysteresis": (1, 2, 4)},
        _colossalai_args,
        "ColossalAI",
        lambda s: f"DynamicGradScaler({_args(_colossalai_args(s))})",
    ),
    _field_peer("jmp", {"loss_scale": POWERS, "period": INTERVALS}, _jmp_args, "jmp", _jmp_line),
)
POLICIES: dict[str, PolicyKind] = {
    k.name: k
    for k in (
        PolicyKind(
            "torch",
            "torch.amp.GradScaler: grow x2 after growth_interval clean steps, halve on overflow, no floor",
            {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000},
            _torch,
            {"init_scale": POWERS, "growth_interval": (100, 250, 500, 1000, 2000)},
            {"steps_per_increase": "growth_interval"},
            _torch_dls,
            "torch.amp",
            _torch_amp,
        ),
        PolicyKind(
            "cerebras",
            "cstorch.amp.GradScaler: ceiling 2**15 (2**31 for cbfloat16), floor 2**-14, overflow tolerance",
            {
                "init_scale": None,
                "steps_per_increase": 2000,
                "min_loss_scale": 2.0**-14,
                "max_loss_scale": None,
                "overflow_tolerance": 0.0,
            },
            _cerebras,
            {"steps_per_increase": (100, 250, 500, 1000, 2000), "overflow_tolerance": (0.0, 0.01, 0.05)},
            dls_line=_cerebras_dls,
            system="Model Zoo YAML",
            line=_model_zoo_yaml,
        ),
        PolicyKind(
            "megatron",
            "Megatron-LM's DynamicGradScaler: start 2**32, hysteresis 2, floor 1, grow after 1000 clean steps",
            {
                "initial_scale": 2.0**32,
                "min_scale": 1.0,
                "growth_factor": 2.0,
                "backoff_factor": 0.5,
                "growth_interval": 1000,
                "hysteresis": 2,
            },
            _megatron,
            {
                "initial_scale": (2.0**16, 2.0**24, 2.0**32),
                "growth_interval": (250, 500, 1000),
                "hysteresis": (1, 2, 4),
            },
            dls_line=_megatron_dls,
            system="Megatron flags",
            line=_megatron_flags,
        ),
        PolicyKind(
            "deepspeed",
            "DeepSpeed's DynamicLossScaler: 2**16, window 1000 (first growth after 1001), hysteresis 2, floor 1",
            {
                "initial_scale_power": 16,
                "loss_scale_window": 1000,
                "hysteresis": 2,
                "consecutive_hysteresis": False,
                "min_loss_scale": 1.0,
            },
            _deepspeed,
            {"initial_scale_power": (12, 16, 24, 32), "loss_scale_window": (250, 500, 1000), "hysteresis": (1, 2, 4)},
            dls_line=_deepspeed_dls,
            system="DeepSpeed JSON",
            line=_deepspeed_json,
        ),
        *FIELD_PEERS,
        PolicyKind(
            "static",
            "a fixed scale: overflowing steps are skipped, the scale never moves",
            {"loss_scale": 2.0**16},
            _static,
            {"loss_scale": POWERS},
            dls_line=_static_dls,
        ),
    )
}


def config_lines(settings: ScalerSettings) -> dict[str, str]:
    """The lines that configure ``settings``' rule in each system that can express it exactly: ``dls``, then each
    peer's own (``PolicyKind.system``: ``torch.amp``, ``Model Zoo YAML`` with dls's trainer and cstorch's keys,
    ``Megatron flags``, ``DeepSpeed JSON``); a system that cannot express it is left out.

    Args:
        settings: the rule to configure.
    """
    out: dict[str, str] = {}
    for kind in POLICIES.values():
        if (line := kind.dls_line(settings)) is not None:
            out["dls"] = line
            break
    for kind in POLICIES.values():
        if kind.system is not None and (line := kind.line(settings)) is not None:
            out[kind.system] = line
    return out


# ------------------------------------------------------------------------------------------------ a policy, parsed
@dataclass(frozen=True)
class Policy:
    """A policy to replay: ``spec`` as given, its ``kind`` (a ``POLICIES`` name or ``"recorded"``), the
    ``values`` of its arguments (defaults overridden) and the ``settings`` they build. ``state``: where the
    ``recorded`` policy starts (the trace's first header); other policies start fresh."""

    spec: str
    kind: str
    values: dict[str, Any]
    settings: ScalerSettings
    state: dict[str, Any] | None = None


# ASCII digits only (``\d`` would take every script's digits), and few of them: a value is a setting, not a number
# Python would need seconds, or a 4,300-digit error, to convert
_NUMBER = re.compile(r"^[+-]?([0-9]{1,20}(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]{1,5})?$")
_POWER = re.compile(r"^2\*\*([+-]?[0-9]{1,5})$")
_INTEGER = re.compile(r"^[+-]?[0-9]+$")


def _parse_value(text: str) -> Any:
    """``true``/``false``, an integer, a float, or ``2**k``."""
    t = text.strip()
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    if m := _POWER.match(t):
        k = int(m.group(1))
        if k > 1023:
            raise ValueError(f"{shown(t)} is past a float's range (2**1023 at most)")
        return 2**k if 0 <= k < 63 else 2.0**k
    if _NUMBER.match(t):
        return int(t) if _INTEGER.match(t) else float(t)
    raise ValueError(f"{shown(text)} is not a number (an integer, a float such as 1e-3, or 2**k) nor true/false")


def parse_policy(spec: str, trace: Trace | None = None, half_dtype: str | None = None) -> Policy:
    """The policy ``spec`` names: ``NAME`` or ``NAME:key=value,key=value`` with NAME from ``POLICIES`` or
    ``recorded`` (the trace's own settings and starting state; needs ``trace``).

    Args:
        spec: the policy as written, e.g. ``"torch"`` or ``"cerebras:steps_per_increase=500"``.
        trace: the trace, for ``recorded`` and for the half dtype.
        half_dtype: the format whose defaults apply (default: the trace's, else float16).

    Raises:
        ValueError: an unknown name or key (with the allowed ones), a key given twice, a value that is not a
            number, or settings the peer's constructor refuses; every message names the policy and the key.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a policy must be a name such as 'torch' or 'cerebras:steps_per_increase=500'; got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip()
    half = half_dtype or (trace.half_dtype if trace is not None else "float16")
    allowed = [*POLICIES, RECORDED]
    if name == RECORDED:
        if rest.strip():
            raise ValueError(
                f"policy 'recorded' takes no settings (it is the recorded run's own); got {shown(spec.strip())}"
            )
        if trace is None:
            raise ValueError("policy 'recorded' needs a trace: it replays the recorded run's own settings")
        header = trace.segments[0].header
        return Policy(spec, RECORDED, {}, recorded_settings(header), dict(header.get("state") or {}))
    if name not in POLICIES:
        close = difflib.get_close_matches(name, allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown policy {shown(name)}{hint}; allowed: {', '.join(allowed)}")
    kind = POLICIES[name]
    values = dict(kind.defaults)
    given: set[str] = set()
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq:
            raise ValueError(
                f"policy {name!r}: {shown(item)} is not key=value (e.g. {name}:{next(iter(kind.defaults), 'key')}=...)"
            )
        if key not in kind.defaults:
            close = difflib.get_close_matches(key, list(kind.defaults), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"policy {name!r} has no key {shown(key)}{hint}; allowed: {', '.join(kind.defaults)}")
        if key in given:
            raise ValueError(f"policy {name!r}: key {key!r} is given twice; give each key once")
        given.add(key)
        try:
            values[key] = _parse_value(text)
        except ValueError as exc:
            raise ValueError(f"policy {name!r}, key {key!r}: {exc}") from None
    return Policy(spec, name, values, _build(kind, values, half))


def buildable(spec: str, trace: Trace) -> bool:
    """Whether ``parse_policy`` builds ``spec`` for ``trace`` (the defaults of ``dls replay`` and ``dls tune``
    are the policies this dls can build).

    Args:
        spec: a policy spec.
        trace: the trace.
    """
    try:
        parse_policy(spec, trace)
    except ValueError:
        return False
    return True


def _build(kind: PolicyKind, values: dict[str, Any], half: str) -> ScalerSettings:
    try:
        return kind.build(values, half)
    except SettingsError as exc:
        problems = "; ".join(
            message.replace(argument, kind.labels[argument], 1) if argument in kind.labels else message
            for argument, message in exc.problems
        )
        raise ValueError(f"policy {kind.name!r}: {problems}") from None
    except ValueError as exc:
        raise ValueError(f"policy {kind.name!r}: {exc}") from None


def recorded_settings(header: dict[str, Any]) -> ScalerSettings:
    """The settings of the ``recorded`` policy in the segment of ``header`` (``dls.diagnostics.trace.settings_of``).

    Args:
        header: a trace's header line.

    Raises:
        ValueError: settings this dls cannot build (``read_trace`` has refused such a trace already).
    """
    try:
        return settings_of(header)
    except ValueError as exc:
        raise ValueError(f"the trace's settings cannot be read by this dls: {exc}") from None
