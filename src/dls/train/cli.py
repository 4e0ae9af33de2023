"""The ``dls`` command: ``dls train``, ``dls demo``, ``dls validate``, ``dls keys``.

Exit status: 0 success; 1 training stopped because loss scaling could not help (state checkpointed first);
2 a bad config, a bad command line or an unusable checkpoint (message printed, no traceback); 130 interrupted.

Data-parallel: ``torchrun --nproc_per_node=2 -m dls.train.cli train CONFIG.yaml`` (or ``python -m
torch.distributed.run ... -m dls.train.cli ...``, or ``torchrun ... $(which dls) train ...``); under torchrun
only rank 0 prints.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dls.config import (
    ConfigError,
    TrainConfig,
    apply_overrides,
    describe_keys,
    load_config,
    parse_checkpoint_states,
    parse_config,
)

DESCRIPTION = """\
dls: train small PyTorch models in mixed precision with dynamic loss scaling (DLS), configured by
Cerebras-Model-Zoo-style YAML files (e.g. optimizer.loss_scaling_factor: "dynamic").

Start here:
  dls demo                                       float32 vs float16 with and without loss scaling (< 1 min)
  dls train configs/mlp_fp16_dls.yaml            train from a YAML config
  dls keys                                       every config key, its default and what it does
"""

TRAIN_EPILOG = """\
examples:
  dls train configs/mlp_fp16_dls.yaml
  dls train configs/mlp_fp16_dls.yaml --override runconfig.max_steps=20 optimizer.loss_scaling_factor=dynamic
  dls train configs/mlp_fp16_dls.yaml --override runconfig.max_steps=800 --resume runs/mlp_fp16_dls
  dls train --resume runs/mlp_fp16_dls --load_checkpoint_states model,optimizer

outputs in runconfig.model_dir: checkpoint_<step>.mdl (the last keep_checkpoint_max), metrics.jsonl
(step, loss, loss_scale = the scale the step used, skipped, grad_norm, lr, time; every log_steps steps
and every skipped step), plots.png, config.yaml (the resolved config).
exit status: 0 done; 1 stopped because loss scaling cannot help (checkpointed first); 2 bad config/usage.

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
        help="compare float32 / float16 / float16 + loss scaling on a small model (< 1 min on 2 CPU cores)",
        description="Train the same small MLP several ways: float32, float16 without loss scaling, float16 with "
        "a static loss scale, float16 with dynamic loss scaling, and cbfloat16 (emulated) with dynamic loss "
        "scaling. Prints a table (final loss, skipped steps, final loss scale, gradient underflow, wall time) "
        "and writes demo.png.",
    )
    demo.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    demo.add_argument("--steps", type=int, default=None, help="training steps per run (default: 600)")
    demo.add_argument("--no_progress", action="store_true", help="no progress bars")

    validate = sub.add_parser(
        "validate",
        help="check a YAML config and print it with every default filled in",
        description="Check a YAML config (with overrides) without training; print the resolved config.",
    )
    validate.add_argument("config")
    validate.add_argument("--override", "-o", nargs="+", action="extend", default=[], metavar="SECTION.KEY=VALUE")

    sub.add_parser("keys", help="list every config key with its default and meaning")
    return parser


def _quiet_rank() -> bool:
    """Under torchrun, ranks other than 0 print nothing (every rank meets the same errors)."""
    return os.environ.get("RANK", "0") != "0" and os.environ.get("WORLD_SIZE", "1") != "1"


def _error(message: str) -> int:
    if not _quiet_rank():
        print(f"dls: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "keys":
        print(describe_keys())
        return 0
    try:
        if args.command == "validate":
            return _validate(args)
        if args.command == "train":
            return _train(args)
        if args.command == "demo":
            return _demo(args)
    except ConfigError as exc:
        return _error(str(exc))
    except KeyboardInterrupt:
        if not _quiet_rank():
            print("dls: interrupted", file=sys.stderr)
        return 130
    return _error(f"unknown command {args.command!r}")


def _validate(args: argparse.Namespace) -> int:
    import yaml

    from dls.config import grad_scaler_kwargs, to_dict

    cfg = load_config(args.config, args.override)
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False).rstrip())
    print(f"# GradScaler kwargs: {grad_scaler_kwargs(cfg)}")
    for warning in cfg.warnings:
        print(f"# warning: {warning}")
    print(f"# {args.config}: OK")
    return 0


def _train(args: argparse.Namespace) -> int:
    from dls.train.checkpoint import CheckpointError, find_checkpoint, load_checkpoint
    from dls.train.trainer import init_distributed, shutdown_distributed

    states = None
    if args.load_checkpoint_states is not None:
        if args.resume is None:
            return _error("--load_checkpoint_states needs --resume DIR_OR_FILE (the checkpoint to load from)")
        try:
            states = parse_checkpoint_states(args.load_checkpoint_states)
        except ValueError as exc:
            return _error(f"--load_checkpoint_states: {exc}")
    try:
        if args.config is not None:
            cfg = load_config(args.config, args.override)
        elif args.resume is not None:
            path = find_checkpoint(args.resume)
            saved = load_checkpoint(path).get("config")
            if not isinstance(saved, dict):
                return _error(f"{path} holds no config: give the YAML config too (dls train CONFIG --resume ...)")
            cfg = parse_config(apply_overrides(saved, args.override), source=f"the config saved in {path}")
        else:
            return _error("give a YAML config (dls train CONFIG.yaml), or --resume DIR to continue a run")
        owns_group = init_distributed(cfg.runconfig.device)  # under torchrun (WORLD_SIZE > 1)
    except (CheckpointError, ValueError) as exc:
        # ConfigError is a ValueError too; other ValueErrors here come from the device set-up.
        return _error(str(exc))
    try:
        return _run(cfg, args, states)
    finally:
        if owns_group:
            shutdown_distributed()


def _run(cfg: TrainConfig, args: argparse.Namespace, states: Sequence[str] | None) -> int:
    from dls.train.checkpoint import CheckpointError
    from dls.train.trainer import Trainer, TrainingStopped

    try:
        trainer = Trainer(cfg, progress=not args.no_progress)
    except ValueError as exc:  # from data/model/device set-up
        return _error(str(exc))
    try:
        trainer.train(resume=args.resume, load_states=states)
    except CheckpointError as exc:
        return _error(str(exc))
    except TrainingStopped as exc:
        if not _quiet_rank():
            print(f"dls: training stopped: {exc}", file=sys.stderr)
        return 1
    finally:
        trainer.close()  # data-parallel: every rank waits for rank 0's outputs; DDP released
    return 0


def _demo(args: argparse.Namespace) -> int:
    from dls.train.demo import DEFAULT_STEPS, run_demo

    steps = args.steps if args.steps is not None else DEFAULT_STEPS
    if steps < 1:
        return _error(f"--steps must be >= 1; got {steps}")
    run_demo(Path(args.out), steps=steps, progress=not args.no_progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
