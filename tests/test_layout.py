"""Where one step lives (issue 19): a steady-state ``scale(loss).backward(); step(opt); update()`` enters at most four
dls source files (the scaler, the gradient passes, the scale it holds, the rule) on the default path."""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

import dls

SRC = str(Path(dls.__file__).parent)


def _files_entered(scaler: dls.GradScaler) -> set[str]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # unfused; no clipping
    entered: set[str] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(SRC):
            entered.add(frame.f_code.co_filename[len(SRC) + 1 :])

    for iteration in range(3):
        loss = model(torch.ones(3, 4)).sum()
        if iteration == 2:  # the third: steady state (indexes built, the scale on its device)
            sys.setprofile(profile)
        try:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        finally:
            sys.setprofile(None)
        opt.zero_grad()
    return entered


@pytest.mark.parametrize(
    "make",
    [lambda: dls.GradScaler("cpu"), lambda: dls.GradScaler("dynamic"), lambda: dls.GradScaler("dynamic", hysteresis=2)],
    ids=["torch-dialect", "cerebras-dialect", "hysteresis"],
)
def test_a_step_enters_at_most_four_dls_files(make: Any) -> None:
    entered = _files_entered(make())
    assert len(entered) <= 4, sorted(entered)
    assert "scaler.py" in entered
