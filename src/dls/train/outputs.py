"""A run's model_dir while it runs: locked, checked once under the lock (:func:`check_model_dir`), then
``metrics.jsonl``, ``config.yaml``, ``plots.png`` and TensorBoard events in ``tensorboard/``. Rank 0 alone writes."""

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
from dls.train.reporting import metrics_to_keep, plot_run, read_metrics
from dls.train.rundir import LOCK_FILE, RunDir, describe_holder, is_same_file, remove_temporaries, resolve_model_dir

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "plots.png"
CONFIG_FILE = "config.yaml"
TENSORBOARD_DIR = "tensorboard"


class RunOutputs:
    """:meth:`lock`, :meth:`check`, :meth:`open`, then rows and plots; :meth:`close` releases model_dir."""

    def __init__(self, model_dir: Path, log: Callable[[str], None]) -> None:
        self.model_dir = model_dir
        self.metrics_path = model_dir / METRICS_FILE
        self.log = log
        self.run_dir: RunDir | None = None
        self.locked = False  # then a crash report may go there
        self.in_place = False
        self._metrics: IO[bytes] | None = None
        self.events: Any = None  # torch.utils.tensorboard.SummaryWriter
        self._events_fd: int | None = None

    def lock(self) -> None:
        run_dir = self.run_dir = RunDir(self.model_dir)
        self.locked = True
        if run_dir.stale:
            holder = describe_holder(run_dir.stale, held=False)
            self.log(f"Taking over the lock of {holder}: that run ended without releasing it")

    def check(self, checkpoint: Path | None, unreadable: Sequence[tuple[Path, str]], states: Sequence[str]) -> None:
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
        """Set unreadable checkpoints aside (in place), keep metrics.jsonl up to ``step`` open, write config.yaml
        (unless it is the input ``config_file``), start this session's TensorBoard events."""
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

            # The directory as its descriptor's path, so that the writer cannot be redirected; a resumed session
            # purges the events a crashed one wrote after its checkpoint, as its metrics rows are dropped.
            proc = Path(f"/proc/self/fd/{self._events_fd}")
            log_dir = proc if proc.is_dir() else self.model_dir / TENSORBOARD_DIR
            self.events = SummaryWriter(str(log_dir), purge_step=step + 1 if step else None, flush_secs=3600)

    def _events_dir(self, run_dir: RunDir) -> int:
        """``tensorboard/``: not a link, the run owner's and writable by no one else (no one can plant a link)."""
        fd = run_dir.subdirectory(TENSORBOARD_DIR)
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            os.close(fd)
            raise ModelDirError(
                f"{self.model_dir / TENSORBOARD_DIR} is writable by others than this run's user: move it away"
            )
        return fd

    def write_row(self, row: dict[str, Any]) -> None:
        """Append one metrics row (on disk before this returns) and its numbers as TensorBoard scalars."""
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
        png = io.BytesIO()
        plot_run(read_metrics(self.run_dir.read(METRICS_FILE) or b""), png, title=title)
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
    """:class:`MissingExtras` when ``runconfig.tensorboard`` cannot work (checked before anything is written)."""
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as exc:
        raise MissingExtras(
            f"runconfig.tensorboard needs the 'tensorboard' extra ({exc}); install it with: "
            "pip install 'dls[tensorboard]'"
        ) from None


def check_model_dir(
    model_dir: Path, checkpoint: Path | None, unreadable: Sequence[tuple[Path, str]], states: Sequence[str]
) -> bool:
    """Whether a run resuming from ``checkpoint`` (``None``: fresh) loading ``states`` may write into
    ``model_dir``: a fresh run needs a directory without checkpoints; a fork (another directory) a new or empty
    one; in place, only from the newest readable checkpoint and loading ``global_step``. Returns whether the run
    continues in place; raises :class:`ModelDirError` (reading only)."""
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
        if model_dir.is_dir() and set(os.listdir(model_dir)) - {LOCK_FILE}:
            raise ModelDirError(
                f"runconfig.model_dir {model_dir} is not the directory of the checkpoint ({source}), so this run "
                f"starts a new run from the checkpoint, and a new run needs a new or empty directory: {model_dir} "
                f"is not empty. To continue {source} itself, resume it without another model_dir "
                f"(or with -o runconfig.model_dir={source})."
            )
        return False
    skipped = {p.name for p, _ in unreadable}
    mine = ckpt.checkpoint_step(checkpoint.name)
    newer = [p for step, p in ckpt.list_checkpoints(source) if p.name not in skipped and step > mine]
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
