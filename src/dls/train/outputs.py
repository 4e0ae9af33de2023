"""A run's model_dir while it runs (:class:`RunOutputs`): locked first, then checked once, under the lock, for
where the run may write (:func:`check_model_dir`), then the files besides checkpoints (``dls.train.checkpoint``):
``metrics.jsonl`` (one JSON row per logged step), ``config.yaml`` (the resolved config), ``plots.png``, and with
``runconfig.tensorboard`` the same rows as TensorBoard events in ``tensorboard/``.

Where a run writes (``runconfig.model_dir``, called DIR below; ``SRC`` is the directory of the checkpoint):

* a fresh run (no ``--resume``) refuses a DIR that already holds checkpoints;
* a resumed run continues *in place* (DIR is SRC) only from SRC's newest readable checkpoint and only when it
  loads ``global_step``: the run goes on where it stopped (Model Zoo's case of loading every state but
  ``grad_scaler`` to switch loss scaling on is one). Anything else in place (a rewind to an older checkpoint, a
  restart at step 0) would overwrite the run's metrics and leave checkpoints of the other history behind, so it
  is refused;
* a resumed run with another DIR is a *fork*: DIR must be new or empty, SRC is only read, and the step count
  continues from the checkpoint's (when ``global_step`` is loaded).

Rank 0 alone writes, while it holds the directory's lock (``dls.train.rundir``); ``metrics.jsonl`` is rewritten
once up to the step the run starts from (a crash may have left rows a checkpoint does not cover), then appended to
through one handle, a row flushed before the next step runs.

TensorBoard: torch's ``SummaryWriter`` writes each session's event file into ``tensorboard/``, opened without
following a link (a link there is refused), the run owner's and writable by no one else (so no one else can plant
a link in it), and given to the writer as the descriptor's path (``/proc/self/fd/N`` on Linux). A resumed session
purges (``purge_step``) the events a crashed session wrote after its checkpoint, as its metrics rows are dropped.
Each numeric value of a row is a scalar under its metrics name at ``step``, flushed with the row.
"""

from __future__ import annotations

import io
import json
import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import yaml

from dls.train import checkpoint as ckpt
from dls.train.errors import MissingExtras, ModelDirError
from dls.train.plots import metrics_to_keep, plot_run, read_metrics
from dls.train.rundir import RunDir, describe_holder, entries, is_same_file, remove_temporaries, resolve_model_dir

__all__ = [
    "CONFIG_FILE",
    "METRICS_FILE",
    "PLOT_FILE",
    "TENSORBOARD_DIR",
    "RunOutputs",
    "check_model_dir",
    "require_tensorboard",
]

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "plots.png"
CONFIG_FILE = "config.yaml"
TENSORBOARD_DIR = "tensorboard"
TENSORBOARD_HINT = "pip install 'dls[tensorboard]'"


class RunOutputs:
    """A run's model_dir while it runs: :meth:`lock`, :meth:`check`, :meth:`open`, then rows and plots;
    :meth:`close` releases it. ``locked``: whether :meth:`lock` got the lock (then a crash report may go there)."""

    def __init__(self, model_dir: Path, log: Callable[[str], None]) -> None:
        self.model_dir = model_dir
        self.metrics_path = model_dir / METRICS_FILE
        self.log = log
        self.run_dir: RunDir | None = None
        self.locked = False
        self.in_place = False
        self._metrics: IO[bytes] | None = None
        self.events: Any = None  # torch.utils.tensorboard.SummaryWriter
        self._events_fd: int | None = None

    def lock(self) -> None:
        """Create (if missing), open and lock model_dir (``dls.train.rundir.RunDir``)."""
        run_dir = self.run_dir = RunDir(self.model_dir)
        self.locked = True
        if run_dir.stale:
            self.log(
                f"Taking over the lock of {describe_holder(run_dir.stale, held=False)}: that run ended without "
                "releasing it"
            )

    def check(self, checkpoint: Path | None, unreadable: Sequence[tuple[Path, str]], states: Sequence[str]) -> None:
        """Whether the run may write here (:func:`check_model_dir`), once, under the lock."""
        self.in_place = check_model_dir(self.model_dir, checkpoint, unreadable, states)

    def open(
        self,
        *,
        unreadable: Sequence[tuple[Path, str]],
        step: int,
        config: dict[str, Any],
        config_file: Path | None,
        tensorboard: bool = False,
    ) -> None:
        """Put unreadable checkpoints aside (in place), rewrite metrics.jsonl up to ``step`` and keep it open, write
        ``config`` to config.yaml unless that file is the input ``config_file``; with ``tensorboard``, start this
        session's event file."""
        run_dir = self.run_dir
        assert run_dir is not None, "open() follows lock()"
        if tensorboard:  # checked before anything is written
            self._events_fd = self._events_dir(run_dir)
        keep = metrics_to_keep(run_dir.read(METRICS_FILE), self.metrics_path, step)  # may refuse
        remove_temporaries(run_dir.fd, tuple(f".{name}." for name in (METRICS_FILE, PLOT_FILE, CONFIG_FILE)))
        for bad, _ in unreadable if self.in_place else []:  # out of the way of this run's checkpoints and rotation
            kept = run_dir.set_aside(bad.name, ".unreadable")
            self.log(f"Renamed {bad.name} to {kept} (kept, never resumed from)")
        self._metrics = run_dir.open_log(METRICS_FILE, keep)
        if config_file is not None and is_same_file(run_dir.fd, CONFIG_FILE, config_file):
            self.log(f"{self.model_dir / CONFIG_FILE} is the input config: left as it is")
        else:
            run_dir.replace(CONFIG_FILE, yaml.safe_dump(config, sort_keys=False).encode())
        if self._events_fd is not None:
            from torch.utils.tensorboard import SummaryWriter

            proc = Path(f"/proc/self/fd/{self._events_fd}")
            log_dir = proc if proc.is_dir() else self.model_dir / TENSORBOARD_DIR
            self.events = SummaryWriter(str(log_dir), purge_step=step + 1 if step else None, flush_secs=3600)

    def _events_dir(self, run_dir: RunDir) -> int:
        """A descriptor of ``tensorboard/`` (see the module docstring for what it must be)."""
        fd = run_dir.subdirectory(TENSORBOARD_DIR)
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            os.close(fd)
            raise ModelDirError(
                f"{self.model_dir / TENSORBOARD_DIR} is writable by others than this run's user: move it away"
            )
        return fd

    def write_row(self, row: dict[str, Any]) -> None:
        """Append one metrics row (on disk before this returns)."""
        assert self._metrics is not None, "rows are written while the outputs are open"
        try:
            self._metrics.write((json.dumps(row, allow_nan=False) + "\n").encode())
            self._metrics.flush()
        except OSError as exc:  # e.g. the disk is full: say which file
            exc.filename = exc.filename or str(self.metrics_path)
            raise
        if self.events is not None:
            for key, value in row.items():
                if key not in ("step", "time") and isinstance(value, (int, float)):  # bool is an int
                    self.events.add_scalar(key, float(value), row["step"])
            self.events.flush()

    def plot(self, title: str) -> Path | None:
        """Write plots.png from metrics.jsonl; its path (``None`` when the outputs are not open)."""
        if self.run_dir is None:
            return None
        rows = read_metrics(self.run_dir.read(METRICS_FILE) or b"")
        png = io.BytesIO()
        plot_run(rows, png, title=title)
        return self.run_dir.replace(PLOT_FILE, png.getbuffer())

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self.events is not None:
            self.events.close()
            self.events = None
        if self._events_fd is not None:
            os.close(self._events_fd)
            self._events_fd = None
        if self.run_dir is not None:
            self.run_dir.close()
            self.run_dir = None


def require_tensorboard() -> None:
    """Raise :class:`MissingExtras` (exit status 2) when ``runconfig.tensorboard`` cannot work: TensorBoard is not
    installed (the ``tensorboard`` extra). The trainer calls it before anything is built or written."""
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as exc:
        raise MissingExtras(
            f"runconfig.tensorboard needs the 'tensorboard' extra ({exc}); install it with: {TENSORBOARD_HINT}"
        ) from None


def check_model_dir(
    model_dir: Path, checkpoint: Path | None, unreadable: Sequence[tuple[Path, str]], states: Sequence[str]
) -> bool:
    """Whether the run may write into ``model_dir`` (resolved) when resuming from ``checkpoint`` (``None``: a
    fresh run) loading ``states``; ``unreadable`` are the newer checkpoints of its directory that could not be
    read. Returns whether the run continues in place; raises :class:`ModelDirError` (reading only)."""
    if checkpoint is None:
        found = ckpt.list_checkpoints(model_dir)
        if found:
            raise ModelDirError(
                f"runconfig.model_dir {model_dir} already holds checkpoints (latest: step {found[-1][0]}). To "
                f"continue that run, add --resume {model_dir}; to start over, choose another model_dir "
                f"(--override runconfig.model_dir=...) or delete {model_dir}."
            )
        return False
    source = resolve_model_dir(checkpoint.parent)
    if source != model_dir:
        if any(True for _ in entries(model_dir)):
            raise ModelDirError(
                f"runconfig.model_dir {model_dir} is not the directory of the checkpoint ({source}), so this run "
                f"starts a new run from the checkpoint, and a new run needs a new or empty directory: {model_dir} "
                f"is not empty. To continue {source} itself, resume it without another model_dir "
                f"(or with -o runconfig.model_dir={source})."
            )
        return False
    skipped = {p.name for p, _ in unreadable}
    newer = [p for step, p in ckpt.list_checkpoints(source) if p.name not in skipped and p.name != checkpoint.name]
    newer = [p for p in newer if _step_of(p) > _step_of(checkpoint)]
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
    return True


def _step_of(path: Path) -> int:
    name = path.name
    digits = name[len("checkpoint_") : -len(".mdl")] if name.startswith("checkpoint_") else ""
    return int(digits) if digits.isdigit() else -1
