"""The ``dls`` command: ``dls train``, ``dls demo``, ``dls audit``, ``dls validate``, ``dls keys``.

Its entry point is ``dls_entry.main`` (the SIGINT/SIGTERM handler first); exit statuses: :mod:`dls.train.errors`.
Every message is one ``dls: ...`` line on stderr (a config's problems are listed below it), without a traceback.
Data-parallel: ``torchrun --nproc_per_node=2 -m dls.train.cli train CONFIG.yaml`` (or ``torchrun ... $(which dls)
train ...``); only rank 0 prints. This module imports the standard library, ``dls.train.errors`` and
``dls.train.launch`` only; what needs the ``train`` extra is imported inside the commands, after checking it.
"""

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
dls: train small PyTorch models in mixed precision with dynamic loss scaling (DLS), configured by
Cerebras-Model-Zoo-style YAML files (e.g. optimizer.loss_scaling_factor: "dynamic").

Start here:
  dls demo                                       float32 vs float16 with and without loss scaling, master
                                                 weights, FP8 recipes (< 1 min)
  dls train configs/mlp_fp16_dls.yaml            train from a YAML config
  dls audit configs/mlp_fp16_dls.yaml            which formats can hold the model, from which loss scale
  dls keys                                       every config key, its default and what it does
"""

AUDIT_EPILOG = """\
examples:
  dls audit configs/mlp_fp16_dls.yaml
  dls audit configs/transformer_lm_fp16_dls.yaml --formats float16 bfloat16 --steps 2 --out runs/audit
  dls audit configs/mlp_fp16_dls.yaml --fp8-recipes current delayed mxfp8
  dls audit configs/mlp_fp16_dls.yaml --fp8-recipes            every recipe: current delayed mxfp8 static

Nothing is trained and, without --out, nothing is written. The model and batches are those dls train starts
with (float32; the loss times model.loss_weight). Per format: whether the forward pass overflows (no loss scale
fixes that), how the gradients fit, and the initial loss scale to start at (optimizer.initial_loss_scale).
--fp8-recipes: per recipe, the shares of grad_output values the FP8 casts saturate and flush to zero, and the
loss against float32 on the same batches; a recipe given in the config's precision.fp8 keeps its fields there.
--out DIR: writes DIR/audit.png (created if missing; written atomically, never through a link).
exit status: 0 done (whatever the verdicts); 2 bad config or arguments.
"""

TRAIN_EPILOG = """\
examples:
  dls train configs/mlp_fp16_dls.yaml
  dls train configs/mlp_fp16_dls.yaml --override runconfig.max_steps=20 optimizer.loss_scaling_factor=dynamic
  dls train --resume runs/mlp_fp16_dls --override runconfig.max_steps=800      continue the run in place
  dls train --resume runs/mlp_fp16_dls --load_checkpoint_states model,optimizer -o runconfig.model_dir=runs/ft
      a new run in the new (or empty) runs/ft from the weights and optimizer of runs/mlp_fp16_dls
  dls train --resume runs/mlp_fp16_dls -o optimizer.loss_scaling_factor=dynamic \
      --load_checkpoint_states model,optimizer,dataloader,lr_scheduler,global_step,rng
      continue in place with the config's loss scaling (Model Zoo: switch DLS on mid-run)

--resume DIR writes into DIR only: it continues DIR's run from its newest readable checkpoint (loading at least
global_step). Another model_dir (in CONFIG or -o runconfig.model_dir=...) starts a new run from the checkpoint
there, which must be new or empty; DIR is only read. One run at a time per model_dir (a lock; a second run is
refused naming the first). The config defines the loss scaling; a checkpoint contributes its scale and counters.

outputs in runconfig.model_dir: checkpoint_<step>.mdl (the last keep_checkpoint_max), metrics.jsonl
(step, loss, loss_scale = the scale the step used, skipped, grad_norm, lr, time; every log_steps steps
and every skipped step, which also names overflow_module = the first module whose gradients overflowed,
in backward order, and forward_overflow = whether the loss was already inf/NaN), plots.png, config.yaml
(the resolved config; never over the input CONFIG), tensorboard/ (with runconfig.tensorboard: true; view
with tensorboard --logdir DIR).
exit status: 0 done; 1 stopped because loss scaling cannot help (checkpointed first) or the weights became
inf/NaN (the newest checkpoint is the last finite one); 2 bad config, usage, checkpoint, model_dir refused or
locked, 'train' extra missing; 3 I/O or environment (unwritable model_dir, disk full, out of memory); 4
internal error (traceback in a file named in the message); 130 Ctrl-C, 143 SIGTERM (both checkpoint first).
Under torchrun only rank 0 prints, and torchrun exits 1 if any rank fails.

data-parallel (DDP, the same YAML; gloo on CPU, NCCL with one GPU per rank):
  torchrun --nproc_per_node=2 -m dls.train.cli train configs/mlp_fp16_dls.yaml
  (or: torchrun --nproc_per_node=2 $(which dls) train configs/mlp_fp16_dls.yaml)
data.batch_size is per rank (global batch = ranks x batch_size); every rank skips and stops at the same steps;
rank 0 alone writes the outputs and prints; --resume works under torchrun, from single-process checkpoints too.
"""


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors exit with status 2 and a one-line hint (argparse's own behaviour) and the
    help text keeps our line breaks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dls", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    train = sub.add_parser(
        "train",
        help="train a model from a YAML config",
        description="Train a model described by a YAML config (sections: model, data, precision, optimizer, "
        "runconfig). The whole config is checked before training starts.",
        epilog=TRAIN_EPILOG,
    )
    train.add_argument("config", nargs="?", help="YAML config file (optional with --resume: the checkpoint's config)")
    train.add_argument(
        "--override",
        "-o",
        nargs="+",
        action="extend",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="change config values; VALUE is read as YAML (20, 1e-3, dynamic, null, [0.9, 0.99])",
    )
    train.add_argument(
        "--resume",
        metavar="DIR_OR_FILE",
        help="continue from the latest checkpoint in DIR (or from that checkpoint file)",
    )
    train.add_argument(
        "--load_checkpoint_states",
        metavar="STATES",
        help="with --resume: comma list of states to load (model, optimizer, dataloader, grad_scaler, "
        "lr_scheduler, global_step, rng; default: all); the others start fresh from the config",
    )
    train.add_argument("--no_progress", action="store_true", help="no progress bar or progress lines")

    demo = sub.add_parser(
        "demo",
        help="compare float32 / float16 / loss scaling / master weights / FP8 on a small model (< 1 min)",
        description="Train the same small MLP several ways: float32, float16 without loss scaling, float16 with "
        "a static loss scale, float16 with dynamic loss scaling, cbfloat16 (emulated) with dynamic loss scaling, "
        "float16 parameters without and with float32 master weights, and FP8 Linear layers at scale 1, with "
        "delayed scaling and with current scaling. Prints a table (final loss, skipped steps, final loss scale, "
        "gradient underflow, wall time) and writes demo.png.",
    )
    demo.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    demo.add_argument("--steps", type=int, default=None, help="training steps per run (default: 600)")
    demo.add_argument("--no_progress", action="store_true", help="no progress bars")

    audit = sub.add_parser(
        "audit",
        help="check which formats can hold a config's model, from which loss scale (no training)",
        description="Run a few forward/backward passes of a config's model on its first batches under exact "
        "emulation of each format (dls.audit): verdicts, recommended initial loss scales, per-module tables; "
        "optionally compare FP8 recipes (dls.fp8.emulate).",
        epilog=AUDIT_EPILOG,
    )
    audit.add_argument("config", help="YAML config file")
    audit.add_argument("--override", "-o", nargs="+", action="extend", default=[], metavar="SECTION.KEY=VALUE")
    audit.add_argument(
        "--formats",
        nargs="+",
        default=None,
        metavar="FORMAT",
        help="formats to audit (default: float16 bfloat16 cbfloat16; any name of dls.formats)",
    )
    audit.add_argument("--steps", type=int, default=4, help="forward/backward passes (batches) per format (default 4)")
    audit.add_argument("--out", default=None, metavar="DIR", help="write DIR/audit.png (default: nothing is written)")
    audit.add_argument(
        "--fp8-recipes",
        nargs="*",
        default=None,
        metavar="RECIPE",
        help="also compare these FP8 recipes (current, delayed, mxfp8, static; none given: all of them)",
    )

    validate = sub.add_parser(
        "validate",
        help="check a YAML config and print it with every default filled in",
        description="Check a YAML config (with overrides) without training; print the resolved config and the loss "
        "scaler's settings (null loss-scaling keys take the scaler's defaults, shown there).",
    )
    validate.add_argument("config")
    validate.add_argument("--override", "-o", nargs="+", action="extend", default=[], metavar="SECTION.KEY=VALUE")

    sub.add_parser("keys", help="list every config key with its default and meaning")
    # dls.train.modelzoo.main parses its own arguments (--help included: no option of this parser's own)
    data = sub.add_parser("data", help="write a tiny data set in a Model Zoo format", add_help=False, prefix_chars="\0")
    data.add_argument("args", nargs=argparse.REMAINDER)
    init_command.add_parser(sub)
    return parser


def _quiet_rank() -> bool:
    """Under torchrun, ranks other than 0 print nothing (every rank meets the same errors)."""
    env = torchrun_env()
    return env.launched and env.rank != 0


class _Run:
    """What a failed command's report needs: the model_dir a crash report may go to."""

    crash_dir: Path | None = None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``dls`` command with ``argv`` (default ``sys.argv[1:]``); its exit status (see the module
    docstring). Usage errors of the command line itself exit 2 through argparse."""
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
            command = {
                "validate": _validate,
                "train": _train,
                "demo": _demo,
                "audit": _audit,
                "init": init_command.command,
                "data": lambda args, run: importlib.import_module("dls.train.modelzoo").main(args.args),
            }[args.command]
            return command(args, run)
    except (Exception, KeyboardInterrupt) as exc:
        return _report(exc, run)


def _require_train_extra() -> None:
    missing = []
    for module, package in TRAIN_EXTRA.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(package)
    if missing:
        raise MissingExtras(
            f"the dls command needs the 'train' extra ({', '.join(TRAIN_EXTRA.values())}); missing: "
            f"{', '.join(missing)}. Install it with: {INSTALL_HINT}"
        )


def _report(exc: BaseException, run: _Run) -> int:
    """Print one line for ``exc`` (unless this is a quiet rank) and return its exit status."""
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
    elif status == ExitStatus.STOPPED:
        message = f"dls: training stopped: {exc}"
    elif status == ExitStatus.INTERRUPTED:
        message = "dls: interrupted"
    elif status == ExitStatus.TERMINATED:
        message = "dls: terminated (SIGTERM)"
    else:
        message = f"dls: error: {describe(exc)}"
    if not _quiet_rank():
        print(message, file=sys.stderr)
    return int(status)


def _build(cfg: Any, source: str, **kwargs: Any) -> Any:
    """The :class:`~dls.train.trainer.Trainer` of ``cfg``; what it rejects while building the run (the device, a
    batch larger than the data set) is a config error (exit 2), for ``dls validate`` as for ``dls train``."""
    from dls.train.trainer import Trainer

    try:
        return Trainer(cfg, **kwargs)
    except ValueError as exc:
        raise ConfigError([str(exc)], source) from None


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
    from dls.train.checkpoint import load_resume_checkpoint
    from dls.train.config import apply_overrides, memory_problem, parse_checkpoint_states, parse_config, read_config

    states = None
    if args.load_checkpoint_states is not None:
        try:
            states = parse_checkpoint_states(args.load_checkpoint_states)
        except ValueError as exc:
            raise UsageError(f"--load_checkpoint_states: {exc}") from None
    if args.config is not None:
        raw, source = read_config(args.config, args.override), args.config
    elif args.resume is not None:
        path, state, _ = load_resume_checkpoint(args.resume)
        saved = state.get("config")
        if not isinstance(saved, dict):
            raise CheckpointError(f"{path} holds no config: give the YAML config too (dls train CONFIG --resume ...)")
        source = f"the config saved in {path}"
        runconfig = saved.get("runconfig")
        if isinstance(runconfig, dict):  # the run's directory is DIR, not where the checkpoint was written
            saved = {**saved, "runconfig": {k: v for k, v in runconfig.items() if k != "model_dir"}}
        raw = apply_overrides(saved, args.override, source=source)
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


def _audit(args: argparse.Namespace, run: _Run) -> int:
    import torch

    import dls.fp8
    from dls import formats
    from dls.train import audit
    from dls.train.config import load_config, loss_scaling_mode, scaler_settings

    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1; got {args.steps}")
    names = args.formats if args.formats is not None else list(audit.DEFAULT_FORMATS)
    for name in names:
        try:
            formats.get(name)
        except ValueError:
            raise UsageError(f"--formats: unknown format {name!r}; allowed: {', '.join(formats.names())}") from None
    recipe_names = None
    if args.fp8_recipes is not None:
        recipe_names = list(dict.fromkeys(args.fp8_recipes or dls.fp8.RECIPE_NAMES))
        unknown = [r for r in recipe_names if r not in dls.fp8.RECIPE_NAMES]
        if unknown:
            raise UsageError(
                f"--fp8-recipes: unknown recipe(s) {', '.join(map(repr, unknown))}; allowed: "
                f"{', '.join(dls.fp8.RECIPE_NAMES)}"
            )
    cfg = load_config(args.config, args.override)
    threads = torch.get_num_threads()
    if cfg.runconfig.num_threads is not None:
        torch.set_num_threads(cfg.runconfig.num_threads)
    try:
        try:
            model, batches = audit.build_inputs(cfg, args.steps)
        except ValueError as exc:  # the device, a batch larger than the data set
            raise ConfigError([str(exc)], args.config) from None
        weight = cfg.model.loss_weight
        print(
            f"dls audit {args.config}: {cfg.model.name} on {cfg.data.dataset}, the first {args.steps} batches of "
            f"{cfg.data.batch_size}, float32 weights as dls train initialises them, loss x {weight:g} "
            "(model.loss_weight)"
        )
        result = audit.audit_formats(model, batches, names, weight)
        print(result.to_text())
        print()
        print("\n".join(audit.recommendation_lines(cfg, result)))
        if recipe_names is not None:
            configured = cfg.precision.fp8
            recipes = [
                dls.fp8.recipe_from_dict(
                    dict(configured) if configured is not None and configured["recipe"] == name else {"recipe": name}
                )
                for name in recipe_names
            ]
            scale = scaler_settings(cfg).init_scale if loss_scaling_mode(cfg) != "off" else 1.0
            rows = audit.compare_fp8(model, batches, recipes, weight, scale, seed=cfg.runconfig.seed)
            print()
            print(audit.fp8_table(rows, scale, args.steps))
        if args.out is not None:
            print(f"\nPlot: {audit.write_plot(result, Path(args.out))}")
    finally:
        torch.set_num_threads(threads)
    return 0


def _demo(args: argparse.Namespace, run: _Run) -> int:
    from dls.train.demo import DEFAULT_STEPS, run_demo

    steps = args.steps if args.steps is not None else DEFAULT_STEPS
    if steps < 1:
        raise UsageError(f"--steps must be >= 1; got {steps}")
    run_demo(Path(args.out), steps=steps, progress=not args.no_progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
