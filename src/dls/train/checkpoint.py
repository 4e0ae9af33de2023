"""The checkpoint format and loading one into a trainer. ``checkpoint_<step>.mdl`` (written into the run directory by
``dls.train.rundir``): a ``torch.save``-d dict of Model Zoo's state names plus ``rng``, ``config``, ``trainer``,
``fp8``, ``format_version`` (1: the LR schedule counted skipped steps; 2: applied steps only), loaded with
``weights_only=True``. Bytes that do not parse are *unreadable* (skipped when resuming a directory, then set aside);
a file that parses but may not load is refused, naming the field (:func:`load_checkpoint`: the format and the step;
:func:`restore`: each state, checked whole before it changes its part of the trainer)."""

from __future__ import annotations

import contextlib
import io
import math
import random
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

import dls.fp8
from dls.checks import shown
from dls.diagnostics.scales import pow2
from dls.optimizer_state import NON_FINITE, all_finite, check_optimizer_state, tensor_problem
from dls.scaler_state import parse_state_dict
from dls.train.config import (
    CHECKPOINT_STATES,
    SCALER_KEYS,
    loss_scaling_mode,
    parse_config,
    scaler_settings,
    step_once,
)
from dls.train.errors import CheckpointError, ConfigError, ModelDirError, is_out_of_memory
from dls.train.launch import free_memory
from dls.train.reporting import describe_scaling
from dls.train.rundir import RunDir, checkpoint_step, list_checkpoints, lock_holder

if TYPE_CHECKING:  # annotations only
    from dls.train.config import TrainConfig

FORMAT = "dls-checkpoint"
FORMAT_VERSION = 2


class UnreadableCheckpoint(CheckpointError):
    """A checkpoint file whose bytes do not parse."""


def load_resume_checkpoint(
    path: str | Path, what: str = "--resume"
) -> tuple[Path, dict[str, Any], list[tuple[Path, str]]]:
    """``(file, state, unreadable)``: the file ``path``, or the newest readable checkpoint of the directory
    ``path`` and the newer ones that could not be read, each with the reason. ``what``: where ``path`` came from
    (``--resume`` or the config key), named in errors."""
    if not str(path):  # Path("") would be the current directory
        raise CheckpointError(f"{what} is empty; give a model_dir or a checkpoint file")
    p = Path(path)
    if p.is_file():
        return p, load_checkpoint(p), []
    if not p.exists():
        raise CheckpointError(f"{what}: {p} does not exist")
    if not (found := list_checkpoints(p)):
        if (holder := lock_holder(p)) is not None:
            raise ModelDirError(
                f"{what}: {p} is in use by another dls run: {holder}, which has written no checkpoint yet. Wait for "
                "its first checkpoint (or for it to finish), or stop it"
            )
        raise CheckpointError(f"{what}: no checkpoint_<step>.mdl files in {p}")
    unreadable: list[tuple[Path, str]] = []
    for _, candidate in reversed(found):
        try:
            return candidate, load_checkpoint(candidate), unreadable
        except UnreadableCheckpoint as exc:
            unreadable.append((candidate, str(exc)))
    raise CheckpointError(f"{what}: no readable checkpoint in {p}: " + "; ".join(reason for _, reason in unreadable))


def _claims_more_than_it_holds(path: Path) -> bool:
    """Whether a checkpoint that ran the machine out of memory while read is far smaller than that memory: loading
    takes about a file's size, so its bytes asked for what they do not hold (a corrupt or crafted length)."""
    try:
        size = path.stat().st_size
    except OSError:
        return False
    free = free_memory()
    return free is not None and size * 4 < free


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint onto the CPU (no code runs); :class:`UnreadableCheckpoint` or :class:`CheckpointError`."""
    p = Path(path)
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols on stderr; the error says it all
            warnings.simplefilter("ignore")
            state = torch.load(p, map_location="cpu", weights_only=True)
    except (FileNotFoundError, IsADirectoryError) as exc:
        raise CheckpointError(f"checkpoint {p}: {exc.strerror}") from None
    except Exception as exc:  # one line, not torch's paragraphs of weights_only advice (which do not apply)
        # Python's MemoryError comes from the unpickler reading a length the bytes give (the tensors' storage is
        # torch's allocator, a RuntimeError): in a file far smaller than the memory, a corrupt or crafted length.
        crafted = isinstance(exc, MemoryError) and _claims_more_than_it_holds(p)
        if is_out_of_memory(exc) and not crafted:
            raise  # the machine's limit, not the file's bytes: never set aside as unreadable
        text = str(exc)
        if crafted:
            text = f"asks for more memory than the machine has, holding {p.stat().st_size:,} bytes"
        if found := re.search(r"WeightsUnpickler error:\s*(.+?)\s*(?:Check the documentation|$)", text, re.S):
            text = f"not a checkpoint of tensors and plain data ({found.group(1)})"
        reason = type(exc).__name__ + (f": {' '.join(text.split())}" if text.strip() else "")
        raise UnreadableCheckpoint(f"cannot read checkpoint {p}: {reason}") from None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{p} is not a dls training checkpoint (no 'model' state)")
    version = state.get("format_version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:  # no dls wrote it
        raise CheckpointError(
            f"{p} has format_version {shown(version)}; it must be an integer from 1 to {FORMAT_VERSION}"
        )
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{p} has checkpoint format version {version!r}; this dls reads versions 1 to {FORMAT_VERSION} (a higher "
            "one was written by a newer dls: resume it with that dls; nothing was changed)"
        )
    _check_step(p, state)
    return state


def _check_step(path: Path, state: dict[str, Any]) -> None:
    """A checkpoint's ``global_step`` is an integer >= 0 and, under a checkpoint's file name, the step that name
    says: a run resumed from it goes on from there, in place, and so never rewinds over its own checkpoints."""
    step, named = state.get("global_step"), checkpoint_step(path.name)
    said, refused = (
        f" (its file name says step {named})" if named >= 0 else "",
        f"cannot load the global_step state of {path}",
    )
    if "global_step" not in state:
        raise CheckpointError(f"{refused}: it holds no global_step{said}; nothing was changed")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**63:
        raise CheckpointError(f"{refused}: global_step must be an integer >= 0; got {shown(step)}{said}")
    if named >= 0 and step != named:
        raise CheckpointError(
            f"{refused}: global_step is {step}, but its file name says step {named}: a checkpoint is resumed only at "
            "the step it was saved at (nothing was changed)"
        )


def save_checkpoint(run_dir: RunDir, state: dict[str, Any], step: int, keep: int | None = None) -> Path:
    """``state`` with the format's header as ``checkpoint_<step>.mdl`` in ``run_dir`` (:meth:`RunDir.write_checkpoint`:
    atomically, the last ``keep`` kept); serialised in memory first, so that a failing write is the ``OSError`` it is,
    naming the file (``torch.save`` into a file makes it a ``RuntimeError``)."""
    buffer = io.BytesIO()
    torch.save({"format": FORMAT, "format_version": FORMAT_VERSION, **state}, buffer)
    return run_dir.write_checkpoint(step, buffer.getbuffer(), keep)


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
    torch.manual_seed(seed % 2**64)  # its limit (a rank's seed grows with the global step)


# ---------------------------------------------------------------------- restoring a checkpoint into a trainer
_LOAD_ERRORS = (ValueError, KeyError, RuntimeError, TypeError, AttributeError, IndexError, OverflowError)


def restore(trainer: Any, path: Path, state: dict[str, Any], states: Sequence[str]) -> None:
    """Load ``states`` of the checkpoint ``state`` (read from ``path``) into ``trainer`` (a ``Trainer``), one state
    after another in ``_RESTORERS``' order, each checked whole before it changes its part of the trainer: every
    field before it is used, every tensor after conversion to the dtype it is loaded into (:func:`tensor_problem`).
    A field that does not fit raises :class:`CheckpointError` naming it and the file. Nothing is written: the
    trainer writes into its model_dir only after this returns. The config defines the optimizer, the LR schedule
    and the loss scaler's mode and settings; the checkpoint contributes their state, each scaling difference
    logged."""
    log = trainer.log
    log(f"Loading {path} (step {state.get('global_step', '?')}): {', '.join(states)}")
    if fresh := [s for s in CHECKPOINT_STATES if s not in states]:
        log(f"Not loaded (fresh from the config): {', '.join(fresh)}")
    saved_cfg: TrainConfig | None = None  # when unreadable, the optimizer type and the scaling are not compared
    with contextlib.suppress(ConfigError):
        saved_cfg = parse_config(state["config"]) if isinstance(state.get("config"), dict) else None
    for key, load in _RESTORERS.items():
        if key in states and key in ("optimizer", "lr_scheduler", "dataloader") and key not in state:
            log(f"{path} has no {key} state; {key} starts fresh")
        elif key in states:
            with _loading(key, path):
                load(trainer, path, state, saved_cfg)


@contextlib.contextmanager
def _loading(key: str, path: Path) -> Iterator[None]:
    """An error while checking or loading the ``key`` state of ``path`` as a :class:`CheckpointError` naming both
    (running out of memory stays what it is: the machine's limit, exit 3)."""
    try:
        yield
    except CheckpointError:
        raise
    except _LOAD_ERRORS as exc:
        if is_out_of_memory(exc):
            raise
        raise CheckpointError(f"cannot load the {key} state of {path}: {exc}") from None


def _restore_step(trainer: Any, path: Path, state: dict[str, Any], saved_cfg: TrainConfig | None) -> None:
    """``global_step`` and the trainer's counters (first: what a bad file most often gets wrong, and the rng of more
    ranks uses it)."""
    step = _number(state["global_step"], "global_step")  # present: load_checkpoint checked it
    if not isinstance(extra := state.get("trainer", {}), dict):
        raise ValueError(f"trainer must be a mapping; got {type(extra).__name__}")
    elapsed = _number(extra.get("elapsed", 0.0), "trainer.elapsed", integer=False)
    at_floor = _number(extra.get("overflows_at_floor", 0), "trainer.overflows_at_floor")
    trainer.global_step, trainer.elapsed, trainer.overflows_at_floor = step, float(elapsed), at_floor


def _restore_model(trainer: Any, path: Path, state: dict[str, Any], saved_cfg: TrainConfig | None) -> None:
    """The model's weights and buffers, each tensor checked as it will be held (:func:`tensor_problem`: weights
    finite, buffers, which may hold inf by design (masks), not made inf by the conversion); then the FP8 state."""
    saved, model = state["model"], trainer.model
    unfit = f"the model in {path} does not fit model: in this config"
    if not isinstance(saved, dict):
        raise CheckpointError(
            f"{unfit} (it is a {type(saved).__name__}, not a state dict); resume with a dls checkpoint"
        )
    own, weights = model.state_dict(), {name for name, _ in model.named_parameters()}
    broken = []
    for key, value in saved.items():
        like = own.get(key)
        if not isinstance(like, torch.Tensor):  # not the model's (strict loading refuses it below) or extra state
            continue
        problem = tensor_problem(value, like, finite=key in weights, whose="this run's")
        if problem == NON_FINITE:
            broken.append(str(key))
        elif problem is not None:
            raise CheckpointError(
                f"{unfit}: model.{key} {problem}; resume with the config the checkpoint was trained with"
            )
    if broken:
        listed = ", ".join(broken[:4]) + (f" and {len(broken) - 4} more" if len(broken) > 4 else "")
        raise CheckpointError(f"the model in {path} holds inf/NaN values ({listed}): resume from an earlier checkpoint")
    try:
        model.load_state_dict(saved, strict=not trainer.cfg.runconfig.disable_strict_checkpoint_loading)
    except _LOAD_ERRORS as exc:
        raise CheckpointError(
            f"{unfit} ({_one_line(exc)}); resume with the config the checkpoint was trained with"
        ) from None
    fp8, handle, log = (
        state.get("fp8"),
        trainer.fp8,
        trainer.log,
    )  # loads with the model when its recipe is the config's
    if handle is None and fp8 is not None:
        log(f"the fp8 state in {path} is not used: this config has no precision.fp8")
    elif handle is not None and fp8 is None:
        log(f"{path} has no fp8 state (a run without precision.fp8 wrote it); FP8 scaling starts fresh")
    elif handle is not None and fp8 is not None:
        with _loading("fp8", path):
            if not isinstance(fp8, dict):
                raise ValueError(f"fp8 must be a mapping (recipe, modules); got {shown(fp8)}")
            if (then := dls.fp8.recipe_from_dict(fp8["recipe"])) == handle.recipe:
                handle.load_state_dict(fp8)
            else:
                log(f"the fp8 state in {path} is for {then!r}; the config's recipe {handle.recipe!r} starts fresh")


def _restore_optimizer(trainer: Any, path: Path, state: dict[str, Any], saved_cfg: TrainConfig | None) -> None:
    then = saved_cfg.optimizer.optimizer_type if saved_cfg else None
    trainer.optimizer.load_state_dict(_check_optimizer(state["optimizer"], trainer, then))


def _restore_scheduler(trainer: Any, path: Path, state: dict[str, Any], saved_cfg: TrainConfig | None) -> None:
    saved = state["lr_scheduler"]
    trainer.scheduler.load_state_dict(_check_scheduler(saved, trainer.scheduler, len(trainer.optimizer.param_groups)))
    if state.get("format_version", 1) == 1:
        trainer.log(
            f"{path} has checkpoint format 1, whose LR schedule advanced on skipped steps too: it goes on from "
            f"its position ({saved['last_epoch']} steps) and from now on advances on applied steps only"
        )


def _restore_dataloader(trainer: Any, path: Path, state: dict[str, Any], saved_cfg: TrainConfig | None) -> None:
    trainer.batches.load_state_dict(state["dataloader"])  # checked whole by the iterator before it changes


def _restore_grad_scaler(trainer: Any, path: Path, state: dict[str, Any], saved_cfg: TrainConfig | None) -> None:
    _restore_scaler(trainer, path, state.get("grad_scaler"), saved_cfg)


def _restore_rng(trainer: Any, path: Path, state: dict[str, Any], saved_cfg: TrainConfig | None) -> None:
    """Last: building the run must not consume the restored generators."""
    ranks: Any = state.get("rng_ranks")  # saved by as many ranks as now: each its own
    own = trainer.world_size > 1 and isinstance(ranks, list) and len(ranks) == trainer.world_size
    if not own and "rng" not in state:
        trainer.log(f"{path} has no rng state; random-number generators start from runconfig.seed")
        return
    set_rng_state(ranks[trainer.rank] if own else state["rng"], f"rng_ranks[{trainer.rank}]" if own else "rng")
    if trainer.rank > 0 and not own:  # saved by fewer ranks: a stream of its own, not a copy of rank 0's
        seed_everything(trainer.cfg.runconfig.seed + trainer.rank + 1_000_003 * trainer.global_step)


# What restore() loads, in its order.
_RESTORERS: dict[str, Callable[[Any, Path, dict[str, Any], TrainConfig | None], None]] = {
    "global_step": _restore_step,
    "model": _restore_model,
    "optimizer": _restore_optimizer,
    "lr_scheduler": _restore_scheduler,
    "dataloader": _restore_dataloader,
    "grad_scaler": _restore_grad_scaler,
    "rng": _restore_rng,
}


def set_rng_state(rng: Any, field: str = "rng") -> None:
    """Set the generators to ``rng`` (as :func:`rng_state` saved it; ``field`` names it in errors). A ``ValueError``
    names the first part that is not a state of its generator, and every generator is left as it was."""
    if not isinstance(rng, dict) or not {"torch", "python", "numpy"} <= set(rng):
        raise ValueError(f"{field} must be a mapping with torch, python and numpy generator states; got {shown(rng)}")
    before = rng_state()
    setters: dict[str, Callable[[Any], Any]] = {
        "torch": torch.set_rng_state,
        "python": lambda s: random.setstate((s[0], tuple(s[1]), s[2])),
        "numpy": np.random.set_state,  # as rng_state() saved it: numpy takes the keys as a list
        "cuda": torch.cuda.set_rng_state_all,
    }
    for key, setter in setters.items():
        if key not in rng or (key == "cuda" and not torch.cuda.is_available()):
            continue
        try:
            setter(rng[key])
        except _LOAD_ERRORS as exc:
            set_rng_state(before)
            raise ValueError(f"{field}.{key} is not a state of {key}'s generator ({_one_line(exc)})") from None


def _number(value: Any, what: str, integer: bool = True, low: int = 0) -> Any:
    """``value`` if it is an integer in [``low``, 2^63) (``integer``; else a finite number >= ``low``); else a
    ``ValueError`` naming ``what``."""
    limit = 2**63 if integer else sys.float_info.max  # compared exactly: a 400-digit integer is beyond both
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or not low <= value < limit:
        raise ValueError(f"{what} must be {'an integer' if integer else 'a number'} >= {low}; got {shown(value)}")
    return value


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:400] or type(exc).__name__


def _same_kind(value: Any, like: Any) -> bool:
    """Whether ``value`` is of ``like``'s kind: a number for a float, an integer for an integer (never a bool), a
    sequence of ``like``'s length item by item for a sequence, else the same type."""
    if isinstance(like, bool) or not isinstance(like, (int, float, list, tuple)):
        return type(value) is type(like)
    if isinstance(like, (list, tuple)):
        return isinstance(value, (list, tuple)) and len(value) == len(like) and all(map(_same_kind, value, like))
    return not isinstance(value, bool) and isinstance(value, int if isinstance(like, int) else (int, float))


def _check_optimizer(saved: Any, trainer: Any, then: str | None) -> dict[str, Any]:
    """The optimizer state dict to load, checked for what torch's ``load_state_dict`` does not check (it checks the
    group sizes, and MasterWeights its master weights, before changing anything): the optimizer family, each
    group's hyperparameters (:func:`_check_group`), each parameter's state by the core's rules
    (``dls.optimizer_state.check_optimizer_state``: its shape, a floating dtype, finite once converted, second
    moments non-negative, ``step`` a number >= 0), the state the family needs once it has stepped and no other.
    ``then``: the checkpoint's optimizer_type (``None``: its config is unreadable). A ``ValueError`` names the
    first bad field."""
    groups, entries = (saved.get("param_groups"), saved.get("state")) if isinstance(saved, dict) else (None, None)
    if not isinstance(groups, list) or not isinstance(entries, dict) or not all(isinstance(g, dict) for g in groups):
        raise ValueError("it is not an optimizer state dict (state, param_groups)")
    now, now_groups = trainer.cfg.optimizer.optimizer_type, trainer.optimizer.param_groups
    if (family := _family(groups, now, then)) != now:
        raise ValueError(
            f"its param_groups are {family}'s and optimizer.optimizer_type is {now} now: resume without it "
            "(--load_checkpoint_states with every state but optimizer; in the run's own directory keep global_step) "
            "or with the checkpoint's optimizer_type"
        )
    sizes = [len(g["params"]) if isinstance(g.get("params"), list) else None for g in groups]
    if sizes != (now_sizes := [len(g["params"]) for g in now_groups]):
        raise ValueError(f"its param_groups hold {sizes} parameters; this run's optimizer {now_sizes}")
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # MasterWeights: the optimizer it wraps
    section, cls = trainer.cfg.optimizer, type(inner)
    loaded = [_check_group(g, group, ng, cls, section) for g, (group, ng) in enumerate(zip(groups, now_groups))]
    needs = ("momentum_buffer",) if now == "SGD" else ("step", "exp_avg", "exp_avg_sq")  # once it has stepped
    known = (*needs, "max_exp_avg_sq") if any(g.get("amsgrad") for g in loaded) else needs
    checked = {**saved, "param_groups": loaded}
    check_optimizer_state(inner, checked, name="optimizer")  # the indices, and each value: shape, dtype, finite, sign
    params = {i: ng for group, ng in zip(groups, now_groups) for i in group["params"]}
    for index, entry in entries.items():
        field = f"optimizer.state[{shown(index)}]"
        if missing := [k for k in needs if k not in entry and (k != "momentum_buffer" or params[index]["momentum"])]:
            raise ValueError(f"{field} lacks {', '.join(missing)}")
        if unknown := [k for k in entry if k not in known]:
            raise ValueError(
                f"{field} holds {shown(unknown[0])}, which is not state of this run's {now} ({', '.join(known)})"
            )
    return checked


def _family(groups: list[dict[str, Any]], now: str, then: str | None) -> str:
    """The optimizer type whose groups ``groups`` are: SGD's have no ``betas``; Adam's and AdamW's tell each other
    apart by ``decoupled_weight_decay`` (without it, written by an older torch: the checkpoint's config's type
    ``then``, else ``now``'s)."""
    if not all("betas" in g for g in groups):
        return "SGD"
    decoupled = {g.get("decoupled_weight_decay") for g in groups}
    if decoupled in ({True}, {False}):
        return "AdamW" if decoupled == {True} else "Adam"
    return then if then in ("Adam", "AdamW") else now if now != "SGD" else "Adam"


def _check_group(g: int, group: dict[str, Any], now_group: dict[str, Any], cls: type, section: Any) -> dict[str, Any]:
    """The hyperparameters of the checkpoint's group ``g`` as loaded, checked against this run's group (the config's
    optimizer ``cls``, as its groups are once it has stepped: an optimizer may keep state there, as cstorch's Adam
    its bias-correction powers). A key it does not hold is left out (it would not use it: a torch Adam's state
    loads into cstorch's Adam, as cstorch loads one; the LR schedule's state is loaded the same way); a key it
    holds that the checkpoint lacks (an older torch's) keeps the config's value. Each value must be of the config's
    type and finite; the flags (booleans, ``foreach``, ``fused``: they change the state's layout, where and how it
    computes, or the direction of the step) the config's; ``betas``, ``eps``, ``weight_decay`` and ``momentum``
    within the config's own ranges (its ``optimizer:`` ``section``); and all of them values ``cls`` takes, with
    which one step of it on a throwaway parameter is finite."""
    field, name = f"optimizer.param_groups[{g}]", cls.__name__
    known = step_once(cls, {k: v for k, v in now_group.items() if k != "params"})[0]
    for key, value in group.items():
        mine = known.get(key, ...)
        if key == "params" or mine is ...:
            continue
        if isinstance(mine, bool) or key in ("foreach", "fused"):
            if type(value) is not type(mine) or value != mine:
                raise ValueError(
                    f"{field}.{key} is {shown(value)}; this config's {name} has {key}={mine!r}, and a flag of the "
                    "optimizer is the config's: resume without the optimizer state (--load_checkpoint_states)"
                )
        elif not _same_kind(value, mine):
            raise ValueError(
                f"{field}.{key} must be of type {type(mine).__name__} as in this config's {name} ({mine!r}); got "
                f"{shown(value)}"
            )
        elif not all_finite(value):
            raise ValueError(f"{field}.{key} must be finite; got {value!r}")
    loaded = {**now_group, **{k: v for k, v in group.items() if k in known or k == "params"}}
    _check_config_ranges(
        field, {k: loaded[k] for k in ("betas", "eps", "weight_decay", "momentum") if k in loaded}, section
    )
    hyper = {k: v for k, v in loaded.items() if k != "params"}
    if (problem := _step_problem(cls, hyper)) is not None:
        mine = {k: v for k, v in now_group.items() if k != "params"}
        changed = [k for k in hyper if k in group and not _same_value(hyper[k], mine.get(k, ...))]
        alone = [k for k in changed if _step_problem(cls, {**mine, k: hyper[k]}) is not None]  # which one does it
        blamed = ", ".join(f"{k} = {shown(hyper[k])}" for k in (alone[:1] or changed))
        where = f" (in {field}: {blamed}{' together' if not alone and len(changed) > 1 else ''})" if changed else ""
        if problem:
            raise ValueError(f"{field} holds hyperparameters {name} refuses: {problem}{where}")
        raise ValueError(f"{field} holds hyperparameters with which a step of {name} gives inf/NaN{where}")
    return loaded


def _step_problem(cls: type, hyper: dict[str, Any]) -> str | None:
    """Why one step of ``cls`` with ``hyper`` fails (:func:`step_once`): what it raised, ``""`` when the step is not
    finite, ``None`` when it is."""
    try:
        return None if step_once(cls, hyper)[1] else ""
    except (ValueError, TypeError, RuntimeError, KeyError) as exc:
        return _one_line(exc)


def _same_value(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # tensors: not one truth value
        return False


def _check_config_ranges(field: str, values: dict[str, Any], section: Any) -> None:
    """``values`` (hyperparameters named as the config's keys) within the ranges the config's ``optimizer:``
    ``section`` takes (pydantic's judgement; a section it cannot judge again as it is is not used)."""
    schema, own = type(section), section.model_dump(exclude_unset=True)
    try:
        schema.model_validate(own)
    except ValueError:
        return
    try:
        schema.model_validate({**own, **values})
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        first: dict[str, Any] = exc.errors()[0] if hasattr(exc, "errors") else {"loc": (), "msg": str(exc)}
        key = ".".join(map(str, first["loc"]))
        rule = first["msg"].replace("Input should", "must")
        raise ValueError(f"{field}.{key} {rule}, as optimizer.{key} in a config; got {first.get('input')!r}") from None


def _check_scheduler(saved: Any, scheduler: Any, num_groups: int) -> dict[str, Any]:
    """The LR schedule's state to load: the keys ``scheduler``'s own ``state_dict()`` has (any other is left out:
    loading sets attributes), each of the type it holds there (a key the checkpoint lacks keeps its value);
    ``last_epoch`` an integer >= -1, ``base_lrs`` (and ``_last_lr``) ``num_groups`` finite numbers. A ``ValueError``
    names the first field that does not fit."""
    if not isinstance(saved, dict):
        raise ValueError(f"a mapping is expected; got {type(saved).__name__}")
    _number(saved.get("last_epoch"), "last_epoch", low=-1)
    for key in ("base_lrs", "_last_lr") if saved.get("_last_lr") is not None else ("base_lrs",):
        values: Any = saved.get(key)
        numbers = isinstance(values, list) and all(type(v) in (int, float) and math.isfinite(v) for v in values)
        if not numbers or len(values) != num_groups:
            raise ValueError(f"{key} must be a list of {num_groups} finite numbers; got {shown(values)}")
    loaded = {}
    for key, mine in scheduler.state_dict().items():
        value = saved.get(key, mine)
        if key == "_last_lr" and value is None:  # not written by every torch: the scheduler's own
            value = mine
        if not _same_kind(value, mine):
            kind = type(getattr(scheduler, "__wrapped__", scheduler)).__name__
            raise ValueError(
                f"{key} must be of type {type(mine).__name__} as in this run's {kind} ({shown(mine)}); got "
                f"{shown(value)}"
            )
        loaded[key] = value
    return loaded


def _restore_scaler(trainer: Any, path: Path, saved: Any, saved_cfg: TrainConfig | None) -> None:
    """Load the part of a checkpoint's ``grad_scaler`` state that this run uses (a ``ValueError`` names a bad field),
    logging each difference between the checkpoint's scaling (``saved_cfg``; ``None`` when unreadable) and the
    config's. Static to dynamic starts from the config's initial scale, dynamic to static uses the config's; skipped
    steps carry over."""
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
    now_mode, now = loss_scaling_mode(cfg), scaler_settings(cfg)
    # The scaler's own parser: keys, torch's aliases, format versions, checks and the clamp into the bounds.
    loaded = parse_state_dict(
        saved, now, apply_settings=False, own_names_first=True, label=lambda key: f"grad_scaler.{key}",
        extra=("kept_in_float32",),  # the float32 fallback's modules: checked by the scaler when it loads them
    )  # fmt: skip
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
    else:  # each setting of the dynamic rule (ScalerSettings attribute -> config key) compared
        rule = {arg: key for key, arg in SCALER_KEYS.items() if arg not in ("loss_scale", "max_gradient_norm")}
        for attribute, config_key in rule.items():
            before, after = (getattr(then, attribute), getattr(now, attribute)) if then else (0, 0)
            if before != after:
                old, new = (pow2(before), pow2(after)) if attribute.endswith("scale") else (f"{before:g}", f"{after:g}")
                used = f"{new} is used"
                if attribute == "init_scale":  # the checkpoint's scale goes on
                    used = f"not used, the scale continues from the checkpoint's ({shown})"
                log(f"optimizer.{config_key}: {old} in the checkpoint's config, {new} now: {used}")
        if loaded.clamped is not None:
            low, high, clamped = now.min_loss_scale, now.max_loss_scale, values["loss_scale"]
            bound = "optimizer.max_loss_scale" if clamped == high else "optimizer.min_loss_scale"
            log(
                f"the checkpoint's loss scale {pow2(loaded.clamped)} is outside [{pow2(low)}, {pow2(high)}]: it "
                f"continues at {bound} ({pow2(clamped)})"
            )
    if values:
        scaler.load_state_dict(values)
