"""The training loop behind ``dls train``: a config in; a trained model, checkpoints, metrics and plots out. Each step
uses the library as its users do (``dls.optimizer_step``, ``dls.skip_aware``, ``scaler.watch``); device reads only
on logged steps (every ``log_steps``, the first, the last and skipped ones). The trainer also holds how a run
computes (``precision:``) and the stops where its numbers cannot go on (exit 1, after a finite checkpoint), each
telling the user what to try; the optimizer and its LR schedule follow it."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import math
import os
import signal
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from torch.nn.parallel import DistributedDataParallel

import dls
import dls.fp8
from dls import distributed, kernels
from dls.diagnostics import OverflowReport
from dls.diagnostics.fallback import apply_precision_fallback, fallback_note
from dls.diagnostics.record import Recorder
from dls.diagnostics.scales import module_label, pow2
from dls.diagnostics.trace import TRACE_FILE
from dls.emulation import EmulationHandle
from dls.train import batches, config, data, reporting, rundir
from dls.train import checkpoint as ckpt
from dls.train.errors import MissingExtras, RankError, TrainingStopped, describe, exit_status
from dls.train.launch import resolve_device
from dls.train.reporting import TrainResult, json_number
from dls_entry import Terminated, signals

__all__ = ["TrainResult", "Trainer", "TrainingStopped"]


class Trainer:
    """Builds everything a config describes; :meth:`train` runs it."""

    def __init__(
        self,
        cfg: config.TrainConfig,
        *,
        console: Console | None = None,
        progress: bool = True,
        summary: bool = True,
        plot: bool = True,
        config_file: str | Path | None = None,
    ) -> None:
        self.cfg, self.config_file = cfg, Path(config_file) if config_file is not None else None
        self.console = console if console is not None else Console()
        self.show_progress, self.show_summary, self.write_plot = progress, summary, plot
        rc = cfg.runconfig
        self.device = resolve_device(rc.device)
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if distributed.is_active() else (0, 1)
        self.is_main = self.rank == 0
        if self.world_size > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())  # one GPU per rank
        if rc.tensorboard:  # can it work: checked before anything is built or written
            try:
                import tensorboard  # noqa: F401
                from torch.utils.tensorboard import SummaryWriter  # noqa: F401
            except ImportError as exc:
                raise MissingExtras(
                    f"runconfig.tensorboard needs the 'tensorboard' extra ({exc}); install it with: "
                    "pip install 'dls[tensorboard]'"
                ) from None
        self.model_dir = rundir.resolve_model_dir(rc.model_dir)
        self.run_dir: rundir.RunDir | None = None  # rank 0, while train() holds model_dir
        self.crash_dir: Path | None = None  # where a crash report may go: model_dir, once this run has locked it
        ckpt.seed_everything(rc.seed)
        # Model Zoo data: the directories are checked here, not by dls validate.
        if not cfg.data.dataset and (missing := data.missing_paths(cfg)):
            raise ValueError("; ".join(missing))
        where = cfg.sources.get
        self.batches = data.build_batches(cfg.data, rc.seed, "train", self.rank, self.world_size, where("data.params"))
        self.dataset = self.batches.dataset if cfg.data.data_processor is None else None  # a built-in data set
        self.eval_batches: batches.BatchIterator | None = None  # without eval_input: Model Zoo's training data, later
        if cfg.eval_data is not None:
            self.eval_batches = data.build_batches(cfg.eval_data, rc.seed, "val", prefix=where("eval_data.params"))
        prec = cfg.precision
        self.model = data.build_model(cfg.model, getattr(self.dataset, "info", None))
        if cfg.model.name in config.ZOO_MODELS:  # can it read the data (positions, token ids)
            from dls.train import modelzoo  # imported only by runs of Model Zoo models, as in dls.train.data

            for source in (self.batches, self.eval_batches):
                if source is not None:
                    modelzoo.fit_to_data(self.model, source.dataset, where("model.params", "model"))
        self.param_dtype: torch.dtype = getattr(torch, prec.param_dtype)  # float32, float16 or bfloat16
        self.model = self.model.to(self.device, self.param_dtype)
        self.max_steps = rc.max_steps
        if rc.num_epochs is not None and "max_steps" not in rc.model_fields_set:
            per_epoch = rc.steps_per_epoch or max(1, self.batches.batches_per_epoch // rc.grad_accum_steps)
            self.max_steps = rc.num_epochs * per_epoch
        freq = rc.eval_frequency
        self.eval_every = freq if isinstance(freq, int) else max(1, round(freq * self.max_steps)) if freq else None
        self.eval_loss: float | None = None
        self.fp8: dls.fp8.Fp8Handle | None = None  # FP8 Linear layers (precision.fp8)
        if prec.fp8 is not None:  # before DDP: FP8's delayed scaling reduces its amaxes over the same ranks
            group = dist.group.WORLD if self.world_size > 1 else None
            self.fp8 = dls.fp8.emulate_recipe(self.model, dls.fp8.recipe_from_dict(dict(prec.fp8)), process_group=group)
        self.emulation: EmulationHandle | None = None  # dls.emulate's hooks (cbfloat16, precision.emulate), per session
        self._recorded: tuple[list[float], ...] = ([], [], [])  # grad_underflow, FP8 flushed, saturated: per row
        self.ddp: DistributedDataParallel | None = None
        if self.world_size > 1:
            # The same initial model everywhere (seeded alike; DDP also broadcasts rank 0's), then a random
            # stream of its own per rank (dropout). DDP wraps the loss; the model stays unwrapped (checkpoints hold it).
            self.ddp = DistributedDataParallel(_LossOf(self.model))  # no device_ids: the batches come on its device
            ckpt.seed_everything(rc.seed + self.rank)
        # The settings carry the half dtype (fp16_type): nothing process-global is read or set.
        enabled = prec.compute_dtype != "float32"
        settings = config.scaler_settings(cfg)
        never = cfg.runconfig.backend == "GPU" and settings.steps_per_increase == config.GPU_NEVER and enabled
        if never and self.max_steps >= config.GPU_NEVER:  # else the static scale of Model Zoo's GPU path could grow
            key = where("runconfig.max_steps", "runconfig.max_steps")
            raise ValueError(
                f"{key} must be below {config.GPU_NEVER:,} with backend_type GPU and a static loss_scaling_factor "
                "(a scale that never grows)"
            )
        self.scaler = dls.GradScaler.from_settings(settings, enabled=enabled, device=self.device)
        # The loss scale is logged unless log_loss_scale says no (Model Zoo's layouts decide it: dls.train.config).
        self.log_loss_scale = cfg.optimizer.log_loss_scale is not False
        self.optimizer = build_optimizer(cfg, self.model)
        if prec.half_params and prec.master_weights:  # float32 masters step for the half parameters
            self.optimizer = dls.master_weights(
                self.optimizer, fmt="cbfloat16" if prec.fp16_type == "cbfloat16" else None
            )
        if not self.scaler.is_enabled():  # nothing can skip a step: inf/NaN gradients stop the run
            self.optimizer.register_step_pre_hook(self._refuse_nonfinite_gradients)
        # Each group's own LR is its factor (1.0 but for Model Zoo's muP groups); LambdaLR does not store a lambda.
        schedule = cfg.optimizer.learning_rate
        lambda_lr = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: learning_rate_at(schedule, step))
        self.scheduler = dls.skip_aware(lambda_lr, self.scaler)  # it advances on applied steps only
        # Where an overflow starts (hooks of Python only; a report on overflowing steps alone); the modules kept in
        # float32 (precision.keep_in_float32, and those the fallback finds).
        keep, fallback = prec.keep_in_float32, prec.fallback_on and self.scaler.is_enabled()
        self.watch = apply_precision_fallback(self.model, self.scaler, keep, fallback)
        self.global_step, self.elapsed = 0, 0.0
        self.overflows_at_floor = 0  # consecutive overflowing steps at the scale's floor (checkpointed), and the
        # overflow reports of the last of them in this session
        self._floor_reports: deque[OverflowReport | None] = deque(maxlen=rc.max_overflows_at_min_loss_scale)
        self._last_checkpoint: Path | None = None
        self._ended_together = False  # data-parallel: train() ended at the same point on every rank
        self.recorder: Recorder | None = None  # rank 0, while train() holds model_dir: model_dir/trace.jsonl

    # ------------------------------------------------------------------ logging, data-parallel
    def log(self, message: str) -> None:
        if self.is_main:
            self.console.print(message, highlight=False, markup=False, soft_wrap=True)

    def close(self) -> None:
        """Data-parallel: wait for all ranks when :meth:`train` ended alike on each, then release the DDP wrapper."""
        if self.ddp is not None:
            if self._ended_together and distributed.is_active():
                dist.barrier()
            self.ddp = None
            gc.collect()

    def _mean_over_ranks(self, values: Sequence[float]) -> list[float]:
        """``values`` averaged over the ranks: one float64 all-reduce."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return [float(v) / self.world_size for v in tensor.tolist()]

    def _on_rank0(self, action: Callable[[], object]) -> None:
        """Run ``action`` on rank 0 alone; when it fails, every other rank raises :class:`RankError` alike."""
        error = None
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

    # ------------------------------------------------------------------ run
    def train(
        self, resume: str | Path | None = None, load_states: Sequence[str] | None = None, overwrite: bool = False
    ) -> TrainResult:
        """Train to ``runconfig.max_steps``; with ``resume`` (a model_dir or a checkpoint file) continue from the
        checkpoint, loading ``load_states`` (default: ``runconfig.load_checkpoint_states``, else all). A run without
        a checkpoint refuses a model_dir holding an earlier run's files, unless ``overwrite`` (which never loads one)
        renames them ``<name>.old-<time>``."""
        if self.fp8 is not None and not self.fp8.active:
            raise RuntimeError("a Trainer with precision.fp8 trains once: build a new Trainer (with resume=...)")
        self._session_start = time.perf_counter()
        rc, threads = self.cfg.runconfig, torch.get_num_threads()
        torch.set_num_threads(rc.num_threads or threads)
        self._ended_together, self.crash_dir = False, None
        states, what = tuple(load_states or config.CHECKPOINT_STATES), "--resume"
        aside: list[tuple[Path, str]] = []  # renamed before the run writes: unreadable checkpoints, overwritten files
        self._resumed_from: Path | None = None  # the checkpoint this session started from

        def lock() -> None:  # first: nothing of model_dir is read before its lock is held
            run_dir = self.run_dir = rundir.RunDir(self.model_dir)
            self.crash_dir = self.model_dir  # then a crash report may go there
            if run_dir.stale:
                self.log(f"Taking over the lock of {run_dir.stale}: that run ended without releasing it")

        def open_run_dir() -> None:
            assert self.run_dir is not None
            recording = rc.record_trace and self.scaler.is_enabled()
            if recording and TRACE_FILE not in {path.name for path, _ in aside}:  # may refuse: before anything changes
                trace = self.run_dir.path / TRACE_FILE
                kept = rundir.trace_to_keep(self.run_dir.read(TRACE_FILE), trace, self.global_step)
            else:
                kept = b""
            self.run_dir.open(
                self.log, set_aside=aside, step=self.global_step, config=config.to_dict(self.cfg),
                config_file=self.config_file, tensorboard=rc.tensorboard,
            )  # fmt: skip
            if recording:  # the trace up to this step, then this session's
                self.run_dir.replace(TRACE_FILE, kept)
                file = os.fdopen(self.run_dir._open(TRACE_FILE, os.O_WRONLY | os.O_APPEND), "ab")
                self.run_dir._held.enter_context(file)  # closed with model_dir, after the recorder
                hooks = rc.record_trace == "model" and not self.cfg.precision.emulated and self.fp8 is None
                self.recorder = self.scaler.record(
                    file, model=self.model if hooks else None, histogram_every=rc.log_steps, start_step=self.global_step
                )
                self.run_dir._held.callback(self.recorder.close)  # what it buffered, written

        try:
            self._on_rank0(lock)
            if resume is None and rc.checkpoint_path is not None:
                key = "runconfig.checkpoint_path"  # or trainer.fit.ckpt_path: errors name the key as written
                resume, what = rc.checkpoint_path, self.cfg.sources.get(key, key)
            autoload = rc.autoload_last_checkpoint and not overwrite  # --overwrite starts a new run
            if resume is None and autoload and rundir.list_checkpoints(self.model_dir):
                key = "runconfig.autoload_last_checkpoint"  # the same command again continues the run (--resume DIR)
                resume, what = self.model_dir, self.cfg.sources.get(key, key)
            path, state, unreadable = (None, None, []) if resume is None else ckpt.load_resume_checkpoint(resume, what)
            # LoadCheckpointStates applies to another run's checkpoint; the run's own load whole.
            if path and load_states is None and rc.load_checkpoint_states and path.parent.resolve() != self.model_dir:
                states = rc.load_checkpoint_states
            for bad, reason in unreadable:
                self.log(f"Skipping {bad}: {reason}")
            check = functools.partial(rundir.check_model_dir, overwrite=overwrite, config_file=self.config_file)
            self._on_rank0(lambda: aside.extend(check(self.model_dir, path, unreadable, states)))
            if path is not None and state is not None:
                ckpt.restore(self, path, state, states)
                del state
            self._resumed_from = path
            if path is not None and rundir.checkpoint_path(self.model_dir, self.global_step).exists():
                self._last_checkpoint = rundir.checkpoint_path(self.model_dir, self.global_step)  # in place: saved
            self._session_from = (self.global_step, self.scaler.get_num_skipped_steps())  # for the stop messages
            self._on_rank0(open_run_dir)
            return self._train()
        finally:
            torch.set_num_threads(threads)
            if self.run_dir is not None:
                self.run_dir.close()
                self.run_dir = None

    def _train(self) -> TrainResult:
        cfg, rc, prec = self.cfg, self.cfg.runconfig, self.cfg.precision
        if rc.num_steps is not None:  # Model Zoo's num_steps: this many steps in this run, within max_steps
            ends = [self.max_steps] if "max_steps" in rc.model_fields_set or rc.num_epochs else []
            self.max_steps = min([*ends, self.global_step + rc.num_steps])
        max_steps, start_step = self.max_steps, self.global_step
        for note in cfg.notes:
            self.log(f"note: {note}")
        self.log(reporting.describe_run(cfg, start_step, self.model_dir, self.world_size, self.device.type, max_steps))
        tail = max(1, (max_steps - start_step) // 10)  # the final loss: mean over the last 10% of the session
        self._tail_from, self._tail_sum = max(max_steps - tail, start_step) + 1, torch.zeros((), device=self.device)
        if prec.emulated:
            self.emulation = dls.emulate(self.model, prec.compute_dtype, track_stats=prec.log_underflow)
        shown = self.show_progress and self.is_main
        self._display = reporting.ProgressDisplay(self.console, shown, max_steps, start_step, cfg.model.name)
        if rc.save_initial_checkpoint and start_step == 0:
            self._save()
        self.model.train()
        self._stop_signal: int | None = None  # the first Ctrl-C or SIGTERM of this session (see _request_stop)
        self._stop_due = False
        stopped: TrainingStopped | None = None
        try:
            with signals(self._request_stop):
                while self.global_step < max_steps and not self._stop_due:
                    self._step()
                    step = self.global_step
                    last = step == max_steps and (self.eval_every or self.eval_batches is not None)
                    if last or (self.eval_every and step % self.eval_every == 0):  # an eval loader: at the end too
                        self._evaluate(step)
                    if rc.checkpoint_steps and step % rc.checkpoint_steps == 0 and step < max_steps:
                        self._save()
                if self._last_checkpoint != rundir.checkpoint_path(self.model_dir, self.global_step):  # not saved yet
                    self._save()
        except KeyboardInterrupt:  # a second Ctrl-C, in the middle of a step
            self._display.close()
            self.log(f"Interrupted; the last checkpoint is {self._last_checkpoint or 'none (nothing saved)'}")
            raise
        except TrainingStopped as exc:  # decided alike on every rank: the scaler state agrees
            stopped = exc
        finally:
            self._display.close()
            if self.emulation is not None:
                self.emulation.remove()
                self.emulation = None
            if self.fp8 is not None:  # its state stays for the final checkpoint
                self.fp8.remove()
        self._ended_together = True  # every rank is here alike (a stop request is agreed at a logged step)
        if stopped is None and self._stop_due and self.global_step < max_steps:  # asked to stop: saved between steps
            saved = f"saved {self._last_checkpoint}. Continue with --resume {self.model_dir}"
            self.log(f"Interrupted at step {self.global_step}; {saved}")
            raise Terminated() if self._stop_signal == signal.SIGTERM else KeyboardInterrupt()
        # What the session did (finished or stopped), with the plot written and the model evaluated.
        wall_time, count = time.perf_counter() - self._session_start, self.global_step - self._tail_from + 1
        final_loss = float(self._tail_sum) / count if count > 0 else None
        if final_loss is not None and self.world_size > 1:
            final_loss = self._mean_over_ranks([final_loss])[0]
        eval_loss = self.eval_loss
        if self.is_main and self.dataset is not None:  # a built-in data set: its first samples, in float32
            eval_loss = data.evaluate(self.model, self.dataset, self.device)
        plot = None
        if self.write_plot and self.run_dir is not None:
            describe = reporting.describe_precision(cfg), reporting.describe_scaling(cfg)
            plot = self.run_dir.plot(f"{cfg.model.name}, {describe[0]}\n{describe[1]}")
        grad_underflow, fp8_flushed, fp8_saturated = (sum(v) / len(v) if v else None for v in self._recorded)
        result = TrainResult(
            model_dir=self.model_dir, global_step=self.global_step, steps_run=self.global_step - start_step,
            final_loss=final_loss, eval_loss=eval_loss if self.is_main else None,
            skipped_steps=self.scaler.get_num_skipped_steps(), scaling=config.loss_scaling_mode(cfg),
            loss_scale=self.scaler.get_scale() if self.scaler.is_enabled() else None,
            grad_underflow=grad_underflow, fp8_flushed=fp8_flushed, fp8_saturated=fp8_saturated,
            wall_time=wall_time, checkpoint=self._last_checkpoint, metrics_path=self.model_dir / rundir.METRICS_FILE,
            plot_path=plot,
        )  # fmt: skip
        if stopped is not None:
            stopped.result = result
            raise stopped
        if self.show_summary and self.is_main:
            reporting.print_summary(self.console, cfg, result)
        return result

    def _request_stop(self, signum: int) -> bool:
        """The first Ctrl-C or SIGTERM asks the loop to stop after the current step (data-parallel: at the next
        logged step, where the ranks agree), checkpointed; a second one is not taken (``False``): it interrupts."""
        if self._stop_signal is not None:
            return False
        self._stop_signal, term = signum, signum == signal.SIGTERM
        if self.world_size == 1:  # data-parallel: set at a logged step by all ranks together, never taken back here
            self._stop_due = True
        when = "at the next logged step (all ranks together)" if self.world_size > 1 else "after this step"
        again = "" if term else " (press Ctrl-C again to quit at once)"
        self.log(f"{'SIGTERM' if term else 'Ctrl-C'}: stopping {when} and saving a checkpoint{again}")
        return True

    def _evaluate(self, step: int) -> None:
        """``eval_steps`` batches of the eval loader (the training data's without one), as a metrics row."""
        rc, batches = self.cfg.runconfig, self.eval_batches
        if batches is None and self.dataset is not None:  # a built-in data set: its first samples
            self.eval_loss = data.evaluate(self.model, self.dataset, self.device)
        else:
            if batches is None:  # Model Zoo training data: built at the first evaluation, read at each
                prefix = self.cfg.sources.get("data.params")
                batches = self.eval_batches = data.build_batches(self.cfg.data, rc.seed, "train", prefix=prefix)
            steps = rc.eval_steps or max(1, batches.batches_per_epoch)
            with self._autocast():
                self.eval_loss = data.evaluate_batches(self.model, batches, steps, self.device, self._to_device)
            batches.load_state_dict({"epoch": 0, "position": 0})  # every evaluation reads the same batches
        if self.run_dir is not None:
            self.run_dir.write_row({"step": step, "eval_loss": json_number(self.eval_loss)})

    # ------------------------------------------------------------------ how a step computes
    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` for float16/bfloat16 without emulation or half parameters, else nothing."""
        prec = self.cfg.precision
        if prec.compute_dtype in ("float16", "bfloat16") and self.emulation is None and not prec.half_params:
            return torch.autocast(self.device.type, dtype=getattr(torch, prec.compute_dtype))
        return contextlib.nullcontext()

    def _to_device(self, batch: batches.Batch, dtype: torch.dtype | None = None) -> batches.Batch:
        """``batch`` (tensors in tuples, lists, dicts) on the device; floating-point inputs in ``dtype``."""
        dtype = dtype or self.param_dtype
        if isinstance(batch, torch.Tensor):
            cast = dtype if batch.is_floating_point() else None
            return batch.to(self.device, dtype=cast, non_blocking=True)
        if isinstance(batch, dict):
            return {k: self._to_device(v, dtype) for k, v in batch.items()}
        if isinstance(batch, tuple) and len(batch) == 2 and isinstance(batch[1], torch.Tensor):
            return self._to_device(batch[0], dtype), batch[1].to(self.device, non_blocking=True)
        if isinstance(batch, (list, tuple)):
            return type(batch)(self._to_device(v, dtype) for v in batch)
        return batch

    def _probe_underflow(self, batch: batches.Batch, scale: float) -> float:
        """The fraction of nonzero activation gradients flushed to zero at ``scale`` (one emulated backward pass)."""
        model: batches.TrainModel = self.model
        if self.param_dtype != torch.float32:  # half parameters: a float32 copy holds the same values
            model = copy.deepcopy(model).float()
            batch = self._to_device(batch, torch.float32)
        params = [p for p in model.parameters() if p.requires_grad]
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        paused = self.recorder.paused() if self.recorder is not None else contextlib.nullcontext()  # not a step
        with paused, torch.random.fork_rng(devices=devices), dls.emulate(model, self.cfg.precision.compute_dtype) as h:
            loss = model.loss(batch) * (self.cfg.model.loss_weight * scale)
            torch.autograd.grad(loss, params, allow_unused=True)
        assert h.stats is not None
        return float(h.stats.underflow_fraction)

    # ------------------------------------------------------------------ one step
    def _step(self) -> None:
        """One training step; on a logged step (see the module docstring) its metrics row, written and shown."""
        cfg, rc, opt_cfg = self.cfg, self.cfg.runconfig, self.cfg.optimizer
        step = self.global_step + 1
        log_now = step % rc.log_steps == 0 or step == self.max_steps or step == 1
        weight, underflow = cfg.model.loss_weight / rc.grad_accum_steps, None
        # Logged steps measure the underflow with one emulated backward pass (half precision, no emulation or FP8).
        probe = cfg.precision.log_underflow and cfg.precision.compute_dtype != "float32"
        probe = probe and self.emulation is None and self.fp8 is None
        losses: list[torch.Tensor] = []
        for later in range(rc.grad_accum_steps - 1, -1, -1):  # micro-batches before the last: gradients add up
            batch = self._to_device(self.batches.next())
            if not later and log_now and probe:
                underflow = self._probe_underflow(batch, self.scaler.get_scale())
            with self.ddp.no_sync() if self.ddp is not None and later else contextlib.nullcontext():
                with self._autocast():
                    loss = self.model.loss(batch) if self.ddp is None else self.ddp(batch)
                if later:
                    self.scaler.scale(loss * weight).backward()
                    losses.append(loss.detach())
        group = self.optimizer.param_groups[0]
        lr = float(group["lr"]) / float(group["initial_lr"])  # the schedule's: the group's own factor divided out
        params_norm = parameter_norm(self.model) if opt_cfg.log_summaries and log_now else None  # before the update
        weighted = loss * weight if weight != 1.0 else loss
        if losses:
            loss = torch.stack([*losses, loss.detach()]).mean()
        try:
            result = dls.optimizer_step(
                weighted, self.optimizer, self.scaler, max_gradient_norm=opt_cfg.max_gradient_norm,
                max_gradient_value=opt_cfg.max_gradient_value, gradient_norm=log_now,
            )  # fmt: skip
        except NonFiniteGradients:  # no loss scaling: stop before applying them
            located = self.watch.build_report(loss.detach())  # the stop path: reads are fine here
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.update()  # ends the iteration the refused step began
            compute = cfg.precision.compute_dtype
            what = f"the gradients are inf/NaN (loss {float(loss.detach())}) and loss scaling is off ({compute}), so "
            what += "nothing can skip this step: it was not applied"
            dynamic = ", or optimizer.loss_scaling_factor: dynamic" if compute != "float32" else ""
            raise self._stop(step, what, _DIVERGED + dynamic, [located], 1) from None
        skipped = self.scaler.step_was_skipped(self.optimizer)
        report = self.scaler.overflow_report() if skipped else None  # built by step() on overflow only
        self.scheduler.step()  # skip-aware: advances only when the step was applied
        self.global_step = step
        if step >= self._tail_from:
            self._tail_sum += loss.detach().float()
        stop = self._at_floor(skipped, report)
        if not (log_now or skipped):
            return
        # Under dls.emulate (its statistics kept with log_underflow): the underflow counted since the last logged step.
        if log_now and self.emulation is not None and (stats := self.emulation.stats) is not None:
            underflow = stats.underflow_fraction
            stats.reset()
        fp8: list[float] = []  # flushed and saturated fractions of FP8 grad_output casts since the previous row
        if self.fp8 is not None:
            totals = self.fp8.stats.totals()["grad_output"]
            self.fp8.stats.reset()
            fp8 = [float(totals["flushed_fraction"]), float(totals["saturated_fraction"])]
        norm = result.grad_norm if result.grad_norm is not None else torch.full((), math.nan)
        loss_value, scale_used, grad_norm = torch.stack(
            [loss.detach().float(), result.loss_scale.float().to(loss.device), norm.float().to(loss.device)]
        ).tolist()
        if self.world_size > 1:  # alike on every rank (skipping is agreed): one all-reduce of the means over the
            # ranks (loss, underflow, FP8 fractions) and of whether any rank got Ctrl-C
            asked = float(self._stop_signal is not None)
            loss_value, mean_underflow, asked, *fp8 = self._mean_over_ranks([loss_value, underflow or 0.0, asked, *fp8])
            underflow = mean_underflow if underflow is not None else None
            self._stop_due = self._stop_due or asked > 0
        for values, value in zip(self._recorded, (underflow, *(fp8 or (None, None)))):  # for the session's means
            if value is not None:
                values.append(value)
        enabled = self.scaler.is_enabled()
        skipped_total = self.scaler.get_num_skipped_steps() if enabled else None
        row: dict[str, Any] = {
            "step": step, "loss": json_number(loss_value),
            "loss_scale": scale_used if enabled and self.log_loss_scale else None,
            "skipped": skipped, "grad_norm": json_number(grad_norm), "lr": lr,
            "time": round(self.elapsed + time.perf_counter() - self._session_start, 4),
        }  # fmt: skip
        if cfg.precision.log_underflow:
            row.update(skipped_total=skipped_total, grad_underflow=underflow)
        if params_norm is not None:  # Model Zoo's ComputeNorm: the parameters' norm (the gradients': grad_norm)
            row["params_norm"] = json_number(float(params_norm))
        if fp8:
            row["fp8_grad_output_flushed"], row["fp8_grad_output_saturated"] = fp8
        if skipped:  # where the overflow started
            where = (report.first_module, report.forward) if report else (None, None)
            row["overflow_module"], row["forward_overflow"] = where
        if self.run_dir is not None:
            self.run_dir.write_row(row)
        self._display.update(row, skipped_total)
        if stop is not None:  # loss scaling cannot help
            raise self._stop(step, *stop, self._floor_reports, self.overflows_at_floor)

    def _refuse_nonfinite_gradients(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The optimizer's step pre-hook in a run without loss scaling: :class:`NonFiniteGradients` when a gradient of
        the model (master weights get theirs inside the step) holds inf/NaN; one read per step."""
        found = torch.zeros((), dtype=torch.float32, device=self.device)  # the model is on one device
        for grads in kernels.group_grads(self.model.parameters()).values():
            kernels.check_nonfinite(grads, found)
        if bool(found > 0):
            raise NonFiniteGradients

    def _at_floor(self, skipped: bool, report: OverflowReport | None) -> tuple[str, str] | None:
        """Count a step at the scale's floor (Model Zoo's test: ``get_non_clamped_scale() < get_scale()``; static
        scaling: every overflowing step; reading the scaler only when skipped); at
        ``runconfig.max_overflows_at_min_loss_scale`` of them without a clean step between, what happened and what
        to try (for :meth:`_stop`); else ``None``."""
        scaler, limit = self.scaler, self.cfg.runconfig.max_overflows_at_min_loss_scale
        if not skipped:  # also every step without loss scaling
            self.overflows_at_floor = 0
            self._floor_reports.clear()
            return None
        scale, static = scaler.get_scale(), scaler.mode == "static"
        if static or scaler.get_non_clamped_scale() < scale:
            self.overflows_at_floor += 1
            self._floor_reports.append(report)
        if self.overflows_at_floor < limit:
            return None
        if static:
            return (
                f"the static loss scale {pow2(scale)} made the gradients overflow on {limit} consecutive steps, and a "
                "static scale never comes down: skipping more steps cannot help",
                "use optimizer.loss_scaling_factor: dynamic (it finds the largest scale that does not overflow), or a "
                "smaller static scale",
            )
        return (
            f"the loss scale is pinned at min_loss_scale ({pow2(scale)}) and the gradients still overflowed on {limit} "
            "steps without a clean step between, so skipping more steps cannot help (Model Zoo: 'Minimum loss scale "
            "threshold was reached but gradient norms are still encountering NaN or inf values')",
            f"{_DIVERGED}; check the data for inf/NaN; switch to bfloat16 (precision.fp16_type: bfloat16), whose range "
            "matches float32, if the forward pass itself overflows in float16; or lower optimizer.min_loss_scale",
        )

    def _stop(
        self, step: int, what: str, advice: str, reports: Iterable[OverflowReport | None], counted: int
    ) -> TrainingStopped:
        """Checkpoint, then what stops the run at ``step``: ``what`` happened; where the overflows of ``reports`` (the
        last of ``counted`` steps) started, and whether the forward pass overflowed in them; what to try (``advice``,
        or a wider format and ``dls audit`` when the forward pass overflowed in most of them)."""
        seen, half, where = [r for r in reports if r is not None], self.cfg.precision.compute_dtype, ""
        n, forward = len(seen), sum(1 for r in seen if r.forward)
        of = f"of the last {n} counted steps" if n < counted else f"of the {n} steps" if n > 1 else "of 1 step"
        if firsts := Counter((r.first_module, r.first_module_type) for r in seen if r.first_module is not None):
            ranked = ", ".join(f"{module_label(m)} ({kind}) in {k}" for (m, kind), k in firsts.most_common(3))
            modules = _listed(list(dict.fromkeys(m for r in seen for m in r.modules)))
            where = f" First module with inf/NaN gradients, in backward order: {ranked} {of}; modules with inf/NaN "
            where += f"gradients: {modules}."
        if forward:
            where += f" The loss was already inf/NaN before scaling in {forward} {of}: the forward pass overflowed, "
            where += "and loss scaling cannot fix that."
        elif seen and all(r.forward is False for r in seen):
            where += " The loss was finite every time: the overflow arose in backward."
        if forward * 2 > n:
            wider = f"use {_WIDER[half]}, if {half}'s range is what overflowed; " if half in _WIDER else ""
            advice = f"{wider}`dls audit CONFIG.yaml` names the first module whose output exceeds each format; if "
            advice += f"float32's range overflowed too, {_DIVERGED}, or check the data and model.loss_weight"
        path = self._save()
        return TrainingStopped(
            f"Stopped at step {step}: {what}{fallback_note(self.watch)}.{where} To try: {advice}. Nothing is lost: the "
            f"state is saved in {path}; after changing the config, continue with --resume {self.model_dir}",
            path,
        )

    # ------------------------------------------------------------------ checkpoints
    def _save(self) -> Path:
        """Checkpoint the current state (every rank calls it; rank 0 writes); inf/NaN weights stop the run instead."""
        named = [(n, t) for n, t in self.model.named_parameters() if t.is_floating_point()]  # not buffers: they may
        finite = torch.stack([torch.isfinite(t).all() for _, t in named]).tolist() if named else []  # hold inf
        if broken := [n for (n, _), ok in zip(named, finite) if not ok]:
            raise self._broken_weights(broken)
        rng_ranks: list[Any] = [None] * self.world_size
        if self.world_size > 1:
            dist.all_gather_object(rng_ranks, ckpt.rng_state())
        if self.is_main:
            assert self.run_dir is not None, "checkpoints are written while train() holds model_dir"
            if self.recorder is not None:  # the trace holds every step up to the checkpoint
                self.recorder.flush()
            state: dict[str, Any] = {
                "global_step": self.global_step,
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "lr_scheduler": self.scheduler.state_dict(),
                "dataloader": self.batches.state_dict(),
                "rng": ckpt.rng_state(),
                "config": config.to_dict(self.cfg),
                "dls_version": dls.__version__,
                "trainer": {
                    "elapsed": self.elapsed + time.perf_counter() - self._session_start,
                    "overflows_at_floor": self.overflows_at_floor,
                },
                **({"rng_ranks": rng_ranks} if self.world_size > 1 else {}),
            }
            optional = {"grad_scaler": self.scaler if self.scaler.is_enabled() else None, "fp8": self.fp8}
            state.update((key, value.state_dict()) for key, value in optional.items() if value is not None)
            ckpt.save_checkpoint(self.run_dir, state, self.global_step, self.cfg.runconfig.keep_checkpoint_max)
        self._last_checkpoint = rundir.checkpoint_path(self.model_dir, self.global_step)
        return self._last_checkpoint

    def _broken_weights(self, broken: list[str]) -> TrainingStopped:
        """The stop for weights found inf/NaN at a checkpoint, told from what is true: how many of this session's
        steps were applied (skipped steps change nothing), and which checkpoints there are to go back to."""
        (start, skipped_before), prec, dir_ = self._session_from, self.cfg.precision, self.model_dir
        steps = self.global_step - start
        applied = steps - (self.scaler.get_num_skipped_steps() - skipped_before)
        if applied > 0:
            how = f"{applied} of this session's {steps} steps were applied and one broke them, so every step after it "
            how += "would overflow"
        else:  # the weights it started from were inf/NaN already
            how = f"no step of this session was applied ({steps} skipped), so they held inf/NaN when it started"
        found, origin = rundir.list_checkpoints(dir_), self._resumed_from
        newest, then = "the run has no checkpoint", "start again"
        if found:
            newest = f"the newest checkpoint is {found[-1][1]}"
            then = f"then --resume {dir_} (its metrics rows after that step are dropped)"
        elif origin is not None:
            newest = f"{dir_} holds no checkpoint; this run started from {origin}"
            then = f"then start from {origin} again"
        repair = "precision.master_weights: true, " if prec.half_params and not prec.master_weights else ""
        return TrainingStopped(
            f"Step {self.global_step}: the model's weights hold inf/NaN ({_listed(broken, 4)}): {how}. No checkpoint "
            f"of them was written; {newest}. To try: {repair}a lower optimizer.learning_rate or clipping "
            f"(optimizer.max_gradient_norm), {then}",
            found[-1][1] if found else None,
        )


# ---------------------------------------------------------------------- the optimizer, its LR schedule, stop messages
def build_optimizer(cfg: config.TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """``optimizer:``'s optimizer, each group's learning rate its factor (1.0; Model Zoo's muP and
    ``adjust_learning_rate`` groups their own): the LR schedule (a ``LambdaLR``) multiplies it. Model Zoo's models
    take Model Zoo's parameter groups and optimizers (``dls.train.modelzoo``: no weight decay on biases and norms;
    cstorch's Adam/AdamW, whose ``correct_bias`` is honoured); dls's own, torch's (whose AdamW always corrects)."""
    opt, (cls, hyper) = cfg.optimizer, config.optimizer_class(cfg.optimizer, cfg.model.name)
    params: Any = model.parameters()
    if cfg.model.name in config.ZOO_MODELS:
        from dls.train import modelzoo  # imported only by runs of Model Zoo models

        where = cfg.sources.get("optimizer.adjust_learning_rate", "optimizer.adjust_learning_rate")
        params = modelzoo.param_groups(model, opt.weight_decay, dict(opt.adjust_learning_rate), where)
    return cls(params, lr=1.0, **hyper)


def learning_rate_at(schedule: float | Sequence[Any], step: int) -> float:
    """The learning rate after ``step`` applied updates (0-based): a constant, or the schedule pieces one after
    another (``Constant``, ``Linear``, ``CosineDecay`` over ``total_iters`` steps each; the last holds its end)."""
    if isinstance(schedule, (int, float)):
        return float(schedule)
    for i, piece in enumerate(schedule):  # config.SchedulePiece; a schedule has at least one
        total = piece.total_iters
        if total is None or step < total or i == len(schedule) - 1:
            break
        step -= total
    if piece.scheduler == "Constant":
        return float(piece.learning_rate)
    start, end = float(piece.initial_learning_rate), float(piece.end_learning_rate)
    frac = min(step / total, 1.0) if total else 1.0
    if piece.scheduler == "Linear":
        return start + (end - start) * frac
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * frac))


def parameter_norm(model: torch.nn.Module) -> torch.Tensor:
    """The L2 norm of all of ``model``'s trainable parameters (Model Zoo's model_wise_params_norm), on the device."""
    params = [p.detach() for p in model.parameters() if p.requires_grad]
    return torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(params)]))


class _LossOf(torch.nn.Module):
    """``forward(batch)`` is ``model.loss(batch)``, so the loss goes through DDP's forward (its all-reduce)."""

    def __init__(self, model: batches.TrainModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: batches.Batch) -> torch.Tensor:
        return self.model.loss(batch)


class NonFiniteGradients(Exception):
    """Raised before the optimizer applies inf/NaN gradients."""


def _listed(names: Sequence[str], count: int = 6) -> str:
    shown = [module_label(n) for n in names[:count]]
    return ", ".join(shown) + (f" and {len(names) - count} more" if len(names) > count else "")


# Formats with more range than each half format, for a forward pass that overflowed it.
_WIDER = {
    "float16": "bfloat16 or cbfloat16 (precision.fp16_type), whose ranges reach float32's max and 2^32",
    "cbfloat16": "bfloat16 (precision.fp16_type: bfloat16), whose range is float32's",
}
_DIVERGED = "lower optimizer.learning_rate or clip with optimizer.max_gradient_norm, e.g. 1.0 (it may have diverged)"
