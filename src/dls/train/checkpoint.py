"""Checkpoint files: ``MODEL_DIR/checkpoint_<step>.mdl``, written atomically, the last N kept.

A checkpoint is a ``torch.save``-d dict with the Model Zoo state names ``model``, ``optimizer``,
``grad_scaler`` (absent when the run had no loss scaling), ``lr_scheduler``, ``dataloader``, ``global_step``,
plus ``rng`` (every random-number generator), ``config`` (the run's config as plain data), ``trainer``
(elapsed time, overflow counters) and ``format``/``format_version``. Everything in it loads with
``torch.load(weights_only=True)``.

Atomic write: the bytes go to a hidden temporary file in the same directory, which is flushed and fsync-ed, then
renamed over the final name with ``os.replace`` (atomic on POSIX and Windows) and the directory fsync-ed. A
crash at any point leaves either the old set of checkpoints or the new one complete, never a truncated
``checkpoint_<step>.mdl``; a leftover temporary file is ignored and removed by the next save.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = "dls-checkpoint"
FORMAT_VERSION = 1
_NAME_RE = re.compile(r"^checkpoint_(\d+)\.mdl$")
_TMP_PREFIX = ".checkpoint_"
_TMP_SUFFIX = ".tmp"


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable or does not fit the run."""


def checkpoint_path(model_dir: str | Path, step: int) -> Path:
    return Path(model_dir) / f"checkpoint_{step}.mdl"


def list_checkpoints(model_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint in ``model_dir``, oldest first."""
    directory = Path(model_dir)
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _NAME_RE.match(entry.name)
        if match and entry.is_file():
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


def save_checkpoint(state: dict[str, Any], path: str | Path, keep: int | None = None) -> Path:
    """Write ``state`` to ``path`` atomically; then, with ``keep``, delete all but the ``keep`` newest
    checkpoints of the directory (never the one just written)."""
    final = Path(path)
    directory = final.parent
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(f"{_TMP_PREFIX}*{_TMP_SUFFIX}"):
        with contextlib.suppress(OSError):
            stale.unlink()
    fd, tmp_name = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=_TMP_SUFFIX, dir=directory)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"format": FORMAT, "format_version": FORMAT_VERSION, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_directory(directory)
    if keep is not None:
        for _, old in list_checkpoints(directory)[:-keep]:
            if old != final:
                with contextlib.suppress(OSError):
                    old.unlink()
    return final


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint onto the CPU (``weights_only=True``: no code runs)."""
    p = Path(path)
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {p} does not exist") from None
    except Exception as exc:
        raise CheckpointError(f"cannot read checkpoint {p}: {type(exc).__name__}: {exc}") from None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{p} is not a dls training checkpoint (no 'model' state)")
    return state


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


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
