"""Checkpoint files: ``MODEL_DIR/checkpoint_<step>.mdl``, written atomically, the last N kept.

A checkpoint is a ``torch.save``-d dict with the Model Zoo state names ``model``, ``optimizer``,
``grad_scaler`` (absent when the run had no loss scaling), ``lr_scheduler``, ``dataloader``, ``global_step``,
plus ``rng`` (every random-number generator), ``config`` (the run's config as plain data), ``trainer``
(elapsed time, overflow counters), ``fp8`` (with ``precision.fp8``: ``dls.fp8``'s handle state, loaded with
``model``) and ``format``/``format_version``. With ``precision.half_params`` the ``optimizer`` state holds the
float32 master weights (``dls.master_weights``). Everything in it loads with ``torch.load(weights_only=True)``.
The optional entries need no new format version: a dls that does not know them cannot read the config that
asks for them.

Format versions (:data:`FORMAT_VERSION`; a file without one is version 1):

* 1: the LR schedule advanced on every step, skipped ones included (``lr_scheduler.last_epoch`` = global step).
* 2: the LR schedule advances on applied steps only (``last_epoch`` = optimizer updates); the config's
  loss-scaling keys may be null (the scaler's defaults); ``runconfig.num_threads``.

Both load: a version-1 schedule goes on from where it was (its position counted the skipped steps too).

Two kinds of bad file, two answers. Bytes that ``torch.load(weights_only=True)`` cannot parse (a truncated copy, a
disk error, garbage) are *unreadable* (:class:`UnreadableCheckpoint`): resuming a directory skips them and, in place,
sets them aside. A file that parses but is not what this dls may load (a later format version, not a dls
checkpoint; and, checked by ``dls.train.restore``, non-finite or ill-fitting state) is *refused*: a
:class:`CheckpointError` naming the file and what is wrong, and nothing in the directory changes.

Written atomically (``dls.train.rundir.replace_file``): a crash leaves the old set of checkpoints or the new one,
never a truncated ``checkpoint_<step>.mdl``; the next save removes a leftover temporary file.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import re
import stat
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dls.train.errors import CheckpointError
from dls.train.rundir import open_directory, remove_temporaries, replace_file

__all__ = [
    "CheckpointError",
    "UnreadableCheckpoint",
    "checkpoint_path",
    "find_checkpoint",
    "format_version",
    "list_checkpoints",
    "load_checkpoint",
    "load_resume_checkpoint",
    "rng_state",
    "save_checkpoint",
    "seed_everything",
    "set_rng_state",
]

FORMAT = "dls-checkpoint"
FORMAT_VERSION = 2
_NAME_RE = re.compile(r"^checkpoint_(\d+)\.mdl$")
_TMP_PREFIX = ".checkpoint_"  # temporary names: .checkpoint_<step>.mdl.<random>.tmp


class UnreadableCheckpoint(CheckpointError):
    """A checkpoint file whose bytes do not parse (see the module docstring)."""


def checkpoint_path(model_dir: str | Path, step: int) -> Path:
    return Path(model_dir) / f"checkpoint_{step}.mdl"


def list_checkpoints(model_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint in ``model_dir``, oldest first. A symbolic link under a
    checkpoint's name is not one (it may point at another run's file): never resumed from, replaced when the run
    writes that step."""
    directory = Path(model_dir)
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _NAME_RE.match(entry.name)
        if match and entry.is_file() and not entry.is_symlink():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def find_checkpoint(path: str | Path) -> Path:
    """``path`` itself if it is a file, else the latest checkpoint in the directory ``path``."""
    p = Path(path)
    if p.is_file():
        return p
    if not p.exists():
        raise CheckpointError(f"--resume: {p} does not exist")
    found = list_checkpoints(p)
    if not found:
        raise CheckpointError(f"--resume: no checkpoint_<step>.mdl files in {p}")
    return found[-1][1]


def load_resume_checkpoint(path: str | Path) -> tuple[Path, dict[str, Any], list[tuple[Path, str]]]:
    """The checkpoint to resume from: the file ``path``, or the newest readable checkpoint of the directory
    ``path``. Returns ``(file, state, unreadable)`` where ``unreadable`` lists the newer checkpoints of the
    directory that could not be read (truncated, garbage), each with the reason. A named file that cannot be
    read, a directory without a readable checkpoint, or a newest readable one that is refused (a later format
    version), raises :class:`CheckpointError`."""
    p = Path(path)
    if p.is_file():
        return p, load_checkpoint(p), []
    find_checkpoint(p)  # the errors for a missing or empty directory
    unreadable: list[tuple[Path, str]] = []
    for _, candidate in reversed(list_checkpoints(p)):
        try:
            return candidate, load_checkpoint(candidate), unreadable
        except UnreadableCheckpoint as exc:
            unreadable.append((candidate, str(exc)))
    raise CheckpointError(f"--resume: no readable checkpoint in {p}: " + "; ".join(reason for _, reason in unreadable))


def save_checkpoint(
    state: dict[str, Any], path: str | Path, keep: int | None = None, *, dir_fd: int | None = None
) -> Path:
    """Write ``state`` to ``path`` atomically (a new temporary file, never written through a symbolic link,
    renamed over ``path``); then, with ``keep``, delete all but the ``keep`` newest checkpoints of the directory
    (never the one just written). ``dir_fd``: an open descriptor of ``path``'s directory (the trainer's locked
    model_dir); without it the directory is opened (and created) here."""
    final = Path(path)
    if dir_fd is None:
        final.parent.mkdir(parents=True, exist_ok=True)
        with _directory(final.parent) as fd:
            return save_checkpoint(state, final, keep, dir_fd=fd)
    remove_temporaries(dir_fd, (_TMP_PREFIX,))  # left by a killed save
    buffer = io.BytesIO()  # in memory first: see dls.train.rundir.replace_file
    torch.save({"format": FORMAT, "format_version": FORMAT_VERSION, **state}, buffer)
    replace_file(dir_fd, final.name, buffer.getbuffer(), shown=final)
    if keep is not None:
        steps = sorted(
            (int(m.group(1)), n)
            for n in os.listdir(dir_fd)
            if (m := _NAME_RE.match(n)) and stat.S_ISREG(os.stat(n, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        )  # a link is not a checkpoint: it does not push a real one out
        for _, name in steps[:-keep]:
            if name != final.name:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dir_fd)
    return final


@contextlib.contextmanager
def _directory(path: Path) -> Any:
    fd = open_directory(Path(os.path.realpath(path)))
    try:
        yield fd
    finally:
        os.close(fd)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint onto the CPU (``weights_only=True``: no code runs). Raises :class:`UnreadableCheckpoint`
    when its bytes do not parse, :class:`CheckpointError` when it parses but is refused (module docstring)."""
    p = Path(path)
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols on stderr; the error says it all
            warnings.simplefilter("ignore")
            state = torch.load(p, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {p} does not exist") from None
    except IsADirectoryError:
        raise CheckpointError(f"checkpoint {p} is a directory") from None
    except Exception as exc:
        raise UnreadableCheckpoint(f"cannot read checkpoint {p}: {_reason(exc)}") from None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{p} is not a dls training checkpoint (no 'model' state)")
    version = format_version(state)
    if version is None:
        raise CheckpointError(f"{p} has an invalid format_version {state.get('format_version')!r}")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{p} has checkpoint format version {version}; this dls reads versions 1 to {FORMAT_VERSION} (a newer "
            "dls wrote it: resume it with that dls; nothing was changed)"
        )
    return state


def _reason(exc: Exception) -> str:
    """One line for what ``torch.load`` raised (its weights_only refusal is several paragraphs of advice that does
    not apply: dls never loads with ``weights_only=False``)."""
    text = str(exc)
    found = re.search(r"WeightsUnpickler error:\s*(.+?)\s*(?:Check the documentation|$)", text, re.S)
    if found:
        text = f"not a checkpoint of tensors and plain data ({found.group(1)})"
    first = " ".join(text.split())
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def format_version(state: dict[str, Any]) -> int | None:
    """The checkpoint format version of ``state`` (1 when absent); ``None`` when it is not a positive integer."""
    version = state.get("format_version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        return None
    return version


# ---------------------------------------------------------------------- random-number generators
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
    """Seed Python's, NumPy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
