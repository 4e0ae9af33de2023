"""The run directory: resolved once, locked for one run at a time (``flock``; a lock left by a killed run is
taken over), written only through its descriptor, never through a link, each file atomically. POSIX only."""

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
from pathlib import Path
from typing import IO, Any

from dls.train.errors import ModelDirError

LOCK_FILE = ".dls.lock"
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW


def resolve_model_dir(path: str | Path, what: str = "runconfig.model_dir") -> Path:
    """``path`` absolute with every link resolved (once per run); ``what`` names it in errors."""
    if "\0" in str(path):
        raise ModelDirError(f"{what} {str(path)!r} contains a NUL character, which no path can hold")
    return Path(os.path.realpath(Path(path).expanduser()))


def describe_holder(record: dict[str, Any] | None, held: bool = True) -> str:
    """Who holds a lock (``held``: still now; then a holder that ended left a child with it)."""
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
        pass
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
    """A descriptor of the directory ``path`` (whose last component must not be a link)."""
    try:
        return os.open(path, _DIRECTORY)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and path.is_symlink()):
            raise ModelDirError(f"{path} is a symbolic link; give the directory it points to") from None
        raise


def replace_file(
    dir_fd: int, name: str, data: bytes | memoryview, *, keep_open: bool = False, shown: Path | None = None
) -> IO[bytes] | None:
    """Write ``name`` in ``dir_fd`` atomically (see the module docstring); with ``keep_open``, return it open for
    appending. ``shown``: the path an ``OSError`` names. Callers serialise into memory first, so that a failing
    write is the ``OSError`` it is (``torch.save`` into a file makes it a ``RuntimeError``)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | (os.O_APPEND if keep_open else 0)
    while True:
        tmp = f".{name}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, flags, 0o644, dir_fd=dir_fd)
            break
        except FileExistsError:  # someone planted this name: take another
            continue
        except OSError as exc:
            raise _named(exc, shown) from None
    f = os.fdopen(fd, "ab" if keep_open else "wb")
    try:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException as exc:
        with contextlib.suppress(OSError):  # close() flushes again, and raises again on a full disk
            f.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        if isinstance(exc, OSError):
            raise _named(exc, shown) from None
        raise
    _fsync_dir(dir_fd)
    if keep_open:
        return f
    f.close()
    return None


def _named(exc: OSError, shown: Path | None) -> OSError:
    if shown is not None and exc.errno is not None:
        exc.filename, exc.filename2 = str(shown), None
    return exc


def remove_temporaries(dir_fd: int, prefixes: tuple[str, ...]) -> None:
    """Delete the ``<prefix>...tmp`` files a killed writer left in ``dir_fd`` (under its lock; links not followed)."""
    for name in os.listdir(dir_fd):
        if name.endswith(".tmp") and name.startswith(prefixes):
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dir_fd)


def is_same_file(dir_fd: int, name: str, other: Path | int) -> bool:
    """Whether ``name`` in ``dir_fd`` (not followed) is the file ``other`` (a path or an open descriptor)."""
    try:
        a, b = os.stat(name, dir_fd=dir_fd, follow_symlinks=False), os.stat(other)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class RunDir:
    """``path`` (resolved), created if missing, opened and locked; ``what`` names it in messages. ``stale``: the
    holder record of a lock left by a run that ended without releasing it. Release with :meth:`close`."""

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
                        f"{self.what} {self.path} is in use by another dls run: {describe_holder(_read_record(fd))}. "
                        "Wait for it to finish (or stop it), or choose another model_dir"
                    ) from None
                # A holder that released between our open and our lock has unlinked the file we locked: retry.
                if not is_same_file(self.fd, LOCK_FILE, fd):
                    os.close(fd)
                    continue
                self.stale = _read_record(fd)
                now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
                record = {"pid": os.getpid(), "host": socket.gethostname(), "since": now}
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(record).encode() + b"\n", 0)
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                raise
            self._lock_fd = fd
            return

    def replace(self, name: str, data: bytes | memoryview) -> Path:
        replace_file(self.fd, name, data, shown=self.path / name)
        return self.path / name

    def open_log(self, name: str, content: bytes) -> IO[bytes]:
        f = replace_file(self.fd, name, content, keep_open=True, shown=self.path / name)
        assert f is not None
        return f

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

    def subdirectory(self, name: str) -> int:
        """A descriptor of the subdirectory ``name``, created if missing; anything else there is refused."""
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o755, dir_fd=self.fd)
        try:
            return os.open(name, _DIRECTORY, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise ModelDirError(
                    f"{self.path / name} is not a directory (or is a symbolic link, which dls does not follow in "
                    "model_dir): move it away"
                ) from None
            exc.filename = str(self.path / name)
            raise

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
        """Release the lock (its file removed first); a directory this created and left empty is removed."""
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
