"""scripts/gpu-check, the one command a session lent a GPU runs (docs/contributing.md): its dry run on the CPU runs
every step's plumbing, so that the script cannot rot between GPU sessions; its parts (time boxes, parsing of pytest's
and the benchmarks' output, the output folder, the carried wheels) are checked here on their own."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import re
import stat
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-check"
GPU_TABLES = (
    "1. unscale",
    "2. unscale + global clip",
    "3. a whole training step",
    "4. host overhead",
    "5. CUDA graphs",
)
FP8_TABLES = ("1. first step", "2. training loss", "3. cost of a training step")
CLAIM_TABLES = ("1. the headline claim", "2. underflow", "3. float16 parameters with dls's float32 master weights")
HOST_OPS_TABLES = (
    "1. unscale + inf check, per call",
    "2. unscale + global clip, per call",
    "3. step + update, per call",
)
INTEGRATION_TABLES = ("1. FSDP2 at world size 1 (gloo)", "2. DCP (gloo)", "3. TRL SFTTrainer, fp16=True")
# What the device tool brings back from $OUT: at most 8 files, named in letters, digits, '.', '_' and '-'.
MAX_FILES, NAME = 8, re.compile(r"^[A-Za-z0-9._-]+$")


def load_script() -> ModuleType:
    """scripts/gpu-check (a file without .py) as a module."""
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up by name
    loader.exec_module(module)
    return module


gpu_check = load_script()


def benchmark(name: str) -> ModuleType:
    """A script of benchmarks/ as a module (they import their neighbours by name)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_the_script_is_executable_and_its_time_boxes_fit_the_budget() -> None:
    assert SCRIPT.stat().st_mode & stat.S_IXUSR
    assert SCRIPT.read_text().startswith("#!/usr/bin/env python3\n")
    # At most 8 minutes on the GPU (the budget), so that a machine start and a rerun fit in 15 minutes.
    assert sum(gpu_check.TIMEOUTS.values()) <= 8 * 60
    assert gpu_check.TIMEOUTS["bench_gpu"] >= gpu_check.BENCH_GPU_BUDGET + 30
    assert gpu_check.TIMEOUTS["tests"] > gpu_check.PER_TEST_TIMEOUT
    assert len(gpu_check.LOG_NAMES) + 2 <= MAX_FILES
    assert all(NAME.match(name) for name in [*gpu_check.LOG_NAMES.values(), gpu_check.VERDICTS, gpu_check.SUMMARY])
    assert list(gpu_check.TIMEOUTS) == list(gpu_check.STEPS) == list(gpu_check.LOG_NAMES)
    assert max(item.timeout for item in gpu_check.INTEGRATIONS) + 15 <= gpu_check.TIMEOUTS["integrations"]
    # The claim's runs, by their own estimate for an H100/H200, fit the budget its step gives them.
    claim = benchmark("claim_gpu")
    estimate = sum(claim.estimate_seconds(p.spec, p.way, p.steps) for p in claim.plan(False, claim.CHECKPOINTS[-1]))
    assert 60 < estimate <= gpu_check.TIMEOUTS["claim"] - gpu_check.CLAIM_SLACK
    # The carried wheels: one pin per project, within what the device call carries.
    projects = [gpu_check.project(pin.split("==")[0]) for pin in gpu_check.WHEELS]
    assert len(set(projects)) == len(projects) and all(pin.count("==") == 1 for pin in gpu_check.WHEELS)
    assert gpu_check.WHEEL_LIMIT < 64 * 2**20
    # docs/contributing.md gives the device call: its numbers are the script's.
    guide = (ROOT / "docs" / "contributing.md").read_text()
    total, boxes = sum(gpu_check.TIMEOUTS.values()), " + ".join(map(str, gpu_check.TIMEOUTS.values()))
    assert f"time boxes add up to {total} s ({boxes})" in guide
    timeout = re.search(r"^timeout_s: +(\d+)$", guide, re.M)
    assert timeout is not None and total + 30 <= int(timeout.group(1)) <= 600  # the device tool's limit
    assert all(f"`{name}`" in guide for name in [*gpu_check.LOG_NAMES.values(), *gpu_check.STEPS])


# ---------------------------------------------------------------------------------------------- the dry run
def fake_nvidia_smi(folder: Path) -> None:
    """An ``nvidia-smi`` that answers the script's query as the H200 machine's did (KINDS.md's readings)."""
    folder.mkdir()
    smi = folder / "nvidia-smi"
    reading = "NVIDIA H200, 580.159.03, 143771 MiB, 345 MHz, 3201 MHz, 1980 MHz, 3201 MHz, 31"
    smi.write_text(f'#!/bin/sh\ncase "$1" in --query-gpu=*) echo "{reading}";; *) echo "a table";; esac\n')
    smi.chmod(0o755)


HIDDEN = ("pydantic", "yaml", "h5py")  # the GPU machine lacks pydantic; the test modules need neither of the others
# transformers (through huggingface_hub) imports PyYAML, which the GPU machine has: hidden from these scripts' processes
# are pydantic and what transformers and TRL import where they find it, which the GPU machine lacks too (wandb, which
# imports pydantic; DeepSpeed).
NEED_YAML = ("claim_gpu.py", "integrations_gpu.py")
HIDDEN_THERE = ("pydantic", "wandb", "deepspeed")
HIDE = """import sys
hidden = {hidden!r} if not any(arg.endswith({need!r}) for arg in sys.orig_argv) else {there!r}
sys.modules.update(dict.fromkeys(hidden))
open({marker!r}, "a").write("x")
"""


@pytest.mark.slow  # every step's subprocess imports torch; the benchmarks run at --quick sizes: about 30 s
def test_dry_run_runs_every_step_and_writes_the_summary(tmp_path: Path) -> None:
    out, bin_dir, hide = tmp_path / "out", tmp_path / "bin", tmp_path / "hide"
    fake_nvidia_smi(bin_dir)
    hide.mkdir()  # imported by every Python of the run: the packages in HIDDEN cannot be imported there
    hidden_in = tmp_path / "hidden-in"
    (hide / "sitecustomize.py").write_text(
        HIDE.format(hidden=HIDDEN, need=NEED_YAML, there=HIDDEN_THERE, marker=str(hidden_in))
    )
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OUT=str(out), PYTHONPATH=str(hide))
    started = time.monotonic()
    # From another working directory, with OUT from the environment, as the device tool runs it.
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert time.monotonic() - started < 300

    files = sorted(p.name for p in out.iterdir())
    assert files == sorted([*gpu_check.LOG_NAMES.values(), gpu_check.VERDICTS, gpu_check.SUMMARY])
    verdicts = (out / gpu_check.VERDICTS).read_text().splitlines()
    assert [v.split(":")[0] for v in verdicts] == list(gpu_check.STEPS)
    assert all(": ok (" in v for v in verdicts), verdicts

    summary = (out / gpu_check.SUMMARY).read_text()
    assert summary in run.stdout  # printed last, where the device tool's output tail shows it
    assert "NVIDIA H200, 143771 MiB, driver 580.159.03" in summary  # the fake nvidia-smi, parsed
    assert len(hidden_in.read_text()) >= len(gpu_check.STEPS)  # every step's Python ran without HIDDEN
    collected = re.search(r"dry run: (\d+) of \d+ tests collected", summary)
    assert collected is not None and int(collected.group(1)) >= 31 + 40  # the CUDA-marked tests + the device ones
    for title in (*GPU_TABLES, *FP8_TABLES, *CLAIM_TABLES, *HOST_OPS_TABLES, *INTEGRATION_TABLES[:2]):
        assert f"\n{title}" in summary, title
    bench_gpu_log, host_ops_log = (out / gpu_check.LOG_NAMES["bench_gpu"]).read_text().split("bench_host_ops.py ")
    gpu_tables = gpu_check.parse_tables(bench_gpu_log)
    assert [t.title[: len(g)] for t, g in zip(gpu_tables, GPU_TABLES)] == list(GPU_TABLES)
    assert len(gpu_tables) == len(GPU_TABLES)
    host_ops = gpu_check.parse_tables(host_ops_log)
    assert [t.title[: len(h)] for t, h in zip(host_ops, HOST_OPS_TABLES)] == list(HOST_OPS_TABLES)
    assert all(row["ops"].isdigit() and row["kernels"] == "n/a" for t in host_ops for row in t.rows)  # counted
    assert all(gpu_check.spread_of(t).startswith("A/A ") for t in gpu_tables)  # every table has its A/A row
    assert "A/A: high again / high" in summary
    assert " NO " not in summary  # dls's FP8 scales and payloads equal torch's (on the CPU too)
    targets = summary.split("## Targets")[1].split("\n## ")[0]
    rows = [line for line in targets.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 9 + 4 + 3 + len(gpu_check.INTEGRATIONS)  # bench_gpu/fp8/tests, claim, host ops, integrations
    not_run = [r for r in rows if r.endswith("| not run |")]
    assert not_run == ["| CUDA-graph replays bit-identical to eager (tests) | all pass | not run |"]  # no test run
    assert all(r.count(" | ") == 2 for r in rows), rows  # cells escape their own '|'

    # The claim's verdict cells are filled (their figures mean nothing on the CPU: none is asserted).
    claim = [r for r in rows if r.startswith("| claim 1. ")]
    assert len(claim) == 2 and all(re.search(r"\| (ok|MISS) / (ok|MISS) / n/a \(speed-up ", r) for r in claim)
    assert re.search(r"^\| claim 2\. .* \| ok / ok \| (ok|MISS) / (ok|MISS) \|$", targets, re.M)
    # The integrations: what is here ran on the CPU under gloo; what is not yet is named, in the summary and the
    # step's verdict, never passed over.
    status = {
        r.split(" | ")[0].removeprefix("| integrations: "): r.split(" | ")[2].removesuffix(" |")
        for r in rows
        if "integrations:" in r
    }
    assert status["fsdp2+dcp"].startswith("ok: 2 tables, 5 checks ok, 0 MISS")
    trl_here = all(importlib.util.find_spec(m) is not None for m in ("trl", "datasets"))
    assert status["trl"].startswith("ok: 1 tables, 2 checks ok" if trl_here else "not present yet: module")
    verdict = next(v for v in verdicts if v.startswith("integrations:"))
    for item in gpu_check.INTEGRATIONS:
        result = status[item.name]
        if result.startswith("not present yet: "):
            assert f"{item.name} (" in verdict, (item.name, verdict)  # named in the step's verdict too
        elif item.on_cpu:  # the suite runs it on the CPU: a dry run checks that it is there
            assert result == f"present: not run in a dry run: on the CPU the suite runs it ({item.on_cpu})"
            assert (ROOT / item.on_cpu).is_file()
        else:
            assert result.startswith("ok: "), (item.name, result)


def test_versions_without_nvidia_smi_or_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``nvidia-smi`` is a fact in the summary, never a crash; no CUDA fails the step on the GPU machine only."""
    monkeypatch.setattr(gpu_check.shutil, "which", lambda name: None)
    monkeypatch.setattr(gpu_check, "VERSIONS_CODE", "print('torch: 2.11.0'); print('CUDA available: False')")
    for dry, status in ((True, "ok"), (False, "FAIL")):
        check = gpu_check.Check(tmp_path, tmp_path, dry, dict(os.environ), time.monotonic() + 60)
        with open(tmp_path / "log", "a", encoding="utf-8") as log:
            verdict = gpu_check.step_versions(check, log)
        assert verdict.status == status, verdict
        assert check.facts["nvidia-smi"] == "not found on PATH" and check.facts["torch"] == "2.11.0"
    assert verdict.text.startswith("torch.cuda.is_available() is False: the GPU steps cannot run")
    assert "- GPU: nvidia-smi: not found on PATH" in gpu_check.machine_lines(check)


# ---------------------------------------------------------------------------------------------- time boxes
def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, ended but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_command_past_its_timeout_is_ended_with_its_children_and_its_output_kept(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    grandchild = "import time; time.sleep(60)"
    code = (
        "import os, subprocess, sys, time; "
        f"p = subprocess.Popen([sys.executable, '-c', {grandchild!r}]); "
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{p.pid}}'); print('started', flush=True); time.sleep(60)"
    )
    with open(tmp_path / "log", "a", encoding="utf-8") as log:
        started = time.monotonic()
        out = gpu_check.call([sys.executable, "-c", code], log, timeout=3)
    assert time.monotonic() - started < 20
    assert out.timed_out and out.code is None
    assert "started" in out.output
    text = (tmp_path / "log").read_text()
    assert "started" in text and "TIMED OUT after" in text
    deadline = time.monotonic() + 10
    while any(alive(int(pid)) for pid in pids.read_text().split()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(int(pid)) for pid in pids.read_text().split())


def test_a_failing_or_crashing_step_never_stops_the_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def times_out(check: Any, log: Any) -> Any:
        out = gpu_check.call([sys.executable, "-c", "import time; time.sleep(60)"], log, timeout=1)
        return gpu_check.Verdict("FAIL", f"sleeper {gpu_check.ending(out)}")

    def crashes(check: Any, log: Any) -> Any:
        raise KeyError("a bug in a step")

    def passes(check: Any, log: Any) -> Any:
        return gpu_check.Verdict("ok", "fine")

    steps = dict.fromkeys(gpu_check.STEPS, passes) | {"versions": times_out, "tests": crashes}
    monkeypatch.setattr(gpu_check, "STEP_FUNCTIONS", steps)
    monkeypatch.setattr(gpu_check, "WHEEL_DIR", tmp_path / "no-wheels")
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path / "out")]) == 1
    verdicts = (tmp_path / "out" / gpu_check.VERDICTS).read_text().splitlines()
    assert verdicts[0].startswith("versions: FAIL") and "sleeper timed out after 1 s" in verdicts[0]
    assert verdicts[1].startswith("tests: FAIL") and "gpu-check's own code failed: KeyError" in verdicts[1]
    assert [v.split(" (")[0] for v in verdicts[2:]] == [f"{step}: ok" for step in gpu_check.STEPS[2:]]
    assert "KeyError: 'a bug in a step'" in (tmp_path / "out" / gpu_check.LOG_NAMES["tests"]).read_text()
    summary = (tmp_path / "out" / gpu_check.SUMMARY).read_text()
    assert "| tests | FAIL |" in summary and "| bench_fp8 | ok |" in summary


def test_a_steps_time_box_bounds_all_its_commands_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outcomes = []

    def two_sleepers(check: Any, log: Any) -> Any:
        for _ in range(2):
            outcomes.append(gpu_check.call([sys.executable, "-c", "import time; time.sleep(60)"], log, check.left()))
        return gpu_check.Verdict("FAIL", "slept")

    monkeypatch.setattr(gpu_check, "STEP_FUNCTIONS", {"versions": two_sleepers})
    monkeypatch.setattr(gpu_check, "TIMEOUTS", {"versions": 6})
    monkeypatch.setattr(gpu_check, "WHEEL_DIR", tmp_path / "no-wheels")
    gpu_check.main(["--out", str(tmp_path), "--steps", "versions"])
    assert [o.timed_out for o in outcomes] == [True, True]
    assert sum(o.seconds for o in outcomes) < 9  # 6 s for both, not 6 s each


def test_a_step_past_the_runs_time_limit_is_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def slow(check: Any, log: Any) -> Any:
        time.sleep(1.2)
        return gpu_check.Verdict("ok", "slow")

    monkeypatch.setattr(gpu_check, "STEP_FUNCTIONS", dict.fromkeys(gpu_check.STEPS, slow))
    monkeypatch.setattr(gpu_check, "WHEEL_DIR", tmp_path / "no-wheels")
    gpu_check.main(["--out", str(tmp_path), "--time-limit", "6", "--steps", "versions", "tests", "bench_fp8"])
    verdicts = (tmp_path / gpu_check.VERDICTS).read_text().splitlines()
    assert [v.split(" (")[0] for v in verdicts] == ["versions: ok", "tests: not run", "bench_fp8: not run"]


# ---------------------------------------------------------------------------------------------- where it writes
def test_an_output_folder_that_cannot_be_written_falls_back_to_a_temporary_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out, note = gpu_check.output_folder(str(blocker / "out"))
    assert out.is_dir() and not out.is_relative_to(tmp_path)
    assert note.startswith(f"output in {out}: {blocker / 'out'} cannot be written")
    out.rmdir()
    monkeypatch.setenv("OUT", str(tmp_path / "from-env"))
    assert gpu_check.output_folder(None) == (tmp_path / "from-env", f"output in {tmp_path / 'from-env'}")


def test_steps_write_their_caches_outside_the_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setenv("DLS_TEST_DEVICE", "cuda")
    env = gpu_check.step_env(tmp_path, tmp_path / "site", dry=False)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT / "src"), str(tmp_path / "site"), "/elsewhere"]
    assert env["PYTHONDONTWRITEBYTECODE"] == "1" and env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] == "1"
    assert "DLS_TEST_DEVICE" not in env
    for key in ("HYPOTHESIS_STORAGE_DIRECTORY", "MPLCONFIGDIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        assert Path(env[key]).is_relative_to(tmp_path), key
    command = gpu_check.pytest_command(gpu_check.Check(tmp_path, tmp_path, False, env, 0.0), tmp_path / "t.xml")
    assert command[command.index("--device") + 1] == "cuda" and "no:cacheprovider" in command
    assert command[command.index("--basetemp") + 1] == str(tmp_path / "pytest")
    assert command[-len(gpu_check.TEST_FILES) :] == list(gpu_check.TEST_FILES)


# ---------------------------------------------------------------------------------------------- carried wheels
def make_wheel(folder: Path, name: str, version: str) -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}-{version}-cp310-abi3-manylinux_2_24_x86_64.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{name}/__init__.py", f"__version__ = {version!r}\n")
        wheel.writestr(f"{name}-{version}.dist-info/METADATA", f"Name: {name}\nVersion: {version}\n")
    return path


def test_carried_wheels_are_unpacked_onto_the_path_and_missing_ones_named(tmp_path: Path) -> None:
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    make_wheel(wheels, "torchao", "0.17.0")
    make_wheel(wheels, "torchao", "0.16.0")
    lines = gpu_check.unpack_wheels(wheels, site, pins=("torchao==0.17.0", "pytest-timeout==2.4.0"))
    assert (site / "torchao" / "__init__.py").read_text() == "__version__ = '0.17.0'\n"
    assert (site / "torchao-0.17.0.dist-info" / "METADATA").is_file()
    assert lines[0].startswith("torchao==0.17.0: unpacked from torchao-0.17.0-")
    assert lines[1] == (
        "pytest-timeout==2.4.0: not carried (no wheels/pytest-timeout-*.whl; `make gpu-wheels` fetches it)"
    )
    assert gpu_check.unpack_wheels(tmp_path / "none", site, pins=("torchao==0.17.0",))[0].endswith("fetches it)")


# ---------------------------------------------------------------------------------------------- reading output
SAMPLE_TESTS = """
import pytest

def test_passes():
    assert True

def test_fails():
    assert 1 == 2, "one is not two"

@pytest.mark.skip(reason="needs a thing")
def test_skipped():
    pass

@pytest.mark.parametrize("n", [1, 2])
def test_param(n):
    assert n
"""


def test_pytests_junit_xml_and_verbose_lines_give_the_same_counts(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS)
    options = ["-p", "no:cacheprovider", "-c", os.devnull, "--rootdir", str(tmp_path), "-v"]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *options, f"--junitxml={tmp_path / 'out.xml'}", "test_sample.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stdout
    counts = gpu_check.junit_counts(tmp_path / "out.xml")
    assert (counts.passed, counts.failed, counts.errors, counts.skipped) == (3, 1, 0, 1)
    assert counts.failures == ["test_sample.py::test_fails (failed): AssertionError: one is not two"]
    assert counts.skips == {"needs a thing": 1}
    assert counts.outcomes["test_sample.py::test_param[2]"] == "passed"
    verbose = gpu_check.verbose_counts(run.stdout)
    assert (verbose.passed, verbose.failed, verbose.skipped) == (3, 1, 1)
    assert verbose.outcomes == counts.outcomes
    assert (
        gpu_check.running_at_stop("test_a.py::test_x PASSED [ 50%]\ntest_a.py::test_hangs ") == "test_a.py::test_hangs"
    )


def test_the_tests_step_reports_counts_failures_and_where_a_timeout_stopped_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tests step on CUDA, with pytest pointed at sample modules instead (its arguments are the GPU run's)."""
    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS)
    (tmp_path / "test_stop.py").write_text("def test_fails():\n    assert 0\n\ndef test_sleeps():\n    import time\n"
                                           "    time.sleep(60)\n")  # fmt: skip
    module = "test_sample.py"

    def sample(check: Any, junit: Path) -> list[str]:
        options = ["-p", "no:cacheprovider", "-c", os.devnull, "--rootdir", str(tmp_path), "-v"]
        return [sys.executable, "-m", "pytest", *options, f"--junitxml={junit}", str(tmp_path / module)]

    monkeypatch.setattr(gpu_check, "pytest_command", sample)
    check = gpu_check.Check(tmp_path, tmp_path, False, dict(os.environ), time.monotonic() + 100)
    with open(tmp_path / "log", "a", encoding="utf-8") as log:
        verdict = gpu_check.step_tests(check, log)
    assert verdict.status == "FAIL" and verdict.text.startswith("3 passed, 1 failed, 0 errors, 1 skipped (")
    heading, body = verdict.sections[0]
    assert heading == "Test run on the GPU"
    assert re.search(r"^- `\S*test_sample.py::test_fails` \(failed\): AssertionError: one is not two$", body, re.M)
    assert "- 1 x needs a thing" in body
    assert check.tests is not None and check.tests.total == 5

    module = "test_stop.py"
    # 12 s: on a loaded 2-core machine pytest can take several seconds to start and run the first test.
    check = gpu_check.Check(tmp_path, tmp_path, False, dict(os.environ), time.monotonic() + 12)
    with open(tmp_path / "log", "a", encoding="utf-8") as log:
        verdict = gpu_check.step_tests(check, log)
    assert verdict.status == "FAIL"
    assert re.fullmatch(
        r"timed out in \S*test_stop.py::test_sleeps after 1 tests: 0 passed, 1 failed, .*", verdict.text
    )


def test_tables_are_cut_into_cells_as_printed(capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench_scaler import print_table
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    print("  ... progress")
    print_table("5. graphs", ["path", "scaler", "graph ms", "note"], [["Adam fused", "dls", "0.1", ""]])
    print("   a note under the table")
    print("W1128 a library's warning")
    print_table("6. more", ["a b", "c"], [["x y z", "capture failed: RuntimeError: x"], ["A/A", "spread 0.1"]])
    tables = gpu_check.parse_tables(capsys.readouterr().out)
    assert [t.title for t in tables] == ["5. graphs", "6. more"]
    assert tables[0].rows == [{"path": "Adam fused", "scaler": "dls", "graph ms": "0.1", "note": ""}]
    assert tables[0].text.splitlines()[-1] == "   a note under the table"
    assert "warning" not in tables[0].text
    assert tables[1].rows[0] == {"a b": "x y z", "c": "capture failed: RuntimeError: x"}
    assert gpu_check.spread_of(tables[1]) == "A/A spread 0.1"


# ---------------------------------------------------------------------------------------------- integrations
TABLE_SCRIPT = """
import sys
print("\\n1. a check\\nwhat  check\\nthis  " + {cell!r}.rjust(5))
sys.exit({code})
"""


def write_script(folder: Path, name: str, cell: str, code: int = 0) -> str:
    path = folder / name
    path.write_text(TABLE_SCRIPT.format(cell=cell, code=code))  # a table as print_table prints it
    return str(path)


def test_the_integrations_step_runs_what_is_there_and_names_what_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dry run reports the items not present yet (and passes); a GPU run fails on them, and on a check that
    printed MISS or a script that exited non-zero; every item's status is in the summary's section."""
    (tmp_path / "test_marked.py").write_text(
        "import pytest\n\n@pytest.mark.cuda\ndef test_on_cuda():\n    pass\n\ndef test_elsewhere():\n    pass\n"
    )
    (tmp_path / "conftest.py").write_text(
        "def pytest_configure(config):\n    config.addinivalue_line('markers', 'cuda: x')\n"
    )
    items = (
        gpu_check.Integration("good", "prints ok", script=(write_script(tmp_path, "good.py", "ok"),)),
        gpu_check.Integration("missed", "prints MISS", script=(write_script(tmp_path, "missed.py", "MISS"),)),
        gpu_check.Integration("crashed", "exits 3", script=(write_script(tmp_path, "crashed.py", "ok", 3),)),
        gpu_check.Integration("absent file", "no such test", tests=("tests/test_no_such_file_here.py",)),
        gpu_check.Integration("absent module", "no such module", script=("x",), modules=("no_such_module_xyz", "json")),
        gpu_check.Integration("absent dls module", "not built", script=("x",), modules=("dls.integrations.no_such",)),
        gpu_check.Integration("tests", "a pytest selection", tests=(str(tmp_path / "test_marked.py"),)),
        gpu_check.Integration(
            "suite's", "run by the suite", script=(write_script(tmp_path, "s.py", "ok"),), on_cpu="tests/test_x.py"
        ),
    )
    monkeypatch.setattr(gpu_check, "INTEGRATIONS", items)
    for dry in (True, False):
        check = gpu_check.Check(
            tmp_path, tmp_path, dry, gpu_check.step_env(tmp_path, None, dry), time.monotonic() + 200
        )
        if not dry:  # the GPU run's pytest arguments name --device cuda: a plain selection stands in for them
            monkeypatch.setattr(
                gpu_check,
                "pytest_command",
                lambda check, junit, files, selection: [sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                                                        "--rootdir", str(tmp_path), f"--junitxml={junit}", "-m",
                                                        selection, *files],
            )  # fmt: skip
        with open(tmp_path / "log", "a", encoding="utf-8") as log:
            verdict = gpu_check.step_integrations(check, log)
        status = {name: (s, text) for name, s, text in check.integrations}
        assert status["good"] == ("ok", "1 tables, 1 checks ok, 0 MISS")
        assert status["missed"][0] == "FAIL" and "0 checks ok, 1 MISS" in status["missed"][1]
        assert status["crashed"][0] == "FAIL" and status["crashed"][1].startswith("exited 3")
        assert status["absent file"] == ("not present yet", "tests/test_no_such_file_here.py")
        assert status["absent module"] == ("not present yet", "module no_such_module_xyz")  # json is there
        assert status["absent dls module"] == ("not present yet", "module dls.integrations.no_such")
        expected = "1 tests collected (-m cuda), not run" if dry else "1 passed, 0 failed, 0 errors, 0 skipped"
        assert status["tests"] == ("ok", expected)
        suites = ("present", "not run in a dry run: on the CPU the suite runs it (tests/test_x.py)")
        assert status["suite's"] == (suites if dry else ("ok", "1 tables, 1 checks ok, 0 MISS"))
        assert verdict.status == "FAIL"  # the MISS and the crash, in both
        ok = "3 of 8 ok" + (" or present" if dry else "")
        assert verdict.text.startswith(f"{ok}; failed: missed, crashed; not present yet: absent file (")
        section = dict(verdict.sections)["Integrations"]
        assert "| absent module | no such module | not present yet | module no_such_module_xyz |" in section

    # Only items that pass, and one not present: ok in a dry run, FAIL on the GPU (the check is not whole there).
    monkeypatch.setattr(gpu_check, "INTEGRATIONS", (items[0], items[3]))
    for dry, expected in ((True, "ok"), (False, "FAIL")):
        check = gpu_check.Check(tmp_path, tmp_path, dry, dict(os.environ), time.monotonic() + 60)
        with open(tmp_path / "log", "a", encoding="utf-8") as log:
            assert gpu_check.step_integrations(check, log).status == expected


def test_the_summary_reads_the_claims_verdicts_from_its_printed_tables(capsys: pytest.CaptureFixture[str]) -> None:
    """claim_gpu.py's judgement (as well, faster, less memory; stalls, matches) as printed, read back by the
    summary's rows: a float16 + dls run 3 % above float32's loss, faster and smaller, is ok on all three; one 8 %
    above is not as well; a float16 run without a scaler whose loss fell as far as float32's did not stall."""
    claim = benchmark("claim_gpu")
    spec = claim.specs(True)["gpt2"]

    def run(way: Any, losses: list[float], step: float, peak: int, skipped: int | None = None) -> Any:
        return claim.Run(spec, way, len(losses), losses, [step] * len(losses), peak, skipped, params=1000)

    base = [10.0, 6.0, 4.0, 2.0]
    good = [run(claim.FLOAT32, base, 0.2, 100), run(claim.BFLOAT16, base, 0.1, 60),
            run(claim.FLOAT16_DLS, [10.0, 6.0, 4.0, 2.06], 0.1, 60, 0)]  # fmt: skip
    worse = [run(claim.FLOAT32, base, 0.2, 100), run(claim.BFLOAT16, base, 0.1, 60),
             run(claim.FLOAT16_DLS, [10.0, 6.0, 4.0, 2.16], 0.3, 120, 2)]  # fmt: skip
    claim.print_headline([good, worse])
    claim.print_underflow([run(claim.FLOAT32, base, 0.2, 100), run(claim.FLOAT16_NONE, base, 0.1, 60),
                           run(claim.FLOAT16_DLS, [10.0, 6.0, 4.0, 2.3], 0.1, 60, 0)])  # fmt: skip
    claim.print_masters([(good[2], run(claim.MASTERS, base, 0.12, 50, 0))])
    tables = gpu_check.parse_tables(capsys.readouterr().out)
    rows = gpu_check.claim_rows(tables)
    assert [r[2].split(" (")[0] for r in rows[:2]] == ["ok / ok / ok", "MISS / MISS / MISS"]
    assert "(speed-up 2.000, memory 0.600, loss@4 2.0600)" in rows[0][2]
    assert rows[2][2] == "MISS / MISS"  # no stall; 2.3 is 15 % off float32's 2.0
    claim.print_underflow([run(claim.FLOAT32, base, 0.2, 100), run(claim.FLOAT16_NONE, [10.0, 9.9, 9.8, 9.8], 0.1, 60),
                           run(claim.FLOAT16_DLS, [10.0, 6.0, 4.0, 1.98], 0.1, 60, 0)])  # fmt: skip
    story = gpu_check.claim_rows(gpu_check.parse_tables(capsys.readouterr().out))
    assert [r[2] for r in story if r[0].startswith("claim 2.")] == ["ok / ok"]  # stalled; 1 % off
    assert rows[3][2] == f"{spec.label} 1.200 / 0.833"
    assert gpu_check.claim_rows([])[0][2] == "not run"
