"""The training loop behind ``dls train``: one config in, a trained model, checkpoints, metrics and plots out.

Per step: forward (under ``torch.autocast`` for float16/bfloat16, or with ``dls.emulate`` hooks for cbfloat16
and ``precision.emulate``), ``scaler.scale(loss).backward()``, ``scaler.unscale_``, the global gradient norm,
clipping (``clip_gradients_and_return_isfinite`` for ``max_gradient_norm``, elementwise for
``max_gradient_value``), ``scaler.step`` (skipped on overflow), ``scaler.update``, the LR schedule, metrics.

Stops with :class:`TrainingStopped` (after writing a checkpoint) when loss scaling cannot help any more: the
dynamic scale sits at ``min_loss_scale`` and ``max_overflows_at_min_loss_scale`` consecutive steps still
overflow, a static scale overflows that many steps in a row, or gradients are inf/NaN with no loss scaling.

Data-parallel: under ``torchrun --nproc_per_node=2 -m dls.train.cli train CONFIG.yaml`` (same YAML; gloo on CPU,
NCCL with one GPU per rank) ``dls train`` initialises ``torch.distributed`` (:func:`init_distributed`) and the
trainer wraps the model in ``DistributedDataParallel``. Each rank takes its own strided batches
(``data.batch_size`` per rank), ``dls.GradScaler`` agrees on overflow across ranks, so every rank skips, stops
and checkpoints at the same steps; the logged loss is the mean over ranks; rank 0 alone writes checkpoints (of
the unwrapped model: they load in a single process and vice versa), metrics, plots and the terminal output.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import math
import os
import random
import re
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from torch.nn.parallel import DistributedDataParallel

import dls
from dls import distributed
from dls.train import checkpoint as ckpt
from dls.train import restore
from dls.train.config import (
    CHECKPOINT_STATES,
    OptimizerConfig,
    TrainConfig,
    grad_scaler_kwargs,
    loss_scaling_mode,
    to_dict,
)
from dls.train.data import Batch, BatchIterator, CharCorpus, build_dataset
from dls.train.errors import RankError, Terminated, TrainingStopped, describe, exit_status
from dls.train.models import TrainModel, build_model
from dls.train.plots import metrics_to_keep, plot_run, read_metrics
from dls.train.restore import format_scale as _pow2
from dls.train.rundir import (
    RunDir,
    check_unlocked,
    describe_holder,
    is_same_file,
    remove_temporaries,
    resolve_model_dir,
)

__all__ = ["TrainResult", "Trainer", "TrainingStopped", "init_distributed", "shutdown_distributed"]

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "plots.png"
CONFIG_FILE = "config.yaml"


@dataclass
class TrainResult:
    """What a run did. ``final_loss``: mean training loss over the last 10% of this session's steps;
    ``eval_loss``: the loss over (up to 4096 samples of) the data set, computed in float32 after training;
    ``grad_underflow``: mean of the logged ``grad_underflow`` values (``None`` without ``log_summaries``)."""

    model_dir: Path
    global_step: int
    steps_run: int
    final_loss: float | None
    eval_loss: float | None
    skipped_steps: int
    loss_scale: float | None
    scaling: str
    grad_underflow: float | None
    wall_time: float
    checkpoint: Path | None
    metrics_path: Path
    plot_path: Path | None


# ---------------------------------------------------------------------- builders
def build_optimizer(cfg: OptimizerConfig, params: Any) -> torch.optim.Optimizer:
    """The optimizer with learning rate 1.0: the LR schedule (a ``LambdaLR``) sets the real one."""
    if cfg.optimizer_type == "SGD":
        return torch.optim.SGD(params, lr=1.0, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    cls = torch.optim.Adam if cfg.optimizer_type == "Adam" else torch.optim.AdamW
    return cls(params, lr=1.0, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def learning_rate_at(schedule: float | Sequence[dict[str, Any]], step: int) -> float:
    """The learning rate of global step ``step`` (0-based): a constant, or the schedule pieces one after
    another (``Constant``, ``Linear``, ``CosineDecay`` over ``total_iters`` steps each; the last holds its end)."""
    if isinstance(schedule, (int, float)):
        return float(schedule)
    t = step
    for i, piece in enumerate(schedule):
        total = piece.get("total_iters")
        last = i == len(schedule) - 1
        if total is not None and t >= total and not last:
            t -= total
            continue
        if piece["scheduler"] == "Constant":
            return float(piece["learning_rate"])
        start, end = float(piece["initial_learning_rate"]), float(piece["end_learning_rate"])
        frac = min(t / total, 1.0) if total else 1.0
        if piece["scheduler"] == "Linear":
            return start + (end - start) * frac
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * frac))
    raise AssertionError("unreachable: a schedule has at least one piece")


def build_scheduler(cfg: OptimizerConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    schedule = cfg.learning_rate

    def lr_at(step: int) -> float:  # a plain function: LambdaLR.state_dict() does not store it
        return learning_rate_at(schedule, step)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("runconfig.device is 'cuda' but no CUDA device is available; use 'cpu' or 'auto'")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------- data-parallel
def launched_distributed() -> bool:
    """Whether this process is one of several ranks started by ``torchrun`` (``WORLD_SIZE`` > 1)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def init_distributed(device: str) -> bool:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1), initialise the default process group from the environment: NCCL
    when ``device`` (``runconfig.device``) resolves to CUDA, this rank then using GPU ``LOCAL_RANK``; gloo
    otherwise. Returns whether it initialised the group (then :func:`shutdown_distributed` ends it); ``False``
    outside ``torchrun`` or when the group already exists."""
    if not launched_distributed() or not dist.is_available() or dist.is_initialized():
        return False
    resolved = resolve_device(device)
    if resolved.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    return True


def shutdown_distributed() -> None:
    """Destroy the default process group, after collecting the objects (DDP's reducer) that still hold it:
    with gloo, a group referenced at interpreter exit can abort the process as it shuts down."""
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class _LossOf(torch.nn.Module):
    """What ``DistributedDataParallel`` wraps: ``forward(batch)`` is the model's ``loss(batch)``, so the loss is
    computed through DDP's forward (which prepares its gradient all-reduce)."""

    def __init__(self, model: TrainModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.model.loss(batch)


def describe_scaling(cfg: TrainConfig) -> str:
    mode = loss_scaling_mode(cfg)
    if mode == "off":
        return "no loss scaling"
    kw = grad_scaler_kwargs(cfg)
    if mode == "static":
        return f"static loss scale {_pow2(kw['loss_scale'])}"
    init = kw["init_scale"] if kw["init_scale"] is not None else kw["max_loss_scale"]
    return (
        f"dynamic loss scaling (start {_pow2(init)}, x{kw['growth_factor']:g} after {kw['steps_per_increase']} "
        f"clean steps, range {_pow2(kw['min_loss_scale'])}..{_pow2(kw['max_loss_scale'])})"
    )


def describe_precision(cfg: TrainConfig) -> str:
    dtype = cfg.precision.compute_dtype
    if dtype == "float32":
        return "float32"
    return f"{dtype} ({'dls.emulate' if cfg.precision.emulated else 'torch.autocast'})"


def _json_number(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


# ---------------------------------------------------------------------- progress
class _Reporter:
    """A rich progress bar on a terminal; otherwise a plain line about every 10% of the steps."""

    def __init__(self, console: Console, enabled: bool, total: int, start: int, label: str) -> None:
        self.console = console
        self.total = total
        self.every = max(1, (total - start) // 10)
        self.progress: Progress | None = None
        self.enabled = enabled
        if enabled and console.is_terminal:
            self.progress = Progress(
                TextColumn("[bold]{task.fields[label]}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=console,
            )
            self.task = self.progress.add_task("", total=total, completed=start, label=label)
            self.progress.start()

    def update(self, step: int, text: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step, description=text)
        elif self.enabled and (step % self.every == 0 or step == self.total):
            self.console.print(f"step {step}/{self.total}  {text}", highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


class _StopRequest:
    """While active (main thread only), the first Ctrl-C (SIGINT) or SIGTERM asks the loop to stop after the current
    step (which then checkpoints a consistent state and raises :meth:`interrupt`: ``KeyboardInterrupt``, or
    :class:`Terminated` for SIGTERM); a second one interrupts at once. Data-parallel: the request is shared in the
    all-reduce of the next logged step, after which every rank stops at the same step."""

    def __init__(self, log: Callable[[str], None], distributed: bool = False) -> None:
        self.log = log
        self.distributed = distributed
        self.requested = False
        self.forced = False
        self.signum: int = signal.SIGINT
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            self.forced = True
            raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt
        self.requested, self.signum = True, signum
        when = "at the next logged step (all ranks together)" if self.distributed else "after this step"
        if signum == signal.SIGTERM:
            self.log(f"SIGTERM: stopping {when} and saving a checkpoint")
        else:
            self.log(f"Ctrl-C: stopping {when} and saving a checkpoint (press Ctrl-C again to quit at once)")

    def interrupt(self) -> KeyboardInterrupt:
        return Terminated() if self.signum == signal.SIGTERM else KeyboardInterrupt()

    def __enter__(self) -> _StopRequest:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}


# ---------------------------------------------------------------------- trainer
class Trainer:
    """Builds everything a config describes; :meth:`train` runs it.

    Args:
        cfg: a validated config (``dls.train.config.load_config`` / ``parse_config``).
        console: where logs, the progress bar and the summary go (default: a new rich ``Console``).
        progress: show a progress bar (terminal) or progress lines (otherwise).
        summary: print the summary table at the end.
        plot: write ``plots.png`` at the end.
        config_file: the YAML file the config was read from, if any: it is never overwritten (``model_dir: .``
            next to it would otherwise replace it by ``config.yaml``).

    ``runconfig.model_dir`` is resolved once; :meth:`train` locks it for the run and writes nothing outside it
    (see :mod:`dls.train.rundir` and, for resuming, :mod:`dls.train.restore`).

    When ``torch.distributed`` is initialised with several ranks (``dls train`` under ``torchrun``:
    :func:`init_distributed`), it trains data-parallel with ``DistributedDataParallel``; only rank 0 writes
    files or prints. Call :meth:`close` before destroying the process group.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        console: Console | None = None,
        progress: bool = True,
        summary: bool = True,
        plot: bool = True,
        config_file: str | Path | None = None,
    ) -> None:
        self.cfg = cfg
        self.config_file = Path(config_file) if config_file is not None else None
        self.console = console if console is not None else Console()
        self.show_progress = progress
        self.show_summary = summary
        self.write_plot = plot
        rc = cfg.runconfig
        self.device = resolve_device(rc.device)
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if distributed.is_active() else (0, 1)
        self.is_main = self.rank == 0
        if self.world_size > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())  # one GPU per rank
        self.model_dir = resolve_model_dir(rc.model_dir)
        self.metrics_path = self.model_dir / METRICS_FILE
        self._run_dir: RunDir | None = None  # rank 0, while train() runs: the locked model_dir
        self._metrics: Any = None  # rank 0, while train() runs: metrics.jsonl open for appending
        self.crash_dir: Path | None = None  # where a crash report may go: model_dir, once this run has locked it
        seed_everything(rc.seed)
        self.dataset = build_dataset(cfg.data)
        shuffle_seed = cfg.data.shuffle_seed if cfg.data.shuffle_seed is not None else rc.seed
        self.batches = BatchIterator(
            self.dataset, cfg.data.batch_size, cfg.data.shuffle, shuffle_seed, self.rank, self.world_size
        )
        self.model = build_model(cfg.model, self.dataset.info).to(self.device)
        self.ddp: DistributedDataParallel | None = None
        if self.world_size > 1:
            # The same initial model everywhere (seeded alike; DDP also broadcasts rank 0's), then a random
            # stream of its own per rank (dropout).
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = DistributedDataParallel(_LossOf(self.model), device_ids=ids)
            seed_everything(rc.seed + self.rank)
        self.optimizer = build_optimizer(cfg.optimizer, self.model.parameters())
        self.scheduler = build_scheduler(cfg.optimizer, self.optimizer)
        self.compute_dtype = cfg.precision.compute_dtype
        # Cerebras' dialect, as the config's keys (no device: the scale moves to the loss's device at scale()).
        self.scaler = dls.GradScaler(**grad_scaler_kwargs(cfg))
        self.scaling = loss_scaling_mode(cfg)
        self.global_step = 0
        self.elapsed = 0.0
        self.overflows_at_floor = 0  # consecutive overflowing steps at min_loss_scale (dynamic) / any scale (static)
        self._emulation: Any = None
        self._last_checkpoint: Path | None = None
        self._session_losses: list[float] = []
        self._last_skipped = False
        self._last_scale: float | None = None
        self._underflows: list[float] = []
        self._stop_agreed = False  # data-parallel: some rank was asked to stop (Ctrl-C), so all stop
        self._ended_together = False  # data-parallel: train() ended at the same point on every rank

    # ------------------------------------------------------------------ logging
    def log(self, message: str) -> None:
        if self.is_main:
            self.console.print(message, highlight=False, markup=False, soft_wrap=True)

    # ------------------------------------------------------------------ data-parallel
    def close(self) -> None:
        """Data-parallel: when :meth:`train` ended alike on every rank (done, stopped, Ctrl-C), wait for all
        ranks (so rank 0 finishes its outputs before any rank exits), then release the DDP wrapper, which holds
        the process group. Nothing to do in a single process."""
        if self.ddp is None:
            return
        if self._ended_together and distributed.is_active():
            dist.barrier()
        self.ddp = None
        gc.collect()

    def _sum_over_ranks(self, values: Sequence[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return [float(v) for v in tensor.tolist()]

    def _stop_requested(self, stop_request: _StopRequest) -> bool:
        return self._stop_agreed if self.world_size > 1 else stop_request.requested

    # ------------------------------------------------------------------ run
    def train(self, resume: str | Path | None = None, load_states: Sequence[str] | None = None) -> TrainResult:
        """Train to ``runconfig.max_steps``; with ``resume`` (a model_dir or a checkpoint file) continue from
        the checkpoint, loading ``load_states`` (default: ``runconfig.load_checkpoint_states``, else all).

        A directory's newest checkpoint that cannot be read is skipped (said in the log; in place it is renamed
        ``checkpoint_<step>.mdl.unreadable``); a named checkpoint file that cannot be read raises
        :class:`~dls.train.errors.CheckpointError`. Where the run may write: :func:`dls.train.restore.check_model_dir`
        (a refusal raises :class:`~dls.train.errors.ModelDirError` before anything is written)."""
        session_start = time.perf_counter()
        self._ended_together = False
        states = tuple(load_states or self.cfg.runconfig.load_checkpoint_states or CHECKPOINT_STATES)
        path: Path | None = None
        unreadable: list[tuple[Path, str]] = []
        self._on_main(lambda: check_unlocked(self.model_dir))
        if resume is not None:
            path, state, unreadable = ckpt.load_resume_checkpoint(resume)
            for bad, reason in unreadable:
                self.log(f"Skipping {bad}: {reason}")
            restore.check_model_dir(self.model_dir, path, unreadable, states)
            restore.restore(self, path, state, states)
            del state
        else:
            restore.check_model_dir(self.model_dir, None, [], ())
        self._on_main(lambda: self._open_outputs(path, unreadable, states))
        try:
            return self._train(session_start)
        finally:
            self._close_outputs()

    def _open_outputs(self, checkpoint: Path | None, unreadable: list[tuple[Path, str]], states: Sequence[str]) -> None:
        """Rank 0: lock model_dir, check again under the lock where the run may write, put unreadable checkpoints
        aside (in place), rewrite metrics.jsonl up to the resumed step and keep it open, write config.yaml."""
        run_dir = self._run_dir = RunDir(self.model_dir)
        try:
            if run_dir.stale:
                holder = describe_holder(run_dir.stale)
                self.log(f"Taking over the lock of {holder}: that run ended without releasing it")
            self.crash_dir = self.model_dir
            in_place = restore.check_model_dir(self.model_dir, checkpoint, unreadable, states)
            keep = metrics_to_keep(run_dir.read(METRICS_FILE), self.metrics_path, self.global_step)  # may refuse
            remove_temporaries(run_dir.fd, tuple(f".{name}." for name in (METRICS_FILE, PLOT_FILE, CONFIG_FILE)))
            for bad, _ in unreadable if in_place else []:  # out of the way of this run's checkpoints and rotation
                kept = run_dir.set_aside(bad.name, ".unreadable")
                self.log(f"Renamed {bad.name} to {kept} (kept, never resumed from)")
            self._metrics = run_dir.open_log(METRICS_FILE, keep)
            if self.config_file is not None and is_same_file(run_dir.fd, CONFIG_FILE, self.config_file):
                self.log(f"{self.model_dir / CONFIG_FILE} is the input config: left as it is")
            else:
                run_dir.replace(CONFIG_FILE, yaml.safe_dump(to_dict(self.cfg), sort_keys=False).encode())
        except BaseException:
            self._close_outputs()
            raise

    def _close_outputs(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._run_dir is not None:
            self._run_dir.close()
            self._run_dir = None

    def _on_main(self, action: Callable[[], None]) -> None:
        """Run ``action`` on rank 0 alone. Data-parallel, its outcome is broadcast: when it failed, every other
        rank raises :class:`RankError` with rank 0's message and exit status, so all ranks end alike."""
        error: Exception | None = None
        if self.is_main:
            try:
                action()
            except Exception as exc:
                error = exc
        if self.world_size > 1:
            outcome = [None if error is None else (describe(error), int(exit_status(error)))]
            dist.broadcast_object_list(outcome, src=0)
            if not self.is_main and outcome[0] is not None:
                raise RankError(*outcome[0])
        if error is not None:
            raise error

    def _train(self, session_start: float) -> TrainResult:
        cfg, rc = self.cfg, self.cfg.runconfig
        for warning in cfg.warnings:
            self.log(f"warning: {warning}")
        data_name = cfg.data.dataset
        self.log(
            f"{cfg.model.name} on {data_name}, {describe_precision(cfg)}, {describe_scaling(cfg)}; "
            f"steps {self.global_step}->{rc.max_steps}; output in {self.model_dir}"
            + (
                f"; data-parallel on {self.world_size} ranks ({self.device.type}), global batch "
                f"{self.world_size} x {cfg.data.batch_size}"
                if self.world_size > 1
                else ""
            )
        )
        start_step = self.global_step
        previous_half = dls.get_half_dtype_str()
        if self.compute_dtype != "float32":
            dls.set_half_dtype(self.compute_dtype)
        self._emulation = dls.emulate(self.model, self.compute_dtype) if cfg.precision.emulated else None
        show = self.show_progress and self.is_main
        reporter = _Reporter(self.console, show, rc.max_steps, self.global_step, cfg.model.name)
        self.model.train()
        stop_request = _StopRequest(self.log, distributed=self.world_size > 1)
        try:
            with stop_request:
                while self.global_step < rc.max_steps:
                    if self._stop_requested(stop_request):
                        raise stop_request.interrupt()
                    row = self._step(session_start, stop_request.requested)
                    if row is not None and self._metrics is not None:
                        self._write_row(row)
                    self._check_overflow_streak(session_start)
                    step = self.global_step
                    if rc.checkpoint_steps and step % rc.checkpoint_steps == 0 and step < rc.max_steps:
                        self._save(session_start)
                    if row is not None:
                        reporter.update(step, self._progress_text(row))
        except KeyboardInterrupt:
            reporter.close()
            if self._stop_requested(stop_request) and not stop_request.forced:  # between two steps: consistent
                path = self._save(session_start)
                self._ended_together = True
                self.log(
                    f"Interrupted at step {self.global_step}; saved {path}. Continue with --resume {self.model_dir}"
                )
            else:
                self.log(f"Interrupted; the last checkpoint is {self._last_checkpoint or 'none (nothing saved)'}")
            raise
        except TrainingStopped:
            reporter.close()
            self._ended_together = True  # decided alike on every rank: the scaler state agrees
            self._finish_outputs()
            raise
        finally:
            reporter.close()
            if self._emulation is not None:
                self._emulation.remove()
                self._emulation = None
            dls.set_half_dtype(previous_half)
        if self._last_checkpoint is None or self._checkpoint_step(self._last_checkpoint) != self.global_step:
            self._save(session_start)
        session_time = time.perf_counter() - session_start
        tail = self._session_losses[-max(1, len(self._session_losses) // 10) :]
        final_loss = sum(tail) / len(tail) if tail else None
        if final_loss is not None and self.world_size > 1:
            final_loss = self._sum_over_ranks([final_loss])[0] / self.world_size
        self._ended_together = True
        plot_path = self._finish_outputs()
        eval_loss = self.evaluate() if self.is_main else None
        result = TrainResult(
            model_dir=self.model_dir,
            global_step=self.global_step,
            steps_run=self.global_step - start_step,
            final_loss=final_loss,
            eval_loss=eval_loss,
            skipped_steps=self.scaler.get_num_skipped_steps(),
            loss_scale=self.scaler.get_scale() if self.scaler.is_enabled() else None,
            scaling=self.scaling,
            grad_underflow=sum(self._underflows) / len(self._underflows) if self._underflows else None,
            wall_time=session_time,
            checkpoint=self._last_checkpoint,
            metrics_path=self.metrics_path,
            plot_path=plot_path,
        )
        if self.show_summary and self.is_main:
            self.print_summary(result)
        return result

    def _write_row(self, row: dict[str, Any]) -> None:
        try:
            self._metrics.write((json.dumps(row, allow_nan=False) + "\n").encode())
            self._metrics.flush()  # a row is on disk before the next step
        except OSError as exc:  # e.g. the disk is full: say which file
            exc.filename = exc.filename or str(self.metrics_path)
            raise

    def _step(self, session_start: float, stop_requested: bool = False) -> dict[str, Any] | None:
        cfg, rc, opt_cfg = self.cfg, self.cfg.runconfig, self.cfg.optimizer
        step = self.global_step + 1
        log_now = step % rc.log_steps == 0 or step == rc.max_steps or step == 1
        x, y = self.batches.next()
        batch: Batch = (x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
        underflow = None
        if opt_cfg.log_summaries and log_now and self.compute_dtype != "float32" and self._emulation is None:
            underflow = self._probe_underflow(batch)
        scale_used = self.scaler.get_scale() if self.scaler.is_enabled() else None
        lr = float(self.optimizer.param_groups[0]["lr"])
        with self._autocast():
            loss = self.model.loss(batch) if self.ddp is None else self.ddp(batch)
        weighted = loss * cfg.model.loss_weight if cfg.model.loss_weight != 1.0 else loss
        self.scaler.scale(weighted).backward()
        self.scaler.unscale_(self.optimizer)
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in params]).item()) if params else 0.0
        loss_value = float(loss.item())
        unscalable = not self.scaler.is_enabled() and not (math.isfinite(grad_norm) and math.isfinite(loss_value))
        if not self.scaler.is_enabled() and self.world_size > 1:  # the loss is rank-local: decide together
            unscalable = self._sum_over_ranks([float(unscalable)])[0] > 0
        if unscalable:
            self.optimizer.zero_grad(set_to_none=True)
            path = self._save(session_start)
            raise TrainingStopped(
                f"Step {step}: the loss ({loss_value}) or the gradients (norm {grad_norm}) are inf/NaN and loss "
                f"scaling is off ({self.compute_dtype}), so nothing can skip this step. Training stopped before "
                f"applying it; the model as of step {self.global_step} is saved in {path}. Try a lower "
                "optimizer.learning_rate, optimizer.max_gradient_norm (e.g. 1.0)"
                + (", or optimizer.loss_scaling_factor: dynamic." if self.compute_dtype != "float32" else "."),
                path,
            )
        if opt_cfg.max_gradient_norm is not None:
            self.scaler.clip_gradients_and_return_isfinite(self.optimizer)
        elif opt_cfg.max_gradient_value is not None:
            torch.nn.utils.clip_grad_value_(params, opt_cfg.max_gradient_value)
        skipped_before = self.scaler.get_num_skipped_steps()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        skipped = self.scaler.get_num_skipped_steps() > skipped_before
        with warnings.catch_warnings():
            # A first step skipped for overflow makes torch warn that the scheduler stepped before the optimizer.
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step = step
        self._session_losses.append(loss_value)
        if self._emulation is not None and opt_cfg.log_summaries and log_now:
            underflow = self._emulation.stats.underflow_fraction
            self._emulation.stats.reset()
        logged_loss = loss_value
        if self.world_size > 1 and (log_now or skipped):  # alike on every rank: skipping is agreed
            # One all-reduce: the mean loss and underflow over the ranks, and whether any rank got Ctrl-C.
            sums = self._sum_over_ranks([loss_value, underflow or 0.0, float(stop_requested)])
            logged_loss = sums[0] / self.world_size
            underflow = sums[1] / self.world_size if underflow is not None else None
            self._stop_agreed = self._stop_agreed or sums[2] > 0
        if underflow is not None:
            self._underflows.append(underflow)
        self._last_skipped, self._last_scale = skipped, scale_used
        if not (log_now or skipped):
            return None
        row: dict[str, Any] = {
            "step": step,
            "loss": _json_number(logged_loss),
            "loss_scale": scale_used,
            "skipped": skipped,
            "grad_norm": _json_number(grad_norm),
            "lr": lr,
            "time": round(self.elapsed + time.perf_counter() - session_start, 4),
        }
        if opt_cfg.log_summaries:
            row["skipped_total"] = self.scaler.get_num_skipped_steps()
            row["grad_underflow"] = underflow
        return row

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.compute_dtype in ("float16", "bfloat16") and self._emulation is None:
            dtype = torch.float16 if self.compute_dtype == "float16" else torch.bfloat16
            return torch.autocast(self.device.type, dtype=dtype)
        return contextlib.nullcontext()

    def _probe_underflow(self, batch: Batch) -> float:
        """The fraction of nonzero activation gradients that the half format flushes to zero at the current
        loss scale, from one emulated backward pass on ``batch`` (parameters' ``.grad`` and every RNG untouched)."""
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else 1.0
        params = [p for p in self.model.parameters() if p.requires_grad]
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), dls.emulate(self.model, self.compute_dtype) as handle:
            loss = self.model.loss(batch) * (self.cfg.model.loss_weight * scale)
            torch.autograd.grad(loss, params, allow_unused=True)
        assert handle.stats is not None
        return float(handle.stats.underflow_fraction)

    def _check_overflow_streak(self, session_start: float) -> None:
        step, skipped, scale_used = self.global_step, self._last_skipped, self._last_scale
        if self.scaling == "off" or scale_used is None:
            return
        min_scale = self.cfg.optimizer.min_loss_scale
        at_floor = self.scaling == "static" or scale_used <= min_scale
        self.overflows_at_floor = self.overflows_at_floor + 1 if (skipped and at_floor) else 0
        limit = self.cfg.runconfig.max_overflows_at_min_loss_scale
        if self.overflows_at_floor < limit:
            return
        path = self._save(session_start)
        if self.scaling == "static":
            what = (
                f"the static loss scale {_pow2(scale_used)} made the gradients overflow on {limit} consecutive "
                "steps, and a static scale never comes down"
            )
            advice = (
                "use optimizer.loss_scaling_factor: dynamic (it finds the largest scale that does not "
                "overflow), or a smaller static scale"
            )
        else:
            what = (
                f"the loss scale is pinned at min_loss_scale ({_pow2(min_scale)}) and the gradients still "
                f"overflowed on {limit} consecutive steps (Model Zoo: 'Minimum loss scale threshold was reached "
                "but gradient norms are still encountering NaN or inf values')"
            )
            advice = (
                "lower optimizer.learning_rate or clip with optimizer.max_gradient_norm (the model may have "
                "diverged); check the data for inf/NaN; switch to bfloat16 (precision.fp16_type: bfloat16), whose "
                "range matches float32, if the forward pass itself overflows in float16; or lower "
                "optimizer.min_loss_scale"
            )
        raise TrainingStopped(
            f"Stopped at step {step}: {what}. Skipping more steps cannot help. To try: {advice}. Nothing is lost: "
            f"the state is saved in {path}; after changing the config, continue with --resume {self.model_dir}",
            path,
        )

    def _progress_text(self, row: dict[str, Any]) -> str:
        loss = row["loss"]
        parts = [f"loss {loss:.4g}" if loss is not None else "loss nan"]
        if row["loss_scale"] is not None:
            parts.append(f"scale {_pow2(row['loss_scale'])}")
            parts.append(f"skipped {self.scaler.get_num_skipped_steps()}")
        return "  ".join(parts)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, max_samples: int = 4096) -> float:
        """Mean loss in float32 over the first ``max_samples`` samples of the data set (64 sequences for the
        character corpus), in eval mode (no dropout)."""
        was_training = self.model.training
        self.model.eval()
        n = len(self.dataset) if not isinstance(self.dataset, CharCorpus) else min(len(self.dataset), 64)
        n = min(n, max_samples)
        total, count = 0.0, 0
        for start in range(0, n, 512):
            idx = torch.arange(start, min(n, start + 512))
            x, y = self.dataset.batch(idx, epoch=0)
            loss = self.model.loss((x.to(self.device), y.to(self.device)))
            total += float(loss.item()) * len(idx)
            count += len(idx)
        self.model.train(was_training)
        return total / max(count, 1)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "global_step": self.global_step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.scheduler.state_dict(),
            "dataloader": self.batches.state_dict(),
            "rng": ckpt.rng_state(),
            "config": to_dict(self.cfg),
            "dls_version": dls.__version__,
        }
        if self.scaler.is_enabled():
            state["grad_scaler"] = self.scaler.state_dict()
        return state

    def _save(self, session_start: float) -> Path:
        """Checkpoint the current state. Data-parallel: every rank calls it at the same step (it gathers each
        rank's random-number generators into ``rng_ranks``); rank 0 alone writes."""
        path = ckpt.checkpoint_path(self.model_dir, self.global_step)
        rng_ranks: list[Any] = []
        if self.world_size > 1:
            rng_ranks = [None] * self.world_size
            dist.all_gather_object(rng_ranks, ckpt.rng_state())
        if self.is_main:
            state = self.state_dict()
            state["trainer"] = {
                "elapsed": self.elapsed + time.perf_counter() - session_start,
                "overflows_at_floor": self.overflows_at_floor,
            }
            if rng_ranks:
                state["rng_ranks"] = rng_ranks
            assert self._run_dir is not None, "checkpoints are written while train() holds model_dir"
            ckpt.save_checkpoint(state, path, keep=self.cfg.runconfig.keep_checkpoint_max, dir_fd=self._run_dir.fd)
        self._last_checkpoint = path
        return path

    @staticmethod
    def _checkpoint_step(path: Path) -> int:
        return int(path.stem.split("_")[-1])

    # ------------------------------------------------------------------ outputs
    def _finish_outputs(self) -> Path | None:
        if not (self.write_plot and self.is_main) or self._run_dir is None:
            return None
        rows = read_metrics(self._run_dir.read(METRICS_FILE) or b"")
        title = f"{self.cfg.model.name}, {describe_precision(self.cfg)}\n{describe_scaling(self.cfg)}"
        png = io.BytesIO()
        plot_run(rows, png, title=title)
        return self._run_dir.replace(PLOT_FILE, png.getbuffer())

    def print_summary(self, result: TrainResult) -> None:
        table = Table(title=f"dls train: {self.model_dir}", show_header=False, title_justify="left")
        table.add_column(style="bold")
        table.add_column()
        table.add_row("global step", f"{result.global_step} ({result.steps_run} in this session)")
        table.add_row("precision", describe_precision(self.cfg))
        table.add_row("loss scaling", describe_scaling(self.cfg))
        if result.final_loss is not None:
            table.add_row("training loss (last 10%)", f"{result.final_loss:.5g}")
        if result.eval_loss is not None:
            table.add_row("eval loss (float32)", f"{result.eval_loss:.5g}")
        if result.loss_scale is not None:
            pct = 100 * result.skipped_steps / max(result.global_step, 1)
            table.add_row("final loss scale", _pow2(result.loss_scale))
            table.add_row("skipped steps", f"{result.skipped_steps} ({pct:.1f}%)")
        if result.grad_underflow is not None:
            table.add_row("gradient underflow", f"{100 * result.grad_underflow:.2f}% of nonzero activation gradients")
        table.add_row("wall time", f"{result.wall_time:.1f} s")
        table.add_row("checkpoint", str(result.checkpoint))
        table.add_row("metrics", str(result.metrics_path))
        if result.plot_path is not None:
            table.add_row("plot", str(result.plot_path))
        self.console.print(table)


def iter_metrics(model_dir: str | Path) -> Iterator[dict[str, Any]]:
    """The rows of ``MODEL_DIR/metrics.jsonl``."""
    path = Path(model_dir) / METRICS_FILE
    yield from read_metrics(path.read_bytes() if path.exists() else b"")
