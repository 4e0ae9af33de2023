"""The files a run writes into its model_dir besides checkpoints (``dls.train.checkpoint``): ``metrics.jsonl``
(one JSON row per logged step), ``config.yaml`` (the resolved config) and ``plots.png``.

Rank 0 alone writes them, while it holds the directory's lock (``dls.train.rundir``); ``metrics.jsonl`` is rewritten
once up to the step the run starts from (a crash may have left rows a checkpoint does not cover), then appended to
through one handle, a row flushed before the next step runs.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import yaml

from dls.train import restore
from dls.train.plots import metrics_to_keep, plot_run, read_metrics
from dls.train.rundir import RunDir, describe_holder, is_same_file, remove_temporaries

__all__ = ["CONFIG_FILE", "METRICS_FILE", "PLOT_FILE", "RunOutputs"]

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "plots.png"
CONFIG_FILE = "config.yaml"


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

    def open(
        self,
        *,
        checkpoint: Path | None,
        unreadable: Sequence[tuple[Path, str]],
        states: Sequence[str],
        step: int,
        config: dict[str, Any],
        config_file: Path | None,
    ) -> None:
        """Lock model_dir, check again under the lock where the run may write (:func:`restore.check_model_dir`),
        put unreadable checkpoints aside (in place), rewrite metrics.jsonl up to ``step`` and keep it open, write
        ``config`` to config.yaml unless that file is the input ``config_file``."""
        run_dir = self.run_dir = RunDir(self.model_dir)
        self.locked = True
        try:
            if run_dir.stale:
                self.log(
                    f"Taking over the lock of {describe_holder(run_dir.stale)}: that run ended without releasing it"
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
        if self.run_dir is not None:
            self.run_dir.close()
            self.run_dir = None
