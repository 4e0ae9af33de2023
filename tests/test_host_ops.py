"""The operators each scaler call dispatches around its passes (``benchmarks/bench_host_ops.py``'s census, on the
CPU): on a GPU each small one is a kernel launch, so the first GPU run's misses by host time (issue 37) show here
as counts. Counts are deterministic; dls's own are pinned, torch's only compared with (they are torch's business).

* ``unscale_``: the inverse scale (one reciprocal), the flag's zeros, the AMP kernel: 3, whatever the tensor count;
* ``clip_gradients_and_return_isfinite``: 12 (the norm's 3, its unscale and check by the AMP kernel, the
  coefficient's 3, its product with the inverse scale, the pass, the returned ``isfinite``);
* a step + update adds a constant number of operators to the optimizer's own, the same at 10 tensors as at 100: 5 on
  the default path, 9 on the fused one, 14 with ``sync_free=True`` (the masked step in foreach operators, with no
  host read of dls's).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
CPU = torch.device("cpu")


def _bench() -> Any:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module("bench_host_ops")
    finally:
        sys.path.remove(str(BENCHMARKS))


def censuses(paths: list[Any]) -> dict[tuple[str, int, str], Any]:
    bench = _bench()
    return {(p.table, p.tensors, p.scaler): bench.census_of(p, warmup=3) for p in paths}


def short(names: list[str]) -> list[str]:
    return [n.removeprefix("aten.").removesuffix(".default") for n in names]


def test_unscale_dispatches_three_operators_whatever_the_tensor_count() -> None:
    counted = censuses(_bench().unscale_paths(CPU, [10, 100]))
    for tensors in (10, 100):
        ours, theirs = counted["unscale", tensors, "dls"], counted["unscale", tensors, "torch.amp"]
        assert short(ours.names) == ["reciprocal", "zeros", "_amp_foreach_non_finite_check_and_unscale_"]
        assert ours.kinds == {"passes": 1, "small": 2, "views": 0, "reads": 0}
        assert len(ours.names) < len(theirs.names)  # torch 2.13: 7


def test_clip_dispatches_twelve_operators_two_passes() -> None:
    counted = censuses(_bench().clip_paths(CPU, [10, 100]))
    for tensors in (10, 100):
        ours, theirs = counted["clip", tensors, "dls"], counted["clip", tensors, "torch.amp"]
        assert ours.kinds == {"passes": 2, "small": 10, "views": 0, "reads": 0}, short(ours.names)
        assert len(ours.names) < len(theirs.names)  # torch 2.13: 15, in 3 passes


@pytest.mark.filterwarnings("ignore:sync_free=True")
def test_a_step_adds_a_constant_number_of_operators_to_the_optimizers_own() -> None:
    """What dls adds to AdamW's own operators (the census without a scaler) does not grow with the tensor count:
    on the sync-free path it did (1,523 operators at 100 tensors against torch.amp's 221, a restore per tensor)."""
    counted = censuses(_bench().step_paths(CPU, [10, 100]))
    added = {
        (label, scaler, tensors): len(counted[f"step {label}", tensors, scaler].names)
        - len(counted[f"step {label}", tensors, "none"].names)
        for label, scalers in (("AdamW", ("dls", "dls sync_free", "torch.amp")), ("AdamW fused", ("dls",)))
        for scaler in scalers
        for tensors in (10, 100)
    }
    for tensors in (10, 100):
        assert added["AdamW", "dls", tensors] == 5
        assert added["AdamW fused", "dls", tensors] == 9
        assert added["AdamW", "dls sync_free", tensors] == 14
        assert added["AdamW", "dls", tensors] <= added["AdamW", "torch.amp", tensors]  # torch 2.13: 9
        # No host read of dls's on the sync-free path: the reads left are AdamW's own (its host step counts).
        free, none = counted["step AdamW", tensors, "dls sync_free"], counted["step AdamW", tensors, "none"]
        assert free.kinds["reads"] == none.kinds["reads"]
