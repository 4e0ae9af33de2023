"""A run's directory: resolved once, locked for one run at a time (``flock``; a lock left by a killed run is taken
over), written only through its descriptor, never through a link, each file atomically. A training run's model_dir
is checked once under the lock (:func:`check_model_dir`), then holds checkpoints, ``metrics.jsonl``,
``config.yaml``, ``plots.png`` and TensorBoard events in ``tensorboard/``; rank 0 alone writes. POSIX only."""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import io
import json
import os
import secrets
import socket
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import torch
import yaml

from dls.train.checkpoint import FORMAT, FORMAT_VERSION, checkpoint_step, list_checkpoints
from dls.train.errors import ModelDirError
from dls.train.reporting import metrics_to_keep, plot_comparison, read_metrics

LOCK_FILE = ".dls.lock"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "plots.png"
CONFIG_FILE = "config.yaml"
TENSORBOARD_DIR = "tensorboard"
_TEMPORARIES = (".checkpoint_", *(f".{name}." for name in (METRICS_FILE, PLOT_FILE, CONFIG_FILE)))
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW


def resolve_model_dir(path: str | Path, what: str = "runconfig.model_dir") -> Path:
    """``path`` absolute with every link resolved (once per run); ``what`` names it in errors."""
    if "\0" in str(path):
        raise ModelDirError(f"{what} {str(path)!r} contains a NUL character, which no path can hold")
    return Path(os.path.realpath(Path(path).expanduser()))


def _holder(lock_fd: int, held: bool = True) -> str | None:
    """Who holds the lock, as the record in its file says (``None``: none recorded); ``held``: still now (then a
    holder that ended left a child with it)."""
    try:
        data = os.pread(lock_fd, 4096, 0)
        record = json.loads(data.decode("utf-8")) if data.strip() else None
    except (OSError, ValueError):
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


def is_same_file(dir_fd: int, name: str, other: Path | int) -> bool:
    """Whether ``name`` in ``dir_fd`` (not followed) is the file ``other`` (a path or an open descriptor)."""
    try:
        a, b = os.stat(name, dir_fd=dir_fd, follow_symlinks=False), os.stat(other)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def check_model_dir(
    model_dir: Path, checkpoint: Path | None, unreadable: Sequence[tuple[Path, str]], states: Sequence[str]
) -> list[Path]:
    """Whether a run resuming from ``checkpoint`` (``None``: fresh) loading ``states`` may write into
    ``model_dir``: a fresh run needs a directory without checkpoints; a fork (another directory) a new or empty
    one; in place, only from the newest readable checkpoint and loading ``global_step``. Raises
    :class:`ModelDirError` (reading only); returns the ``unreadable`` checkpoints to set aside (in place only)."""
    if checkpoint is None:
        if found := list_checkpoints(model_dir):
            raise ModelDirError(
                f"runconfig.model_dir {model_dir} already holds checkpoints (latest: step {found[-1][0]}). To "
                f"continue that run, add --resume {model_dir}; to start over, choose another model_dir "
                f"(--override runconfig.model_dir=...) or delete {model_dir}."
            )
        return []
    source = resolve_model_dir(checkpoint.parent)
    if source != model_dir:
        if model_dir.is_dir() and set(os.listdir(model_dir)) - {LOCK_FILE}:
            raise ModelDirError(
                f"runconfig.model_dir {model_dir} is not the directory of the checkpoint ({source}), so this run "
                f"starts a new run from the checkpoint, and a new run needs a new or empty directory: {model_dir} "
                f"is not empty. To continue {source} itself, resume it without another model_dir "
                f"(or with -o runconfig.model_dir={source})."
            )
        return []
    skipped, mine = {p.name for p, _ in unreadable}, checkpoint_step(checkpoint.name)
    newer = [p for step, p in list_checkpoints(source) if p.name not in skipped and step > mine]
    fork_hint = "load it into a new or empty directory instead: -o runconfig.model_dir=NEW_DIR"
    if newer:
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
    return [p for p, _ in unreadable]


class RunDir:
    """``path`` (resolved), created if missing, opened and locked; ``what`` names it in messages. ``stale``: the
    holder of a lock left by a run that ended without releasing it. A training run then calls :meth:`open`
    and writes rows, checkpoints and plots. Release with :meth:`close`."""

    def __init__(self, path: Path, what: str = "runconfig.model_dir") -> None:
        self.path, self.what = path, what
        if path.is_symlink():
            raise ModelDirError(f"{what} {path} is a symbolic link; give the directory it points to")
        self.created = not path.exists()  # removed again by close() when nothing was written into it
        try:
            path.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise NotADirectoryError(errno.ENOTDIR, f"{what} is not a directory", str(path)) from None
        try:
            self.fd = os.open(path, _DIRECTORY)
        except OSError as exc:  # replaced by a link since the check above
            if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and path.is_symlink()):
                raise ModelDirError(f"{what} {path} is a symbolic link; give the directory it points to") from None
            raise
        self.stale: str | None = None
        self._metrics: IO[bytes] | None = None
        self.events: Any = None  # torch.utils.tensorboard.SummaryWriter
        self._close = contextlib.ExitStack()  # what close() releases, last acquired first
        self._close.callback(os.close, self.fd)
        try:
            self._lock()
        except BaseException:
            self._close.close()
            raise

    def _lock(self) -> None:
        lock = self.path / LOCK_FILE
        while True:
            try:
                fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | _NOFOLLOW | os.O_NONBLOCK, 0o644, dir_fd=self.fd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise ModelDirError(f"{lock} is a symbolic link, which dls does not follow: remove it") from None
                exc.filename = str(lock)
                raise
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise ModelDirError(f"{lock} is not a regular file: remove it")
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
                    os.close(fd)
                    continue
                self.stale = _holder(fd, held=False)
                now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
                record = {"pid": os.getpid(), "host": socket.gethostname(), "since": now}
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(record).encode() + b"\n", 0)
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                raise
            self._close.callback(self._unlock, fd)
            return

    def _unlock(self, fd: int) -> None:
        """Release the lock (its file removed first); a directory this created and left empty is removed."""
        with contextlib.suppress(OSError):
            os.unlink(LOCK_FILE, dir_fd=self.fd)
        os.close(fd)
        if self.created:
            with contextlib.suppress(OSError):  # not empty: kept
                os.rmdir(self.path)

    def write(self, name: str, data: bytes | memoryview, append: bool = False) -> IO[bytes]:
        """Write ``name`` atomically: a new temporary file (a planted name is never opened), flushed to disk, renamed
        over ``name``; returned open (for appending with ``append``). Callers serialise into memory first, so that a
        failing write is the ``OSError`` it is, naming the file (``torch.save`` into a file makes it a
        ``RuntimeError``); a failed write leaves no temporary file."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | (os.O_APPEND if append else 0)
        tmp, f = "", None
        try:
            while f is None:
                tmp = f".{name}.{secrets.token_hex(6)}.tmp"
                with contextlib.suppress(FileExistsError):  # someone planted this name: take another
                    f = os.fdopen(os.open(tmp, flags, 0o644, dir_fd=self.fd), "ab" if append else "wb")
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException as exc:
            if f is not None:
                with contextlib.suppress(OSError):  # close() flushes again, and raises again on a full disk
                    f.close()
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=self.fd)
            if isinstance(exc, OSError) and exc.errno is not None:
                exc.filename, exc.filename2 = str(self.path / name), None
            raise
        with contextlib.suppress(OSError):
            os.fsync(self.fd)
        return f

    def replace(self, name: str, data: bytes | memoryview) -> Path:
        """:meth:`write` ``name``; its path."""
        self.write(name, data).close()
        return self.path / name

    def read(self, name: str) -> bytes | None:
        """The bytes of the regular file ``name``; ``None`` when there is none (a link or other kind counts as none)."""
        try:
            fd = os.open(name, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ELOOP):
                return None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen, which names a directory by its descriptor number
            os.close(fd)
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def open(
        self, log: Callable[[str], None], *, set_aside: Sequence[Path], step: int, config: dict[str, Any],
        config_file: Path | None, tensorboard: bool = False,
    ) -> None:  # fmt: skip
        """Start a training session: set the ``set_aside`` checkpoints aside, keep metrics.jsonl up to ``step`` open,
        write config.yaml (unless it is the input ``config_file``), start this session's TensorBoard events."""
        events = self.path / TENSORBOARD_DIR
        if tensorboard:  # checked before anything is written: created if missing, and refused unless a directory
            with contextlib.suppress(FileExistsError):  # (not a link) of the run's user writable by no one else
                os.mkdir(TENSORBOARD_DIR, 0o755, dir_fd=self.fd)
            try:
                events_fd = os.open(TENSORBOARD_DIR, _DIRECTORY, dir_fd=self.fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise ModelDirError(
                        f"{events} is not a directory (or is a symbolic link, which dls does not follow in "
                        "model_dir): move it away"
                    ) from None
                exc.filename = str(events)
                raise
            self._close.callback(os.close, events_fd)
            info = os.fstat(events_fd)
            if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise ModelDirError(f"{events} is writable by others than this run's user: move it away")
        keep = metrics_to_keep(self.read(METRICS_FILE), self.path / METRICS_FILE, step)  # may refuse
        for name in os.listdir(self.fd):  # the temporary files a killed writer left
            if name.endswith(".tmp") and name.startswith(_TEMPORARIES):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self.fd)
        for bad in set_aside:  # out of the way of this run's checkpoints and rotation, under the first free name
            for n in range(1, 1000):
                kept = f"{bad.name}.unreadable" + (f"-{n}" if n > 1 else "")
                try:
                    os.stat(kept, dir_fd=self.fd, follow_symlinks=False)
                except FileNotFoundError:
                    break
            else:
                raise FileExistsError(errno.EEXIST, "no free name to set the file aside", str(bad))
            os.rename(bad.name, kept, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            log(f"Renamed {bad.name} to {kept} (kept, never resumed from)")
        self._metrics = self._close.enter_context(self.write(METRICS_FILE, keep, append=True))
        if config_file is not None and is_same_file(self.fd, CONFIG_FILE, config_file):
            log(f"{self.path / CONFIG_FILE} is the input config: left as it is")
        else:
            self.replace(CONFIG_FILE, yaml.safe_dump(config, sort_keys=False).encode())
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # The directory as its descriptor's path, so that the writer cannot be redirected; a resumed session
            # purges the events a crashed one wrote after its checkpoint, as its metrics rows are dropped.
            proc = Path(f"/proc/self/fd/{events_fd}")
            log_dir = proc if proc.is_dir() else events
            self.events = SummaryWriter(str(log_dir), purge_step=step + 1 if step else None, flush_secs=3600)
            self._close.callback(self.events.close)

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
        newest checkpoints (never the one just written; a link is not a checkpoint: it pushes no real one out)."""
        buffer = io.BytesIO()  # in memory first: see write()
        torch.save({"format": FORMAT, "format_version": FORMAT_VERSION, **state}, buffer)
        path = self.replace(f"checkpoint_{step}.mdl", buffer.getbuffer())
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

    def close(self) -> None:
        """End the session's files, release the lock (see :meth:`_unlock`) and the directory."""
        self._close.close()

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
