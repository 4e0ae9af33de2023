"""``checkpoint_<step>.mdl``: Model Zoo's state names plus ``rng``, ``config``, ``trainer``, ``fp8``, ``format_version``
(1: the LR schedule counted skipped steps; 2: applied steps only); written atomically, the last N kept
(:meth:`dls.train.rundir.RunDir.save_checkpoint`). Bytes that do not parse are *unreadable* (skipped when resuming a
directory); a file that parses but may not load is refused. :func:`restore` loads one into a trainer."""

from __future__ import annotations

import contextlib
import math
import os
import random
import re
import stat
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

import dls.fp8
from dls.diagnostics.scales import pow2
from dls.scaler_state import parse_state_dict
from dls.train.config import (
    CHECKPOINT_STATES,
    SCALER_KEYS,
    TrainConfig,
    loss_scaling_mode,
    parse_config,
    scaler_settings,
)
from dls.train.errors import CheckpointError, ConfigError
from dls.train.reporting import describe_scaling

FORMAT = "dls-checkpoint"
FORMAT_VERSION = 2
_NAME_RE = re.compile(r"^checkpoint_(\d+)\.mdl$")


class UnreadableCheckpoint(CheckpointError):
    """A checkpoint file whose bytes do not parse."""


def checkpoint_path(model_dir: str | Path, step: int) -> Path:
    return Path(model_dir) / f"checkpoint_{step}.mdl"


def checkpoint_step(name: str) -> int:
    """The step of a checkpoint's file name; -1 for any other name."""
    match = _NAME_RE.match(name)
    return int(match.group(1)) if match else -1


def list_checkpoints(model_dir: str | Path, dir_fd: int | None = None) -> list[tuple[int, Path]]:
    """``(step, path)`` of every checkpoint in ``model_dir`` (read through its descriptor ``dir_fd`` if given), oldest
    first. A symbolic link under a checkpoint's name is not one (it may point at another run's file): never resumed
    from, replaced when that step is written."""
    directory, found = Path(model_dir), []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for name in os.listdir(directory if dir_fd is None else dir_fd):
            with contextlib.suppress(OSError):  # gone meanwhile: none
                info = os.stat(name if dir_fd is not None else directory / name, dir_fd=dir_fd, follow_symlinks=False)
                if (step := checkpoint_step(name)) >= 0 and stat.S_ISREG(info.st_mode):
                    found.append((step, directory / name))
    return sorted(found)


def load_resume_checkpoint(
    path: str | Path, what: str = "--resume"
) -> tuple[Path, dict[str, Any], list[tuple[Path, str]]]:
    """``(file, state, unreadable)``: the file ``path``, or the newest readable checkpoint of the directory
    ``path`` and the newer ones that could not be read, each with the reason. ``what``: where ``path`` came from
    (``--resume`` or the config key), named in errors."""
    p = Path(path)
    if p.is_file():
        return p, load_checkpoint(p), []
    if not p.exists():
        raise CheckpointError(f"{what}: {p} does not exist")
    if not (found := list_checkpoints(p)):
        raise CheckpointError(f"{what}: no checkpoint_<step>.mdl files in {p}")
    unreadable: list[tuple[Path, str]] = []
    for _, candidate in reversed(found):
        try:
            return candidate, load_checkpoint(candidate), unreadable
        except UnreadableCheckpoint as exc:
            unreadable.append((candidate, str(exc)))
    raise CheckpointError(f"{what}: no readable checkpoint in {p}: " + "; ".join(reason for _, reason in unreadable))


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint onto the CPU (no code runs); :class:`UnreadableCheckpoint` or :class:`CheckpointError`."""
    p = Path(path)
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols on stderr; the error says it all
            warnings.simplefilter("ignore")
            state = torch.load(p, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {p} does not exist") from None
    except IsADirectoryError:
        raise CheckpointError(f"checkpoint {p} is a directory") from None
    except Exception as exc:  # one line, not torch's paragraphs of weights_only advice (which do not apply)
        text = str(exc)
        if found := re.search(r"WeightsUnpickler error:\s*(.+?)\s*(?:Check the documentation|$)", text, re.S):
            text = f"not a checkpoint of tensors and plain data ({found.group(1)})"
        reason = type(exc).__name__ + (f": {' '.join(text.split())}" if text.strip() else "")
        raise UnreadableCheckpoint(f"cannot read checkpoint {p}: {reason}") from None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{p} is not a dls training checkpoint (no 'model' state)")
    version = state.get("format_version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CheckpointError(f"{p} has an invalid format_version {version!r}")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{p} has checkpoint format version {version}; this dls reads versions 1 to {FORMAT_VERSION} (a newer "
            "dls wrote it: resume it with that dls; nothing was changed)"
        )
    return state


def rng_state() -> dict[str, Any]:
    """The state of torch's (CPU and CUDA), Python's and NumPy's global generators, as plain data."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------- restoring a checkpoint into a trainer
# The settings of the dynamic rule (ScalerSettings attribute -> config key), compared on resume.
_SETTING_KEYS = {arg: key for key, arg in SCALER_KEYS.items() if arg not in ("loss_scale", "max_gradient_norm")}
# Per-parameter state every optimizer family needs once it has stepped.
_REQUIRED_STATE = {"SGD": ("momentum_buffer",), "Adam": ("step", "exp_avg", "exp_avg_sq")}
_LOAD_ERRORS = (ValueError, KeyError, RuntimeError, TypeError, AttributeError, IndexError, OverflowError)


def restore(trainer: Any, path: Path, state: dict[str, Any], states: Sequence[str]) -> None:
    """Load ``states`` of the checkpoint ``state`` (read from ``path``) into ``trainer`` (a ``Trainer``), every field
    checked before use; a field that does not fit raises :class:`CheckpointError` naming it and the file. The config
    defines the loss scaler's mode and settings; the checkpoint contributes only its dynamic state, each difference
    logged."""
    trainer.log(f"Loading {path} (step {state.get('global_step', '?')}): {', '.join(states)}")
    if fresh := [s for s in CHECKPOINT_STATES if s not in states]:
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
        if broken := [k for k, v in saved.items() if k in weights and not _finite(v)]:
            raise CheckpointError(
                f"the model in {path} holds inf/NaN values ({', '.join(map(str, broken[:4]))}): resume from an "
                "earlier checkpoint"
            )
        try:
            trainer.model.load_state_dict(
                state["model"], strict=not trainer.cfg.runconfig.disable_strict_checkpoint_loading
            )
        except _LOAD_ERRORS as exc:
            first = (str(exc).strip().splitlines() or [str(exc)])[0]
            raise CheckpointError(
                f"the model in {path} does not fit model: in this config ({first}); resume with the config the "
                "checkpoint was trained with"
            ) from None
        fp8, handle = state.get("fp8"), trainer.fp8  # loads with the model when its recipe is the config's
        if handle is None and fp8 is not None:
            trainer.log(f"the fp8 state in {path} is not used: this config has no precision.fp8")
        elif handle is not None and fp8 is None:
            trainer.log(f"{path} has no fp8 state (a run without precision.fp8 wrote it); FP8 scaling starts fresh")
        elif handle is not None and fp8 is not None:
            try:
                then = dls.fp8.recipe_from_dict(fp8["recipe"])
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"the fp8 state in {path} names no valid recipe: {exc}") from None
            if then != handle.recipe:
                trainer.log(
                    f"the fp8 state in {path} is for {then!r}; the config's recipe {handle.recipe!r} starts fresh"
                )
            else:
                try:
                    handle.load_state_dict(fp8)
                except (ValueError, TypeError, RuntimeError) as exc:
                    raise CheckpointError(f"cannot load the fp8 state of {path}: {exc}") from None
    saved_cfg = state.get("config")
    try:
        saved_cfg = parse_config(saved_cfg) if isinstance(saved_cfg, dict) else None
    except ConfigError:
        saved_cfg = None
    targets = {"optimizer": trainer.optimizer, "lr_scheduler": trainer.scheduler, "dataloader": trainer.batches}
    for key, target in targets.items():
        if key in states and key not in state:
            trainer.log(f"{path} has no {key} state; {key} starts fresh")
        elif key in states:
            if key == "optimizer":
                _check_optimizer(state[key], trainer, saved_cfg, path)
            try:
                if key == "lr_scheduler":
                    _check_scheduler(state[key], len(trainer.optimizer.param_groups))
                target.load_state_dict(state[key])
            except _LOAD_ERRORS as exc:
                raise CheckpointError(f"cannot load the {key} state of {path}: {exc}") from None
            if key == "lr_scheduler" and state.get("format_version", 1) == 1:
                trainer.log(
                    f"{path} has checkpoint format 1, whose LR schedule advanced on skipped steps too: it goes on "
                    f"from its position ({state[key]['last_epoch']} steps) and from now on advances on applied steps "
                    "only"
                )
    if "grad_scaler" in states:
        _restore_scaler(trainer, path, state.get("grad_scaler"), saved_cfg)
    if "global_step" in states:
        trainer.global_step, trainer.elapsed, trainer.overflows_at_floor = step, float(elapsed), floor
    if "rng" in states:  # last: building the run above must not consume the restored RNG
        rng_ranks = state.get("rng_ranks")
        try:
            if trainer.world_size > 1 and isinstance(rng_ranks, list) and len(rng_ranks) == trainer.world_size:
                _set_rng_state(rng_ranks[trainer.rank])  # saved by as many ranks: each its own
            elif "rng" in state:
                _set_rng_state(state["rng"])  # rank 0's
                if trainer.rank > 0:  # saved by fewer ranks: a stream of its own, not a copy of rank 0's
                    seed_everything(trainer.cfg.runconfig.seed + trainer.rank + 1_000_003 * trainer.global_step)
            else:
                trainer.log(f"{path} has no rng state; random-number generators start from runconfig.seed")
        except _LOAD_ERRORS as exc:
            raise CheckpointError(f"cannot restore the random-number generators (rng) of {path}: {exc}") from None


def _count(value: Any, what: str, path: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise CheckpointError(f"{what} in {path} must be an integer >= 0; got {value!r}")
    return value


def _finite(value: Any) -> bool:
    """Whether every number and floating-point tensor in ``value`` (nested in lists, tuples, dicts) is finite."""
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple, dict)):
        return all(_finite(v) for v in (value.values() if isinstance(value, dict) else value))
    return True


def _check_optimizer(saved: Any, trainer: Any, saved_cfg: TrainConfig | None, path: Path) -> None:
    """What torch's ``load_state_dict`` does not check: the optimizer family, finite values and hyperparameters, each
    parameter's state of its shape and a floating dtype, ``step`` a count >= 0, the state the family needs once it
    has stepped. A state that does not fit raises :class:`CheckpointError` naming the field and the file."""
    groups, entries = (saved.get("param_groups"), saved.get("state")) if isinstance(saved, dict) else (None, None)
    if not isinstance(groups, list) or not isinstance(entries, dict) or not all(isinstance(g, dict) for g in groups):
        raise CheckpointError(f"the optimizer state in {path} is not an optimizer state dict (state, param_groups)")
    now = trainer.cfg.optimizer.optimizer_type
    # SGD groups have 'momentum', Adam/AdamW groups 'betas': a state of the other family breaks the first step.
    then = saved_cfg.optimizer.optimizer_type if saved_cfg is not None else None
    guessed = "Adam" if all("betas" in g for g in groups) else "SGD"  # from its groups, without a readable config
    family, family_then = ("SGD" if name == "SGD" else "Adam" for name in (now, then or guessed))
    if family_then != family:
        raise CheckpointError(
            f"the optimizer state in {path} is {then or family_then}'s and optimizer.optimizer_type is {now} now: "
            "resume without it (--load_checkpoint_states with every state but optimizer; in the run's own "
            "directory keep global_step) or with the checkpoint's optimizer_type"
        )
    now_groups = trainer.optimizer.param_groups
    if len(groups) != len(now_groups):
        raise CheckpointError(
            f"the optimizer state in {path} has {len(groups)} param groups; this run has {len(now_groups)}"
        )
    params: dict[Any, tuple[torch.Tensor, dict[str, Any]]] = {}
    for g, (group, now_group) in enumerate(zip(groups, now_groups)):
        ids = group.get("params")
        if not isinstance(ids, list) or len(ids) != len(now_group["params"]):
            raise CheckpointError(f"optimizer.param_groups[{g}].params in {path} does not fit this run's model")
        if bad := [k for k, v in group.items() if k != "params" and not _finite(v)]:
            raise CheckpointError(
                f"optimizer.param_groups[{g}].{bad[0]} in {path} must be finite; got {group[bad[0]]!r}"
            )
        params.update((i, (p, now_group)) for i, p in zip(ids, now_group["params"]))
    for index, entry in entries.items():
        field = f"optimizer.state[{index!r}]"
        if index not in params or not isinstance(entry, dict):
            raise CheckpointError(f"{field} in {path} is not the state of a parameter of this run's optimizer")
        param, group = params[index]
        required = [k for k in _REQUIRED_STATE[family] if k != "momentum_buffer" or group["momentum"]]
        if missing := [k for k in required if k not in entry]:
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


def _check_scheduler(saved: Any, num_groups: int) -> None:
    """A ``ValueError`` naming the first field of the LR schedule's state that is not what ``LambdaLR`` wrote."""
    if not isinstance(saved, dict):
        raise ValueError(f"a mapping is expected; got {type(saved).__name__}")
    last = saved.get("last_epoch")
    if isinstance(last, bool) or not isinstance(last, int) or not -1 <= last < 2**63:
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


def _restore_scaler(trainer: Any, path: Path, saved: Any, saved_cfg: TrainConfig | None) -> None:
    """Load the part of a checkpoint's ``grad_scaler`` state that this run uses, logging each difference between the
    checkpoint's scaling (``saved_cfg``; ``None`` when unreadable) and the config's. Static to dynamic starts from the
    config's initial scale, dynamic to static uses the config's; skipped steps carry over."""
    cfg, scaler, log = trainer.cfg, trainer.scaler, trainer.log
    if not scaler.is_enabled() or not saved:
        if saved:
            log(f"the grad_scaler state in {path} is not used: this config has no loss scaling")
        elif scaler.is_enabled():
            log(
                f"{path} has no grad_scaler state (it was saved by a run without loss scaling); using the loss scaler "
                f"built from the config: {describe_scaling(cfg)}"
            )
        return
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
    if then is None:
        log(f"the config saved in {path} is unreadable: its loss-scaling settings are not compared")
    if then is not None and then_mode != now_mode:
        skipped = f"{values.get('num_skipped_steps', 0)} skipped steps carried over"
        log(
            f"loss scaling: static {pow2(then.init_scale)} in the checkpoint, dynamic now: the scale starts from "
            f"the config's initial scale {pow2(now.init_scale)}; {skipped}"
            if now_mode == "dynamic"
            else f"loss scaling: dynamic in the checkpoint (scale {shown}), static {pow2(now.init_scale)} now: "
            f"the config's static scale is used; {skipped}"
        )
        values = {k: values[k] for k in ("num_skipped_steps",) if k in values}
    elif now_mode == "static":
        values.pop("loss_scale", None)  # a static scale is the config's
        if then is not None and then.init_scale != now.init_scale:
            old, new = pow2(then.init_scale), pow2(now.init_scale)
            log(f"static loss scale: {old} in the checkpoint, {new} now: {new} is used")
    else:
        for attribute, config_key in _SETTING_KEYS.items():
            before, after = (getattr(then, attribute, None), getattr(now, attribute, None)) if then else (0, 0)
            if before != after:
                log(
                    f"optimizer.initial_loss_scale: {before} in the checkpoint's config, {after} now: not used, the "
                    f"scale continues from the checkpoint's ({shown})"
                    if attribute == "init_scale"
                    else f"optimizer.{config_key}: {before:g} in the checkpoint's config, {after:g} now: {after:g} is "
                    "used"
                )
        if loaded.clamped is not None:
            low, high, clamped = now.min_loss_scale, now.max_loss_scale, values["loss_scale"]
            bound = "optimizer.max_loss_scale" if clamped == high else "optimizer.min_loss_scale"
            log(
                f"the checkpoint's loss scale {pow2(loaded.clamped)} is outside [{pow2(low)}, {pow2(high)}]: it "
                f"continues at {bound} ({pow2(clamped)})"
            )
    if values:
        try:
            scaler.load_state_dict(values)
        except (ValueError, RuntimeError, TypeError, OverflowError) as exc:
            raise CheckpointError(f"cannot load the grad_scaler state of {path}: {exc}") from None
