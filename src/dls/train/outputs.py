"""The files a run writes into its model_dir besides checkpoints (``dls.train.checkpoint``): ``metrics.jsonl``
(one JSON row per logged step), ``config.yaml`` (the resolved config), ``plots.png``, and with
``runconfig.tensorboard`` the same rows as TensorBoard events in ``tensorboard/``.

Rank 0 alone writes them, while it holds the directory's lock (``dls.train.rundir``); ``metrics.jsonl`` is rewritten
once up to the step the run starts from (a crash may have left rows a checkpoint does not cover), then appended to
through one handle, a row flushed before the next step runs.

TensorBoard (:class:`TensorBoardEvents`): each session writes one new event file,
``tensorboard/events.out.tfevents.<seconds>.<nanoseconds>.<host>.<pid>``, in the subdirectory ``tensorboard`` that
the run creates (or reuses) itself; ``tensorboard --logdir runs/`` shows every run under its model_dir. The rundir rules
hold for it: the subdirectory is opened without following a link (a link named ``tensorboard`` is refused), the
event file is created exclusively inside it, never through a link, and written through that one handle.
That is why the events are framed by TensorBoard's own ``RecordWriter`` and the summaries built by
``torch.utils.tensorboard.summary.scalar``, but not written by ``SummaryWriter``: its file writer takes a path and
reopens the file by that path at every flush (TensorBoard's ``gfile`` without TensorFlow), which would follow a link
put in its place, and it flushes from a thread of its own, where these rows are on disk when the step ends, as
``metrics.jsonl``'s are. A resumed session starts its file with TensorBoard's purge marker at the step it resumes
from, so the events a crashed session wrote after its last checkpoint are hidden, as its metrics rows are dropped.
Every numeric value of a row is a scalar under its metrics name (``loss``, ``loss_scale``, ``skipped`` as 0/1,
``grad_norm``, ``lr``, ``grad_underflow``, ``fp8_grad_output_flushed``, ...); ``step`` is the global step.
"""

from __future__ import annotations

import io
import json
import os
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import yaml

from dls.train import restore
from dls.train.errors import MissingExtras
from dls.train.plots import metrics_to_keep, plot_run, read_metrics
from dls.train.rundir import RunDir, create_file, describe_holder, is_same_file, remove_temporaries

__all__ = [
    "CONFIG_FILE",
    "METRICS_FILE",
    "PLOT_FILE",
    "TENSORBOARD_DIR",
    "RunOutputs",
    "TensorBoardEvents",
    "require_tensorboard",
]

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "plots.png"
CONFIG_FILE = "config.yaml"
TENSORBOARD_DIR = "tensorboard"
TENSORBOARD_HINT = "pip install 'dls[tensorboard]'"


class RunOutputs:
    """A run's model_dir while it runs: :meth:`open` locks it and prepares the files, :meth:`close` releases it.

    ``locked``: whether :meth:`open` got the lock (then the directory is the run's: a crash report may go there).
    """

    def __init__(self, model_dir: Path, log: Callable[[str], None]) -> None:
        self.model_dir = model_dir
        self.metrics_path = model_dir / METRICS_FILE
        self.log = log
        self.run_dir: RunDir | None = None
        self.locked = False
        self._metrics: IO[bytes] | None = None
        self.events: TensorBoardEvents | None = None

    def open(
        self,
        *,
        checkpoint: Path | None,
        unreadable: Sequence[tuple[Path, str]],
        states: Sequence[str],
        step: int,
        config: dict[str, Any],
        config_file: Path | None,
        tensorboard: bool = False,
    ) -> None:
        """Lock model_dir, check again under the lock where the run may write (:func:`restore.check_model_dir`),
        put unreadable checkpoints aside (in place), rewrite metrics.jsonl up to ``step`` and keep it open, write
        ``config`` to config.yaml unless that file is the input ``config_file``; with ``tensorboard``, start this
        session's event file (:class:`TensorBoardEvents`)."""
        run_dir = self.run_dir = RunDir(self.model_dir)
        self.locked = True
        try:
            if run_dir.stale:
                self.log(
                    f"Taking over the lock of {describe_holder(run_dir.stale, held=False)}: that run ended without "
                    "releasing it"
                )
            in_place = restore.check_model_dir(self.model_dir, checkpoint, unreadable, states)
            keep = metrics_to_keep(run_dir.read(METRICS_FILE), self.metrics_path, step)  # may refuse
            remove_temporaries(run_dir.fd, tuple(f".{name}." for name in (METRICS_FILE, PLOT_FILE, CONFIG_FILE)))
            for bad, _ in unreadable if in_place else []:  # out of the way of this run's checkpoints and rotation
                kept = run_dir.set_aside(bad.name, ".unreadable")
                self.log(f"Renamed {bad.name} to {kept} (kept, never resumed from)")
            self._metrics = run_dir.open_log(METRICS_FILE, keep)
            if config_file is not None and is_same_file(run_dir.fd, CONFIG_FILE, config_file):
                self.log(f"{self.model_dir / CONFIG_FILE} is the input config: left as it is")
            else:
                run_dir.replace(CONFIG_FILE, yaml.safe_dump(config, sort_keys=False).encode())
            if tensorboard:
                self.events = TensorBoardEvents(run_dir, step)
        except BaseException:
            self.close()
            raise

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
            self.events.write(row)

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
        if self.run_dir is not None:
            self.run_dir.close()
            self.run_dir = None


class TensorBoardEvents:
    """This session's TensorBoard event file in ``run_dir/tensorboard/`` (see the module docstring); the session
    resumes from ``start_step``. Needs the ``tensorboard`` extra (imported here)."""

    def __init__(self, run_dir: RunDir, start_step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.record_writer import RecordWriter
        from torch.utils.tensorboard.summary import scalar

        self._event, self._summary, self._scalar = Event, Summary, scalar
        # TensorBoard reads a directory's event files in the order of their names: the start time, to the nanosecond,
        # comes first, so a session's events follow those of the sessions before it.
        seconds, nanoseconds = divmod(time.time_ns(), 10**9)
        name = f"events.out.tfevents.{seconds:010d}.{nanoseconds:09d}.{socket.gethostname()}.{os.getpid()}"
        self.path = run_dir.path / TENSORBOARD_DIR / name
        directory = run_dir.subdirectory(TENSORBOARD_DIR)
        try:
            self._file = create_file(directory, name, shown=self.path)
        finally:
            os.close(directory)
        self._records = RecordWriter(self._file)
        now = time.time()
        self._add(Event(wall_time=now, file_version="brain.Event:2"))
        # TensorBoard hides the events at this step and after that earlier files hold (a crashed session's).
        self._add(Event(wall_time=now, step=start_step + 1, session_log=SessionLog(status=SessionLog.START)))
        self._flush()

    def write(self, row: dict[str, Any]) -> None:
        """One event at ``row["step"]`` holding every numeric value of the metrics row (booleans as 0/1)."""
        values = [
            v
            for key, value in row.items()
            if key not in ("step", "time") and isinstance(value, (int, float))  # bool is an int
            for v in self._scalar(key, float(value)).value
        ]
        self._add(self._event(wall_time=time.time(), step=row["step"], summary=self._summary(value=values)))
        self._flush()

    def _add(self, event: Any) -> None:
        self._records.write(event.SerializeToString())

    def _flush(self) -> None:
        try:
            self._file.flush()
        except OSError as exc:
            exc.filename = exc.filename or str(self.path)
            raise

    def close(self) -> None:
        self._file.close()


def require_tensorboard() -> None:
    """Raise :class:`MissingExtras` (exit status 2) when ``runconfig.tensorboard`` cannot work: TensorBoard's event
    writer is not installed (the ``tensorboard`` extra). The trainer calls it before anything is built or written."""
    try:
        import tensorboard.summary.writer.record_writer  # noqa: F401
        import torch.utils.tensorboard.summary  # noqa: F401
    except ImportError as exc:
        raise MissingExtras(
            f"runconfig.tensorboard needs the 'tensorboard' extra ({exc}); install it with: {TENSORBOARD_HINT}"
        ) from None
