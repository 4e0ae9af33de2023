"""What can go wrong in a ``dls`` command, and its one exit-status map (:func:`exit_status`): 0 done, 1 stopped,
2 bad input, 3 environment (I/O, memory), 4 internal error, 130 SIGINT, 143 SIGTERM. Standard library only."""

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


class ExitStatus(enum.IntEnum):
    OK = 0
    STOPPED = 1
    USAGE = 2
    ENVIRONMENT = 3
    INTERNAL = 4
    INTERRUPTED = 130
    TERMINATED = 143


class TrainingStopped(RuntimeError):
    """Training cannot usefully continue (exit 1); ``result``: the session's ``TrainResult``, set by the trainer."""

    def __init__(self, message: str, checkpoint: Path | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint
        self.result: Any = None


PROBLEMS_SHOWN_AT_MOST = 20  # dls.checks.PROBLEMS_SHOWN_AT_MOST


class ConfigError(ValueError):
    """An invalid config (exit 2): ``errors``, each naming its key; ``source``: where the config came from."""

    def __init__(self, errors: Sequence[str], source: str | None = None) -> None:
        self.errors, self.source = list(errors), source
        where = f" in {source}" if source else ""
        # Every problem of a config a person wrote, and a bound for a generated one: dls.checks.bulleted's rule
        # (this module imports no torch, dls.checks does).
        shown = self.errors[:PROBLEMS_SHOWN_AT_MOST]
        more = len(self.errors) - len(shown)
        listed = "".join(f"\n  - {e}" for e in shown) + (f"\n  - and {more:,} more" if more else "")
        said = f": {self.errors[0]}" if len(self.errors) == 1 else f" ({len(self.errors)} problems):{listed}"
        super().__init__(f"invalid config{where}{said}")


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable or does not fit the run (exit 2)."""


class ModelDirError(ValueError):
    """The run refuses its model_dir (locked, not empty for a fork, a rewind in place, a link); exit 2."""


class UsageError(ValueError):
    """A command line that cannot work (exit 2)."""


class MissingExtras(ImportError):
    """An extra's dependency cannot be imported (exit 2)."""


class OutOfMemory(MemoryError):
    """Out of memory where the command knows what to lower: ``advice`` replaces the trainer's (exit 3)."""

    def __init__(self, message: str, advice: str) -> None:
        super().__init__(message)
        self.advice = advice


class RankError(RuntimeError):
    """Rank 0 failed in a step only it performs; the other ranks raise this with its message and exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def exit_status(exc: BaseException) -> ExitStatus:
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
    if isinstance(exc, OSError) or is_out_of_memory(exc):
        return ExitStatus.ENVIRONMENT
    return ExitStatus.INTERNAL


SPACE_ERRORS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def standard_output_error(exc: OSError) -> OSError:
    """``exc``, raised writing to the standard output, as the error of that output (exit 3): named as such, with
    the advice to send it elsewhere when the disk behind it is full, not the trainer's about its model_dir."""
    error = OSError(exc.errno, exc.strerror or str(exc), "the standard output")
    if exc.errno in SPACE_ERRORS:
        error.advice = "free some space or send the output elsewhere"  # type: ignore[attr-defined]
    return error


class NamedOutput:
    """``sys.stdout`` while a ``dls`` command runs: a write or flush that fails raises ``standard_output_error``
    (a ``dls train`` or ``dls validate`` printing into a full disk was told to free space for its model_dir)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def write(self, text: str) -> int:
        try:
            return int(self._stream.write(text))
        except OSError as exc:
            raise standard_output_error(exc) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            raise standard_output_error(exc) from None


def describe(exc: BaseException) -> str:
    """The text after ``dls: error:``; an ``OSError`` names its path(s) and the system's reason. The advice for a
    full disk or for memory is the trainer's, unless the error carries its command's as ``advice``."""
    if isinstance(exc, OSError):
        reason = exc.strerror or str(exc) or type(exc).__name__
        if exc.errno in SPACE_ERRORS:
            advice = getattr(exc, "advice", "free some space or choose another runconfig.model_dir, then --resume")
            reason += f" ({advice})"
        where = "" if exc.filename is None else f"{exc.filename}: "
        where = f"{exc.filename} -> {exc.filename2}: " if exc.filename2 is not None else where
        return f"{where}{reason}"
    if is_out_of_memory(exc):
        first = (str(exc).strip().splitlines() or [""])[0]
        advice = exc.advice if isinstance(exc, OutOfMemory) else TRAIN_MEMORY_ADVICE
        return f"out of memory{': ' if first else ''}{first}; {advice}"
    return str(exc) or type(exc).__name__


TRAIN_MEMORY_ADVICE = "lower data.num_samples, data.batch_size or the model's size (or free memory), then --resume"


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says that memory ran out (exit 3)."""
    # torch's CPU allocator raises a plain RuntimeError ("DefaultCPUAllocator: can't allocate memory: ...")
    return (
        isinstance(exc, MemoryError)
        or type(exc).__name__ == "OutOfMemoryError"
        or (isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))
    )


def write_crash_report(exc: BaseException, directory: Path | None) -> Path | None:
    """``exc``'s traceback in a new file (exclusive, no link followed) in ``directory``, else the temporary
    directory; its path, or ``None``."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    name = f"dls-crash-{stamp}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}.txt"
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    for folder in [d for d in (directory, Path(tempfile.gettempdir())) if d is not None]:
        path = folder / name
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError:  # e.g. the disk is full: try the next place
            continue
        return path
    return None
