"""The training loop behind ``dls train``: a config in; a trained model, checkpoints, metrics and plots out. Each step
uses the library as its users do (``dls.optimizer_step``, ``dls.skip_aware``, ``scaler.watch``); device reads only
on logged steps (every ``log_steps``, the first, the last and skipped ones)."""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from rich.console import Console
from torch.nn.parallel import DistributedDataParallel

import dls
import dls.fp8
from dls import distributed
from dls.diagnostics import OverflowReport
from dls.diagnostics.fallback import apply_precision_fallback, fallback_note
from dls.train import checkpoint as ckpt
from dls.train import restore
from dls.train.config import CHECKPOINT_STATES, TrainConfig, loss_scaling_mode, scaler_settings, to_dict
from dls.train.data import BatchIterator, build_batches, build_model, evaluate, evaluate_batches, modelzoo
from dls.train.errors import TrainingStopped
from dls.train.launch import StopRequest, resolve_device, run_on_rank0, sum_over_ranks, wrap_data_parallel
from dls.train.optim import build_optimizer, build_scheduler
from dls.train.outputs import RunOutputs, require_tensorboard
from dls.train.precision import RunPrecision
from dls.train.reporting import (
    ProgressDisplay,
    TrainResult,
    describe_precision,
    describe_run,
    describe_scaling,
    json_number,
    print_summary,
)
from dls.train.rundir import resolve_model_dir
from dls.train.schema import ZOO_MODELS
from dls.train.stops import (
    FloorWatch,
    NonFiniteGradients,
    nonfinite_message,
    nonfinite_parameters,
    nonfinite_weights,
    refuse_nonfinite_gradients,
)

__all__ = ["TrainResult", "Trainer", "TrainingStopped"]


class Trainer:
    """Builds everything a config describes; :meth:`train` runs it."""

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
        self.cfg, self.config_file = cfg, Path(config_file) if config_file is not None else None
        self.console = console if console is not None else Console()
        self.show_progress, self.show_summary, self.write_plot = progress, summary, plot
        rc = cfg.runconfig
        self.device = resolve_device(rc.device)
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if distributed.is_active() else (0, 1)
        self.is_main = self.rank == 0
        if self.world_size > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())  # one GPU per rank
        if rc.tensorboard:
            require_tensorboard()  # before anything is built or written
        self.model_dir = resolve_model_dir(rc.model_dir)
        self.outputs = RunOutputs(self.model_dir, self.log)
        self.metrics_path = self.outputs.metrics_path
        self.crash_dir: Path | None = None  # where a crash report may go: model_dir, once this run has locked it
        ckpt.seed_everything(rc.seed)
        if not cfg.data.dataset:  # Model Zoo data: the directories are checked here, not by dls validate
            from dls.train.config import missing_paths

            if missing := missing_paths(cfg):
                raise ValueError("; ".join(missing))
        where = cfg.sources.get
        self.batches = build_batches(cfg.data, rc.seed, "train", self.rank, self.world_size, where("data.params"))
        self.dataset = self.batches.dataset if cfg.data.data_processor is None else None  # a built-in data set
        self.eval_batches = (
            build_batches(cfg.eval_data, rc.seed, "val", prefix=where("eval_data.params"))
            if cfg.eval_data is not None
            else None
        )
        self._train_data_eval: BatchIterator | None = None  # Model Zoo training data, for evaluation without eval_input
        prec = cfg.precision
        self.model = build_model(cfg.model, getattr(self.dataset, "info", None))
        if cfg.model.name in ZOO_MODELS:  # can it read the data (positions, token ids)
            for batches in (self.batches, self.eval_batches):
                if batches is not None:
                    modelzoo().fit_to_data(self.model, batches.dataset, where("model.params", "model"))
        self.model = self.model.to(self.device)
        self.max_steps = rc.max_steps
        if rc.num_epochs is not None and "max_steps" not in rc.model_fields_set:
            per_epoch = rc.steps_per_epoch or max(1, self.batches.batches_per_epoch // rc.grad_accum_steps)
            self.max_steps = rc.num_epochs * per_epoch
        freq = rc.eval_frequency
        self.eval_every = freq if isinstance(freq, int) else max(1, round(freq * self.max_steps)) if freq else None
        self.eval_loss: float | None = None
        # Before DDP: FP8's delayed scaling reduces its amaxes over the same ranks.
        group = dist.group.WORLD if self.world_size > 1 else None
        self.precision = RunPrecision(cfg, self.model, self.device, process_group=group)
        self.ddp: DistributedDataParallel | None = None
        if self.world_size > 1:
            # The same initial model everywhere (seeded alike; DDP also broadcasts rank 0's), then a random
            # stream of its own per rank (dropout).
            self.ddp = wrap_data_parallel(self.model, self.device)
            ckpt.seed_everything(rc.seed + self.rank)
        self.optimizer = self.precision.wrap_optimizer(build_optimizer(cfg.optimizer, self.model.parameters()))
        self.compute_dtype = cfg.precision.compute_dtype
        self.scaling = loss_scaling_mode(cfg)
        # The settings carry the half dtype (fp16_type): nothing process-global is read or set.
        self.scaler = dls.GradScaler.from_settings(
            scaler_settings(cfg), enabled=self.compute_dtype != "float32", device=self.device
        )
        self.scheduler = dls.skip_aware(build_scheduler(cfg.optimizer, self.optimizer), self.scaler)
        # Where an overflow starts (hooks of Python only; a report on overflowing steps alone); the modules kept in
        # float32 (precision.keep_in_float32, and those the fallback finds).
        keep, fallback = prec.keep_in_float32, prec.fallback_on and self.scaler.is_enabled()
        self.watch = apply_precision_fallback(self.model, self.scaler, keep, fallback)
        if not self.scaler.is_enabled():
            guard = refuse_nonfinite_gradients(self.device, list(self.model.parameters()))
            self.optimizer.register_step_pre_hook(guard)
        self.global_step = 0
        self.elapsed = 0.0
        # Stops when the scale cannot help.
        repair = "precision.master_weights: true, " if prec.half_params and not prec.master_weights else ""
        self.floor = FloorWatch(rc.max_overflows_at_min_loss_scale, prec.fp16_type, repair)
        self._last_checkpoint: Path | None = None
        self._last_skipped = False
        self._skipped_total: int | None = None  # as last read, on a logged step
        self._tail = (0, torch.zeros((), device=self.device), 0)  # (first step, loss sum, count): the final loss
        self._last_report: OverflowReport | None = None
        self._stop_agreed = False  # data-parallel: some rank was asked to stop (Ctrl-C), so all stop
        self._ended_together = False  # data-parallel: train() ended at the same point on every rank

    @property
    def fp8(self) -> dls.fp8.Fp8Handle | None:
        """The ``dls.fp8.emulate`` handle of ``precision.fp8`` (``None`` without it)."""
        return self.precision.fp8

    # ------------------------------------------------------------------ logging
    def log(self, message: str) -> None:
        if self.is_main:
            self.console.print(message, highlight=False, markup=False, soft_wrap=True)

    # ------------------------------------------------------------------ data-parallel
    def close(self) -> None:
        """Data-parallel: wait for all ranks when :meth:`train` ended alike on each, then release the DDP wrapper."""
        if self.ddp is None:
            return
        if self._ended_together and distributed.is_active():
            dist.barrier()
        self.ddp = None
        gc.collect()

    def _stop_requested(self, stop_request: StopRequest) -> bool:
        """Whether to stop before the next step: data-parallel, once the ranks agreed (at a logged step)."""
        return self._stop_agreed if self.world_size > 1 else stop_request.requested

    # ------------------------------------------------------------------ run
    def train(self, resume: str | Path | None = None, load_states: Sequence[str] | None = None) -> TrainResult:
        """Train to ``runconfig.max_steps``; with ``resume`` (a model_dir or a checkpoint file) continue from the
        checkpoint, loading ``load_states`` (default: ``runconfig.load_checkpoint_states``, else all)."""
        threads = torch.get_num_threads()
        if self.cfg.runconfig.num_threads is not None:
            torch.set_num_threads(self.cfg.runconfig.num_threads)
        try:
            return self._run(resume, load_states)
        finally:
            torch.set_num_threads(threads)

    def _run(self, resume: str | Path | None, load_states: Sequence[str] | None) -> TrainResult:
        if self.fp8 is not None and not self.fp8.active:
            raise RuntimeError("a Trainer with precision.fp8 trains once: build a new Trainer (with resume=...)")
        session_start = time.perf_counter()
        self._ended_together = False
        rc = self.cfg.runconfig
        states = tuple(load_states or CHECKPOINT_STATES)
        path: Path | None = None
        unreadable: list[tuple[Path, str]] = []

        def lock() -> None:  # first: nothing of model_dir is read before its lock is held
            try:
                self.outputs.lock()
            finally:
                self.crash_dir = self.model_dir if self.outputs.locked else None

        run_on_rank0(lock, self.rank, self.world_size)
        try:
            state = None
            if resume is None and rc.checkpoint_path is not None:  # trainer.fit.ckpt_path / runconfig.checkpoint_path
                resume = rc.checkpoint_path
            if resume is None and rc.autoload_last_checkpoint and ckpt.list_checkpoints(self.model_dir):
                resume = self.model_dir  # the same command again continues the run (the --resume DIR rules)
            if resume is not None:
                path, state, unreadable = ckpt.load_resume_checkpoint(resume)
                # LoadCheckpointStates applies to another run's checkpoint; the run's own load whole.
                if load_states is None and rc.load_checkpoint_states and path.parent.resolve() != self.model_dir:
                    states = rc.load_checkpoint_states
                for bad, reason in unreadable:
                    self.log(f"Skipping {bad}: {reason}")
            run_on_rank0(lambda: self.outputs.check(path, unreadable, states), self.rank, self.world_size)
            if path is not None and state is not None:
                restore.restore(self, path, state, states)
                del state
            run_on_rank0(
                lambda: self.outputs.open(
                    unreadable=unreadable,
                    step=self.global_step,
                    config=to_dict(self.cfg),
                    config_file=self.config_file,
                    tensorboard=self.cfg.runconfig.tensorboard,
                ),
                self.rank,
                self.world_size,
            )
            return self._train(session_start)
        finally:
            self.outputs.close()

    def _train(self, session_start: float) -> TrainResult:
        cfg, rc = self.cfg, self.cfg.runconfig
        if rc.num_steps is not None:  # Model Zoo's num_steps: this many steps in this run, within max_steps
            ends = [self.max_steps] if "max_steps" in rc.model_fields_set or rc.num_epochs else []
            self.max_steps = min([*ends, self.global_step + rc.num_steps])
        max_steps = self.max_steps
        for note in cfg.notes:
            self.log(f"note: {note}")
        self.log(describe_run(cfg, self.global_step, self.model_dir, self.world_size, self.device.type, max_steps))
        start_step = self.global_step
        tail = max(1, (max_steps - start_step) // 10)  # the final loss: mean over the last 10% of the session
        self._tail = (max_steps - tail + 1, torch.zeros((), device=self.device), 0)
        self.precision.start_session()
        display = ProgressDisplay(
            self.console, self.show_progress and self.is_main, max_steps, self.global_step, cfg.model.name
        )
        if rc.save_initial_checkpoint and self.global_step == 0:
            self._save(session_start)
        self.model.train()
        stop_request = StopRequest(self.log, distributed=self.world_size > 1)
        try:
            with stop_request:
                while self.global_step < max_steps:
                    if self._stop_requested(stop_request):
                        raise stop_request.interrupt()
                    row = self._step(session_start, stop_request.requested)
                    if row is not None and self.is_main:
                        self.outputs.write_row(row)
                    self._check_floor(session_start)
                    step = self.global_step
                    last = step == max_steps and (self.eval_every or self.eval_batches is not None)
                    if last or (self.eval_every and step % self.eval_every == 0):  # an eval loader: at the end too
                        self._evaluate(step)
                    if rc.checkpoint_steps and step % rc.checkpoint_steps == 0 and step < max_steps:
                        self._save(session_start)
                    if row is not None:
                        display.update(row, self._skipped_total)
                if self._last_checkpoint != ckpt.checkpoint_path(self.model_dir, self.global_step):  # not saved yet
                    self._save(session_start)
        except KeyboardInterrupt:
            display.close()
            if self._stop_requested(stop_request) and not stop_request.forced:  # between two steps: consistent
                path = self._save(session_start)
                self._ended_together = True
                self.log(
                    f"Interrupted at step {self.global_step}; saved {path}. Continue with --resume {self.model_dir}"
                )
            else:
                self.log(f"Interrupted; the last checkpoint is {self._last_checkpoint or 'none (nothing saved)'}")
            raise
        except TrainingStopped as stop:
            display.close()
            self._ended_together = True  # decided alike on every rank: the scaler state agrees
            self.precision.remove_hooks()
            stop.result = self._result(start_step, time.perf_counter() - session_start)
            raise
        finally:
            display.close()
            self.precision.remove_hooks()
        result = self._result(start_step, time.perf_counter() - session_start)
        if self.show_summary and self.is_main:
            print_summary(self.console, self.cfg, result)
        return result

    def _result(self, start_step: int, session_time: float) -> TrainResult:
        """What the session did (finished or stopped), with the plot written and the model evaluated."""
        _, loss_sum, count = self._tail
        final_loss = float(loss_sum) / count if count else None
        if final_loss is not None and self.world_size > 1:
            final_loss = sum_over_ranks([final_loss], self.device)[0] / self.world_size
        self._ended_together = True
        grad_underflow, fp8_flushed, fp8_saturated = self.precision.means()
        return TrainResult(
            model_dir=self.model_dir, global_step=self.global_step, steps_run=self.global_step - start_step,
            final_loss=final_loss, eval_loss=self._final_eval() if self.is_main else None,
            skipped_steps=self.scaler.get_num_skipped_steps(),
            loss_scale=self.scaler.get_scale() if self.scaler.is_enabled() else None, scaling=self.scaling,
            grad_underflow=grad_underflow, fp8_flushed=fp8_flushed, fp8_saturated=fp8_saturated,
            wall_time=session_time, checkpoint=self._last_checkpoint, metrics_path=self.metrics_path,
            plot_path=self._plot(),
        )  # fmt: skip

    # ------------------------------------------------------------------ evaluation
    def _evaluate(self, step: int) -> None:
        """``eval_steps`` batches of the eval loader (the training data's without one), as a metrics row."""
        rc = self.cfg.runconfig
        source = self.eval_batches
        if source is None and self.dataset is None:  # built at the first evaluation, read again at the next
            if self._train_data_eval is None:
                prefix = self.cfg.sources.get("data.params")
                self._train_data_eval = build_batches(self.cfg.data, rc.seed, "train", prefix=prefix)
            source = self._train_data_eval
        if source is None:
            assert self.dataset is not None
            self.eval_loss = evaluate(self.model, self.dataset, self.device)
        else:
            steps = rc.eval_steps or max(1, source.batches_per_epoch)
            with self.precision.autocast():
                self.eval_loss = evaluate_batches(self.model, source, steps, self.device, self.precision.to_device)
            source.load_state_dict({"epoch": 0, "position": 0})  # every evaluation reads the same batches
        if self.is_main:
            self.outputs.write_row({"step": step, "eval_loss": json_number(self.eval_loss)})

    def _final_eval(self) -> float | None:
        if self.dataset is not None:  # a built-in data set: its first samples, in float32
            return evaluate(self.model, self.dataset, self.device)
        return self.eval_loss

    # ------------------------------------------------------------------ one step
    def _step(self, session_start: float, stop_requested: bool = False) -> dict[str, Any] | None:
        """One training step; its metrics row when the step is logged (see the module docstring), else ``None``."""
        cfg, rc, opt_cfg = self.cfg, self.cfg.runconfig, self.cfg.optimizer
        step = self.global_step + 1
        log_now = step % rc.log_steps == 0 or step == self.max_steps or step == 1
        accum, weight = rc.grad_accum_steps, cfg.model.loss_weight / rc.grad_accum_steps
        losses = []
        for _ in range(accum - 1):  # micro-batches before the last: gradients add up, no step
            with self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext():
                micro = self.precision.to_device(self.batches.next())
                with self.precision.autocast():
                    losses.append(self.model.loss(micro) if self.ddp is None else self.ddp(micro))
                self.scaler.scale(losses[-1] * weight).backward()
                losses[-1] = losses[-1].detach()
        batch = self.precision.to_device(self.batches.next())
        underflow = None
        if log_now and self.precision.probes_underflow:
            underflow = self.precision.probe_underflow(batch, self.scaler.get_scale())
        lr = float(self.optimizer.param_groups[0]["lr"])
        with self.precision.autocast():
            loss = self.model.loss(batch) if self.ddp is None else self.ddp(batch)
        weighted = loss * weight if weight != 1.0 else loss
        if losses:
            loss = torch.stack([*losses, loss.detach()]).mean()
        try:
            result = dls.optimizer_step(
                weighted,
                self.optimizer,
                self.scaler,
                max_gradient_norm=opt_cfg.max_gradient_norm,
                max_gradient_value=opt_cfg.max_gradient_value,
                gradient_norm=log_now,
            )
        except NonFiniteGradients:
            self._stop_without_scaling(step, loss, session_start)
        skipped = self.scaler.step_was_skipped(self.optimizer)
        self._last_report = self.scaler.overflow_report() if skipped else None  # built by step() on overflow only
        self.scheduler.step()  # skip-aware: advances only when the step was applied
        self.global_step = step
        first, loss_sum, count = self._tail
        if step >= first:
            self._tail = (first, loss_sum + loss.detach().float(), count + 1)
        if log_now and (emulated := self.precision.emulated_underflow()) is not None:
            underflow = emulated
        self._last_skipped = skipped
        if not (log_now or skipped):
            return None
        fp8 = self.precision.fp8_fractions()  # the casts since the previous row
        norm = result.grad_norm if result.grad_norm is not None else torch.full((), math.nan)
        loss_value, scale_used, grad_norm = torch.stack(
            [loss.detach().float(), result.loss_scale.float().to(loss.device), norm.float().to(loss.device)]
        ).tolist()
        if self.world_size > 1:  # alike on every rank: skipping is agreed
            # One all-reduce: the mean loss, underflow and FP8 fractions over the ranks, and whether any rank got
            # Ctrl-C.
            sums = sum_over_ranks([loss_value, underflow or 0.0, float(stop_requested), *fp8], self.device)
            loss_value = sums[0] / self.world_size
            underflow = sums[1] / self.world_size if underflow is not None else None
            self._stop_agreed = self._stop_agreed or sums[2] > 0
            fp8 = [v / self.world_size for v in sums[3:]]
        self.precision.record(underflow, fp8)
        enabled = self.scaler.is_enabled()
        self._skipped_total = self.scaler.get_num_skipped_steps() if enabled else None
        row: dict[str, Any] = {
            "step": step,
            "loss": json_number(loss_value),
            "loss_scale": scale_used if enabled else None,
            "skipped": skipped,
            "grad_norm": json_number(grad_norm),
            "lr": lr,
            "time": round(self.elapsed + time.perf_counter() - session_start, 4),
        }
        if opt_cfg.log_summaries:
            row["skipped_total"] = self._skipped_total
            row["grad_underflow"] = underflow
        if fp8:
            row["fp8_grad_output_flushed"], row["fp8_grad_output_saturated"] = fp8
        if skipped:
            report = self._last_report
            row["overflow_module"] = report.first_module if report is not None else None
            row["forward_overflow"] = report.forward if report is not None else None
        return row

    # ------------------------------------------------------------------ stops (dls.train.stops)
    def _stop_without_scaling(self, step: int, loss: torch.Tensor, session_start: float) -> NoReturn:
        report = self.watch.build_report(loss.detach())  # the stop path: reads are fine here
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.update()  # ends the iteration the refused step began
        path = self._save(session_start)
        message = nonfinite_message(step, float(loss.detach()), self.compute_dtype, self.global_step, path, report)
        raise TrainingStopped(message, path)

    def _check_floor(self, session_start: float) -> None:
        problem = self.floor.after_step(self.scaler, self._last_skipped, self._last_report)
        if problem is None:
            return
        path = self._save(session_start)
        raise TrainingStopped(
            f"Stopped at step {self.global_step}: {problem}{fallback_note(self.watch)}. Nothing is lost: the state is "
            f"saved in {path}; after changing the config, continue with --resume {self.model_dir}",
            path,
        )

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
        if self.fp8 is not None:
            state["fp8"] = self.fp8.state_dict()
        return state

    def _save(self, session_start: float) -> Path:
        """Checkpoint the current state (every rank calls it; rank 0 writes); inf/NaN weights stop the run instead."""
        broken = nonfinite_parameters(self.model)
        if broken:
            message = nonfinite_weights(
                self.global_step, broken, self._last_checkpoint, self.model_dir, self.floor.repair
            )
            raise TrainingStopped(message, self._last_checkpoint)
        path = ckpt.checkpoint_path(self.model_dir, self.global_step)
        rng_ranks: list[Any] = []
        if self.world_size > 1:
            rng_ranks = [None] * self.world_size
            dist.all_gather_object(rng_ranks, ckpt.rng_state())
        if self.is_main:
            state = self.state_dict()
            state["trainer"] = {
                "elapsed": self.elapsed + time.perf_counter() - session_start,
                "overflows_at_floor": self.floor.count,
            }
            if rng_ranks:
                state["rng_ranks"] = rng_ranks
            run_dir = self.outputs.run_dir
            assert run_dir is not None, "checkpoints are written while train() holds model_dir"
            ckpt.save_checkpoint(state, path, keep=self.cfg.runconfig.keep_checkpoint_max, dir_fd=run_dir.fd)
        self._last_checkpoint = path
        return path

    def _plot(self) -> Path | None:
        if not (self.write_plot and self.is_main):
            return None
        title = f"{self.cfg.model.name}, {describe_precision(self.cfg)}\n{describe_scaling(self.cfg)}"
        return self.outputs.plot(title)
