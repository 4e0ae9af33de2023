"""``dls replay`` and ``dls tune``: the policy lab's command line (the work is ``dls.diagnostics``': ``trace``
reads, ``replaying`` replays, ``tuning`` searches the table of ``policies``).

``dls replay TRACE --policy torch --policy "cerebras:steps_per_increase=500"`` prints, per policy, the steps it
would have skipped, its steps at the minimum scale, the underflow in the run's format and the undecided steps,
each as the estimate and the bounds the trace allows (a figure the trace cannot decide: ``-``, ``null`` in
JSON); ``--plot FILE`` draws one panel per policy (scale and skips against steps), ``--json`` prints it all as
JSON. ``dls tune TRACE`` searches each policy's stated grid and prints the best settings with the lines to paste
into each system. Bad input (a trace that breaks the format, a policy, an argument) exits 2 with one line naming
it, before anything is written; a plot that cannot be written exits 3 naming its path, and leaves no file.
"""

from __future__ import annotations

import argparse
import errno
import io
import json
import math
import os
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dls.train.errors import SPACE_ERRORS, OutOfMemory, UsageError

REPLAY_EPILOG = """\
policies: recorded (the run's own settings), torch, cerebras, megatron, deepspeed, static; NAME:key=value,...
overrides the peer's own arguments, e.g. torch:growth_interval=500 megatron:hysteresis=4,initial_scale=2**24
examples:
  dls replay runs/mlp_fp16_dls/trace.jsonl
  dls replay trace.jsonl --policy torch --policy "cerebras:steps_per_increase=500" --plot replay.png
skipped: the estimate, then [lowest, highest] over every outcome the trace allows (steps it cannot decide: an
overflow below the recorded scale; without record(model=...), a clean step above it).
a figure the trace cannot decide is "-" (null in --json).
exit status: 0 done; 2 bad trace, policy or arguments; 3 the plot or the output could not be written (disk full,
permissions, no standard output)."""

TUNE_EPILOG = """\
Each policy's grid (every combination; other arguments at the peer's defaults) is replayed; the settings with the
fewest skipped steps in the worst case the trace allows, among those whose underflow stays below --max-underflow
(its upper bound), are recommended, with the lines for dls, torch.amp, Model Zoo YAML, DeepSpeed, Megatron-LM.
A search of more than a few million settings x steps says so on standard error first (it takes minutes).
exit status: 0 done; 2 bad trace, policy or arguments; 3 the output could not be written."""


def add_commands(sub: Any, formatter: type[argparse.HelpFormatter]) -> None:
    """Register ``replay`` and ``tune`` on the ``dls`` parser's subparsers."""
    replay = sub.add_parser(
        "replay", help="replay loss-scaling policies over a recorded trace", epilog=REPLAY_EPILOG,
        formatter_class=formatter,
    )  # fmt: skip
    replay.add_argument("trace", help="a trace: model_dir/trace.jsonl of dls train, or scaler.record(...)'s file")
    replay.add_argument(
        "--policy", action="append", metavar="SPEC",
        help="NAME or NAME:key=value,... (repeatable; default: recorded torch cerebras megatron deepspeed)",
    )  # fmt: skip
    replay.add_argument("--format", metavar="FORMAT", help="format of the underflow column (default: the run's)")
    replay.add_argument("--plot", metavar="FILE", help="write one panel per policy (PNG)")
    replay.add_argument("--json", action="store_true", help="print JSON (per-step scales included)")
    tune = sub.add_parser(
        "tune", help="recommend loss-scaling settings from a recorded trace", epilog=TUNE_EPILOG,
        formatter_class=formatter,
    )  # fmt: skip
    tune.add_argument("trace", help="a trace (see dls replay)")
    tune.add_argument("--policy", action="append", metavar="NAME", help="only these policies (repeatable)")
    tune.add_argument(
        "--max-underflow", default="1e-3", metavar="FRACTION",
        help="largest mean underflow fraction allowed, or none (default: 1e-3)",
    )  # fmt: skip
    tune.add_argument("--format", metavar="FORMAT", help="format of the underflow (default: the run's)")
    tune.add_argument("--top", type=int, default=1, metavar="N", help="candidates listed per policy (default: 1)")
    tune.add_argument("--json", action="store_true", help="print JSON")


def _read(path: str) -> Any:
    from dls.diagnostics.trace import TraceError, read_trace

    try:
        trace = read_trace(path)
    except TraceError as exc:
        raise UsageError(str(exc)) from None
    except MemoryError:  # a valid trace larger than the memory: the advice is not the trainer's
        raise OutOfMemory(
            f"reading the trace {path}", "replay a part of it (a header line, then the step lines that follow it)"
        ) from None
    if not trace.steps:
        raise UsageError(f"the trace {path} holds no steps (was the scaler's update() called while recording?)")
    return trace


def _check_format(value: str | None) -> None:
    from dls import formats

    if value is not None and value not in formats.names():
        raise UsageError(f"--format: format must be one of {', '.join(formats.names())}; got {value!r}")


def _once(specs: Sequence[str]) -> None:
    for i, spec in enumerate(specs):
        if spec.strip() in (s.strip() for s in specs[:i]):
            raise UsageError(f"--policy {spec.strip()!r} is given twice; give each policy once")


def run_replay(args: argparse.Namespace) -> None:
    from dls.diagnostics.policies import POLICIES, RECORDED, buildable
    from dls.diagnostics.replaying import replay

    _check_format(args.format)
    _once(args.policy or [])
    if args.plot is not None:
        _writable(Path(args.plot))
        if _same_file(args.plot, args.trace):  # replacing it would lose the trace for a picture of it
            raise UsageError(f"--plot: {args.plot} is the trace being replayed; give another path for the PNG")
    trace = _read(args.trace)
    specs = args.policy or [RECORDED, *(name for name in POLICIES if name != "static")]
    try:
        if not args.policy:  # the defaults this dls can build (DeepSpeed's timing needs a dls that has it)
            specs = [spec for spec in specs if buildable(spec, trace)]
        results = replay(trace, specs, args.format)
    except ValueError as exc:
        raise UsageError(f"--policy: {exc}") from None
    plot = None
    if args.plot is not None:
        plot = _write(Path(args.plot), _plot_png(trace, results))
    if args.json:
        data = {"trace": trace.path, "steps": len(trace.steps), "format": results[0].format}
        data["policies"] = [r.to_dict() for r in results]
        if plot is not None:
            data["plot"] = str(plot)
        _print(json.dumps(data, indent=1, allow_nan=False, default=_plain))
        return
    _print(_replay_text(trace, results) + ("" if plot is None else f"\nPlot: {plot}"))


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):  # either missing (or not a path): not the same existing file
        return False


def _print(text: str) -> None:
    """``text`` on standard output, flushed: a full disk, a closed pipe or no standard output at all (closed
    before the command started: ``sys.stdout`` is ``None``) is this command's error (exit 3), named as the
    standard output, not a run's."""
    try:
        if sys.stdout is None:
            raise OSError(errno.EBADF, "it is closed (nothing to print to)")
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except OSError as exc:
        error = OSError(exc.errno, exc.strerror or str(exc), "the standard output")
        if exc.errno in SPACE_ERRORS:
            error.advice = "free some space or send the output elsewhere"  # type: ignore[attr-defined]
        raise error from None


def _plain(value: Any) -> Any:
    raise TypeError(f"not JSON: {type(value).__name__}")


def _count(triple: tuple[float, float, float], digits: int = 0) -> str:
    estimate, low, high = triple
    text = f"{estimate:.{digits}f}" if digits else f"{int(estimate)}"
    if low == high == estimate:
        return text
    bounds = (f"{low:.{digits}f}", f"{high:.{digits}f}") if digits else (f"{int(low)}", f"{int(high)}")
    return f"{text} [{bounds[0]}, {bounds[1]}]"


def _underflow(triple: tuple[float, float, float] | None) -> str:
    if triple is None:  # no histogram in the trace: undecidable
        return "-"
    estimate, low, high = triple
    text = f"{estimate:.2e}"
    return text if low == high == estimate else f"{text} [{low:.2e}, {high:.2e}]"


def _replay_text(trace: Any, results: Sequence[Any]) -> str:
    from dls.diagnostics.scales import pow2

    steps = trace.steps
    recorded_skips = sum(bool(r["overflow"]) for r in steps)
    first, last = steps[0]["step"], steps[-1]["step"]
    lines = [
        f"dls replay {trace.path}: steps {first} to {last} ({len(steps)} recorded, {recorded_skips} skipped), "
        f"{trace.half_dtype}; underflow in {results[0].format}. Figures: the estimate [lowest, highest the trace "
        "allows]."
    ]
    rows = [["policy", "skipped", "at min scale", f"underflow ({results[0].format})", "final scale", "undecided"]]
    for r in results:
        final = "-" if r.final_scale is None else pow2(r.final_scale)
        rows.append(
            [r.policy.spec, _count(r.skipped), _count(r.at_min_scale), _underflow(r.underflow), final, str(r.undecided)]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    for r in results:
        if r.policy.kind == "recorded":
            if r.first_departure is None:
                lines.append("recorded: the replay reproduces the recorded scales and skips at every step")
            else:
                lines.append(
                    f"recorded: the replay departs from the recording at step {r.first_departure} (the run changed "
                    "its scale outside the rule there: update(new_scale), a loaded state or new settings)"
                )
        if not r.bounds_exact:
            lines.append(f"{r.policy.spec}: too many undecided steps to follow every outcome; its bounds are loose")
    if any(r.undecided for r in results) and not any(trace_has_modules(trace)):
        lines.append(
            "undecided steps: record with scaler.record(..., model=model) (dls train: runconfig.record_trace: model) "
            "to decide clean steps above the recorded scale"
        )
    return "\n".join(lines)


def trace_has_modules(trace: Any) -> list[bool]:
    """Per segment, whether it was recorded with the model hooks."""
    return [bool(segment.header.get("modules")) for segment in trace.segments]


def _plot_png(trace: Any, results: Sequence[Any]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [int(r["step"]) for r in trace.steps]
    recorded = [math.log2(float(r["scale"])) for r in trace.steps]
    fig, axes = plt.subplots(len(results), 1, figsize=(9, 2.2 * len(results) + 0.6), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        ax.plot(steps, recorded, color="0.75", lw=1, label="recorded")
        low = [math.nan if v is None else math.log2(v) for v in r.scale_low]  # None: any scale (no band)
        high = [math.nan if v is None else math.log2(v) for v in r.scale_high]
        ax.fill_between(steps, low, high, color="tab:blue", alpha=0.2, lw=0, label="allowed by the trace")
        ax.plot(steps, [math.log2(v) for v in r.scales], color="tab:blue", lw=1.2, label="estimate")
        sure = [(s, math.log2(v)) for s, v, k, g in zip(steps, r.scales, r.skips, r.guessed) if k and not g]
        guess = [(s, math.log2(v)) for s, v, k, g in zip(steps, r.scales, r.skips, r.guessed) if k and g]
        if sure:
            ax.scatter(*zip(*sure), marker="x", color="tab:red", s=18, label="skipped")
        if guess:
            ax.scatter(*zip(*guess), marker="o", facecolors="none", edgecolors="tab:orange", s=18, label="skip guessed")
        ax.set_ylabel("log2 scale")
        ax.set_title(f"{r.policy.spec}: skipped {_count(r.skipped)}", fontsize=9, loc="left")
        ax.legend(fontsize=7, loc="upper right", ncol=4)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=110)
    plt.close(fig)
    return out.getvalue()


def _writable(path: Path) -> None:
    """Refuse a ``--plot`` path that ``_write`` must not replace: a link (never followed), a directory, a FIFO."""
    if str(path) in ("", "."):
        raise UsageError("--plot is empty; give the PNG file to write")
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise UsageError(f"--plot: {path} is not a regular file (or is a link, which dls does not follow)")


def _write(path: Path, data: bytes) -> Path:
    """``data`` into ``path`` (created, or replaced whole) through a temporary file in its directory, never
    through a link at ``path``; on failure, no file of it is left and the ``OSError`` names ``path``."""
    _writable(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(exc.errno, f"{exc.strerror or exc} (making its directory {exc.filename})") from None
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except OSError as exc:
        error = OSError(exc.errno, exc.strerror or str(exc), str(path))
        if exc.errno in SPACE_ERRORS:
            error.advice = "free some space or give another --plot path"  # type: ignore[attr-defined]
        raise error from None
    return path


def run_tune(args: argparse.Namespace) -> None:
    from dls.diagnostics.policies import config_lines
    from dls.diagnostics.tuning import tune

    _check_format(args.format)
    text = str(args.max_underflow).strip().lower()
    try:
        limit = None if text == "none" else float(text)
    except ValueError:
        raise UsageError(f"--max-underflow must be a fraction in [0, 1] or none; got {args.max_underflow!r}") from None
    if args.top < 1:
        raise UsageError(f"--top must be >= 1; got {args.top}")
    trace = _read(args.trace)
    _say_how_long(trace, args.policy)
    try:
        result = tune(trace, args.policy, max_underflow=limit, fmt=args.format)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        data = {
            "trace": trace.path,
            "max_underflow": limit,
            "grid": {name: {k: list(v) for k, v in grid.items()} for name, grid in result.grid.items()},
            "best": {
                name: {**r.to_dict(per_step=False), "config": config_lines(r.policy.settings)}
                for name, r in result.best.items()
            },
            "candidates": [
                {**r.to_dict(per_step=False), "meets_max_underflow": ok}
                for r, ok in zip(result.candidates, result.feasible)
            ],
        }
        _print(json.dumps(data, indent=1, allow_nan=False, default=_plain))
        return
    _print(_tune_text(trace, result, args.top))


LONG_TUNE = 2_000_000  # settings x steps beyond which dls tune says that it takes a while (about 10 us each here)


def _say_how_long(trace: Any, names: Sequence[str] | None) -> None:
    """On standard error, before a search that takes minutes: how big it is and how to make it smaller (a silent
    command that long looks hung)."""
    from dls.diagnostics.policies import POLICIES

    grids = [POLICIES[name].grid for name in (names or POLICIES) if name in POLICIES]
    settings = sum(math.prod(len(values) for values in grid.values()) for grid in grids)
    if settings * len(trace.steps) > LONG_TUNE:
        print(
            f"dls tune: replaying {settings} settings over {len(trace.steps):,} steps takes a while (minutes); "
            "--policy NAME searches one policy's grid",
            file=sys.stderr,
            flush=True,
        )


def _tune_text(trace: Any, result: Any, top: int) -> str:
    from dls.diagnostics.policies import config_lines

    limit = "no underflow limit" if result.max_underflow is None else f"underflow <= {result.max_underflow:g}"
    lines = [
        f"dls tune {trace.path}: {len(trace.steps)} steps, {len(result.candidates)} settings tried, {limit} "
        f"(upper bound). Ranked by skipped steps: the most the trace allows, then the estimate."
    ]
    for name, grid in result.grid.items():
        tried = ", ".join(f"{k} in {{{', '.join(_show(v) for v in values)}}}" for k, values in grid.items())
        lines.append(f"\n{name}: grid {tried}")
        ranked = [(r, ok) for r, ok in zip(result.candidates, result.feasible) if r.policy.kind == name]
        if not any(ok for _, ok in ranked):
            lines.append(f"  no setting meets {limit}")
        for r in [r for r, ok in ranked if ok][:top]:
            under = _underflow(r.underflow)
            lines.append(
                f"  {r.policy.spec}: skipped {_count(r.skipped)}, at min scale {_count(r.at_min_scale)}, "
                f"underflow {under}"
            )
        best = result.best.get(name)
        if best is not None:
            for system, text in config_lines(best.policy.settings).items():
                body = text.replace("\n", "\n      ")
                lines.append(f"    {system}:\n      {body}")
    return "\n".join(lines)


def _show(value: Any) -> str:
    from dls.diagnostics.scales import pow2

    return pow2(value) if isinstance(value, float) else str(value)
