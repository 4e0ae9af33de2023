"""Shared set-up and helpers of the test suite.

Fixtures: ``_reset_half_dtype`` and ``one_thread`` (every test); ``device`` (the device the device-dependent tests
run on: ``cpu`` unless ``--device cuda`` or ``DLS_TEST_DEVICE=cuda`` asks for CUDA, which is then an error where there
is none); ``fresh_accelerate_state`` (requested by name). Tests marked ``cuda`` need a GPU: they skip without one. Tests
that take the ``device`` fixture are marked ``device``: ``-m "cuda or device"`` selects what a GPU run concerns.
Plain helpers, imported with ``from conftest import ...``:

* tiny models and losses: ``tiny_model``, ``batch``, ``loss_of``; overflow injection: ``inject``; training loops:
  ``train`` (a tiny model), ``one_parameter`` with ``one_iteration``;
* exact comparisons: ``snapshot`` (parameters and optimizer state), ``assert_same``, ``assert_bits_equal``,
  ``assert_tensors_equal``, ``params_of``;
* torch.amp side by side: ``torch_scaler``, ``dls_scaler``, ``side_by_side``;
* what a block does on the device: ``host_reads`` (values read back to the host), ``OpLog`` (aten ops);
* ``ReferenceRule``: the dynamic scale rule written out step by step (the suite's one statement of the rule);
* ``load_example``: a script of ``examples/`` as a module;
* ``launch_ranks``, ``free_port``, ``dist_env``: multi-process runs on CPU (gloo, 127.0.0.1 only); ``run_rank``: the
  worker's side of ``launch_ranks``.

Under pytest-xdist (``make test``: ``-n auto --dist loadfile``) each test file is one unit of work, run by one
worker, so that a module-scoped fixture is built once; the files of ``LAUNCHING_FILES`` together are ONE unit,
handed out first (``pytest_xdist_make_scheduler``).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import gc
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import settings
from torch.utils._python_dispatch import TorchDispatchMode

import dls
from dls.policy import DynamicRule

# CI machines have 2 cores; keep each test process to its share and hypothesis deterministic there.
# One torch thread for the whole suite: on 2 busy CI cores the tests' tiny models run many times faster on one
# thread than on two (measured 10-60x), and tests that run processes set their own.
torch.set_num_threads(1)
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

INF, NAN = math.inf, math.nan
DLS_DIR = os.path.dirname(dls.__file__)
EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"


# ---------------------------------------------------------------------------------------------- the device switch
DEVICE_ENV = "DLS_TEST_DEVICE"
_DEVICE_KEY = pytest.StashKey[torch.device]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default=None,
        help=f"device of the device-dependent tests: cpu (default) or cuda, cuda:N; also ${DEVICE_ENV}. Asking for "
        "CUDA where torch.cuda.is_available() is False is an error, never a silent CPU run",
    )


def requested_device(option: str | None, env: Mapping[str, str], cuda_available: bool) -> torch.device:
    """The device the option (else the environment's ``DLS_TEST_DEVICE``, else ``cpu``) asks for; ``UsageError``
    for anything but ``cpu`` and ``cuda[:N]``, or for CUDA where there is none."""
    text = option if option is not None else env.get(DEVICE_ENV) or "cpu"
    source = "--device" if option is not None else DEVICE_ENV
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index is not None):
        raise pytest.UsageError(f"{source} must be 'cpu', 'cuda' or 'cuda:N'; got {text!r}")
    if device.type == "cuda" and not cuda_available:
        raise pytest.UsageError(
            f"{source}={text} asks for CUDA, but torch.cuda.is_available() is False here (no GPU, or a CPU build of "
            "torch): unset it to run the suite on the CPU"
        )
    return device


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_DEVICE_KEY] = requested_device(config.getoption("--device"), os.environ, torch.cuda.is_available())
    config.addinivalue_line("markers", "device: the test takes the device fixture (marked by tests/conftest.py)")


def pytest_report_header(config: pytest.Config) -> str:
    device = config.stash[_DEVICE_KEY]
    cuda = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})" if torch.cuda.is_available() else "none"
    return f"dls: device-dependent tests on {device}; CUDA device: {cuda}"


@pytest.hookimpl(tryfirst=True)  # before -m selects: `-m "cuda or device"` is every test a GPU run concerns
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parametrized = getattr(getattr(item, "callspec", None), "params", {})  # a test's own `device` argument
        if "device" in getattr(item, "fixturenames", ()) and "device" not in parametrized:
            item.add_marker(pytest.mark.device)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device(pytestconfig: pytest.Config) -> torch.device:
    """The device of the device-dependent tests (``--device`` / ``DLS_TEST_DEVICE``; ``cpu`` by default)."""
    return pytestconfig.stash[_DEVICE_KEY]


@pytest.fixture(autouse=True)
def _reset_half_dtype() -> Iterator[None]:
    """Every test starts with the default half dtype, whatever an earlier test chose."""
    previous = dls.get_half_dtype_str()
    dls.set_half_dtype("float16")
    yield
    dls.set_half_dtype(previous)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Every test starts on one torch thread (tiny models on 2 busy cores run many times faster on one), and the
    count is restored after it, whatever the test set."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)


@pytest.fixture
def fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps its state in process-wide singletons: reset before and after the test, so that every test
    builds its own ``Accelerator`` (a Hugging Face ``Trainer`` builds one too). Request it by name; the test
    module must have skipped already where accelerate is not installed."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


# ---------------------------------------------------------------------------------------------- models and losses
def tiny_model(
    seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.nn.Sequential:
    """``Linear(6, 8) → Tanh → Linear(8, 2)`` on ``device``, initialised from ``seed`` (on the CPU, so the
    same weights on every device)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return model.to(device=device, dtype=dtype)


def batch(
    step: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (4 × 6, in ``dtype``) and float32 targets (4 × 2) of a step on ``device``, the same for every call."""
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 2, generator=gen)
    return x.to(device=device, dtype=dtype), y.to(device)


def loss_of(model: torch.nn.Module, step: int = 0) -> torch.Tensor:
    """The float32 mean squared error of ``model`` (any dtype, on its device) on ``batch(step)``."""
    first = next(model.parameters())
    x, y = batch(step, first.dtype, first.device)
    return torch.nn.functional.mse_loss(model(x).float(), y)


def inject(target: torch.nn.Module | torch.Tensor, value: float = INF, index: int = 0) -> None:
    """Put ``value`` (inf, -inf or NaN) into element ``index`` of a gradient after backward: of ``target`` when it is a
    gradient, else of the first parameter of ``target`` that has one."""
    if isinstance(target, torch.nn.Module):
        grad = next(p.grad for p in target.parameters() if p.grad is not None)
    else:
        grad = target
    grad.view(-1)[index] = value


def train(
    scaler: Any,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    steps: Iterable[int],
    overflows: Mapping[int, float] | None = None,
) -> list[dict[str, Any]]:
    """``scale(loss_of(model, step)).backward() → [inject] → step → update → zero_grad`` for each step, with
    ``overflows[step]`` (inf, -inf or NaN) injected at the steps ``overflows`` maps; returns the scaler's state dict
    after each step (torch.amp's scaler works too)."""
    states = []
    for step in steps:
        scaler.scale(loss_of(model, step)).backward()
        if overflows and step in overflows:
            inject(model, overflows[step])
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        states.append(scaler.state_dict())
    return states


def one_parameter() -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    """``ones(1)`` and an SGD at lr 0 (the scale changes, the parameter never does)."""
    p = torch.nn.Parameter(torch.ones(1))
    return p, torch.optim.SGD([p], lr=0.0)


def one_iteration(scaler: Any, p: torch.nn.Parameter, opt: torch.optim.Optimizer, overflow: bool = False) -> None:
    """A whole iteration on the gradient of ``p.sum()``, inf everywhere when ``overflow``."""
    scaler.scale(p.sum() * (INF if overflow else 1.0)).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


# ---------------------------------------------------------------------------------------------- exact comparisons
Snapshot = tuple[list[torch.Tensor], list[dict[str, Any]]]
_INT_OF = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16}
_INT_OF[torch.bfloat16] = torch.int16


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    """Copies of ``model``'s parameters."""
    return [p.detach().clone() for p in model.parameters()]


def snapshot(params: torch.nn.Module | Iterable[torch.Tensor], opt: torch.optim.Optimizer) -> Snapshot:
    """Copies of the parameters and of the optimizer state of each (``{}`` for a parameter without state)."""
    params = list(params.parameters() if isinstance(params, torch.nn.Module) else params)
    state = [
        {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in opt.state.get(p, {}).items()}
        for p in params
    ]
    return [p.detach().clone() for p in params], state


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(_INT_OF[t.dtype]) if t.dtype in _INT_OF else t.detach()


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Same dtype, shape and bits (NaN payloads and the sign of zero included)."""
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    assert torch.equal(_bits(a), _bits(b)), f"{what}: {a} != {b}"


def assert_tensors_equal(a: Iterable[torch.Tensor | None], b: Iterable[torch.Tensor | None], what: str = "") -> None:
    """Two equally long sequences of tensors, bit for bit."""
    a, b = list(a), list(b)
    assert len(a) == len(b), f"{what}: {len(a)} vs {len(b)} tensors"
    for i, (x, y) in enumerate(zip(a, b)):
        assert x is not None and y is not None, f"{what}: tensor {i} is None"
        assert_bits_equal(x, y, f"{what} tensor {i}")


def assert_same(a: Snapshot, b: Snapshot, where: str = "") -> None:
    """Two snapshots hold the same parameters and optimizer state, bit for bit (Python values by ``==``)."""
    assert_tensors_equal(a[0], b[0], f"{where}: params")
    assert len(a[1]) == len(b[1])
    for i, (sa, sb) in enumerate(zip(a[1], b[1])):
        assert sa.keys() == sb.keys(), f"{where}: state keys of param {i}: {sorted(sa)} vs {sorted(sb)}"
        for key, value in sa.items():
            if isinstance(value, torch.Tensor):
                assert_bits_equal(value, sb[key], f"{where}: state[{i}][{key!r}]")
            else:
                assert value == sb[key], f"{where}: state[{i}][{key!r}]"


# ---------------------------------------------------------------------------------------------- torch.amp side by side
def torch_scaler(
    init_scale: float = 2.0**10, growth_interval: int = 2000, device: torch.device | str = "cpu"
) -> torch.amp.GradScaler:
    return torch.amp.GradScaler(torch.device(device).type, init_scale=init_scale, growth_interval=growth_interval)


def dls_scaler(init_scale: float = 2.0**10, steps_per_increase: int = 2000, **kwargs: Any) -> dls.GradScaler:
    """A dynamic ``dls.GradScaler`` (torch dialect: torch's growth timing) with the Cerebras floor 2**-14 and a
    maximum, 2**40, out of reach: its rule is torch's."""
    kwargs = {"min_loss_scale": 2.0**-14, "max_loss_scale": 2.0**40, **kwargs}
    return dls.GradScaler("cpu", init_scale=init_scale, growth_interval=steps_per_increase, **kwargs)


def side_by_side(
    body: Callable[[Any, torch.nn.Module, torch.optim.Optimizer, int], None],
    make_opt: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    iterations: int,
    init_scale: float = 2.0**10,
    interval: int = 2000,
    device: torch.device | str = "cpu",
) -> None:
    """Run ``body(scaler, model, opt, i)`` with ``torch_scaler`` and with ``dls_scaler`` on identical tiny models
    on ``device``: the scales after every iteration, the parameters and the optimizer state must be the same."""
    results = []
    for scaler in (torch_scaler(init_scale, interval, device), dls_scaler(init_scale, interval)):
        model = tiny_model(device=device)
        opt = make_opt(list(model.parameters()))
        scales = []
        for i in range(iterations):
            body(scaler, model, opt, i)
            scales.append(scaler.get_scale())
        results.append((snapshot(model, opt), scales))
    (torch_state, torch_scales), (dls_state, dls_scales) = results
    assert dls_scales == torch_scales
    assert_same(dls_state, torch_state, "dls vs torch")


# ---------------------------------------------------------------------------------------------- device activity
SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__complex__")


@contextlib.contextmanager
def host_reads() -> Iterator[list[tuple[str, str]]]:
    """Record ``(method, calling file)`` for every read of a tensor's value back to the host inside the block.

    The ``torch.Tensor`` methods that copy a value to the host are patched for the duration of the block. On CPU
    nothing waits, but each of these calls is a host sync on an accelerator: the count is what a GPU run pays.
    """
    calls: list[tuple[str, str]] = []
    saved = {name: torch.Tensor.__dict__.get(name) for name in SYNC_METHODS}

    def spy(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            calls.append((name, sys._getframe(1).f_code.co_filename))
            return original(self, *args, **kwargs)

        return wrapper

    for name in SYNC_METHODS:
        setattr(torch.Tensor, name, spy(name, getattr(torch.Tensor, name)))
    try:
        yield calls
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, value)


def from_dls(calls: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The ``host_reads`` made by dls's own code."""
    return [c for c in calls if c[1].startswith(DLS_DIR)]


class OpLog(TorchDispatchMode):
    """Records the aten ops run inside the block, as ``str(func)`` (``"aten.mul_.Tensor"``), with whether each may
    write its arguments; given ``watched`` tensors, only the ops that read or write one of their buffers."""

    def __init__(self, watched: Iterable[torch.Tensor] | None = None) -> None:
        super().__init__()
        self.watched = None if watched is None else {t.data_ptr() for t in watched}
        self.ops: list[str] = []
        self.writes: list[bool] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        flat: list[Any] = []
        for a in [*args, *(kwargs or {}).values()]:
            flat.extend(a if isinstance(a, (list, tuple)) else [a])
        if self.watched is None or any(isinstance(t, torch.Tensor) and t.data_ptr() in self.watched for t in flat):
            self.ops.append(str(func))
            self.writes.append(func._schema.is_mutable)
        return func(*args, **(kwargs or {}))

    def names(self) -> list[str]:
        """The ops without namespace and overload: ``"mul_"``."""
        return [op.split(".")[1] for op in self.ops]

    def passes(self) -> tuple[int, int]:
        """(read-only ops, read+write ops)."""
        writes = sum(self.writes)
        return len(self.ops) - writes, writes


# ---------------------------------------------------------------------------------------------- the scale rule
@dataclass
class ReferenceRule:
    """The dynamic scale rule (the pseudo-code in ``dls.policy``'s docstring) written out step by step in Python
    numbers; the peers' own rules, re-stated from their sources, are in test_policy.py.

    float32 where the contract says so: the overflow ratio is a float32 division, and products of the scale and a
    factor are computed in float64 and rounded once to float32, as torch's update kernel does.
    """

    rule: DynamicRule
    scale: float
    steps: int = 0
    overflows: int = 0
    skipped: int = 0
    budget: int = 0  # the hysteresis budget left (hysteresis_tracker); 0: full, set in __post_init__
    non_clamped: float = 0.0

    def __post_init__(self) -> None:
        self.budget = self.budget or self.rule.hysteresis

    def update(self, overflow: bool) -> str:
        """One ``update()`` with this iteration's overflow flag; returns what happened: ``"none"``, ``"hit"`` (an
        overflow that spent a unit of the budget without back-off), ``"backoff"`` or ``"growth"``."""
        r = self.rule
        f = int(overflow)
        self.steps += 1
        self.overflows += f
        self.skipped += f
        event = "none"
        ratio = np.float32(self.overflows) / np.float32(self.steps)
        if f and ratio > np.float32(r.overflow_tolerance):
            self.steps = self.overflows = 0
            if self.budget == 1:
                self.scale = float(np.float32(np.float64(np.float32(self.scale)) * r.backoff_factor))
                event = "backoff"
            else:
                self.budget -= 1
                event = "hit"
        elif self.steps >= r.growth_interval:
            with np.errstate(over="ignore"):
                grown = np.float32(np.float64(np.float32(self.scale)) * r.growth_factor)
            if np.isfinite(grown):  # growth that would reach inf is dropped; the counters still reset
                self.scale = float(grown)
            self.steps, self.overflows = r.steps_after_growth, 0
            self.budget = r.hysteresis
            event = "growth"
        elif r.consecutive_hysteresis and not f:
            self.budget = r.hysteresis
        self.scale = min(self.scale, float(np.float32(r.max_loss_scale)))
        self.non_clamped = self.scale
        self.scale = max(self.scale, float(np.float32(r.min_loss_scale)))
        return event


# ---------------------------------------------------------------------------------------------- examples
def load_example(name: str) -> ModuleType:
    """``examples/{name}`` (``"underflow.py"``) executed as a fresh module: ``examples/`` is not a package, and each
    call gives a new module, so nothing one test does to a module's globals reaches another."""
    path = EXAMPLES_DIR / name
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------- several processes
# The test files that launch ranks (``launch_ranks``, torchrun): each launch keeps both cores busy by itself, so under
# pytest-xdist these files form one unit of work, run in turn by one worker while the others take the rest: two
# launches side by side (8 processes on 2 cores for two 4-rank runs) would only slow each other, against the ranks'
# 60 s collective timeout and the launches' deadlines. The unit goes out first: it is the longest.
# ``launch_ranks`` fails a test of a file missing here.
LAUNCHING_FILES = frozenset(
    {
        "test_distributed.py",
        "test_fallback.py",
        "test_fp8_distributed.py",
        "test_fsdp_mesh.py",
        "test_integration_torchtitan.py",
        "test_master_weights.py",
        "test_train_ddp.py",
    }
)
LAUNCHES = "tests/launching rank processes"  # the unit's name in xdist's log


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: ignored where the plugin is not installed
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, with the files of ``LAUNCHING_FILES`` as one unit, handed out before the others."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LaunchesTogether(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return LAUNCHES if Path(path).name in LAUNCHING_FILES else path

        def _assign_work_unit(self, node: Any) -> None:
            if LAUNCHES in self.workqueue:
                self.workqueue.move_to_end(LAUNCHES, last=False)
            super()._assign_work_unit(node)

    return LaunchesTogether(config, log)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dist_env(**extra: str) -> dict[str, str]:
    """This process's environment for ranks on 127.0.0.1: one thread each, gloo on the loopback interface."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1", **extra)
    with contextlib.suppress(AttributeError, OSError, StopIteration):  # else gloo picks the host name's interface
        env["GLOO_SOCKET_IFNAME"] = next(name for _, name in socket.if_nameindex() if name.startswith("lo"))
    return env


def launch_ranks(
    worker: Path, args: list[str], out: Path, world_size: int, timeout: float, **env: str
) -> list[dict[str, Any]]:
    """Run ``python worker OUT *args`` once per rank (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_*`` set as
    torchrun sets them, plus ``env``) and return what each rank wrote to ``OUT/rank{r}.json``. A rank that fails, or
    ranks still running after ``timeout`` seconds (then killed), fail the test with the ranks' logs. The calling
    test's file must be one of ``LAUNCHING_FILES``."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split("::", 1)[0]
    if test and Path(test).name not in LAUNCHING_FILES:
        pytest.fail(f"{test} launches ranks: add {Path(test).name!r} to LAUNCHING_FILES in tests/conftest.py")
    base = dist_env(MASTER_PORT=str(free_port()), WORLD_SIZE=str(world_size), **env)
    logs = [out / f"rank{r}.log" for r in range(world_size)]
    procs = []
    for rank, log in enumerate(logs):
        with log.open("w") as f:
            cmd = [sys.executable, str(worker), str(out), *args]
            rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
            procs.append(subprocess.Popen(cmd, env=rank_env, stdout=f, stderr=subprocess.STDOUT))

    def logs_text() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in logs if p.exists())

    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                why = f"a rank exited with {failed[0]}" if failed else f"ranks still running after {timeout:.0f}s"
                pytest.fail(f"{why} ({worker.name} {' '.join(args)}, world size {world_size})\n{logs_text()}")
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    assert codes == [0] * world_size, f"exit codes {codes}\n{logs_text()}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]


def run_rank(results: Callable[[], dict[str, Any]]) -> None:
    """The worker's side of ``launch_ranks``, called by a worker script's ``main``: join the gloo process group that
    the environment describes (60 s timeout), run ``results()``, wait for every rank at a barrier, leave the group
    (also when ``results`` raises) and write what it returned, as JSON, to ``OUT/rank{RANK}.json`` (``OUT``: the
    script's first argument)."""
    import torch.distributed as dist

    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        result = results()
        dist.barrier()
    finally:
        # DDP's reducer and the watches' hooks form reference cycles: collected while the group exists, not at
        # interpreter exit, where gloo's threads abort the process ("terminate called without an active exception").
        gc.collect()
        dist.destroy_process_group()
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))
