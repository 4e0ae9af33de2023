"""A run's model_dir and the files dls writes there: resolved once, locked for one run at a time (``flock``; a lock
left by a killed run is taken over), written only through its descriptor, never through a link, each file atomically
(:meth:`RunDir.replace`) or created exclusively (:meth:`RunDir.create_all`, for ``dls init`` and ``dls data``),
checked once under the lock (:func:`check_model_dir`: where a fresh, resumed or forked run may write); rank 0 alone
writes. The names: ``checkpoint_<step>.mdl`` (what is in one: ``dls.train.checkpoint``), ``metrics.jsonl``,
``config.yaml``, ``plots.png``, ``trace.jsonl``, ``tensorboard/``, the lock ``.dls.lock``. POSIX only."""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import io
import itertools
import json
import os
import re
import secrets
import socket
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import yaml

from dls.diagnostics.trace import TRACE_FILE, TraceError, kept_until
from dls.train.errors import ModelDirError
from dls.train.reporting import metrics_to_keep, plot_comparison, read_metrics

LOCK_FILE = ".dls.lock"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "plots.png"
CONFIG_FILE = "config.yaml"
TENSORBOARD_DIR = "tensorboard"
_TEMPORARIES = (".checkpoint_", *(f".{name}." for name in (METRICS_FILE, PLOT_FILE, CONFIG_FILE, TRACE_FILE)))
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def trace_to_keep(data: bytes | None, path: Path, step: int) -> bytes:
    """The lines of the trace ``data`` (the file ``path``) a run resumed at ``step`` keeps
    (``dls.diagnostics.trace.kept_until``: read with the trace reader's bounds and checks); a trace that reader
    refuses is refused (:class:`ModelDirError`: the file is kept), as a metrics.jsonl that is not one."""
    if not data:
        return b""
    file = io.BytesIO(data)
    file.name = str(path)
    try:
        return kept_until(file, step)
    except TraceError as exc:
        raise ModelDirError(
            f"{exc}; a resumed run rewrites that file and would lose it: move the file away (resuming does not "
            "need it) and run again"
        ) from None


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
    except (OSError, ValueError, RecursionError):  # empty, or not a record dls wrote (a nesting bomb among them)
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

    def write_checkpoint(self, step: int, data: bytes | memoryview, keep: int | None = None) -> Path:
        """Write the serialised checkpoint ``data`` as ``checkpoint_<step>.mdl`` atomically (:meth:`replace`), then with
        ``keep`` delete all but the ``keep`` newest checkpoints (never the one just written; a link is not a
        checkpoint: it pushes no real one out). A checkpoint of a step the directory held when the session opened it
        is never replaced (:class:`ModelDirError`): a session writes only the steps it trains."""
        if step in self._steps_before:
            raise ModelDirError(
                f"{checkpoint_path(self.path, step)} was there before this session, which would replace it: a run "
                "never writes a step it did not train (nothing was written)"
            )
        path = self.replace(checkpoint_path(self.path, step).name, data)
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
