"""The ``dls`` command (entry ``dls_entry.main``): one ``dls: ...`` line per failure, exit status by
``errors.exit_status``; rank 0 alone prints. What needs the ``train`` extra is imported inside the commands.
``dls init`` is here: it lists the configs shipped in the wheel, or copies one into a directory (a Model Zoo config
with a tiny data set in its format, its ``data_dir`` pointed there)."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib.resources
import importlib.util
import inspect
import io
import re
import shutil
import sys
import tempfile
import textwrap
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from dls.train import lab
from dls.train.errors import (
    SPACE_ERRORS,
    CheckpointError,
    ConfigError,
    ExitStatus,
    MissingExtras,
    OutOfMemory,
    UsageError,
    describe,
    exit_status,
    is_out_of_memory,
    write_crash_report,
)
from dls.train.launch import init_distributed, shutdown_distributed, torchrun_env
from dls_entry import signals

# What the trainer imports beyond torch (the ``train`` extra): import name -> package name.
TRAIN_EXTRA = {"yaml": "PyYAML", "numpy": "numpy", "rich": "rich", "matplotlib": "matplotlib", "pydantic": "pydantic"}
INSTALL_HINT = "pip install 'dls[train]'"

DESCRIPTION = """\
dls: train PyTorch models in mixed precision with dynamic loss scaling, from Cerebras-Model-Zoo-style YAML
configs (optimizer.loss_scaling_factor: "dynamic").

Start with:
  dls demo                               ten ways to train one small model, side by side
  dls init                               the configs shipped with dls
  dls init mlp_fp16_dls my_run           copy one into my_run/
  dls train my_run/mlp_fp16_dls.yaml     train from it (in a clone: configs/mlp_fp16_dls.yaml)
  dls audit my_run/mlp_fp16_dls.yaml     which formats can hold its model, from which loss scale
  dls keys                               every config key, its default and meaning"""

TRAIN_EPILOG = """\
examples:
  dls train configs/mlp_fp16_dls.yaml -o runconfig.max_steps=20 optimizer.loss_scaling_factor=dynamic
  dls train --resume runs/mlp_fp16_dls -o runconfig.max_steps=800        continue the run in place
  dls train --resume runs/mlp_fp16_dls --load_checkpoint_states model,optimizer -o runconfig.model_dir=runs/ft
  torchrun --nproc_per_node=2 -m dls_entry train configs/mlp_fp16_dls.yaml        data-parallel
--resume DIR continues DIR's run in DIR; another (new or empty) model_dir starts a new run from the checkpoint.
outputs in runconfig.model_dir: checkpoint_<step>.mdl, metrics.jsonl, plots.png, config.yaml, trace.jsonl, tensorboard/.
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

_DATA_PROCESSOR = re.compile(r"^\s*data_processor:\s*[\"']?(\w+)", re.MULTILINE)
_KIND = {"MNISTDataProcessor": "mnist", "GptHDF5DataProcessor": "gpt", "GptHDF5MapDataProcessor": "gpt"}
MAX_AUDIT_STEPS = 1000  # passes per format over the first batches: more says nothing new, and each costs time
MAX_DEMO_STEPS = 100_000  # per run, several runs: about 3 hours on 2 cores; more is a training job, not a demo


def _config_args(parser: argparse.ArgumentParser, **config: Any) -> None:
    parser.add_argument("config", help="YAML config file", **config)
    parser.add_argument(
        "--override", "-o", nargs="+", action="extend", default=[], metavar="SECTION.KEY=VALUE",
        help="change config values; VALUE is read as YAML (20, 1e-3, dynamic, null, [0.9, 0.99])",
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dls", description=DESCRIPTION, formatter_class=RAW)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = sub.add_parser("train", help="train a model from a YAML config", epilog=TRAIN_EPILOG, formatter_class=RAW)
    _config_args(train, nargs="?")
    train.add_argument("--resume", metavar="DIR_OR_FILE", help="continue from DIR's latest checkpoint (or FILE)")
    train.add_argument(
        "--overwrite", action="store_true",
        help="start a new run in a model_dir holding an earlier run's files: they are renamed <name>.old-<time>",
    )  # fmt: skip
    train.add_argument(
        "--load_checkpoint_states", metavar="STATES",
        help="states to load (model, optimizer, dataloader, grad_scaler, lr_scheduler, global_step, rng; default all)",
    )  # fmt: skip
    demo = sub.add_parser("demo", help="one small model trained ten ways, side by side")
    demo.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    demo.add_argument(
        "--steps", type=int, default=600, help=f"training steps per run (default: 600, at most {MAX_DEMO_STEPS})"
    )
    for command in (train, demo):
        command.add_argument("--no_progress", action="store_true", help="no progress bars")
    audit = sub.add_parser("audit", help="which formats fit a config's model", epilog=AUDIT_EPILOG, formatter_class=RAW)
    _config_args(audit)
    audit.add_argument("--formats", nargs="+", metavar="FORMAT", help="default: float16 bfloat16 cbfloat16")
    audit.add_argument(
        "--steps",
        type=int,
        default=4,
        help=f"forward/backward passes per format (default 4, at most {MAX_AUDIT_STEPS})",
    )
    audit.add_argument("--out", metavar="DIR", help="write DIR/audit.png")
    audit.add_argument("--fp8-recipes", nargs="*", metavar="RECIPE", help="compare FP8 recipes (none given: all)")
    _config_args(sub.add_parser("validate", help="check a config; print it with every default"))
    sub.add_parser("keys", help="list every config key with its default and meaning")
    # dls.train.modelzoo.main parses its own arguments (--help included: no option of this parser's own)
    data = sub.add_parser("data", help="write a tiny data set in a Model Zoo format", add_help=False, prefix_chars="\0")
    data.add_argument("args", nargs=argparse.REMAINDER)
    init = sub.add_parser("init", help="list the shipped configs, or copy one (and its data) into DIR")
    init.add_argument("name", nargs="?", metavar="NAME", help="a shipped config, as listed by dls init")
    init.add_argument("directory", nargs="?", metavar="DIR", help="where to write the config (and its data)")
    lab.add_commands(sub, RAW)  # dls replay, dls tune
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The ``dls`` command's exit status (argparse's own usage errors exit 2 through ``SystemExit``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    args.crash_dir = None  # where a crash report may go (dls train sets it)
    try:
        with signals():  # Ctrl-C / SIGTERM raise from here on (dls_entry)
            missing = [package for module, package in TRAIN_EXTRA.items() if not _importable(module)]
            if missing:
                raise MissingExtras(
                    f"the dls command needs the 'train' extra ({', '.join(TRAIN_EXTRA.values())}); missing: "
                    f"{', '.join(missing)}. Install it with: {INSTALL_HINT}"
                )
            if getattr(args, "steps", 1) < 1:  # dls demo and dls audit
                raise UsageError(f"--steps must be >= 1; got {args.steps}")
            if getattr(args, "out", None) == "":  # dls demo and dls audit: not the current directory
                raise UsageError("--out is empty; give the directory to write into")
            return COMMANDS[args.command](args) or 0
    except (Exception, KeyboardInterrupt) as exc:
        return _report(exc, args.crash_dir)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _report(exc: BaseException, crash_dir: Path | None) -> int:
    """Print one line for ``exc`` (ranks other than 0 print nothing: every rank meets the same errors); its exit
    status. An internal error's traceback goes to a crash report in ``crash_dir`` (or the temporary directory)."""
    env = torchrun_env()
    quiet = env.world_size > 1 and env.rank != 0
    if isinstance(exc, ImportError) and not isinstance(exc, MissingExtras):
        root = (exc.name or "").split(".")[0]
        if root in TRAIN_EXTRA:  # installed but broken
            exc = MissingExtras(f"cannot import {root} ({exc}); reinstall the 'train' extra: {INSTALL_HINT}")
    status = exit_status(exc)
    if status == ExitStatus.INTERNAL:
        report = write_crash_report(exc, None if quiet else crash_dir)
        where = f"the traceback is in {report}" if report else "no file could be written for the traceback"
        message = f"dls: internal error: {type(exc).__name__}: {exc} ({where}; please report it)"
        if report is None:
            traceback.print_exception(type(exc), exc, exc.__traceback__)
    else:
        ended = {ExitStatus.INTERRUPTED: "interrupted", ExitStatus.TERMINATED: "terminated (SIGTERM)"}
        message = "dls: " + ended.get(status, f"training stopped: {exc}" if status == 1 else f"error: {describe(exc)}")
    if not quiet:
        print(message, file=sys.stderr)
    return int(status)


def _width() -> int:
    """Where to wrap text: the terminal's width, or 100 columns when the output is not a terminal (a file, a pipe:
    nothing is cut, lines are wrapped as in this command's other texts)."""
    return shutil.get_terminal_size((100, 24)).columns if sys.stdout.isatty() else 100


def existing_config(path: str) -> str:
    """``path`` if it names a file; else a ``UsageError`` with the nearest config file of its directory, or the
    shipped config of that name (``dls init`` copies it out), and where to find configs."""
    given = Path(path)
    if given.is_file() or given.is_symlink() or given.exists():
        return path  # anything else that exists: read_config says what is wrong with it
    nearby = sorted(p.name for p in given.parent.glob("*.y*ml")) if given.parent.is_dir() else []
    close = difflib.get_close_matches(given.name, nearby, n=1, cutoff=0.6)
    shipped = shipped_configs()
    hint = f"did you mean {given.parent / close[0]}? " if close else ""
    if given.stem in shipped or any(name.endswith(f"/{given.stem}") for name in shipped):
        name = next(n for n in shipped if n == given.stem or n.endswith(f"/{given.stem}"))
        hint += f"dls ships {name}: `dls init {name} DIR` copies it into DIR"
    else:
        hint += "`dls init` lists the configs shipped with dls, `dls init NAME DIR` copies one out"
    raise UsageError(f"no config file {path} ({hint})")


@contextlib.contextmanager
def _columns(width: int) -> Iterator[None]:
    import os

    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


def commands_markdown(width: int = 100) -> str:
    """``dls --help`` and each command's ``--help``, as printed at ``width`` columns (Markdown)."""
    with _columns(width):
        parser = build_parser()
        parts = [f"### `dls`\n\n```text\n{parser.format_help().rstrip()}\n```\n"]
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        for name, sub in subparsers.choices.items():
            if name == "data":  # dls.train.modelzoo parses its own arguments
                from dls.train.modelzoo import main as data_main

                text = io.StringIO()
                with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
                    data_main(["--help"])
                usage = text.getvalue().rstrip()
            else:
                usage = sub.format_help().rstrip()
            parts.append(f"### `dls {name}`\n\n```text\n{usage}\n```\n")
    return "\n".join(parts)


@contextlib.contextmanager
def config_errors(source: str) -> Iterator[None]:
    """What a run's set-up rejects (the device, a batch larger than the data) is an error of the config ``source``."""
    try:
        yield
    except ValueError as exc:
        raise ConfigError(exc.errors if isinstance(exc, ConfigError) else [str(exc)], source) from None


def _keys(args: argparse.Namespace) -> None:
    from dls.train.reference import keys_text

    print(keys_text(_width()))


def _validate(args: argparse.Namespace) -> None:
    import yaml
    from rich.console import Console

    from dls.train.config import load_config, loss_scaling_mode, memory_problem, scaler_settings, to_dict
    from dls.train.data import missing_paths
    from dls.train.trainer import Trainer

    cfg = load_config(existing_config(args.config), args.override)
    # The config is judged, not this machine: a data directory or memory this machine lacks is a note.
    here = [*missing_paths(cfg), *filter(None, [memory_problem(cfg)])]
    if not here and cfg.data.data_processor is None and (cfg.eval_data is None or cfg.eval_data.data_processor is None):
        with config_errors(args.config):
            Trainer(cfg, console=Console(quiet=True), progress=False, summary=False, plot=False)
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False).rstrip())
    if loss_scaling_mode(cfg) == "off":
        print(f"# loss scaling: off ({cfg.precision.compute_dtype})")
    else:  # null loss-scaling keys above take these defaults
        print(f"# loss scaling: dls.GradScaler.from_settings({scaler_settings(cfg)})")
    for note in [*cfg.notes, *(f"on this machine: {line}" for line in here)]:
        print(f"# note: {note}")
    print(f"# {args.config}: OK")


def _train(args: argparse.Namespace) -> None:
    from dls.train.config import default_model_dir, memory_problem, parse_checkpoint_states, parse_config, read_config
    from dls.train.trainer import Trainer

    try:
        states = None if args.load_checkpoint_states is None else parse_checkpoint_states(args.load_checkpoint_states)
    except ValueError as exc:
        raise UsageError(f"--load_checkpoint_states: {exc}") from None
    notes: list[str] = []
    if args.config is not None:
        raw, source = read_config(existing_config(args.config), args.override, notes), args.config
    elif args.resume is not None:
        raw, source = _saved_config(args.resume, args.override)
    else:
        raise UsageError("give a YAML config (dls train CONFIG.yaml), or --resume DIR to continue a run")
    if args.resume is not None:  # the run continues in DIR, unless the config names another model_dir
        resume = Path(args.resume)
        raw = default_model_dir(raw, str(resume.parent if resume.is_file() else resume))
    cfg = parse_config(raw, source=source, notes=notes)
    rc = cfg.runconfig
    if args.overwrite and (args.resume is not None or states is not None):
        given = "--resume" if args.resume is not None else "--load_checkpoint_states"
        raise UsageError(f"--overwrite starts a new run without a checkpoint; it cannot be combined with {given}")
    if states is not None and args.resume is None and rc.checkpoint_path is None and not rc.autoload_last_checkpoint:
        raise UsageError(
            "--load_checkpoint_states needs a checkpoint to load from: --resume DIR_OR_FILE (or the config's "
            "trainer.fit.ckpt_path / runconfig.checkpoint_path)"
        )
    if (problem := memory_problem(cfg)) is not None:
        raise MemoryError(problem)
    with config_errors(source):
        owns_group = init_distributed(rc.device)  # under torchrun (WORLD_SIZE > 1)
    try:
        with config_errors(source):
            trainer = Trainer(cfg, progress=not args.no_progress, config_file=args.config)
        try:
            trainer.train(resume=args.resume, load_states=states, overwrite=args.overwrite)
        finally:
            args.crash_dir = trainer.crash_dir
            trainer.close()  # data-parallel: every rank waits for rank 0's outputs; DDP released
    finally:
        if owns_group:
            shutdown_distributed()


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


def _audit(args: argparse.Namespace) -> None:
    """The arguments checked, then the verdicts, the scales, the FP8 table and the plot (what: AUDIT_EPILOG)."""
    import torch

    import dls
    from dls.diagnostics.scales import pow2
    from dls.train.audit import audit_formats, build_inputs
    from dls.train.config import load_config, loss_scaling_mode, scaler_settings
    from dls.train.rundir import RunDir, resolve_model_dir

    if args.steps > MAX_AUDIT_STEPS:
        raise UsageError(f"--steps must be at most {MAX_AUDIT_STEPS}; got {args.steps}")
    names = args.formats if args.formats is not None else ["float16", "bfloat16", "cbfloat16"]
    if unknown := [name for name in names if name not in dls.formats.names()]:
        raise UsageError(f"--formats: unknown format {unknown[0]!r}; allowed: {', '.join(dls.formats.names())}")
    recipe_names = None if args.fp8_recipes is None else list(dict.fromkeys(args.fp8_recipes or dls.fp8.RECIPE_NAMES))
    if unknown := [r for r in recipe_names or () if r not in dls.fp8.RECIPE_NAMES]:
        allowed = ", ".join(dls.fp8.RECIPE_NAMES)
        raise UsageError(f"--fp8-recipes: unknown recipe(s) {', '.join(map(repr, unknown))}; allowed: {allowed}")
    cfg = load_config(existing_config(args.config), args.override)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.runconfig.num_threads or threads)
    try:
        with config_errors(args.config):
            model, batches = build_inputs(cfg, args.steps)
        weight, half = cfg.model.loss_weight, cfg.precision.fp16_type
        print(
            f"dls audit {args.config}: {cfg.model.name} on {cfg.data.dataset}, the first {args.steps} batches of "
            f"{cfg.data.batch_size}, float32 weights as dls train initialises them, loss x {weight:g} "
            "(model.loss_weight)"
        )
        result = audit_formats(model, batches, names, weight)
        print(
            f"{result.to_text()}\n\nRecommended initial loss scales (optimizer.initial_loss_scale; "
            "loss_scaling_factor: dynamic):"
        )
        for name, scale in result.recommended_init_scale.items():
            print(f"  {name:<10} {pow2(scale) if scale else 'none: loss scaling cannot help (see the verdict)'}")
        given, scale = scaler_settings(cfg).init_scale, result.recommended_init_scale.get(half)
        if loss_scaling_mode(cfg) == "dynamic" and scale is not None and scale != given:
            print(
                f"This config starts {half} at {pow2(given)}; to start at the audit's scale: "
                f"-o optimizer.initial_loss_scale={scale:g}"
            )
        if recipe_names is not None:
            own = cfg.precision.fp8 or {"recipe": None}  # a recipe the config names keeps its fields
            recipes = [
                dls.fp8.recipe_from_dict(dict(own) if own["recipe"] == r else {"recipe": r}) for r in recipe_names
            ]
            at = given if loss_scaling_mode(cfg) != "off" else 1.0
            fp8 = dls.fp8.compare_recipes(
                model, model.loss, batches, recipes, loss_weight=weight, loss_scale=at, seed=cfg.runconfig.seed
            )
            print("\n" + fp8.to_text())
        if args.out is not None:  # save_plot takes a path only: drawn in a private temporary directory first
            directory = resolve_model_dir(Path(args.out), "--out")
            with tempfile.TemporaryDirectory(prefix="dls-audit-") as scratch:
                png = result.save_plot(Path(scratch) / "audit.png").read_bytes()
            with RunDir(directory, "--out") as run_dir:
                print(f"\nPlot: {run_dir.replace('audit.png', png)}")
    finally:
        torch.set_num_threads(threads)


def _demo(args: argparse.Namespace) -> None:
    from dls.train.demo import run_demo

    if args.steps > MAX_DEMO_STEPS:
        raise UsageError(
            f"--steps must be at most {MAX_DEMO_STEPS} (runs of that many steps: dls train); got {args.steps}"
        )
    run_demo(Path(args.out), steps=args.steps, progress=not args.no_progress)


def _data(args: argparse.Namespace) -> int:
    from dls.train.modelzoo import main as write_data  # parses its own arguments

    if "" in args.args:  # as a directory, '' would be the current one
        raise UsageError(
            "dls data: an argument is empty ('' is no directory); give DIR, e.g. dls data mnist data/mnist"
        )
    with _writing_to_dir():
        try:
            return write_data(args.args)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            first = (str(exc).strip().splitlines() or [""])[0]
            raise OutOfMemory(first, "lower --train, --val, --msl or --files (or free memory)") from None


@contextlib.contextmanager
def _writing_to_dir() -> Iterator[None]:
    """A full disk while ``dls data`` or ``dls init`` writes into DIR: their advice, not the trainer's."""
    try:
        yield
    except OSError as exc:
        if exc.errno in SPACE_ERRORS:
            exc.advice = "free some space or write to another DIR"  # type: ignore[attr-defined]
        raise


def shipped_configs() -> dict[str, Path]:
    """The shipped configs by name (their path below ``configs/`` without ``.yaml``)."""
    root = Path(str(importlib.resources.files("dls.train") / "configs"))  # pip unpacks wheels: a directory
    return dict(sorted((p.relative_to(root).with_suffix("").as_posix(), p) for p in root.rglob("*.yaml")))


# What a config's model or data reader imports beyond the train extra: module -> the extra that installs it.
EXTRA_OF = {"transformers": "modelzoo", "h5py": "modelzoo", "tensorboard": "tensorboard"}
_HF_MODELS = ("gpt2", "gpt3", "llama", "LlamaModel")  # built on transformers' classes (dls.train.modelzoo)
_HDF5_READERS = ("GptHDF5DataProcessor", "GptHDF5MapDataProcessor")  # read with h5py


def _values(data: Any, key: str) -> Iterator[Any]:
    """Every value of ``key`` in the nested mappings and lists of a parsed config."""
    if isinstance(data, dict):
        for k, v in data.items():
            if k == key:
                yield v
            yield from _values(v, key)
    elif isinstance(data, list):
        for item in data:
            yield from _values(item, key)


def config_imports(text: str) -> set[str]:
    """The modules beyond the train extra that training from the YAML ``text`` imports (keys of ``EXTRA_OF``)."""
    import yaml

    raw = yaml.safe_load(text)
    needed = {"transformers"} if any(name in _HF_MODELS for name in _values(raw, "name")) else set()
    needed |= {"h5py"} if any(reader in _HDF5_READERS for reader in _values(raw, "data_processor")) else set()
    return needed | ({"tensorboard"} if True in _values(raw, "tensorboard") else set())


def _extras(text: str) -> str:
    """The extras a shipped config needs, as ``dls[train,...]``."""
    return f"dls[{','.join(['train', *sorted({EXTRA_OF[m] for m in config_imports(text)})])}]"


def _summary(text: str) -> str:
    """The first sentence of a config's header comment (its lines joined, up to a command line or a blank line)."""
    words = []
    for line in text.splitlines():
        if not line.startswith("#") or line.startswith("#  ") or not line.strip("# "):
            break
        words.append(line.lstrip("# ").strip())
    header, depth = " ".join(words), 0
    for i, char in enumerate(header):  # the first full stop outside parentheses ends the sentence
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "." and depth == 0 and (i + 1 == len(header) or header[i + 1] == " "):
            return header[: i + 1]
    return header.rstrip(":") + "."


def _init(args: argparse.Namespace) -> None:
    configs = shipped_configs()
    if args.name is None:
        print("Configs shipped with dls (dls init NAME DIR copies one into DIR, with the data it needs):")
        for name, path in configs.items():
            text = path.read_text()
            print(f"\n  {name}   (needs {_extras(text)})")
            print(textwrap.fill(_summary(text), _width(), initial_indent=" " * 6, subsequent_indent=" " * 6))
        return
    if args.name not in configs:
        raise UsageError(f"no shipped config {args.name!r}; shipped: {', '.join(configs)}")
    if args.directory is None:
        raise UsageError(f"give the directory to write it into (dls init {args.name} DIR)")
    if not args.directory:
        raise UsageError(f"DIR is empty ('' is no directory); give one, e.g. dls init {args.name} my_run")
    from dls.train.rundir import RunDir, resolve_model_dir

    directory = Path(args.directory)
    target = args.name.rsplit("/", 1)[-1] + ".yaml"
    text, files = configs[args.name].read_text(), {}
    processor = _DATA_PROCESSOR.search(text)
    if processor is not None:  # everything checked before anything is written
        try:
            from dls.train.modelzoo import require, tiny_data_files, write_tiny_data
        except ImportError:
            raise UsageError(
                "this dls cannot write Model Zoo data (dls.train.modelzoo.write_tiny_data is missing); "
                "copy the config by hand and point its data_dir at your data"
            ) from None
        if processor.group(1) not in _KIND:
            raise UsageError(f"dls init cannot write data for {processor.group(1)} (it writes {', '.join(_KIND)})")
        kind = _KIND[processor.group(1)]
        if kind == "gpt":
            require("h5py")  # MissingExtras, naming the modelzoo extra
        defaults = inspect.signature(write_tiny_data).parameters
        data = tiny_data_files(kind, **{k: p.default for k, p in defaults.items() if k not in ("kind", "directory")})
        files = {f"data/{kind}/{name}": content for name, content in data.items()}
        text = _point_data_dirs(text, directory / "data")
    files[target] = text.encode()  # last: written once the data is there
    with _writing_to_dir(), RunDir(resolve_model_dir(directory, "DIR"), "DIR") as out:  # new files only
        out.create_all(files)
    if processor is not None:
        print(f"Wrote a tiny {processor.group(1)} data set into {directory / 'data' / kind}")
    print(f"Wrote {directory / target} (needs {_extras(text)}). Next: dls train {directory / target}")


def _point_data_dirs(text: str, data: Path) -> str:
    """The config ``text`` with each ``data_dir: ./data/<rest>`` (where the shipped Model Zoo configs keep their
    data, as the ``dls data`` line in their header writes it) pointing at ``data/<rest>``, its comments kept: the
    YAML library finds the values (their exact places in the text) and writes the new ones, double-quoted with
    every character a path may hold escaped as YAML needs (quotes, backslashes, tabs, newlines)."""
    import yaml

    spans: list[tuple[int, int, str]] = []
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    nodes: list[yaml.Node] = [root] if root is not None else []
    seen: set[int] = set()  # an alias reaches its anchor's node again
    while nodes:
        node = nodes.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if key.value == "data_dir" and isinstance(value, yaml.ScalarNode) and value.value.startswith("./data/"):
                    path = str(data / value.value.removeprefix("./data/"))
                    spans.append((value.start_mark.index, value.end_mark.index, path))
                nodes.append(value)
        elif isinstance(node, yaml.SequenceNode):
            nodes.extend(node.value)
    for start, end, path in sorted(spans, reverse=True):  # from the end: earlier places stay where they are
        quoted = yaml.safe_dump(path, default_style='"', width=float("inf"), allow_unicode=True).strip()
        text = text[:start] + quoted + text[end:]
    return text


# What each subcommand of build_parser() runs (its status; None: 0).
COMMANDS: dict[str, Callable[[argparse.Namespace], int | None]] = {
    "train": _train,
    "validate": _validate,
    "audit": _audit,
    "demo": _demo,
    "keys": _keys,
    "data": _data,
    "init": _init,
    "replay": lab.run_replay,
    "tune": lab.run_tune,
}


if __name__ == "__main__":
    sys.exit(main())
