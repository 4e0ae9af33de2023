"""Loading a checkpoint into a trainer (:func:`restore`), every field checked before use. The config defines the
loss scaler's mode and settings; the checkpoint contributes only its dynamic state, each difference logged."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dls.diagnostics.scales import pow2
from dls.scaler_state import parse_state_dict
from dls.train import checkpoint as ckpt
from dls.train import config
from dls.train.config import CHECKPOINT_STATES, TrainConfig, loss_scaling_mode, parse_config, scaler_settings
from dls.train.errors import CheckpointError, ConfigError

# The settings of the dynamic rule (ScalerSettings attribute -> config key), compared on resume.
_SETTING_KEYS = {arg: key for key, arg in config.SCALER_KEYS.items() if arg not in ("loss_scale", "max_gradient_norm")}
# Per-parameter state every optimizer family needs once it has stepped.
_REQUIRED_STATE = {"SGD": ("momentum_buffer",), "Adam": ("step", "exp_avg", "exp_avg_sq")}
_INT64_MAX = 2**63 - 1
_LOAD_ERRORS = (ValueError, KeyError, RuntimeError, TypeError, AttributeError, IndexError, OverflowError)


def restore(trainer: Any, path: Path, state: dict[str, Any], states: Sequence[str]) -> None:
    """Load ``states`` of the checkpoint ``state`` (read from ``path``) into ``trainer`` (a ``Trainer``); a field
    that does not fit raises :class:`CheckpointError` naming it and the file."""
    trainer.log(f"Loading {path} (step {state.get('global_step', '?')}): {', '.join(states)}")
    fresh = [s for s in CHECKPOINT_STATES if s not in states]
    if fresh:
        trainer.log(f"Not loaded (fresh from the config): {', '.join(fresh)}")
    if "global_step" in states:  # checked first: it is what a bad file most often gets wrong
        step = _count(state.get("global_step", 0), "global_step", path)
        extra = state.get("trainer", {})
        if not isinstance(extra, dict):
            raise CheckpointError(f"the trainer state in {path} must be a mapping; got {type(extra).__name__}")
        elapsed = extra.get("elapsed", 0.0)
        if isinstance(elapsed, bool) or not isinstance(elapsed, (int, float)) or not 0 <= elapsed < math.inf:
            raise CheckpointError(f"trainer.elapsed in {path} must be a number of seconds >= 0; got {elapsed!r}")
        floor = _count(extra.get("overflows_at_floor", 0), "trainer.overflows_at_floor", path)
    if "model" in states:
        weights = {n for n, _ in trainer.model.named_parameters()}  # buffers may hold inf by design (masks)
        saved = state["model"] if isinstance(state["model"], dict) else {}
        broken = [k for k, v in saved.items() if k in weights and not _finite(v)]
        if broken:
            raise CheckpointError(
                f"the model in {path} holds inf/NaN values ({', '.join(map(str, broken[:4]))}): resume from an "
                "earlier checkpoint"
            )
        try:
            strict = not trainer.cfg.runconfig.disable_strict_checkpoint_loading
            trainer.model.load_state_dict(state["model"], strict=strict)
        except _LOAD_ERRORS as exc:
            first = (str(exc).strip().splitlines() or [str(exc)])[0]
            raise CheckpointError(
                f"the model in {path} does not fit model: in this config ({first}); resume with the config the "
                "checkpoint was trained with"
            ) from None
        _restore_fp8(trainer, path, state.get("fp8"))
    saved_cfg = _saved_config(state)
    targets = {"optimizer": None, "lr_scheduler": trainer.scheduler, "dataloader": trainer.batches}
    for key, target in targets.items():
        if key not in states:
            continue
        if key not in state:
            trainer.log(f"{path} has no {key} state; {key} starts fresh")
        elif key == "optimizer":
            _load_optimizer(trainer, path, state[key], saved_cfg)
        else:
            try:
                if key == "lr_scheduler":
                    _check_scheduler(state[key], len(trainer.optimizer.param_groups))
                target.load_state_dict(state[key])
            except _LOAD_ERRORS as exc:
                raise CheckpointError(f"cannot load the {key} state of {path}: {exc}") from None
            if key == "lr_scheduler" and ckpt.format_version(state) == 1:
                trainer.log(
                    f"{path} has checkpoint format 1, whose LR schedule advanced on skipped steps too: it goes on "
                    f"from its position ({state[key]['last_epoch']} steps) and from now on advances on applied steps "
                    "only"
                )
    if "grad_scaler" in states:
        _restore_scaler(trainer, path, state.get("grad_scaler"), saved_cfg)
    if "global_step" in states:
        trainer.global_step, trainer.elapsed, trainer.floor.count = step, float(elapsed), floor
    if "rng" in states:
        _restore_rng(trainer, path, state)  # last: building the run above must not consume the restored RNG


def _restore_fp8(trainer: Any, path: Path, saved: Any) -> None:
    """FP8 state loads with the model when the checkpoint's recipe is the config's; else FP8 scaling starts fresh."""
    handle = trainer.fp8
    if handle is None:
        if saved is not None:
            trainer.log(f"the fp8 state in {path} is not used: this config has no precision.fp8")
        return
    if saved is None:
        trainer.log(f"{path} has no fp8 state (a run without precision.fp8 wrote it); FP8 scaling starts fresh")
        return
    from dls.fp8 import recipe_from_dict

    try:
        then = recipe_from_dict(saved["recipe"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"the fp8 state in {path} names no valid recipe: {exc}") from None
    if then != handle.recipe:
        trainer.log(f"the fp8 state in {path} is for {then!r}; the config's recipe {handle.recipe!r} starts fresh")
        return
    try:
        handle.load_state_dict(saved)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"cannot load the fp8 state of {path}: {exc}") from None


def _count(value: Any, what: str, path: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _INT64_MAX:
        raise CheckpointError(f"{what} in {path} must be an integer >= 0; got {value!r}")
    return value


def _saved_config(state: dict[str, Any]) -> TrainConfig | None:
    saved = state.get("config")
    try:
        return parse_config(saved) if isinstance(saved, dict) else None
    except ConfigError:
        return None


def _family(optimizer_type: str) -> str:
    return "SGD" if optimizer_type == "SGD" else "Adam"


def _load_optimizer(trainer: Any, path: Path, saved: Any, saved_cfg: TrainConfig | None) -> None:
    groups, state = (saved.get("param_groups"), saved.get("state")) if isinstance(saved, dict) else (None, None)
    if not isinstance(groups, list) or not isinstance(state, dict) or not all(isinstance(g, dict) for g in groups):
        raise CheckpointError(f"the optimizer state in {path} is not an optimizer state dict (state, param_groups)")
    now = trainer.cfg.optimizer.optimizer_type
    # SGD groups have 'momentum', Adam/AdamW groups 'betas': a state of the other family breaks the first step.
    then = saved_cfg.optimizer.optimizer_type if saved_cfg is not None else None
    family_then = _family(then) if then else ("Adam" if all("betas" in g for g in groups) else "SGD")
    if family_then != _family(now):
        raise CheckpointError(
            f"the optimizer state in {path} is {then or family_then}'s and optimizer.optimizer_type is {now} now: "
            "resume without it (--load_checkpoint_states with every state but optimizer; in the run's own "
            "directory keep global_step) or with the checkpoint's optimizer_type"
        )
    _check_optimizer_state(saved, trainer.optimizer, _REQUIRED_STATE[_family(now)], path)
    try:
        trainer.optimizer.load_state_dict(saved)
    except _LOAD_ERRORS as exc:
        raise CheckpointError(f"cannot load the optimizer state of {path}: {exc}") from None


def _check_optimizer_state(saved: dict[str, Any], optimizer: Any, required: Sequence[str], path: Path) -> None:
    """What torch's ``load_state_dict`` does not check: finite values and hyperparameters, each parameter's state
    of its shape and a floating dtype, ``step`` a count >= 0, the state the family needs once it has stepped."""
    groups, now_groups = saved["param_groups"], optimizer.param_groups
    if len(groups) != len(now_groups):
        raise CheckpointError(
            f"the optimizer state in {path} has {len(groups)} param groups; this run has {len(now_groups)}"
        )
    params: dict[Any, tuple[torch.Tensor, dict[str, Any]]] = {}
    for g, (then, group) in enumerate(zip(groups, now_groups)):
        ids = then.get("params")
        if not isinstance(ids, list) or len(ids) != len(group["params"]):
            raise CheckpointError(f"optimizer.param_groups[{g}].params in {path} does not fit this run's model")
        for key, value in then.items():
            if key != "params" and not _finite(value):
                raise CheckpointError(f"optimizer.param_groups[{g}].{key} in {path} must be finite; got {value!r}")
        params.update((i, (p, group)) for i, p in zip(ids, group["params"]))
    for index, entry in saved["state"].items():
        field = f"optimizer.state[{index!r}]"
        if index not in params or not isinstance(entry, dict):
            raise CheckpointError(f"{field} in {path} is not the state of a parameter of this run's optimizer")
        param, group = params[index]
        missing = [k for k in required if k not in entry and not (k == "momentum_buffer" and not group["momentum"])]
        if missing:
            raise CheckpointError(f"{field} in {path} lacks {', '.join(missing)}")
        for key, value in entry.items():
            if key == "step":
                count = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
                if isinstance(count, bool) or not isinstance(count, (int, float)) or not 0 <= count < math.inf:
                    raise CheckpointError(f"{field}.step in {path} must be a count >= 0; got {value!r}")
            elif isinstance(value, torch.Tensor) and (not value.is_floating_point() or value.shape != param.shape):
                raise CheckpointError(
                    f"{field}.{key} in {path} is a {value.dtype} tensor of shape {tuple(value.shape)}; this run's "
                    f"parameter needs a floating-point tensor of shape {tuple(param.shape)}"
                )
            if not _finite(value):
                raise CheckpointError(f"{field}.{key} in {path} holds inf/NaN values")
    if not _finite(saved.get("master_weights")):
        raise CheckpointError(f"the master weights (optimizer.master_weights) in {path} hold inf/NaN values")


def _finite(value: Any) -> bool:
    """Whether every number and floating-point tensor in ``value`` (nested in lists, tuples, dicts) is finite."""
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple, dict)):
        return all(_finite(v) for v in (value.values() if isinstance(value, dict) else value))
    return True


def _check_scheduler(saved: Any, num_groups: int) -> None:
    if not isinstance(saved, dict):
        raise ValueError(f"a mapping is expected; got {type(saved).__name__}")
    last = saved.get("last_epoch")
    if isinstance(last, bool) or not isinstance(last, int) or not -1 <= last <= _INT64_MAX:
        raise ValueError(f"last_epoch must be an integer >= -1; got {last!r}")
    for key in ("base_lrs", "_last_lr"):
        values = saved.get(key)
        if key == "_last_lr" and values is None:
            continue
        numbers = isinstance(values, list) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values
        )
        if not numbers or len(values or ()) != num_groups:
            raise ValueError(f"{key} must be a list of {num_groups} finite numbers; got {values!r}")


def _restore_rng(trainer: Any, path: Path, state: dict[str, Any]) -> None:
    rng_ranks = state.get("rng_ranks")
    try:
        if trainer.world_size > 1 and isinstance(rng_ranks, list) and len(rng_ranks) == trainer.world_size:
            ckpt.set_rng_state(rng_ranks[trainer.rank])  # saved by as many ranks: each its own
        elif "rng" in state:
            ckpt.set_rng_state(state["rng"])  # rank 0's
            if trainer.rank > 0:  # saved by fewer ranks: a stream of its own, not a copy of rank 0's
                ckpt.seed_everything(trainer.cfg.runconfig.seed + trainer.rank + 1_000_003 * trainer.global_step)
        else:
            trainer.log(f"{path} has no rng state; random-number generators start from runconfig.seed")
    except _LOAD_ERRORS as exc:
        raise CheckpointError(f"cannot restore the random-number generators (rng) of {path}: {exc}") from None


def _restore_scaler(trainer: Any, path: Path, saved: Any, saved_cfg: TrainConfig | None) -> None:
    scaler = trainer.scaler
    if not scaler.is_enabled():
        if saved:
            trainer.log(f"the grad_scaler state in {path} is not used: this config has no loss scaling")
        return
    if not saved:
        from dls.train.reporting import describe_scaling

        trainer.log(
            f"{path} has no grad_scaler state (it was saved by a run without loss scaling); "
            f"using the loss scaler built from the config: {describe_scaling(trainer.cfg)}"
        )
        return
    values, lines = scaler_state_to_load(saved, saved_cfg, trainer.cfg, path)
    for line in lines:
        trainer.log(line)
    if values:
        try:
            scaler.load_state_dict(values)
        except (ValueError, RuntimeError, TypeError, OverflowError) as exc:
            raise CheckpointError(f"cannot load the grad_scaler state of {path}: {exc}") from None


def scaler_state_to_load(
    saved: Any, saved_cfg: TrainConfig | None, cfg: TrainConfig, path: Path
) -> tuple[dict[str, Any], list[str]]:
    """The part of a checkpoint's ``grad_scaler`` state that a run of ``cfg`` loads, and one log line per
    difference between the checkpoint's scaling (``saved_cfg``; ``None`` when unreadable) and ``cfg``'s. Static to
    dynamic starts from the config's initial scale, dynamic to static uses the config's; skipped steps carry over."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"the grad_scaler state in {path} must be a mapping; got {type(saved).__name__}")
    now_mode, now = loss_scaling_mode(cfg), scaler_settings(cfg)
    try:  # the scaler's own parser: keys, torch's aliases, format versions, checks and the clamp into the bounds
        loaded = parse_state_dict(
            saved, now, apply_settings=False, own_names_first=True, label=lambda key: f"grad_scaler.{key} in {path}",
            extra=("kept_in_float32",),  # the float32 fallback's modules: checked by the scaler when it loads them
        )  # fmt: skip
    except (ValueError, RuntimeError) as exc:
        raise CheckpointError(str(exc)) from None
    values: dict[str, Any] = {**loaded.values, **loaded.extra}
    scale = loaded.clamped if loaded.clamped is not None else values.get("loss_scale")
    shown = "none" if scale is None else pow2(scale)
    then_mode = loss_scaling_mode(saved_cfg) if saved_cfg is not None else None
    then = scaler_settings(saved_cfg) if saved_cfg is not None and then_mode in ("static", "dynamic") else None
    unreadable = f"the config saved in {path} is unreadable: its loss-scaling settings are not compared"
    lines = [] if then is not None else [unreadable]
    if then is not None and then_mode != now_mode:
        skipped = f"{values.get('num_skipped_steps', 0)} skipped steps carried over"
        lines.append(
            f"loss scaling: static {pow2(then.init_scale)} in the checkpoint, dynamic now: the scale starts from "
            f"the config's initial scale {pow2(now.init_scale)}; {skipped}"
            if now_mode == "dynamic"
            else f"loss scaling: dynamic in the checkpoint (scale {shown}), static {pow2(now.init_scale)} now: "
            f"the config's static scale is used; {skipped}"
        )
        return {k: values[k] for k in ("num_skipped_steps",) if k in values}, lines
    if now_mode == "static":
        values.pop("loss_scale", None)  # a static scale is the config's
        if then is not None and then.init_scale != now.init_scale:
            old, new = pow2(then.init_scale), pow2(now.init_scale)
            lines.append(f"static loss scale: {old} in the checkpoint, {new} now: {new} is used")
        return values, lines
    for attribute, config_key in _SETTING_KEYS.items():
        before, after = (getattr(then, attribute, None), getattr(now, attribute, None)) if then else (0, 0)
        if before == after:
            continue
        lines.append(
            f"optimizer.initial_loss_scale: {before} in the checkpoint's config, {after} now: not used, the scale "
            f"continues from the checkpoint's ({shown})"
            if attribute == "init_scale"
            else f"optimizer.{config_key}: {before:g} in the checkpoint's config, {after:g} now: {after:g} is used"
        )
    if loaded.clamped is not None:
        low, high, clamped = now.min_loss_scale, now.max_loss_scale, values["loss_scale"]
        bound = "optimizer.max_loss_scale" if clamped == high else "optimizer.min_loss_scale"
        lines.append(
            f"the checkpoint's loss scale {pow2(loaded.clamped)} is outside [{pow2(low)}, {pow2(high)}]: it continues "
            f"at {bound} ({pow2(clamped)})"
        )
    return values, lines
