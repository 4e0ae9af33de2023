"""The run directory (``runconfig.model_dir``): resolved once, locked for one run at a time, written without ever
following a symbolic link.

* :func:`resolve_model_dir` resolves the path once (a symlinked ``runs/`` is fine); everything after works relative
  to a descriptor of that directory (opened with ``O_NOFOLLOW``), so the run cannot be redirected later.
* :class:`RunDir` holds an exclusive lock on ``MODEL_DIR/.dls.lock`` (``fcntl.flock``, which the kernel releases
  when the holding process dies, however it dies). The file records the holder's pid, host and start time, so a
  second run is refused naming the holder, and a lock file left by a killed run is recognised as stale (its
  holder is gone: the lock is free) and taken over. The lock file is removed when the run releases it.
* Every file is written to a new temporary name created exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW``), flushed,
  fsync-ed and renamed over the final name (``os.replace``, which replaces a symbolic link itself, never its
  target). Readers see the old file or the new one, never a part.
* ``metrics.jsonl`` is rewritten that way once, then kept open as one append handle (:meth:`RunDir.open_log`).
* A subdirectory (TensorBoard's) is created or opened without following a link (:meth:`RunDir.subdirectory`).

POSIX only (Linux, macOS): it relies on ``flock``, ``O_NOFOLLOW`` and ``dir_fd``. On NFS, Linux emulates
``flock`` with byte-range locks, which work across hosts.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import secrets
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from dls.train.errors import ModelDirError

LOCK_FILE = ".dls.lock"
_NOFOLLOW, _CLOEXEC, _DIRECTORY = os.O_NOFOLLOW, os.O_CLOEXEC, os.O_DIRECTORY


def resolve_model_dir(path: str | Path, what: str = "runconfig.model_dir") -> Path:
    """``path`` made absolute with every symbolic link resolved (done once per run); ``what``: the key or option
    that named it, for the error."""
    if "\0" in str(path):
        raise ModelDirError(f"{what} {str(path)!r} contains a NUL character, which no path can hold")
    return Path(os.path.realpath(Path(path).expanduser()))


def _holder_record() -> dict[str, Any]:
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": now}


def describe_holder(record: dict[str, Any] | None, held: bool = True) -> str:
    """Who ``record`` names; ``held``: the lock is still held now (then a holder that ended left a child with it)."""
    if not record:
        return "another process (no holder recorded)"
    pid, host = record.get("pid", "?"), record.get("host", "?")
    text = f"pid {pid} on host {host}" + (f" (since {record['since']})" if record.get("since") else "")
    if held and host == socket.gethostname() and isinstance(pid, int) and not _alive(pid):
        text += f"; process {pid} has ended, so a process it started (which inherited the lock) still holds it"
    return text


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. EPERM: it exists
        return True
    return True


def _read_record(fd: int) -> dict[str, Any] | None:
    try:
        data = os.pread(fd, 4096, 0)
        record = json.loads(data.decode("utf-8")) if data.strip() else None
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _fsync_dir(dir_fd: int) -> None:
    with contextlib.suppress(OSError):
        os.fsync(dir_fd)


def open_directory(path: Path) -> int:
    """A descriptor of the directory ``path`` (its last component must not be a symbolic link)."""
    try:
        return os.open(path, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and path.is_symlink()):
            raise ModelDirError(f"{path} is a symbolic link; give the directory it points to") from None
        raise


def replace_file(
    dir_fd: int, name: str, data: bytes | memoryview, *, keep_open: bool = False, shown: Path | None = None
) -> IO[bytes] | None:
    """Write ``data`` to ``name`` in the directory ``dir_fd`` atomically: a new temporary file (created
    exclusively, never through a link) receives it, is fsync-ed and renamed over ``name``. With ``keep_open``
    the file is returned open for appending (its name is ``name`` by then). ``shown``: the path an ``OSError``
    names (default: the name inside the directory).

    Callers serialise in memory first (``torch.save``, matplotlib and PyYAML into a buffer): then a failing write
    (disk full, file too large) is the ``OSError`` it is, where ``torch.save`` into a file turns it into a
    ``RuntimeError``."""
    try:
        return _replace_file(dir_fd, name, data, keep_open)
    except OSError as exc:
        if shown is not None and exc.errno is not None:
            exc.filename, exc.filename2 = str(shown), None
        raise


def remove_temporaries(dir_fd: int, prefixes: tuple[str, ...]) -> None:
    """Delete the files ``<prefix>...tmp`` in ``dir_fd``: temporary files left by a process killed while writing
    (call it only while no other process writes the directory: under its lock). A link is removed, never
    followed."""
    for name in os.listdir(dir_fd):
        if name.endswith(".tmp") and name.startswith(prefixes):
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dir_fd)


def _replace_file(dir_fd: int, name: str, data: bytes | memoryview, keep_open: bool) -> IO[bytes] | None:
    while True:
        tmp = f".{name}.{secrets.token_hex(6)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC | (os.O_APPEND if keep_open else 0)
        try:
            fd = os.open(tmp, flags, 0o644, dir_fd=dir_fd)
            break
        except FileExistsError:  # someone planted this name: take another
            continue
    f = os.fdopen(fd, "ab" if keep_open else "wb")
    try:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:  # close() flushes again, and raises again on a full disk: the temporary file goes all the same
            f.close()
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
        raise
    _fsync_dir(dir_fd)
    if keep_open:
        return f
    f.close()
    return None


def read_file(dir_fd: int, name: str) -> bytes | None:
    """The bytes of the regular file ``name`` in ``dir_fd``; ``None`` when there is none (a symbolic link or
    anything else that is not a regular file counts as none: it is not followed)."""
    try:
        fd = os.open(name, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | getattr(os, "O_NONBLOCK", 0), dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen, which names a directory by its descriptor number
        os.close(fd)
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def is_same_file(dir_fd: int, name: str, other: Path) -> bool:
    """Whether ``name`` in ``dir_fd`` is the file ``other`` (same device and inode; links not followed)."""
    try:
        a = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        b = os.stat(other)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _in_use(path: Path, record: dict[str, Any] | None, what: str) -> ModelDirError:
    return ModelDirError(
        f"{what} {path} is in use by another dls run: {describe_holder(record)}. Wait for it to "
        "finish (or stop it), or choose another model_dir"
    )


class RunDir:
    """``path`` (already resolved), created if missing, opened and locked. Raises :class:`ModelDirError` (held by
    another run, a symbolic link) or ``OSError`` (not a directory, not writable); ``what``: the key or option that
    named the directory, for the messages.

    ``stale``: the holder record of a lock file left by a run that ended without releasing it (killed), or
    ``None``. Release with :meth:`close` (also a context manager)."""

    def __init__(self, path: Path, what: str = "runconfig.model_dir") -> None:
        self.path, self.what = path, what
        if path.is_symlink():
            raise ModelDirError(f"{what} {path} is a symbolic link; give the directory it points to")
        self.created = not path.exists()  # removed again by close() when nothing was written into it
        try:
            path.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise NotADirectoryError(errno.ENOTDIR, f"{what} is not a directory", str(path)) from None
        self.fd = open_directory(path)
        self.stale: dict[str, Any] | None = None
        self._lock_fd: int | None = None
        try:
            self._lock()
        except BaseException:
            os.close(self.fd)
            raise

    def _lock(self) -> None:
        while True:
            try:
                fd = os.open(
                    LOCK_FILE, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC | os.O_NONBLOCK, 0o644, dir_fd=self.fd
                )
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise ModelDirError(
                        f"{self.path / LOCK_FILE} is a symbolic link; dls does not follow links in model_dir: remove it"
                    ) from None
                exc.filename = str(self.path / LOCK_FILE)
                raise
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise ModelDirError(f"{self.path / LOCK_FILE} is not a regular file: remove it")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise _in_use(self.path, _read_record(fd), self.what) from None
                # A holder that released between our open and our lock has unlinked the file we locked: retry.
                try:
                    current = os.stat(LOCK_FILE, dir_fd=self.fd, follow_symlinks=False)
                except FileNotFoundError:
                    current = None
                mine = os.fstat(fd)
                if current is None or (current.st_dev, current.st_ino) != (mine.st_dev, mine.st_ino):
                    os.close(fd)
                    continue
                self.stale = _read_record(fd)
                record = json.dumps(_holder_record()).encode()
                os.ftruncate(fd, 0)
                os.pwrite(fd, record + b"\n", 0)
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                raise
            self._lock_fd = fd
            return

    def replace(self, name: str, data: bytes | memoryview) -> Path:
        """Write ``name`` atomically (see :func:`replace_file`); its path."""
        replace_file(self.fd, name, data, shown=self.path / name)
        return self.path / name

    def open_log(self, name: str, content: bytes) -> IO[bytes]:
        """Replace ``name`` by ``content`` atomically and return it open for appending (one handle per run)."""
        f = replace_file(self.fd, name, content, keep_open=True, shown=self.path / name)
        assert f is not None
        return f

    def read(self, name: str) -> bytes | None:
        return read_file(self.fd, name)

    def subdirectory(self, name: str) -> int:
        """A descriptor of the subdirectory ``name``, created if missing (close it with ``os.close``). A symbolic
        link or anything else that is not a directory under that name raises :class:`ModelDirError`."""
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o755, dir_fd=self.fd)
        try:
            return os.open(name, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise ModelDirError(
                    f"{self.path / name} is not a directory (or is a symbolic link, which dls does not follow in "
                    "model_dir): move it away"
                ) from None
            exc.filename = str(self.path / name)
            raise

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def set_aside(self, name: str, suffix: str) -> str:
        """Rename ``name`` to the first free ``name + suffix`` (then ``-2``, ``-3``, ...); the new name."""
        for n in range(1, 1000):
            new_name = name + suffix + (f"-{n}" if n > 1 else "")
            try:
                os.stat(new_name, dir_fd=self.fd, follow_symlinks=False)
            except FileNotFoundError:
                os.rename(name, new_name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
                _fsync_dir(self.fd)
                return new_name
        raise FileExistsError(errno.EEXIST, "no free name to set the file aside", str(self.path / name))

    def close(self) -> None:
        """Release the lock (removing the lock file first, so a waiting run cannot lock a file that is gone); a
        directory this created and nothing was written into (a run refused after locking) is removed."""
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(LOCK_FILE, dir_fd=self.fd)
            os.close(self._lock_fd)
            self._lock_fd = None
            if self.created:
                with contextlib.suppress(OSError):  # not empty: kept
                    os.rmdir(self.path)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def entries(path: Path) -> Iterator[str]:
    """Names in the directory ``path`` other than a lock file (none when it does not exist)."""
    try:
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return iter(())
    return iter(n for n in names if n != LOCK_FILE)
