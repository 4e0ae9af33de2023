"""``checkpoint_<step>.mdl``: Model Zoo's state names plus ``rng``, ``config``, ``trainer``, ``fp8``, ``format_version``
(1: the LR schedule counted skipped steps; 2: applied steps only); written atomically, the last N kept. Bytes that
do not parse are *unreadable* (skipped when resuming a directory); a file that parses but may not load is refused."""

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


def list_checkpoints(model_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every checkpoint in ``model_dir``, oldest first. A symbolic link under a checkpoint's
    name is not one (it may point at another run's file): never resumed from, replaced when that step is written."""
    directory = Path(model_dir)
    if not directory.is_dir():
        return []
    found = [(step, directory / n) for n in os.listdir(directory) if (step := checkpoint_step(n)) >= 0]
    return sorted((step, p) for step, p in found if p.is_file() and not p.is_symlink())


def find_checkpoint(path: str | Path) -> Path:
    p = Path(path)
    return p if p.is_file() else _resumable(p)[-1][1]


def _resumable(directory: Path) -> list[tuple[int, Path]]:
    """``list_checkpoints(directory)``, or --resume's error for a directory that is missing or holds none."""
    if not directory.exists():
        raise CheckpointError(f"--resume: {directory} does not exist")
    found = list_checkpoints(directory)
    if not found:
        raise CheckpointError(f"--resume: no checkpoint_<step>.mdl files in {directory}")
    return found


def load_resume_checkpoint(path: str | Path) -> tuple[Path, dict[str, Any], list[tuple[Path, str]]]:
    """``(file, state, unreadable)``: the file ``path``, or the newest readable checkpoint of the directory
    ``path`` and the newer ones that could not be read, each with the reason."""
    p = Path(path)
    if p.is_file():
        return p, load_checkpoint(p), []
    unreadable: list[tuple[Path, str]] = []
    for _, candidate in reversed(_resumable(p)):
        try:
            return candidate, load_checkpoint(candidate), unreadable
        except UnreadableCheckpoint as exc:
            unreadable.append((candidate, str(exc)))
    raise CheckpointError(f"--resume: no readable checkpoint in {p}: " + "; ".join(reason for _, reason in unreadable))


def save_checkpoint(
    state: dict[str, Any], path: str | Path, keep: int | None = None, *, dir_fd: int | None = None
) -> Path:
    """Write ``state`` to ``path`` atomically, then with ``keep`` delete all but the ``keep`` newest checkpoints
    (never the one just written). ``dir_fd``: the locked model_dir's descriptor (else the directory is opened)."""
    final = Path(path)
    if dir_fd is None:
        final.parent.mkdir(parents=True, exist_ok=True)
        fd = open_directory(Path(os.path.realpath(final.parent)))
        try:
            return save_checkpoint(state, final, keep, dir_fd=fd)
        finally:
            os.close(fd)
    remove_temporaries(dir_fd, (".checkpoint_",))  # left by a killed save
    buffer = io.BytesIO()  # in memory first: see replace_file
    torch.save({"format": FORMAT, "format_version": FORMAT_VERSION, **state}, buffer)
    replace_file(dir_fd, final.name, buffer.getbuffer(), shown=final)
    if keep is not None:
        found = [(step, n) for n in os.listdir(dir_fd) if (step := checkpoint_step(n)) >= 0]
        found = [(s, n) for s, n in found if stat.S_ISREG(os.stat(n, dir_fd=dir_fd, follow_symlinks=False).st_mode)]
        for _, name in sorted(found)[:-keep]:  # a link is not a checkpoint: it does not push a real one out
            if name != final.name:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dir_fd)
    return final


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
    """One line for what ``torch.load`` raised (not its paragraphs of weights_only advice, which do not apply)."""
    text = str(exc)
    found = re.search(r"WeightsUnpickler error:\s*(.+?)\s*(?:Check the documentation|$)", text, re.S)
    if found:
        text = f"not a checkpoint of tensors and plain data ({found.group(1)})"
    first = " ".join(text.split())
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def format_version(state: dict[str, Any]) -> int | None:
    """The checkpoint format version of ``state`` (1 when absent); ``None`` when it is not a positive integer."""
    version = state.get("format_version", 1)
    return None if isinstance(version, bool) or not isinstance(version, int) or version < 1 else version


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


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
