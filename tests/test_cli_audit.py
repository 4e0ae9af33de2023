"""``dls audit CONFIG``: per-format verdicts and recommended initial loss scales for a config's model, FP8 recipes
compared on the same batches, the PNG only with --out, and nothing of the model changed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import dls.fp8
from dls.train.audit import audit_formats, build_inputs
from dls.train.cli import main
from dls.train.config import load_config, parse_config
from dls.train.data import BatchIterator
from test_train import tiny

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "configs" / "mlp_fp16_dls.yaml")


def test_audit_prints_verdicts_scales_and_the_fp8_table_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # the config's model_dir (runs/...) is relative: it must not appear
    args = ["audit", MLP, "--steps", "2", "--formats", "float16", "bfloat16", "--fp8-recipes", "current", "static"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "  float16: " in out and "underflow at scale 1; start at 2^" in out
    assert "  bfloat16: gradients fit at scale 1" in out and "cbfloat16" not in out
    (float16,) = [line for line in out.splitlines() if line.startswith("  float16    2^")]
    assert int(float16.split("2^")[1]) >= 10  # gradients of a 1e-4-weighted loss need a large scale
    assert "This config starts float16 at 2^15; to start at the audit's scale: -o optimizer.initial_loss_scale=" in out
    table = out[out.index("recipe ") :].splitlines()
    assert table[0].split() == ["recipe", "grad_output", "saturated", "grad_output", "flushed", "forward", "flushed",
                                "loss", "vs", "fp32"]  # fmt: skip
    assert [line.split("  ")[0] for line in table[1:4]] == ["float32", "current scaling", "static scaling"]
    assert "gradients at loss scale 2^15" in out
    assert os.listdir(tmp_path) == []


def test_audit_out_writes_the_png_there(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "audit"
    assert main(["audit", MLP, "--steps", "1", "--formats", "float16", "--out", str(out)]) == 0
    assert f"Plot: {out / 'audit.png'}" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["audit.png"]  # no lock file or temporary left
    assert (out / "audit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--formats", "float17"], "--formats: unknown format 'float17'; allowed: float16, bfloat16"),
        (["--fp8-recipes", "tensorwise"], "--fp8-recipes: unknown recipe(s) 'tensorwise'; allowed: current"),
        (["--steps", "0"], "--steps must be >= 1; got 0"),
        (["-o", "precision.fp8.margin=1"], "precision.fp8.recipe must be one of"),
    ],
)
def test_audit_usage_errors_exit_2(extra: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", MLP, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dls: error:") and needle in err


def test_audit_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["audit", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for text in ("--formats", "--steps", "--out", "--fp8-recipes", "optimizer.initial_loss_scale", "exit status"):
        assert text in out


def test_the_audit_sees_the_runs_first_batches_and_changes_nothing(tmp_path: Path) -> None:
    """Every format and every FP8 recipe runs on the same batches, in the same order; parameters and gradients
    are left as they were."""
    cfg = parse_config(tiny(tmp_path / "run", model={"dropout": 0.1}))
    model, batches = build_inputs(cfg, 3)
    inputs = [x for x, _ in batches]
    assert len(batches) == len(inputs) == 3 and not torch.equal(inputs[0], inputs[1])
    seen: list[int] = []
    loss = model.loss

    def spy(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        seen.append(next(i for i, x in enumerate(inputs) if torch.equal(x, batch[0])))
        return loss(batch)

    model.loss = spy  # type: ignore[method-assign]
    params = [p.detach().clone() for p in model.parameters()]
    marker = torch.full_like(next(model.parameters()), 7.0)
    next(model.parameters()).grad = marker
    result = audit_formats(model, batches, ["float16", "cbfloat16"], loss_weight=1e-4)
    per_format = len(seen) // 2
    assert seen[:per_format] == seen[per_format:] and seen[:3] == [0, 1, 2]
    assert set(result.audits) == {"float16", "cbfloat16"}
    seen.clear()
    recipes = [dls.fp8.StaticScaling(), dls.fp8.CurrentScaling()]
    fp8 = dls.fp8.compare_recipes(model, model.loss, batches, recipes, loss_weight=1e-4)
    assert seen == [0, 1, 2] * 3  # float32, then each recipe
    static, current = fp8.results  # 1e-4 x the gradients: below E5M2 at scale 1
    assert static.grad_flushed > 0.99 and current.grad_flushed < 0.01 and abs(current.loss / fp8.reference - 1) < 0.02
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert next(model.parameters()).grad is marker and all(p.grad is None for p in list(model.parameters())[1:])


def test_the_audit_builds_the_model_dls_train_starts_from() -> None:
    cfg = load_config(MLP)
    from dls.train.trainer import Trainer

    trainer = Trainer(cfg, progress=False, summary=False, plot=False)
    model, batches = build_inputs(cfg, 1)
    for a, b in zip(model.state_dict().values(), trainer.model.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(next(iter(batches))[0], trainer.batches.next()[0])


def test_the_audit_streams_its_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``dls audit --steps N`` makes each batch when a pass needs it: none up front, at most one held at a time
    (issue 18, item 10: a billion steps ran out of memory collecting them)."""
    made = 0
    make = BatchIterator.next

    def counted(self: BatchIterator) -> Any:
        nonlocal made
        made += 1
        return make(self)

    monkeypatch.setattr(BatchIterator, "next", counted)
    _, batches = build_inputs(parse_config(tiny(tmp_path / "run")), 10**5)
    assert made == 0 and len(batches) == 10**5
    stream = iter(batches)
    first, second = next(stream), next(stream)
    assert made == 2 and not torch.equal(first[0], second[0])
