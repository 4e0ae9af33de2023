"""What can go wrong in ``dls train`` / ``dls demo`` / ``dls validate``, and the one exit-status map of the ``dls``
command (:func:`exit_status`).

====  ==========================================================================================================
code  meaning
====  ==========================================================================================================
0     done
1     stopped because loss scaling cannot help (:class:`TrainingStopped`; the state was checkpointed first), or
      because the weights became inf/NaN (no checkpoint of them: the newest is the last finite one)
2     the input is wrong: config, command line, checkpoint, model_dir refused or locked by another run, missing
      ``train`` extra (message names the key, path or holder; nothing was written)
3     the environment failed: a file or directory cannot be read or written (model_dir is a file, no permission,
      disk full, file too large), out of memory (CPU or GPU; the message names the allocation). A process the
      kernel's out-of-memory killer ends gets no message: the shell shows "Killed" and status 137 (SIGKILL),
      which no program can catch
4     internal error (a bug in dls): the traceback is written to a file, whose name is printed
130   interrupted by Ctrl-C (SIGINT) after checkpointing the last finished step
143   terminated by SIGTERM (e.g. a cluster's pre-emption) after checkpointing the last finished step
====  ==========================================================================================================

Under ``torchrun``, rank 0 alone prints; each rank's process exits with its own status, and torchrun itself exits
1 whenever a rank exits non-zero, so read the code from rank 0's message (``dls: error: ...``).

This module imports the standard library (and the standard-library-only ``dls_entry``) only: the ``dls`` command
reports a missing ``train`` extra with it.
"""

from __future__ import annotations

import datetime
import enum
import errno
import os
import secrets
import socket
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dls_entry import Terminated

__all__ = [
    "CheckpointError",
    "ConfigError",
    "ExitStatus",
    "MissingExtras",
    "ModelDirError",
    "RankError",
    "Terminated",
    "TrainingStopped",
    "UsageError",
    "describe",
    "exit_status",
    "write_crash_report",
]


class ExitStatus(enum.IntEnum):
    OK = 0
    STOPPED = 1
    USAGE = 2
    ENVIRONMENT = 3
    INTERNAL = 4
    INTERRUPTED = 130
    TERMINATED = 143


class TrainingStopped(RuntimeError):
    """Training cannot usefully continue; the state was checkpointed first (``checkpoint``). Exit status 1.
    ``result``: what the session did up to the stop (a ``dls.train.TrainResult``, set by the trainer)."""

    def __init__(self, message: str, checkpoint: Path | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint
        self.result: Any = None


class ConfigError(ValueError):
    """An invalid config. ``errors`` lists every problem found, each naming its key (``section.key``); ``source``
    names where the config came from (a file, an override, a checkpoint). Exit status 2."""

    def __init__(self, errors: Sequence[str], source: str | None = None) -> None:
        self.errors = list(errors)
        self.source = source
        where = f" in {source}" if source else ""
        if len(self.errors) == 1:
            message = f"invalid config{where}: {self.errors[0]}"
        else:
            problems = "\n".join(f"  - {e}" for e in self.errors)
            message = f"invalid config{where} ({len(self.errors)} problems):\n{problems}"
        super().__init__(message)


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable or does not fit the run. Exit status 2."""


class ModelDirError(ValueError):
    """The run refuses its model_dir (another run holds it, a fork into a used directory, a rewind in place, a
    symbolic link where dls writes). Nothing was written. Exit status 2."""


class UsageError(ValueError):
    """A command line that cannot work (e.g. ``--load_checkpoint_states`` without ``--resume``). Exit status 2."""


class MissingExtras(ImportError):
    """A dependency of the ``train`` extra cannot be imported. Exit status 2."""


class RankError(RuntimeError):
    """Data-parallel: rank 0 failed in a step only it performs (the model_dir, its outputs); the other ranks raise
    this with rank 0's message and exit status, so every rank exits alike."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def exit_status(exc: BaseException) -> ExitStatus:
    """The ``dls`` command's exit status for an exception that ended a command (see the module docstring)."""
    if isinstance(exc, RankError):
        return ExitStatus(exc.status)
    if isinstance(exc, Terminated):
        return ExitStatus.TERMINATED
    if isinstance(exc, KeyboardInterrupt):
        return ExitStatus.INTERRUPTED
    if isinstance(exc, TrainingStopped):
        return ExitStatus.STOPPED
    if isinstance(exc, (ConfigError, CheckpointError, ModelDirError, MissingExtras, UsageError)):
        return ExitStatus.USAGE
    if isinstance(exc, OSError) or _out_of_memory(exc):
        return ExitStatus.ENVIRONMENT
    return ExitStatus.INTERNAL


def describe(exc: BaseException) -> str:
    """One line (or the config's problem list) for ``dls: error: ...``: an ``OSError`` names the operation's path
    and the system's reason."""
    if isinstance(exc, OSError) and not isinstance(exc, (CheckpointError, ModelDirError)):
        reason = exc.strerror or str(exc) or type(exc).__name__
        if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            reason += " (free some space or choose another runconfig.model_dir, then --resume)"
        where = f"{exc.filename}: " if exc.filename is not None else ""
        if exc.filename2 is not None:
            where = f"{exc.filename} -> {exc.filename2}: "
        return f"{where}{reason}"
    if _out_of_memory(exc):
        first = str(exc).strip().splitlines()
        return (
            "out of memory"
            + (f": {first[0]}" if first else "")
            + ("; lower data.num_samples, data.batch_size or the model's size (or free memory), then --resume")
        )
    return str(exc) or type(exc).__name__


def _out_of_memory(exc: BaseException) -> bool:
    """Python's ``MemoryError``, torch's CUDA ``OutOfMemoryError``, and torch's CPU allocator failing (a plain
    ``RuntimeError``: "DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes")."""
    return (
        isinstance(exc, MemoryError)
        or type(exc).__name__ == "OutOfMemoryError"
        or (isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))
    )


def write_crash_report(exc: BaseException, directory: Path | None) -> Path | None:
    """Write ``exc``'s traceback to a new file ``dls-crash-<time>-<pid>.txt`` in ``directory`` (when it is an
    existing directory), else in the system's temporary directory. The file is created exclusively and never
    through a symbolic link. Returns its path, or ``None`` when no file could be written."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    name = f"dls-crash-{stamp}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}.txt"
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    candidates = [d for d in (directory, Path(tempfile.gettempdir())) if d is not None]
    for folder in candidates:
        path = folder / name
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError:
            continue
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError:  # e.g. the disk is full: try the next place
            continue
        return path
    return None
