"""The GPU benchmark scripts on the CPU (``--quick``): bench_gpu.py's budget, bench_fp8_gpu.py's tables. No figure is
checked (timings are the scripts' business, never a unit test's). Every table of both, with its A/A row, is also
printed by ``scripts/gpu-check --dry-run`` (tests/test_gpu_check.py)."""

from __future__ import annotations

import atexit
import importlib
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(autouse=True)
def _no_exit_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scripts print their wall time at interpreter exit: not at the end of the test session."""
    monkeypatch.setattr(atexit, "register", lambda *args, **kwargs: None)


def script(name: str) -> Any:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_bench_gpu_budget_runs_each_tables_first_point_and_names_those_left_out(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every table once through (all five, quick, are run by scripts/gpu-check's dry run: tests/test_gpu_check.py);
    here the tables of several points, under a budget already spent."""
    argv = ["--quick", "--device", "cpu", "--reps", "2", "--warmup", "0", "--budget", "0"]
    script("bench_gpu").main([*argv, "--tables", "unscale", "clip", "overhead"])
    out = capsys.readouterr().out
    assert "   budget: 2 of 3 points not run: float32 100k x100, float16 100k x10" in out
    assert "   budget: 1 of 2 points not run: bfloat16 100k x100" in out
    assert "   budget: 2 of 3 points not run: SGD fused, Adam fused" in out
    for title in ("1. unscale", "2. unscale + global clip", "4. host overhead"):
        lines = out.split(title)[1].split("\n\n")[0].splitlines()
        assert len([line for line in lines if line.startswith(("float", "bfloat", "      SGD"))]) == 1
        aa = next(i for i, line in enumerate(lines) if line.lstrip().startswith("A/A  "))  # from the one point run
        assert lines[aa + 1].startswith("   budget: ")  # printed right under the table it concerns


def test_bench_gpu_budget_shares_the_seconds_in_order() -> None:
    bench_gpu = script("bench_gpu")
    budget = bench_gpu.Budget(100.0, ["unscale", "step"])
    start = min(budget.deadlines.values()) - 100.0 * 0.3 / 0.55
    assert budget.deadlines["step"] - start == pytest.approx(100.0, abs=0.5)
    assert bench_gpu.Budget(None, ["unscale"]).deadlines == {}
    assert list(bench_gpu.Budget(None, ["clip"]).points("clip", [1, 2, 3])) == [1, 2, 3]


@pytest.mark.slow
def test_bench_fp8_gpu_quick_compares_emulated_and_scaled_mm_fp8(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--quick", "--device", "cpu", "--reference", "scaled_mm", "--reps", "2", "--warmup", "0", "--steps", "2"]
    script("bench_fp8_gpu").main(argv)
    out = capsys.readouterr().out
    assert "1. first step" in out and "2. training loss" in out and "3. cost of a training step" in out
    assert " NO " not in out  # dls's scales and payloads equal torch's on the CPU too
    assert "A/A: high again / high" in out


# ---------------------------------------------------------------------------------------------- claim_gpu.py
def test_claim_tokens_are_walks_on_one_graph_the_same_for_a_seed() -> None:
    """Every run of a model sees the same batches; each token follows its predecessor on the graph (at most
    ``SUCCESSORS`` successors per token), so that there is something to learn below ln(1024)."""
    claim = script("claim_gpu")
    spec = claim.specs(True)["gpt2"]
    walks = claim.token_walks(spec, 6, seed=0)
    assert walks.shape == (6, spec.batch, spec.seq + 1) and walks.dtype == torch.long
    assert torch.equal(walks, claim.token_walks(spec, 6, seed=0))
    assert not torch.equal(walks, claim.token_walks(spec, 6, seed=1))
    pairs = walks.flatten(0, 1)
    successors: dict[int, set[int]] = {}
    for a, b in zip(pairs[:, :-1].flatten().tolist(), pairs[:, 1:].flatten().tolist()):
        successors.setdefault(a, set()).add(b)
    assert max(len(s) for s in successors.values()) <= claim.SUCCESSORS
    assert len(set(pairs.flatten().tolist())) <= claim.STATES


def test_claim_budget_shares_the_time_by_each_runs_estimate() -> None:
    claim = script("claim_gpu")
    planned = claim.plan(False, 200)
    costs = [claim.estimate_seconds(p.spec, p.way, p.steps) for p in planned]
    ends = claim.deadlines(planned, 100.0, start=0.0)
    assert ends[-1] == pytest.approx(100.0)
    assert ends[0] == pytest.approx(100.0 * costs[0] / sum(costs))
    assert all(b - a == pytest.approx(100.0 * c / sum(costs)) for a, b, c in zip(ends, ends[1:], costs[1:]))
    float32 = next(c for p, c in zip(planned, costs) if p.way is claim.FLOAT32)
    half = next(c for p, c in zip(planned, costs) if p.way is claim.FLOAT16_DLS)
    assert float32 > 2 * half  # float32 without TF32: the slow run of each model
    assert claim.deadlines(planned, None, 0.0) == [float("inf")] * len(planned)


def test_claim_runs_past_their_budget_stop_and_say_so(capsys: pytest.CaptureFixture[str]) -> None:
    """A run whose share of the budget is spent stops before its next step: the tables still print, the run
    marked ``(budget)``, its missing losses ``-``, and no verdict passes on what was not measured."""
    claim = script("claim_gpu")
    spec = claim.specs(True)["gpt2"]
    data = claim.token_walks(spec, 4, seed=0)
    cpu = torch.device("cpu")
    done = claim.train(spec, claim.FLOAT32, 4, data, cpu, deadline=float("inf"))
    stopped = claim.train(spec, claim.FLOAT16_DLS, 4, data, cpu, deadline=0.0)
    assert (len(done.losses), done.stopped) == (4, False) and (stopped.losses, stopped.stopped) == ([], True)
    claim.print_headline([[done, done, stopped]])
    rows = capsys.readouterr().out.split("\n1. the headline claim")[1].splitlines()[2:5]
    assert " 4 " in rows[0] and "(budget)" not in rows[0]
    assert rows[2].split()[-13:] == ["0", "(budget)", *["-"] * 3, "n/a", *["-"] * 3, "0", "MISS", "MISS", "n/a"]


# ---------------------------------------------------------------------------------------------- bench_host_ops.py
def test_host_op_census_sorts_operators_into_passes_small_ops_views_and_reads() -> None:
    census = script("bench_host_ops").Census(big=100)
    grads = [torch.ones(100), torch.ones(200)]
    scale = torch.tensor(2.0)
    with census:
        torch._foreach_mul_(grads, scale)  # a pass over the gradients
        flag = torch.zeros(())  # a small op: a flag's zeros
        flag.add_(scale.reciprocal())  # two more
        grads[0].view(10, 10)  # a view: no kernel
        flag.item()  # a host read
    assert census.kinds == {"passes": 1, "small": 3, "views": 1, "reads": 1}
    assert len(census.names) == 6


# ---------------------------------------------------------------------------------------------- integrations_gpu.py
def test_an_integration_section_that_cannot_run_is_named_and_fails_the_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    integrations = script("integrations_gpu")
    monkeypatch.setattr(integrations, "NEEDS", {"trl": ("no_such_module_xyz",), "fsdp2": ()})
    assert integrations.main(["--quick", "--device", "cpu", "--sections", "trl"]) == 1
    out = capsys.readouterr().out
    assert "trl: not run: no_such_module_xyz not importable" in out
    assert out.rstrip().endswith("0 of 1 sections ok; failed or not run: trl")
    with pytest.raises(SystemExit, match="--steps must be more than 4"):
        integrations.main(["--quick", "--device", "cpu", "--steps", "4"])


TITAN_LOG = """[titan] 2026-12-02 02:20:47,001 - root - INFO - Building the model
[dls-sync]
[dls-sync]
[titan] 2026-12-02 02:20:49,097 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss:  8.24244  \x1b[39m
[dls-sync]
[titan] 2026-12-02 02:20:50,060 - root - INFO - \x1b[31mstep:  2  \x1b[32mloss:  8.07785  \x1b[39m
[titan] 2026-12-02 02:20:51,004 - root - INFO - \x1b[31mstep: 10  \x1b[32mloss:  8.12239  \x1b[39m
[titan] 2026-12-02 02:20:52,980 - root - INFO - Sleeping 2 seconds for other ranks to complete
"""


def test_syncs_are_counted_between_torchtitans_step_lines() -> None:
    """torchtitan logs each step after it (its colours in the line); the syncs marked before a step's line and after
    the previous one are that step's."""
    assert script("integrations_gpu").syncs_per_step(TITAN_LOG) == {1: 2, 2: 1, 10: 0}


FAKE_SCALE_WORKER = """
import json, os, sys
out = sys.argv[1]
assert sys.argv[2:] == ["dropin", "offload"] and os.environ["WORLD_SIZE"] == "1" and os.environ["RANK"] == "0"
run = {"trace": [[65536.0, 1], [32768.0, 1], [32768.0, 2]], "params": "ab", "optimizer": "cd", "state_dict": {}}
other = dict(run, params="ef" if os.environ["DLS_TEST_DEVICE"] == "cpu" and "DIFFER" in os.environ else "ab")
offload = {f"{n}_{layers}": {"reads": [1, 1] if n == "dls" else [3, 3], "tensors": layers * 4, "skipped": 1}
           for n in ("dls", "torch") for layers in (2, 6)}
result = {"seconds": {"dropin": 1.0, "offload": 0.5}, "offload": offload,
          "dropin": {"dls": run, "torch": other, "dls_clip": run, "torch_clip": run}}
open(os.path.join(out, "rank0.json"), "w").write(json.dumps(result))
"""


def test_the_sharded_section_reads_the_scale_out_worker_and_fails_on_a_difference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The section runs the worker as the one rank of a world of one and judges what it wrote: equal runs are ok,
    a drop-in whose parameters differ from torch's is a MISS and fails the section."""
    integrations = script("integrations_gpu")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "_scale_worker.py").write_text(FAKE_SCALE_WORKER)
    monkeypatch.setattr(integrations, "TESTS", tmp_path / "tests")
    args = integrations.argparse.Namespace(quick=True, steps=8)
    assert integrations.section_sharded(torch.device("cpu"), args, tmp_path / "a") is True
    out = capsys.readouterr().out
    assert re.search(r"drop-in, step +3 steps, 2 scales, final 32768 +ok$", out, re.M)
    assert re.search(r"CPU offload, 6 layers: host reads per step \(most\) +dls 1, torch 3 \(24 tensors\) +info", out)
    monkeypatch.setenv("DIFFER", "1")
    assert integrations.section_sharded(torch.device("cpu"), args, tmp_path / "b") is False
    assert re.search(r"drop-in, step .* MISS$", capsys.readouterr().out, re.M)


FAKE_TITAN_WORKER = """
import json, os, sys
out, args = sys.argv[1], sys.argv[2:]
assert args[args.index("--training.steps") + 1] == "5" and os.environ["DLS_TT_POISON"] == "5:0"
assert __name__ == "__main__" and os.path.dirname(__file__) in sys.path  # run as the worker script is, by runpy
print(open(os.path.join(os.path.dirname(__file__), "log.txt")).read(), file=sys.stderr)
changed = {1: False, 2: False, 3: False, 4: True, 5: False}
records = [{"step": s, "scale": 256.0, "skipped": sum(not changed[t] for t in range(1, s + 1)), "changed": c,
            "last_epoch": sum(changed[t] for t in range(1, s + 1)),
            "lr": 1e-4, "param_dtype": "torch.float32"} for s, c in changed.items()]
result = {"records": records, "resumed_scaler": {}, "compute_dtype": "torch.float16"}
open(os.path.join(out, "rank0.json"), "w").write(json.dumps(result))
"""


def test_the_torchtitan_section_runs_the_worker_counting_syncs_and_judges_its_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    integrations = script("integrations_gpu")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "_torchtitan_worker.py").write_text(FAKE_TITAN_WORKER)
    (tmp_path / "tests" / "log.txt").write_text(TITAN_LOG)
    monkeypatch.setattr(integrations, "TESTS", tmp_path / "tests")
    args = integrations.argparse.Namespace(quick=True, steps=8)
    assert integrations.section_torchtitan(torch.device("cpu"), args, tmp_path / "a") is True
    table = capsys.readouterr().out.split("5. torchtitan")[1]
    assert re.search(r"steps; skipped \(.*\) +5; 4 +ok$", table, re.M)
    assert re.search(r"the injected overflow at step 5: skipped +True +ok$", table, re.M)
    assert re.search(r"LR-scheduler steps = applied steps +1 = 1 +ok$", table, re.M)
