"""The documentation's pictures and the outputs printed with them, made from real runs when the site is built.

* ``demo.png`` and ``demo.txt``: ``dls demo`` (600 steps per run): its picture and its two tables;
* ``burst.png``: the loss scale of a float16 run through a burst of overflowing steps (a few batches of outliers);
* ``audit.png`` and ``audit.txt``: ``dls audit configs/mlp_fp16_dls.yaml --fp8-recipes``.

They are made once per version of the sources that make them (a hash of ``src/``, ``configs/`` and this file) into
``build/docs-figures/<hash>/``, so a rebuild of the site reuses them; the first build after a change of the
sources runs them again (about two minutes on 2 CPU cores). ``generated.py`` puts them into pages."""

from __future__ import annotations

import contextlib
import hashlib
import io
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "build" / "docs-figures"
SITE_DIR = "assets/generated"  # where the pictures are in the site
STEPS = 600


def _key() -> str:
    import torch

    digest = hashlib.sha256(torch.__version__.encode())
    sources = [*sorted((ROOT / "src").rglob("*.py")), *sorted((ROOT / "configs").rglob("*.yaml")), Path(__file__)]
    for path in sources:
        digest.update(path.relative_to(ROOT).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def outputs() -> Path:
    """The directory holding this version's pictures and texts, made now if missing."""
    done = CACHE / _key()
    if (done / "complete").is_file():
        return done
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as scratch:
        work = Path(scratch)
        _demo(work)
        _burst(work / "burst.png")
        _audit(work)
        (work / "complete").write_text("")
        shutil.rmtree(done, ignore_errors=True)
        (work).rename(done)
        work.mkdir()  # for TemporaryDirectory's clean-up
    for stale in CACHE.iterdir():  # older versions' outputs
        if stale.is_dir() and stale != done and (stale / "complete").is_file():
            shutil.rmtree(stale, ignore_errors=True)
    return done


def _demo(work: Path) -> None:
    from dls.train.demo import run_demo

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        run_demo(work / "demo", steps=STEPS, progress=False)
    printed = text.getvalue()
    start, end = printed.index(f"dls demo ({STEPS} steps each)"), printed.index("float16 + DLS ends at")
    (work / "demo.txt").write_text(printed[start:end].rstrip() + "\n")
    (work / "demo" / "demo.png").rename(work / "demo.png")
    shutil.rmtree(work / "demo")  # the runs' checkpoints and metrics: not needed


def burst_rows(steps: int = 400, burst: range = range(150, 156), seed: int = 0) -> list[dict[str, Any]]:
    """A float16 run of the demo's MLP with ``dls.GradScaler("cpu")`` (torch's defaults, growth every 50 steps),
    whose batches at the steps of ``burst`` hold inputs 1e4 times too large: their gradients overflow, the scaler
    skips those steps and backs off once per step; afterwards the scale grows back, one doubling per 50 clean steps.
    One row per step: step, loss, loss_scale (the scale the step used), skipped."""
    import torch

    import dls

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = dls.GradScaler("cpu", growth_interval=50)
    x = torch.randn(4096, 32)
    y = torch.tanh(x[:, :4].sum(1, keepdim=True))
    rows = []
    for step in range(1, steps + 1):
        batch = torch.randint(0, 4096, (128,))
        inputs = x[batch] * (1e4 if step in burst else 1.0)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(inputs).float(), y[batch])
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        rows.append(
            {"step": step, "loss": loss.item(), "loss_scale": scale, "skipped": scaler.step_was_skipped(optimizer)}
        )
    return rows


def _burst(path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from dls.train.reporting import log2_axis

    burst = range(150, 156)
    rows = burst_rows(burst=burst)
    fig = Figure(figsize=(9, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_scale = fig.subplots(2, 1, sharex=True, height_ratios=[1, 1.4])
    finite = [r for r in rows if math.isfinite(r["loss"])]
    ax_loss.plot([r["step"] for r in finite], [r["loss"] for r in finite], color="tab:blue", lw=1)
    ax_loss.set_yscale("log")
    ax_loss.set_ylabel("loss")
    steps, scales = [r["step"] for r in rows], [r["loss_scale"] for r in rows]
    ax_scale.step(steps, scales, where="post", color="tab:green", lw=1.5, label="loss scale")
    skipped = [r for r in rows if r["skipped"]]
    ax_scale.scatter([r["step"] for r in skipped], [r["loss_scale"] for r in skipped], s=14, color="tab:red",
                     zorder=3, label=f"skipped step ({len(skipped)})")  # fmt: skip
    log2_axis(ax_scale, scales)
    ax_scale.set_ylabel("loss scale")
    ax_scale.set_xlabel("step")
    for ax in (ax_loss, ax_scale):
        ax.axvspan(burst.start, burst.stop, color="tab:red", alpha=0.12, lw=0)
        ax.grid(True, alpha=0.3)
    ax_scale.legend(loc="lower right", fontsize=8, frameon=False)
    fig.suptitle(
        f"float16 + dls.GradScaler('cpu', growth_interval=50): inputs x1e4 at steps {burst.start}-{burst.stop - 1}",
        fontsize=10,
    )
    fig.savefig(path, format="png", dpi=100)


def _audit(work: Path) -> None:
    from dls.train.cli import main

    text, before = io.StringIO(), os.getcwd()
    os.chdir(ROOT)  # the command as the page shows it, from the clone's root
    try:
        with contextlib.redirect_stdout(text):
            status = main(["audit", "configs/mlp_fp16_dls.yaml", "--fp8-recipes", "--out", str(work / "audit")])
    finally:
        os.chdir(before)
    if status != 0:
        raise RuntimeError(f"dls audit exited {status}:\n{text.getvalue()}")
    printed = re.sub(r"\n+Plot: .*\n?$", "\n", text.getvalue())  # where this build wrote it: not the reader's
    (work / "audit.txt").write_text(printed)
    (work / "audit" / "audit.png").rename(work / "audit.png")
    shutil.rmtree(work / "audit")


def _image(name: str, alt: str) -> Callable[[Any], str]:
    def markdown(page: Any) -> str:
        up = "../" * page.file.src_uri.count("/")
        return f"![{alt}]({up}{SITE_DIR}/{name})"

    return markdown


def _text(name: str) -> Callable[[Any], str]:
    return lambda page: f"```text\n{(outputs() / name).read_text().rstrip()}\n```"


GENERATORS: dict[str, Callable[[Any], str]] = {
    "demo-figure": _image("demo.png", "dls demo: every run's loss against float32's, and its loss scale"),
    "demo-tables": _text("demo.txt"),
    "burst-figure": _image("burst.png", "the loss scale of a float16 run through a burst of overflowing steps"),
    "audit-figure": _image("audit.png", "dls audit: per module, the gradients' exponents against each format"),
    "audit-output": _text("audit.txt"),
}


def files(config: Any) -> list[Any]:
    """The pictures as mkdocs files of the site, so that pages link to them like to any other file."""
    from mkdocs.structure.files import File

    done = outputs()
    return [
        File.generated(config, f"{SITE_DIR}/{name}", abs_src_path=str(done / name))
        for name in ("demo.png", "burst.png", "audit.png")
    ]
