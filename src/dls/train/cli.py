"""The ``dls`` command (entry ``dls_entry.main``): one ``dls: ...`` line per failure, exit status by
``errors.exit_status``; rank 0 alone prints. What needs the ``train`` extra is imported inside the commands."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dls.train import init as init_command
from dls.train.errors import (
    CheckpointError,
    ConfigError,
    ExitStatus,
    MissingExtras,
    UsageError,
    describe,
    exit_status,
    write_crash_report,
)
from dls.train.launch import init_distributed, shutdown_distributed, torchrun_env
from dls_entry import signals

# What the trainer imports beyond torch (the ``train`` extra): import name -> package name.
TRAIN_EXTRA = {"yaml": "PyYAML", "numpy": "numpy", "rich": "rich", "matplotlib": "matplotlib", "pydantic": "pydantic"}
INSTALL_HINT = "pip install 'dls[train]'"

DESCRIPTION = """\
dls: train PyTorch models in mixed precision with dynamic loss scaling, from Cerebras-Model-Zoo-style YAML
configs (optimizer.loss_scaling_factor: "dynamic"). Start with: dls demo; dls train configs/mlp_fp16_dls.yaml;
dls audit configs/mlp_fp16_dls.yaml; dls keys (every config key)."""

TRAIN_EPILOG = """\
examples:
  dls train configs/mlp_fp16_dls.yaml -o runconfig.max_steps=20 optimizer.loss_scaling_factor=dynamic
  dls train --resume runs/mlp_fp16_dls -o runconfig.max_steps=800        continue the run in place
  dls train --resume runs/mlp_fp16_dls --load_checkpoint_states model,optimizer -o runconfig.model_dir=runs/ft
  torchrun --nproc_per_node=2 -m dls_entry train configs/mlp_fp16_dls.yaml        data-parallel
--resume DIR continues DIR's run in DIR; another (new or empty) model_dir starts a new run from the checkpoint.
outputs in runconfig.model_dir: checkpoint_<step>.mdl, metrics.jsonl, plots.png, config.yaml, tensorboard/.
exit status: 0 done; 1 stopped (loss scaling cannot help, or inf/NaN weights); 2 bad input or model_dir
refused; 3 I/O, disk or memory; 4 internal error (traceback in a file); 130 Ctrl-C; 143 SIGTERM."""

AUDIT_EPILOG = """\
examples:
  dls audit configs/transformer_lm_fp16_dls.yaml --formats float16 bfloat16 --steps 2 --out runs/audit
  dls audit configs/mlp_fp16_dls.yaml --fp8-recipes          every recipe: current delayed mxfp8 static
Per format: whether the forward pass overflows, how the gradients fit, the initial loss scale to start at
(optimizer.initial_loss_scale). Nothing is trained; only --out writes (DIR/audit.png, locked like a model_dir).
exit status: 0 done (whatever the verdicts); 2 bad config or arguments."""
RAW = argparse.RawDescriptionHelpFormatter  # keeps the line breaks of the texts above


def _config_args(parser: argparse.ArgumentParser, **config: Any) -> None:
    parser.add_argument("config", help="YAML config file", **config)
    parser.add_argument(
        "--override", "-o", nargs="+", action="extend", default=[], metavar="SECTION.KEY=VALUE",
        help="change config values; VALUE is read as YAML (20, 1e-3, dynamic, null, [0.9, 0.99])",
    )  # fmt: skip


def _data(args: argparse.Namespace, run: Any) -> int:
    from dls.train.modelzoo import main as write_data  # parses its own arguments

    return write_data(args.args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dls", description=DESCRIPTION, formatter_class=RAW)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = sub.add_parser("train", help="train a model from a YAML config", epilog=TRAIN_EPILOG, formatter_class=RAW)
    _config_args(train, nargs="?")
    train.add_argument("--resume", metavar="DIR_OR_FILE", help="continue from DIR's latest checkpoint (or FILE)")
    train.add_argument(
        "--load_checkpoint_states", metavar="STATES",
        help="states to load (model, optimizer, dataloader, grad_scaler, lr_scheduler, global_step, rng; default all)",
    )  # fmt: skip
    demo = sub.add_parser("demo", help="float32 / float16 / loss scaling / master weights / FP8 on a small model")
    demo.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    demo.add_argument("--steps", type=int, default=None, help="training steps per run (default: 600)")
    for command in (train, demo):
        command.add_argument("--no_progress", action="store_true", help="no progress bars")
    audit = sub.add_parser("audit", help="which formats fit a config's model", epilog=AUDIT_EPILOG, formatter_class=RAW)
    _config_args(audit)
    audit.add_argument("--formats", nargs="+", metavar="FORMAT", help="default: float16 bfloat16 cbfloat16")
    audit.add_argument("--steps", type=int, default=4, help="forward/backward passes per format (default 4)")
    audit.add_argument("--out", metavar="DIR", help="write DIR/audit.png")
    audit.add_argument("--fp8-recipes", nargs="*", metavar="RECIPE", help="compare FP8 recipes (none given: all)")
    _config_args(sub.add_parser("validate", help="check a config; print it with every default and the scaler's"))
    sub.add_parser("keys", help="list every config key with its default and meaning")
    # dls.train.modelzoo.main parses its own arguments (--help included: no option of this parser's own)
    data = sub.add_parser("data", help="write a tiny data set in a Model Zoo format", add_help=False, prefix_chars="\0")
    data.add_argument("args", nargs=argparse.REMAINDER)
    init_command.add_parser(sub)
    return parser


def _quiet_rank() -> bool:
    env = torchrun_env()  # ranks other than 0 print nothing: every rank meets the same errors
    return env.world_size > 1 and env.rank != 0


class _Run:
    crash_dir: Path | None = None  # where a crash report may go


def main(argv: Sequence[str] | None = None) -> int:
    """The ``dls`` command's exit status (argparse's own usage errors exit 2 through ``SystemExit``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    run = _Run()
    try:
        with signals():  # Ctrl-C / SIGTERM raise from here on (dls_entry)
            _require_train_extra()
            if args.command == "keys":
                from dls.train.config import describe_keys

                print(describe_keys())
                return 0
            commands = {"validate": _validate, "train": _train, "demo": _demo, "audit": _audit}
            commands |= {"init": init_command.command, "data": _data}
            return commands[args.command](args, run)
    except (Exception, KeyboardInterrupt) as exc:
        return _report(exc, run)


def _require_train_extra() -> None:
    missing = [package for module, package in TRAIN_EXTRA.items() if not _importable(module)]
    if missing:
        raise MissingExtras(
            f"the dls command needs the 'train' extra ({', '.join(TRAIN_EXTRA.values())}); missing: "
            f"{', '.join(missing)}. Install it with: {INSTALL_HINT}"
        )


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _report(exc: BaseException, run: _Run) -> int:
    """Print one line for ``exc`` (unless this is a quiet rank); its exit status."""
    if isinstance(exc, ImportError) and not isinstance(exc, MissingExtras):
        root = (exc.name or "").split(".")[0]
        if root in TRAIN_EXTRA:  # installed but broken
            exc = MissingExtras(f"cannot import {root} ({exc}); reinstall the 'train' extra: {INSTALL_HINT}")
    status = exit_status(exc)
    if status == ExitStatus.INTERNAL:
        report = write_crash_report(exc, None if _quiet_rank() else run.crash_dir)
        where = f"the traceback is in {report}" if report else "no file could be written for the traceback"
        message = f"dls: internal error: {type(exc).__name__}: {exc} ({where}; please report it)"
        if report is None:
            traceback.print_exception(type(exc), exc, exc.__traceback__)
    else:
        ended = {ExitStatus.INTERRUPTED: "interrupted", ExitStatus.TERMINATED: "terminated (SIGTERM)"}
        message = "dls: " + ended.get(status, f"training stopped: {exc}" if status == 1 else f"error: {describe(exc)}")
    if not _quiet_rank():
        print(message, file=sys.stderr)
    return int(status)


def _build(cfg: Any, source: str, **kwargs: Any) -> Any:
    """The ``Trainer`` of ``cfg``; what it rejects (the device, a batch larger than the data) is a config error."""
    from dls.train.trainer import Trainer

    try:
        return Trainer(cfg, **kwargs)
    except ValueError as exc:
        raise ConfigError(exc.errors if isinstance(exc, ConfigError) else [str(exc)], source) from None


def _validate(args: argparse.Namespace, run: _Run) -> int:
    import io

    import yaml
    from rich.console import Console

    from dls.train.config import load_config, loss_scaling_mode, memory_problem, missing_paths, scaler_settings, to_dict

    cfg = load_config(args.config, args.override)
    # The config is judged, not this machine: a data directory or memory this machine lacks is a note.
    here = [*missing_paths(cfg), *filter(None, [memory_problem(cfg)])]
    if not here and cfg.data.data_processor is None and (cfg.eval_data is None or cfg.eval_data.data_processor is None):
        _build(cfg, args.config, console=Console(file=io.StringIO()), progress=False, summary=False, plot=False)
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False).rstrip())
    if loss_scaling_mode(cfg) == "off":
        print(f"# loss scaling: off ({cfg.precision.compute_dtype})")
    else:  # null loss-scaling keys above take these defaults
        print(f"# loss scaling: dls.GradScaler.from_settings({scaler_settings(cfg)})")
    for note in [*cfg.notes, *(f"on this machine: {line}" for line in here)]:
        print(f"# note: {note}")
    print(f"# {args.config}: OK")
    return 0


def _train(args: argparse.Namespace, run: _Run) -> int:
    from dls.train.config import memory_problem, parse_checkpoint_states, parse_config, read_config

    states = None
    if args.load_checkpoint_states is not None:
        try:
            states = parse_checkpoint_states(args.load_checkpoint_states)
        except ValueError as exc:
            raise UsageError(f"--load_checkpoint_states: {exc}") from None
    if args.config is not None:
        raw, source = read_config(args.config, args.override), args.config
    elif args.resume is not None:
        raw, source = _saved_config(args.resume, args.override)
    else:
        raise UsageError("give a YAML config (dls train CONFIG.yaml), or --resume DIR to continue a run")
    section = raw.get("runconfig")
    if args.resume is not None and not (isinstance(section, dict) and "model_dir" in section):
        resume = Path(args.resume)
        directory = resume.parent if resume.is_file() else resume
        raw = {**raw, "runconfig": {**(section if isinstance(section, dict) else {}), "model_dir": str(directory)}}
    cfg = parse_config(raw, source=source)
    rc = cfg.runconfig
    if states is not None and args.resume is None and rc.checkpoint_path is None and not rc.autoload_last_checkpoint:
        raise UsageError(
            "--load_checkpoint_states needs a checkpoint to load from: --resume DIR_OR_FILE (or the config's "
            "trainer.fit.ckpt_path / runconfig.checkpoint_path)"
        )
    if (problem := memory_problem(cfg)) is not None:
        raise MemoryError(problem)
    try:
        owns_group = init_distributed(cfg.runconfig.device)  # under torchrun (WORLD_SIZE > 1)
    except ValueError as exc:  # the device
        raise ConfigError([str(exc)], source) from None
    try:
        trainer = _build(cfg, source, progress=not args.no_progress, config_file=args.config)
        try:
            trainer.train(resume=args.resume, load_states=states)
        finally:
            run.crash_dir = trainer.crash_dir
            trainer.close()  # data-parallel: every rank waits for rank 0's outputs; DDP released
    finally:
        if owns_group:
            shutdown_distributed()
    return 0


def _saved_config(resume: str, overrides: Sequence[str]) -> tuple[dict[str, Any], str]:
    """The config saved in the checkpoint ``--resume`` names, with the overrides, and where it came from. A function
    of its own so that the checkpoint's tensors are freed before the run starts (the trainer loads it again under
    the model_dir's lock)."""
    from dls.train.checkpoint import load_resume_checkpoint
    from dls.train.config import apply_overrides

    path, state, _ = load_resume_checkpoint(resume)
    saved = state.get("config")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path} holds no config: give the YAML config too (dls train CONFIG --resume ...)")
    source = f"the config saved in {path}"
    runconfig = saved.get("runconfig")
    if isinstance(runconfig, dict):  # the run's directory is DIR, not where the checkpoint was written
        saved = {**saved, "runconfig": {k: v for k, v in runconfig.items() if k != "model_dir"}}
    return apply_overrides(saved, overrides, source=source), source


def _audit(args: argparse.Namespace, run: _Run) -> int:
    import torch

    import dls.fp8
    from dls import formats
    from dls.train import audit
    from dls.train.config import load_config, loss_scaling_mode, scaler_settings

    _check_steps(args.steps)
    names = args.formats if args.formats is not None else list(audit.DEFAULT_FORMATS)
    for name in names:
        try:
            formats.get(name)
        except ValueError:
            raise UsageError(f"--formats: unknown format {name!r}; allowed: {', '.join(formats.names())}") from None
    recipe_names = None if args.fp8_recipes is None else list(dict.fromkeys(args.fp8_recipes or dls.fp8.RECIPE_NAMES))
    if unknown := [r for r in recipe_names or () if r not in dls.fp8.RECIPE_NAMES]:
        allowed = ", ".join(dls.fp8.RECIPE_NAMES)
        raise UsageError(f"--fp8-recipes: unknown recipe(s) {', '.join(map(repr, unknown))}; allowed: {allowed}")
    cfg = load_config(args.config, args.override)
    threads = torch.get_num_threads()
    if cfg.runconfig.num_threads is not None:
        torch.set_num_threads(cfg.runconfig.num_threads)
    try:
        try:
            model, batches = audit.build_inputs(cfg, args.steps)
        except ValueError as exc:  # the device, a batch larger than the data set
            raise ConfigError(exc.errors if isinstance(exc, ConfigError) else [str(exc)], args.config) from None
        weight = cfg.model.loss_weight
        print(
            f"dls audit {args.config}: {cfg.model.name} on {cfg.data.dataset}, the first {args.steps} batches of "
            f"{cfg.data.batch_size}, float32 weights as dls train initialises them, loss x {weight:g} "
            "(model.loss_weight)"
        )
        result = audit.audit_formats(model, batches, names, weight)
        print(result.to_text() + "\n\n" + "\n".join(audit.recommendation_lines(cfg, result)))
        if recipe_names is not None:
            own = cfg.precision.fp8 or {"recipe": None}  # a recipe the config names keeps its fields
            recipes = [
                dls.fp8.recipe_from_dict(dict(own) if own["recipe"] == n else {"recipe": n}) for n in recipe_names
            ]
            scale = scaler_settings(cfg).init_scale if loss_scaling_mode(cfg) != "off" else 1.0
            rows = audit.compare_fp8(model, batches, recipes, weight, scale, seed=cfg.runconfig.seed)
            print("\n" + audit.fp8_table(rows, scale, args.steps))
        if args.out is not None:
            print(f"\nPlot: {audit.write_plot(result, Path(args.out))}")
    finally:
        torch.set_num_threads(threads)
    return 0


def _demo(args: argparse.Namespace, run: _Run) -> int:
    from dls.train.demo import DEFAULT_STEPS, run_demo

    steps = _check_steps(args.steps if args.steps is not None else DEFAULT_STEPS)
    run_demo(Path(args.out), steps=steps, progress=not args.no_progress)
    return 0


def _check_steps(steps: int) -> int:
    if steps < 1:
        raise UsageError(f"--steps must be >= 1; got {steps}")
    return steps


if __name__ == "__main__":
    sys.exit(main())
