"""A run's model_dir and its checkpoints. The directory: resolved once, locked for one run at a time (``flock``; a
lock left by a killed run is taken over), written only through its descriptor, never through a link, each file
atomically, checked once under the lock (:func:`check_model_dir`); rank 0 alone writes. POSIX only.
``checkpoint_<step>.mdl``: Model Zoo's state names plus ``rng``, ``config``, ``trainer``, ``fp8``, ``format_version``
(1: the LR schedule counted skipped steps; 2: applied steps only), the last N kept. Bytes that do not parse are
*unreadable* (skipped when resuming a directory, then set aside); a file that parses but may not load is refused.
:func:`restore` loads one into a trainer."""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import io
import itertools
import json
import math
import os
import random
import re
import secrets
import socket
import stat
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np
import torch
import yaml

import dls.fp8
from dls.diagnostics.record import TRACE_FILE
from dls.diagnostics.scales import pow2
from dls.optimizer_state import NON_FINITE, all_finite, check_optimizer_state, tensor_problem
from dls.policy import shown
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
from dls.train.reporting import describe_scaling, metrics_to_keep, plot_comparison, read_metrics

if TYPE_CHECKING:  # annotations only
    from dls.train.config import TrainConfig

FORMAT = "dls-checkpoint"
FORMAT_VERSION = 2
LOCK_FILE = ".dls.lock"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "plots.png"
CONFIG_FILE = "config.yaml"
TENSORBOARD_DIR = "tensorboard"
_TEMPORARIES = (".checkpoint_", *(f".{name}." for name in (METRICS_FILE, PLOT_FILE, CONFIG_FILE, TRACE_FILE)))
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class UnreadableCheckpoint(CheckpointError):
    """A checkpoint file whose bytes do not parse."""


def checkpoint_path(model_dir: str | Path, step: int) -> Path:
    return Path(model_dir) / f"checkpoint_{step}.mdl"


def checkpoint_step(name: str) -> int:
    """The step of a checkpoint's file name (as :func:`checkpoint_path` writes it: no leading zeros, so that each step
    has one name); -1 for any other name."""
    match = re.fullmatch(r"checkpoint_(0|[1-9][0-9]*)\.mdl", name)
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
        if is_out_of_memory(exc):  # the machine's limit, not the file's bytes: never set aside as unreadable
            raise
        text = str(exc)
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


# ---------------------------------------------------------------------- the run directory
def resolve_model_dir(path: str | Path, what: str = "runconfig.model_dir") -> Path:
    """``path`` absolute with every link resolved (once per run); ``what`` names it in errors. Refused
    (:class:`ModelDirError`): a path through a link to nothing (creating the directory would create the link's
    target, wherever it points), and the file system's root (a run's files would land among the system's)."""
    if "\0" in str(path):
        raise ModelDirError(f"{what} {str(path)!r} contains a NUL character, which no path can hold")
    given, prefix = Path(path).expanduser(), ""
    for part in given.parts:  # as written, left to right, until the part a run would create
        prefix = os.path.join(prefix, part)
        if not os.path.lexists(prefix):
            break
        if os.path.islink(prefix) and not os.path.exists(prefix):
            raise ModelDirError(
                f"{what} {path}: {prefix} is a symbolic link to {os.readlink(prefix)}, which does not exist; dls does "
                "not create a link's target: create it, or give the directory itself"
            )
    resolved = Path(os.path.realpath(given))
    if resolved == resolved.parent:
        raise ModelDirError(f"{what} {path} is the file system's root; give a directory of the run's own")
    return resolved


def check_model_dir(
    model_dir: Path,
    checkpoint: Path | None,
    unreadable: Sequence[tuple[Path, str]],
    states: Sequence[str],
    *,
    overwrite: bool = False,
    config_file: Path | None = None,
) -> list[tuple[Path, str]]:
    """Whether a run resuming from ``checkpoint`` (``None``: fresh) loading ``states`` may write into
    ``model_dir``. A fresh run needs a directory without an earlier run's files (:func:`earlier_run_files`; the
    input ``config_file`` is not one), unless ``overwrite`` moves them aside; a fork (another directory) a new or
    empty one; in place, only from the newest readable checkpoint and loading ``global_step``. Raises
    :class:`ModelDirError` (reading only); returns what :meth:`RunDir.open` renames before the run writes, each with
    the suffix of its new name: the ``unreadable`` checkpoints (in place), or the earlier run's files
    (``overwrite``)."""
    fresh_hint = (
        "choose another model_dir (-o runconfig.model_dir=NEW_DIR), or add --overwrite to move its files aside (each "
        "renamed <name>.old-<time>; nothing is deleted)"
    )
    if checkpoint is None:
        earlier = earlier_run_files(model_dir, config_file)
        if overwrite or not earlier:
            stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
            return [(path, f".old-{stamp}") for path in earlier]
        if found := list_checkpoints(model_dir):
            raise ModelDirError(
                f"runconfig.model_dir {model_dir} already holds checkpoints (latest: step {found[-1][0]}). To "
                f"continue that run, add --resume {model_dir}; to start over, {fresh_hint}."
            )
        names = ", ".join(p.name for p in earlier)
        raise ModelDirError(
            f"runconfig.model_dir {model_dir} holds {names} of an earlier run (no checkpoint to resume from), which "
            f"a new run would replace. To keep them, {fresh_hint}."
        )
    if overwrite:
        raise ModelDirError(
            f"--overwrite starts a new run in {model_dir}, but this run loads the checkpoint {checkpoint}: resume "
            "without --overwrite, or start without a checkpoint"
        )
    source = resolve_model_dir(checkpoint.parent)
    if source != model_dir:
        if model_dir.is_dir() and set(os.listdir(model_dir)) - {LOCK_FILE}:
            raise ModelDirError(
                f"runconfig.model_dir {model_dir} is not empty, and a run from the checkpoint of another directory "
                f"({source}) starts a new run, which needs a new or empty directory. To continue {source} itself, "
                f"resume it without another model_dir (or with -o runconfig.model_dir={source})."
            )
        return []
    skipped, mine = {p.name for p, _ in unreadable}, checkpoint_step(checkpoint.name)
    fork_hint = "load it into a new or empty directory instead: -o runconfig.model_dir=NEW_DIR"
    if newer := [p for step, p in list_checkpoints(source) if p.name not in skipped and step > mine]:
        raise ModelDirError(
            f"{checkpoint} is not the latest checkpoint of {source} ({newer[-1].name} is): continuing in {source} "
            f"would mix two histories of the run. Continue from the latest with --resume {source}, or {fork_hint}"
        )
    if "global_step" not in states:
        raise ModelDirError(
            f"loading {', '.join(states)} without global_step restarts at step 0, which in {source} would "
            f"overwrite the run's metrics and leave its checkpoints behind. Add global_step to continue the run "
            f"in place, or {fork_hint}"
        )
    return [(p, ".unreadable") for p, _ in unreadable]


def earlier_run_files(model_dir: Path, config_file: Path | None = None) -> list[Path]:
    """What in ``model_dir`` a run writes under a fixed name, so that a new run would replace it or mix with it:
    checkpoint_<step>.mdl, metrics.jsonl, config.yaml (unless it is the input ``config_file``, which is never
    written), plots.png, trace.jsonl and tensorboard/, whatever their kind (a link under such a name too)."""
    try:
        names = sorted(os.listdir(model_dir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    fixed = (CONFIG_FILE, METRICS_FILE, PLOT_FILE, TRACE_FILE, TENSORBOARD_DIR)
    found = [model_dir / name for name in names if name in fixed or checkpoint_step(name) >= 0]
    config = model_dir / CONFIG_FILE
    if config_file is not None and not config.is_symlink() and config.exists() and config.samefile(config_file):
        found.remove(config)
    return found


def _holder(lock_fd: int, held: bool = True) -> str | None:
    """Who holds the lock, as the record in its file says (``None``: none recorded); ``held``: still now (then a
    holder that ended left a child with it)."""
    try:
        record = json.loads(os.pread(lock_fd, 4096, 0))
    except (OSError, ValueError):  # empty, or not a record dls wrote
        return None
    if not isinstance(record, dict) or not record:
        return None
    pid, host = record.get("pid", "?"), record.get("host", "?")
    text = f"pid {pid} on host {host}" + (f" (since {record['since']})" if record.get("since") else "")
    if held and host == socket.gethostname() and isinstance(pid, int):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            text += f"; process {pid} has ended, so a process it started (which inherited the lock) still holds it"
        except OSError:  # e.g. EPERM: it exists
            pass
    return text


def lock_holder(directory: Path) -> str | None:
    """Who holds ``directory``'s lock now, as its record says (``None``: no one): asked only to explain why a
    directory has nothing to resume from, never to decide whether a run may start (:class:`RunDir` decides)."""
    try:
        fd = os.open(directory / LOCK_FILE, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(fd) or "another process (no holder recorded)"
    except OSError:
        return None
    finally:
        os.close(fd)  # releases the shared lock too
    return None


def is_same_file(dir_fd: int, name: str, other: Path | int) -> bool:
    """Whether ``name`` in ``dir_fd`` (not followed) is the file ``other`` (a path or an open descriptor)."""
    try:
        return os.path.samestat(os.stat(name, dir_fd=dir_fd, follow_symlinks=False), os.stat(other))
    except OSError:
        return False


class RunDir:
    """``path`` (resolved), created if missing, opened and locked; ``what`` names it in messages. ``stale``: the
    holder of a lock left by a run that ended without releasing it. A training run then calls :meth:`open`
    and writes rows, checkpoints and plots. :meth:`close` (or the end of a ``with`` block) releases, last acquired
    first, the session's files, the lock (its file removed) and the directory (removed, with the parents this
    created for it, while empty)."""

    def __init__(self, path: Path, what: str = "runconfig.model_dir") -> None:
        self.path, self.what = path, what
        self._held = contextlib.ExitStack()  # what close() releases, last acquired first
        # The directories this creates (the path and any missing parents), removed again on close() while empty.
        self._created = [d for d in (path, *path.parents) if not os.path.lexists(d)]
        with contextlib.suppress(FileExistsError):  # a directory, or something refused below
            path.mkdir(parents=True)
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
        except OSError as exc:  # a link to anything (ELOOP, or ENOTDIR when it points at a file), or a file
            if path.is_symlink():
                raise ModelDirError(f"{what} {path} is a symbolic link; give the directory it points to") from None
            if exc.errno == errno.ENOTDIR:
                raise NotADirectoryError(errno.ENOTDIR, f"{what} is not a directory", str(path)) from None
            raise
        self.stale: str | None = None
        self._metrics: IO[bytes] | None = None
        self._steps_before: set[int] = set()  # the checkpoints in the directory when the session opened it
        self.events: Any = None  # torch.utils.tensorboard.SummaryWriter
        self._held.callback(self._remove_if_created)  # last, once the lock and the directory are released
        self._held.callback(os.close, self.fd)
        with contextlib.ExitStack() as failed:  # the directory is closed again unless the lock is taken
            failed.callback(self.close)
            self._lock()
            failed.pop_all()

    def close(self) -> None:
        self._held.close()

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _lock(self) -> None:
        while True:
            with contextlib.ExitStack() as attempt:  # the lock file is closed unless this attempt takes the lock
                fd = self._open(LOCK_FILE, os.O_RDWR | os.O_CREAT)
                attempt.callback(os.close, fd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise ModelDirError(
                        f"{self.what} {self.path} is in use by another dls run: "
                        f"{_holder(fd) or 'another process (no holder recorded)'}. Wait for it to finish (or stop it), "
                        "or choose another model_dir"
                    ) from None
                # A holder that released between our open and our lock has unlinked the file we locked: retry.
                if not is_same_file(self.fd, LOCK_FILE, fd):
                    continue
                self.stale = _holder(fd, held=False)
                now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
                record = {"pid": os.getpid(), "host": socket.gethostname(), "since": now}
                try:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, json.dumps(record).encode() + b"\n", 0)
                    os.fsync(fd)
                except OSError as exc:  # e.g. the disk is full: no lock file without its record is left
                    with contextlib.suppress(OSError):
                        os.unlink(LOCK_FILE, dir_fd=self.fd)
                    exc.filename, exc.filename2 = str(self.path / LOCK_FILE), None
                    raise
                attempt.pop_all()
                self._held.callback(self._unlock, fd)
                return

    def _unlock(self, fd: int) -> None:
        with contextlib.suppress(OSError):
            os.unlink(LOCK_FILE, dir_fd=self.fd)
        os.close(fd)

    def _remove_if_created(self) -> None:
        for directory in self._created:  # the deepest first
            try:
                os.rmdir(directory)
            except OSError:  # not empty: kept, and so are its parents
                return

    def _open(self, name: str, flags: int, kind: int = stat.S_IFREG) -> int:
        """``name`` opened through the directory's descriptor; a symbolic link (never followed) or a file of another
        kind than ``kind`` is refused (:class:`ModelDirError`), another error names the path."""
        path = self.path / name
        try:
            fd = os.open(name, flags | _NOFOLLOW | os.O_NONBLOCK, 0o644, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):  # a link; not a directory
                exc.filename = str(path)
                raise
        else:
            if stat.S_IFMT(os.fstat(fd).st_mode) == kind:
                return fd
            os.close(fd)
        noun = "directory" if kind == stat.S_IFDIR else "regular file"
        raise ModelDirError(f"{path} is not a {noun} (or is a symbolic link, which dls does not follow): move it away")

    def replace(self, name: str, data: bytes | memoryview) -> Path:
        """Write ``name`` atomically: a new temporary file (a planted name is never opened), flushed to disk, renamed
        over ``name``; its path. Callers serialise into memory first, so that a failing write is the ``OSError`` it is,
        naming the file (``torch.save`` into a file makes it a ``RuntimeError``); a failed write leaves no temporary
        file."""
        tmp = None
        try:
            while tmp is None:
                candidate = f".{name}.{secrets.token_hex(6)}.tmp"
                with contextlib.suppress(FileExistsError):  # someone planted this name: take another
                    _write_new(self.fd, candidate, data)
                    tmp = candidate
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException as exc:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=self.fd)
            if isinstance(exc, OSError) and exc.errno is not None:
                exc.filename, exc.filename2 = str(self.path / name), None
            raise
        with contextlib.suppress(OSError):
            os.fsync(self.fd)
        return self.path / name

    def existing(self, name: str) -> Path | None:
        """The first of ``name``'s components (a relative path, ``/``-separated) that :meth:`create` could not pass:
        the file itself when it exists, in any kind, a link included; a directory on the way that is a link or no
        directory. ``None`` when ``name`` can be created."""
        parts, fd = name.split("/"), self.fd
        with contextlib.ExitStack() as opened:
            for i, part in enumerate(parts):
                try:
                    info = os.stat(part, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    return None
                if i == len(parts) - 1 or not stat.S_ISDIR(info.st_mode):
                    return self.path.joinpath(*parts[: i + 1])
                fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=fd)
                opened.callback(os.close, fd)
        return None

    def create_all(self, contents: dict[str, bytes]) -> list[Path]:
        """Each of ``contents`` (relative path -> bytes) created by :meth:`create`, in order, after checking that each
        can be (:meth:`existing`): one that cannot refuses them all before anything is written (:class:`ModelDirError`
        naming it)."""
        if found := next(filter(None, map(self.existing, contents)), None):
            kind = " (a symbolic link)" if found.is_symlink() else ""
            raise ModelDirError(
                f"{found} exists{kind}: dls never replaces a file or writes through a link (nothing was written); "
                f"choose another {self.what}, or move it away"
            )
        written: list[str] = []
        try:
            for name, data in contents.items():
                self.create(name, data)
                written.append(name)
        except BaseException:  # all or nothing: a full disk (or Ctrl-C) halfway leaves none of them
            for name in reversed(written):
                with contextlib.suppress(OSError):
                    self._unlink(name)
            raise
        return [self.path / name for name in written]

    def _unlink(self, name: str) -> None:
        """Remove ``name`` (a relative path, ``/``-separated), its directories opened without following a link."""
        *folders, leaf = name.split("/")
        with contextlib.ExitStack() as opened:
            fd = self.fd
            for folder in folders:
                fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=fd)
                opened.callback(os.close, fd)
            os.unlink(leaf, dir_fd=fd)

    def create(self, name: str, data: bytes | memoryview) -> Path:
        """Create the new file ``name`` (a relative path, ``/``-separated; its missing directories are made) holding
        ``data``, flushed to disk; its path. Nothing is replaced and no link followed: an existing file of any kind
        (a link too) under ``name``, or a link or file where a directory of ``name`` is expected, is
        :class:`ModelDirError` naming it; a failed write leaves no file."""
        *folders, leaf = name.split("/")
        fd = self.fd
        with contextlib.ExitStack() as opened:
            for i, folder in enumerate(folders):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(folder, 0o755, dir_fd=fd)
                    self._created.insert(0, self.path.joinpath(*folders[: i + 1]))  # removed on close while empty
                try:
                    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=fd)
                except OSError as exc:
                    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                        exc.filename = str(self.path.joinpath(*folders[: i + 1]))
                        raise
                    raise ModelDirError(f"{self.path.joinpath(*folders[: i + 1])} {_NOT_WRITTEN}") from None
                opened.callback(os.close, fd)
            path = self.path / name
            try:
                _write_new(fd, leaf, data)
            except FileExistsError:
                raise ModelDirError(f"{path} exists: dls never replaces it (nothing more was written)") from None
            except OSError as exc:
                exc.filename, exc.filename2 = str(path), None
                raise
            with contextlib.suppress(OSError):
                os.fsync(fd)
        return path

    def read(self, name: str) -> bytes | None:
        """The bytes of the regular file ``name``; ``None`` when there is none (a link or other kind counts as none)."""
        try:
            fd = self._open(name, os.O_RDONLY)
        except (FileNotFoundError, ModelDirError):
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def open(
        self, log: Callable[[str], None], *, set_aside: Sequence[tuple[Path, str]], step: int, config: dict[str, Any],
        config_file: Path | None, tensorboard: bool = False,
    ) -> None:  # fmt: skip
        """Start a training session: rename each of ``set_aside`` (``(file, suffix)``: unreadable checkpoints, an
        earlier run's files) to its name plus the suffix (the first free one), keep metrics.jsonl up to ``step``
        open, write config.yaml (unless it is the input ``config_file``), start this session's TensorBoard events.
        What can refuse (metrics.jsonl, tensorboard/ that stays) does so before anything changes."""
        moving = {path.name for path, _ in set_aside}
        events_fd = None if not tensorboard or TENSORBOARD_DIR in moving else self._events_dir()
        keep = metrics_to_keep(  # may refuse
            None if METRICS_FILE in moving else self.read(METRICS_FILE), self.path / METRICS_FILE, step
        )
        names = set(os.listdir(self.fd))
        for name in names:  # the temporary files a killed writer left
            if name.endswith(".tmp") and name.startswith(_TEMPORARIES):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self.fd)
        for path, suffix in set_aside:  # out of the way of this run's files and rotation, under the first free name
            free = (f"{path.name}{suffix}" + (f"-{n}" if n > 1 else "") for n in itertools.count(1))
            kept = next(name for name in free if name not in names)
            os.rename(path.name, kept, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            names.add(kept)
            why = "never resumed from" if suffix == ".unreadable" else "an earlier run's, moved aside by --overwrite"
            log(f"Renamed {path.name} to {kept} (kept, {why})")
        self._steps_before = {step for step, _ in list_checkpoints(self.path, self.fd)}
        if tensorboard and events_fd is None:
            events_fd = self._events_dir()
        self.replace(METRICS_FILE, keep)
        self._metrics = self._held.enter_context(os.fdopen(self._open(METRICS_FILE, os.O_WRONLY | os.O_APPEND), "ab"))
        if config_file is not None and is_same_file(self.fd, CONFIG_FILE, config_file):
            log(f"{self.path / CONFIG_FILE} is the input config: left as it is")
        else:
            self.replace(CONFIG_FILE, yaml.safe_dump(config, sort_keys=False).encode())
        if events_fd is not None:
            from torch.utils.tensorboard import SummaryWriter

            # The directory as its descriptor's path, so that the writer cannot be redirected; a resumed session
            # purges the events a crashed one wrote after its checkpoint, as its metrics rows are dropped.
            proc = Path(f"/proc/self/fd/{events_fd}")
            log_dir = proc if proc.is_dir() else self.path / TENSORBOARD_DIR
            self.events = SummaryWriter(str(log_dir), purge_step=step + 1 if step else None, flush_secs=3600)
            self._held.callback(self.events.close)

    def _events_dir(self) -> int:
        """tensorboard/ opened (created if missing); refused unless a directory (not a link) of the run's user
        writable by no one else."""
        with contextlib.suppress(FileExistsError):
            os.mkdir(TENSORBOARD_DIR, 0o755, dir_fd=self.fd)
        events_fd = self._open(TENSORBOARD_DIR, os.O_RDONLY | os.O_DIRECTORY, stat.S_IFDIR)
        self._held.callback(os.close, events_fd)
        info = os.fstat(events_fd)
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ModelDirError(
                f"{self.path / TENSORBOARD_DIR} is writable by others than this run's user: move it away"
            )
        return events_fd

    def write_row(self, row: dict[str, Any]) -> None:
        """Append one metrics row (on disk before this returns) and its numbers as TensorBoard scalars."""
        assert self._metrics is not None, "rows are written while the run directory is open"
        try:
            self._metrics.write((json.dumps(row, allow_nan=False) + "\n").encode())
            self._metrics.flush()
        except OSError as exc:  # e.g. the disk is full: say which file
            exc.filename = exc.filename or str(self.path / METRICS_FILE)
            raise
        if self.events is not None:
            for key, value in row.items():
                if key not in ("step", "time") and isinstance(value, (int, float)):  # bool is an int
                    self.events.add_scalar(key, float(value), row["step"])
            self.events.flush()

    def save_checkpoint(self, state: dict[str, Any], step: int, keep: int | None = None) -> Path:
        """Write ``state`` as ``checkpoint_<step>.mdl`` atomically, then with ``keep`` delete all but the ``keep``
        newest checkpoints (never the one just written; a link is not a checkpoint: it pushes no real one out). A
        checkpoint of a step the directory held when the session opened it is never replaced (:class:`ModelDirError`):
        a session writes only the steps it trains."""
        if step in self._steps_before:
            raise ModelDirError(
                f"{checkpoint_path(self.path, step)} was there before this session, which would replace it: a run "
                "never writes a step it did not train (nothing was written)"
            )
        buffer = io.BytesIO()  # in memory first: see replace()
        torch.save({"format": FORMAT, "format_version": FORMAT_VERSION, **state}, buffer)
        path = self.replace(checkpoint_path(self.path, step).name, buffer.getbuffer())
        for _, old in list_checkpoints(self.path, self.fd)[:-keep] if keep is not None else []:
            if old != path:
                with contextlib.suppress(OSError):
                    os.unlink(old.name, dir_fd=self.fd)
        return path

    def plot(self, title: str) -> Path:
        """Write plots.png from metrics.jsonl; its path."""
        png = io.BytesIO()
        plot_comparison([("training loss", read_metrics(self.read(METRICS_FILE) or b""))], png, title)
        return self.replace(PLOT_FILE, png.getbuffer())


_NOT_WRITTEN = "is not a directory (or is a symbolic link, which dls does not follow): nothing more was written"


def _write_new(dir_fd: int, name: str, data: bytes | memoryview) -> None:
    """Create ``name`` in the directory ``dir_fd`` exclusively (``FileExistsError`` when any file, a link too, has
    that name: none is opened), holding ``data``, flushed to disk; a failed write removes it again."""
    f = os.fdopen(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644, dir_fd=dir_fd), "wb")
    try:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        f.close()
    except BaseException:
        with contextlib.suppress(OSError):  # close() flushes again, and raises again on a full disk
            f.close()
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)
        raise


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
