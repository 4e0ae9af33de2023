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
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from torch.nn.parallel import DistributedDataParallel

import dls
from dls import distributed
from dls.diagnostics.fallback import apply_precision_fallback, fallback_note
from dls.train import checkpoint as ckpt
from dls.train import reporting, rundir
from dls.train.config import CHECKPOINT_STATES, TrainConfig, loss_scaling_mode, scaler_settings, to_dict
from dls.train.data import BatchIterator, build_batches, modelzoo
from dls.train.errors import TrainingStopped
from dls.train.launch import StopRequest, resolve_device, run_on_rank0, sum_over_ranks, wrap_data_parallel
from dls.train.models import build_model, evaluate, evaluate_batches
from dls.train.precision import NonFiniteGradients, RunPrecision, Stops, build_optimizer, build_scheduler
from dls.train.reporting import TrainResult, json_number
from dls.train.schema import ZOO_MODELS

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
            rundir.require_tensorboard()  # before anything is built or written
        self.model_dir = rundir.resolve_model_dir(rc.model_dir)
        self.run_dir: rundir.RunDir | None = None  # rank 0, while train() holds model_dir
        self.crash_dir: Path | None = None  # where a crash report may go: model_dir, once this run has locked it
        ckpt.seed_everything(rc.seed)
        if not cfg.data.dataset:  # Model Zoo data: the directories are checked here, not by dls validate
            from dls.train.config import missing_paths

            if missing := missing_paths(cfg):
                raise ValueError("; ".join(missing))
        where = cfg.sources.get
        self.batches = build_batches(cfg.data, rc.seed, "train", self.rank, self.world_size, where("data.params"))
        self.dataset = self.batches.dataset if cfg.data.data_processor is None else None  # a built-in data set
        self.eval_batches = None
        if cfg.eval_data is not None:
            self.eval_batches = build_batches(cfg.eval_data, rc.seed, "val", prefix=where("eval_data.params"))
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
        self.fp8 = self.precision.fp8  # the dls.fp8.emulate handle of precision.fp8 (None without it)
        self.ddp: DistributedDataParallel | None = None
        if self.world_size > 1:
            # The same initial model everywhere (seeded alike; DDP also broadcasts rank 0's), then a random
            # stream of its own per rank (dropout).
            self.ddp = wrap_data_parallel(self.model, self.device)
            ckpt.seed_everything(rc.seed + self.rank)
        self.scaling = loss_scaling_mode(cfg)
        # The settings carry the half dtype (fp16_type): nothing process-global is read or set.
        enabled = prec.compute_dtype != "float32"
        self.scaler = dls.GradScaler.from_settings(scaler_settings(cfg), enabled=enabled, device=self.device)
        optimizer = build_optimizer(cfg.optimizer, self.model.parameters())
        self.optimizer = self.precision.wrap_optimizer(optimizer, scaled=self.scaler.is_enabled())
        self.scheduler = dls.skip_aware(build_scheduler(cfg.optimizer, self.optimizer), self.scaler)
        # Where an overflow starts (hooks of Python only; a report on overflowing steps alone); the modules kept in
        # float32 (precision.keep_in_float32, and those the fallback finds).
        keep, fallback = prec.keep_in_float32, prec.fallback_on and self.scaler.is_enabled()
        self.watch = apply_precision_fallback(self.model, self.scaler, keep, fallback)
        self.global_step, self.elapsed = 0, 0.0
        self.stops = Stops(rc.max_overflows_at_min_loss_scale, prec)  # when the numbers cannot go on
        self._last_checkpoint: Path | None = None
        self._skipped_total: int | None = None  # as last read, on a logged step
        self._tail = (0, torch.zeros((), device=self.device), 0)  # (first step, loss sum, count): the final loss
        self._ended_together = False  # data-parallel: train() ended at the same point on every rank

    # ------------------------------------------------------------------ logging, data-parallel
    def log(self, message: str) -> None:
        if self.is_main:
            self.console.print(message, highlight=False, markup=False, soft_wrap=True)

    def close(self) -> None:
        """Data-parallel: wait for all ranks when :meth:`train` ended alike on each, then release the DDP wrapper."""
        if self.ddp is None:
            return
        if self._ended_together and distributed.is_active():
            dist.barrier()
        self.ddp = None
        gc.collect()

    # ------------------------------------------------------------------ run
    def train(self, resume: str | Path | None = None, load_states: Sequence[str] | None = None) -> TrainResult:
        """Train to ``runconfig.max_steps``; with ``resume`` (a model_dir or a checkpoint file) continue from the
        checkpoint, loading ``load_states`` (default: ``runconfig.load_checkpoint_states``, else all)."""
        if self.fp8 is not None and not self.fp8.active:
            raise RuntimeError("a Trainer with precision.fp8 trains once: build a new Trainer (with resume=...)")
        self._session_start = time.perf_counter()
        rc, threads = self.cfg.runconfig, torch.get_num_threads()
        if rc.num_threads is not None:
            torch.set_num_threads(rc.num_threads)
        self._ended_together, self.crash_dir = False, None
        states, what = tuple(load_states or CHECKPOINT_STATES), "--resume"
        path: Path | None = None
        unreadable: list[tuple[Path, str]] = []
        aside: list[Path] = []  # unreadable checkpoints of this run's own directory

        def lock() -> None:  # first: nothing of model_dir is read before its lock is held
            run_dir = self.run_dir = rundir.RunDir(self.model_dir)
            self.crash_dir = self.model_dir  # then a crash report may go there
            if run_dir.stale:
                self.log(f"Taking over the lock of {run_dir.stale}: that run ended without releasing it")

        def open_run_dir() -> None:
            assert self.run_dir is not None
            self.run_dir.open(
                self.log, set_aside=aside, step=self.global_step, config=to_dict(self.cfg),
                config_file=self.config_file, tensorboard=rc.tensorboard,
            )  # fmt: skip

        try:
            run_on_rank0(lock)
            state = None
            if resume is None and rc.checkpoint_path is not None:
                key = "runconfig.checkpoint_path"  # or trainer.fit.ckpt_path: errors name the key as written
                resume, what = rc.checkpoint_path, self.cfg.sources.get(key, key)
            if resume is None and rc.autoload_last_checkpoint and ckpt.list_checkpoints(self.model_dir):
                resume = self.model_dir  # the same command again continues the run (the --resume DIR rules)
            if resume is not None:
                path, state, unreadable = ckpt.load_resume_checkpoint(resume, what)
                # LoadCheckpointStates applies to another run's checkpoint; the run's own load whole.
                if load_states is None and rc.load_checkpoint_states and path.parent.resolve() != self.model_dir:
                    states = rc.load_checkpoint_states
                for bad, reason in unreadable:
                    self.log(f"Skipping {bad}: {reason}")
            run_on_rank0(lambda: aside.extend(rundir.check_model_dir(self.model_dir, path, unreadable, states)))
            if path is not None and state is not None:
                ckpt.restore(self, path, state, states)
                del state
            run_on_rank0(open_run_dir)
            return self._train()
        finally:
            torch.set_num_threads(threads)
            if self.run_dir is not None:
                self.run_dir.close()
                self.run_dir = None

    def _train(self) -> TrainResult:
        cfg, rc = self.cfg, self.cfg.runconfig
        if rc.num_steps is not None:  # Model Zoo's num_steps: this many steps in this run, within max_steps
            ends = [self.max_steps] if "max_steps" in rc.model_fields_set or rc.num_epochs else []
            self.max_steps = min([*ends, self.global_step + rc.num_steps])
        max_steps, start_step = self.max_steps, self.global_step
        for note in cfg.notes:
            self.log(f"note: {note}")
        self.log(reporting.describe_run(cfg, start_step, self.model_dir, self.world_size, self.device.type, max_steps))
        tail = max(1, (max_steps - start_step) // 10)  # the final loss: mean over the last 10% of the session
        self._tail = (max_steps - tail + 1, torch.zeros((), device=self.device), 0)
        self.precision.start_session()
        shown = self.show_progress and self.is_main
        display = reporting.ProgressDisplay(self.console, shown, max_steps, start_step, cfg.model.name)
        if rc.save_initial_checkpoint and start_step == 0:
            self._save()
        self.model.train()
        stop_request = StopRequest(self.log, distributed=self.world_size > 1)
        stopped: TrainingStopped | None = None
        try:
            with stop_request:
                while self.global_step < max_steps:
                    if stop_request.due:
                        raise stop_request.interrupt()
                    row = self._step(stop_request)
                    step = self.global_step
                    last = step == max_steps and (self.eval_every or self.eval_batches is not None)
                    if last or (self.eval_every and step % self.eval_every == 0):  # an eval loader: at the end too
                        self._evaluate(step)
                    if rc.checkpoint_steps and step % rc.checkpoint_steps == 0 and step < max_steps:
                        self._save()
                    if row is not None:
                        display.update(row, self._skipped_total)
                if self._last_checkpoint != ckpt.checkpoint_path(self.model_dir, self.global_step):  # not saved yet
                    self._save()
        except KeyboardInterrupt:
            display.close()
            if stop_request.due and not stop_request.forced:  # between two steps: consistent
                path = self._save()
                self._ended_together = True
                self.log(
                    f"Interrupted at step {self.global_step}; saved {path}. Continue with --resume {self.model_dir}"
                )
            else:
                self.log(f"Interrupted; the last checkpoint is {self._last_checkpoint or 'none (nothing saved)'}")
            raise
        except TrainingStopped as exc:
            stopped, self._ended_together = exc, True  # decided alike on every rank: the scaler state agrees
        finally:
            display.close()
            self.precision.remove_hooks()
        # What the session did (finished or stopped), with the plot written and the model evaluated.
        wall_time, (_, loss_sum, count) = time.perf_counter() - self._session_start, self._tail
        final_loss = float(loss_sum) / count if count else None
        if final_loss is not None and self.world_size > 1:
            final_loss = sum_over_ranks([final_loss], self.device)[0] / self.world_size
        self._ended_together = True
        eval_loss = self.eval_loss
        if self.is_main and self.dataset is not None:  # a built-in data set: its first samples, in float32
            eval_loss = evaluate(self.model, self.dataset, self.device)
        plot = None
        if self.write_plot and self.run_dir is not None:
            describe = reporting.describe_precision(cfg), reporting.describe_scaling(cfg)
            plot = self.run_dir.plot(f"{cfg.model.name}, {describe[0]}\n{describe[1]}")
        grad_underflow, fp8_flushed, fp8_saturated = self.precision.means()
        result = TrainResult(
            model_dir=self.model_dir, global_step=self.global_step, steps_run=self.global_step - start_step,
            final_loss=final_loss, eval_loss=eval_loss if self.is_main else None,
            skipped_steps=self.scaler.get_num_skipped_steps(),
            loss_scale=self.scaler.get_scale() if self.scaler.is_enabled() else None, scaling=self.scaling,
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
        if self.run_dir is not None:
            self.run_dir.write_row({"step": step, "eval_loss": json_number(self.eval_loss)})

    # ------------------------------------------------------------------ one step
    def _step(self, stop_request: StopRequest) -> dict[str, Any] | None:
        """One training step; its metrics row when the step is logged (see the module docstring), else ``None``."""
        cfg, rc, opt_cfg = self.cfg, self.cfg.runconfig, self.cfg.optimizer
        step = self.global_step + 1
        log_now = step % rc.log_steps == 0 or step == self.max_steps or step == 1
        weight, underflow = cfg.model.loss_weight / rc.grad_accum_steps, None
        losses: list[torch.Tensor] = []
        for later in range(rc.grad_accum_steps - 1, -1, -1):  # micro-batches before the last: gradients add up
            batch = self.precision.to_device(self.batches.next())
            if not later and log_now and self.precision.probes_underflow:
                underflow = self.precision.probe_underflow(batch, self.scaler.get_scale())
            with self.ddp.no_sync() if self.ddp is not None and later else contextlib.nullcontext():
                with self.precision.autocast():
                    loss = self.model.loss(batch) if self.ddp is None else self.ddp(batch)
                if later:
                    self.scaler.scale(loss * weight).backward()
                    losses.append(loss.detach())
        lr = float(self.optimizer.param_groups[0]["lr"])
        weighted = loss * weight if weight != 1.0 else loss
        if losses:
            loss = torch.stack([*losses, loss.detach()]).mean()
        try:
            result = dls.optimizer_step(
                weighted, self.optimizer, self.scaler, max_gradient_norm=opt_cfg.max_gradient_norm,
                max_gradient_value=opt_cfg.max_gradient_value, gradient_norm=log_now,
            )  # fmt: skip
        except NonFiniteGradients:  # no loss scaling: stop before applying them
            where = self.watch.build_report(loss.detach())  # the stop path: reads are fine here
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.update()  # ends the iteration the refused step began
            path = self._save()
            message = self.stops.nonfinite_gradients(step, float(loss.detach()), self.global_step, path, where)
            raise TrainingStopped(message, path) from None
        skipped = self.scaler.step_was_skipped(self.optimizer)
        report = self.scaler.overflow_report() if skipped else None  # built by step() on overflow only
        self.scheduler.step()  # skip-aware: advances only when the step was applied
        self.global_step = step
        first, loss_sum, count = self._tail
        if step >= first:
            self._tail = (first, loss_sum + loss.detach().float(), count + 1)
        if log_now and (emulated := self.precision.emulated_underflow()) is not None:
            underflow = emulated
        if not (log_now or skipped):
            self.stops.after_step(self.scaler, skipped)  # a clean step
            return None
        fp8 = self.precision.fp8_fractions()  # the casts since the previous row
        norm = result.grad_norm if result.grad_norm is not None else torch.full((), math.nan)
        loss_value, scale_used, grad_norm = torch.stack(
            [loss.detach().float(), result.loss_scale.float().to(loss.device), norm.float().to(loss.device)]
        ).tolist()
        if self.world_size > 1:  # alike on every rank: skipping is agreed
            # One all-reduce: the mean loss, underflow and FP8 fractions over the ranks, and whether any rank got
            # Ctrl-C.
            sums = sum_over_ranks([loss_value, underflow or 0.0, float(stop_request.requested), *fp8], self.device)
            loss_value = sums[0] / self.world_size
            underflow = sums[1] / self.world_size if underflow is not None else None
            stop_request.agreed = stop_request.agreed or sums[2] > 0
            fp8 = [v / self.world_size for v in sums[3:]]
        self.precision.record(underflow, fp8)
        enabled = self.scaler.is_enabled()
        self._skipped_total = self.scaler.get_num_skipped_steps() if enabled else None
        row: dict[str, Any] = {
            "step": step, "loss": json_number(loss_value), "loss_scale": scale_used if enabled else None,
            "skipped": skipped, "grad_norm": json_number(grad_norm), "lr": lr,
            "time": round(self.elapsed + time.perf_counter() - self._session_start, 4),
        }  # fmt: skip
        if opt_cfg.log_summaries:
            row["skipped_total"] = self._skipped_total
            row["grad_underflow"] = underflow
        if fp8:
            row["fp8_grad_output_flushed"], row["fp8_grad_output_saturated"] = fp8
        if skipped:  # where the overflow started
            row["overflow_module"], row["forward_overflow"] = (
                (report.first_module, report.forward) if report else (None, None)
            )
        if self.run_dir is not None:
            self.run_dir.write_row(row)
        if problem := self.stops.after_step(self.scaler, skipped, report):  # loss scaling cannot help: stop
            path = self._save()
            raise TrainingStopped(
                f"Stopped at step {step}: {problem}{fallback_note(self.watch)}. Nothing is lost: the state is saved in "
                f"{path}; after changing the config, continue with --resume {self.model_dir}",
                path,
            )
        return row

    # ------------------------------------------------------------------ checkpoints
    def _save(self) -> Path:
        """Checkpoint the current state (every rank calls it; rank 0 writes); inf/NaN weights stop the run instead."""
        last = self._last_checkpoint
        if message := self.stops.nonfinite_weights(self.model, self.global_step, last, self.model_dir):
            raise TrainingStopped(message, last)
        rng_ranks: list[Any] = [None] * self.world_size
        if self.world_size > 1:
            dist.all_gather_object(rng_ranks, ckpt.rng_state())
        if self.run_dir is not None:
            state: dict[str, Any] = {
                "global_step": self.global_step,
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "lr_scheduler": self.scheduler.state_dict(),
                "dataloader": self.batches.state_dict(),
                "rng": ckpt.rng_state(),
                "config": to_dict(self.cfg),
                "dls_version": dls.__version__,
                "trainer": {
                    "elapsed": self.elapsed + time.perf_counter() - self._session_start,
                    "overflows_at_floor": self.stops.count,
                },
            }
            optional = {"grad_scaler": self.scaler if self.scaler.is_enabled() else None, "fp8": self.fp8}
            state.update((key, value.state_dict()) for key, value in optional.items() if value is not None)
            if self.world_size > 1:
                state["rng_ranks"] = rng_ranks
            self.run_dir.save_checkpoint(state, self.global_step, self.cfg.runconfig.keep_checkpoint_max)
        self._last_checkpoint = ckpt.checkpoint_path(self.model_dir, self.global_step)
        return self._last_checkpoint
