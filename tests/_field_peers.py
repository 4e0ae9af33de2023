"""The field's other loss scalers as their own code runs them, for the differential tests (tests/test_peers_field.py):
Keras 3's ``LossScaleOptimizer`` and jmp's ``DynamicLossScale`` as installed packages (the ``peers`` extra), and
fairseq's ``DynamicLossScaler``, MXNet's ``LossScaler`` and ColossalAI's ``DynamicGradScaler`` as the one file each
in their published archives (``make test`` fetches them with ``pip download --no-deps`` into ``build/peers/``; see
``requirements/peer-archives.txt``), compiled from the archive as it is and given only the names the file imports.

Each ``*Run`` drives one real scaler object through the public calls its framework makes in a training step and
answers ``step(m) -> (scale used for the step, skipped?, scale after)`` for a gradient of magnitude ``m`` (the
traces of ``_peers``): the step's gradient is ``float16(m * scale)`` as a float16 parameter receives it, so a scale
too large makes its own overflows and each scaler's skips follow its own scale. ``StoppedTraining`` is raised where
the peer stops training (fairseq's ``FloatingPointError`` at ``min_loss_scale``). ``saved()`` is the scaler state
as the peer saves it.

The stubs are the few names the files import that are not the decision: MXNet's ``autograd.pause``,
``ndarray.ones`` and ``multi_all_finite`` (the all-finite check, written out below from its operator's documented
meaning), ColossalAI's accelerator (the CPU) and logger; fairseq's file imports nothing.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ARCHIVES = ROOT / "build" / "peers"
PINS = ROOT / "requirements" / "peer-archives.txt"
FETCH = "make test (or: pip download --no-deps --no-build-isolation -d build/peers -r requirements/peer-archives.txt)"

Step = tuple[float, bool, float]


class StoppedTraining(Exception):
    """The peer stopped training at this step (its own exception is the ``__cause__``)."""


def half(m: float, scale: float) -> float:
    """The step's gradient as a float16 parameter receives it: ``m * scale`` in float32 (a scale past float32's range
    is inf there), rounded to float16."""
    scaled = torch.tensor(m, dtype=torch.float32) * torch.tensor(float(scale), dtype=torch.float32)
    return float(scaled.half())


def pinned(project: str) -> str:
    """``project``'s version in requirements/peer-archives.txt."""
    for line in PINS.read_text().splitlines():
        name, _, version = line.split("#")[0].strip().partition("==")
        if name == project:
            return version
    raise LookupError(f"{project} is not pinned in {PINS}")


def archived_source(project: str, member: str) -> tuple[str, str]:
    """The text of ``member`` in ``project``'s archive in build/peers/ (an sdist's ``project-version/`` prefix
    implied), and the name it is compiled under; the test module is skipped, naming the fetch, if it is absent."""
    version = pinned(project)
    found = sorted(ARCHIVES.glob(f"{project}-{version}[-.]*")) if ARCHIVES.is_dir() else []
    if not found:
        pytest.skip(f"{project} {version}'s archive is not in {ARCHIVES}: {FETCH}", allow_module_level=True)
    path = found[0]
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as wheel:
            return wheel.read(member).decode(), f"{path}/{member}"
    with tarfile.open(path) as sdist:
        name = f"{project}-{version}/{member}"
        handle = sdist.extractfile(name)
        assert handle is not None, name
        return handle.read().decode(), f"{path}/{name}"


def module_from(project: str, member: str, name: str, stubs: dict[str, ModuleType] | None = None) -> ModuleType:
    """``member`` of ``project``'s archive compiled and run as module ``name``, with ``stubs`` (and the modules
    already made) in ``sys.modules`` only while it runs, so that its imports find them and nothing else is left
    behind."""
    source, filename = archived_source(project, member)
    module = ModuleType(name)
    module.__file__ = filename
    module.__package__ = name.rpartition(".")[0]
    with mock.patch.dict(sys.modules, {**(stubs or {}), name: module}):
        exec(compile(source, filename, "exec"), module.__dict__)
    return module


def stub(name: str, **attributes: Any) -> ModuleType:
    module = ModuleType(name)
    module.__path__ = []  # a package, for the relative imports below it
    vars(module).update(attributes)
    return module


# --------------------------------------------------------------------------------------------------------- fairseq
@functools.cache
def fairseq_scaler() -> Any:
    return module_from("fairseq", "fairseq/optim/dynamic_loss_scaler.py", "fairseq.optim.dynamic_loss_scaler")


class FairseqRun:
    """fairseq's ``DynamicLossScaler(**kwargs)`` as ``FP16Optimizer`` drives it: the loss scaled by ``loss_scale``;
    ``clip_grad_norm`` passes the norm of the unscaled gradients to ``check_overflow``, which raises
    ``OverflowError`` (the trainer skips the step) or ``FloatingPointError`` (the trainer stops); ``step`` calls
    ``update()`` after a step it applied."""

    def __init__(self, **kwargs: Any) -> None:
        self.scaler = fairseq_scaler().DynamicLossScaler(**kwargs)

    def step(self, m: float) -> Step:
        used = self.scaler.loss_scale
        g = half(m, used)
        norm = abs(g) / used  # inf and NaN stay so, as in fairseq's norm of the fp32 gradients
        try:
            self.scaler.check_overflow(norm)
        except OverflowError:
            return used, True, self.scaler.loss_scale
        except FloatingPointError as exc:
            raise StoppedTraining(str(exc)) from exc
        self.scaler.update()
        return used, False, self.scaler.loss_scale

    def saved(self) -> dict[str, Any]:
        """``FP16Optimizer.state_dict()``'s own entry: the scale only."""
        return {"loss_scale": self.scaler.loss_scale}


# ---------------------------------------------------------------------------------------------------------- MXNet
class _NDArray:
    """The two things MXNet's file asks of an NDArray: its ``context`` and ``asnumpy()``."""

    def __init__(self, values: Any, ctx: str = "cpu(0)") -> None:
        self.values = np.asarray(values)
        self.context = ctx

    def asnumpy(self) -> np.ndarray:
        return self.values


def _multi_all_finite(*arrays: _NDArray, num_arrays: int, init_output: bool, out: _NDArray) -> None:
    """MXNet's ``multi_all_finite`` operator (src/operator/contrib/all_finite.cc): ``out`` becomes 0 if any element
    of the first ``num_arrays`` arrays is inf or NaN; it starts from 1 with ``init_output``, else from its value."""
    finite = all(bool(np.isfinite(a.values).all()) for a in arrays[:num_arrays])
    out.values = np.array([float((init_output or bool(out.values[0])) and finite)], dtype=np.float32)


@functools.cache
def mxnet_scaler() -> Any:
    ndarray = stub(
        "mxnet.ndarray",
        multi_all_finite=_multi_all_finite,
        ndarray=SimpleNamespace(ones=lambda shape, ctx: _NDArray(np.ones(shape, np.float32), ctx)),
    )
    autograd = stub("mxnet.autograd", pause=contextlib.nullcontext)
    root = stub("mxnet", ndarray=ndarray, autograd=autograd)
    stubs = {"mxnet": root, "mxnet.ndarray": ndarray, "mxnet.autograd": autograd}
    stubs |= {"mxnet.contrib": stub("mxnet.contrib"), "mxnet.contrib.amp": stub("mxnet.contrib.amp")}
    return module_from("mxnet", "mxnet/contrib/amp/loss_scaler.py", "mxnet.contrib.amp.loss_scaler", stubs)


class MxnetRun:
    """MXNet's ``LossScaler()`` as ``amp.init_trainer`` and Gluon's ``Trainer`` drive it: ``amp.scale_loss``
    multiplies the loss by ``loss_scale``; ``Trainer._update`` returns without updating when
    ``has_overflow(params)`` says so. ``LossScaler`` takes no arguments; ``state`` sets its attributes (MXNet
    saves none) to start elsewhere than its constructor does."""

    def __init__(self, **state: Any) -> None:
        self.scaler = mxnet_scaler().LossScaler()
        for key, value in state.items():
            assert hasattr(self.scaler, key), key
            setattr(self.scaler, key, value)

    def step(self, m: float) -> Step:
        used = self.scaler.loss_scale
        param = SimpleNamespace(_grad=[_NDArray(np.array([half(m, used)], np.float16))])
        skipped = self.scaler.has_overflow([param])
        return used, bool(skipped), self.scaler.loss_scale


# ------------------------------------------------------------------------------------------------------ ColossalAI
@functools.cache
def colossalai_scaler() -> Any:
    accelerator = SimpleNamespace(get_current_device=lambda: torch.device("cpu"), device_count=lambda: 0)
    stubs = {
        "colossalai": stub("colossalai"),
        "colossalai.accelerator": stub("colossalai.accelerator", get_accelerator=lambda: accelerator),
        "colossalai.logging": stub("colossalai.logging", get_dist_logger=lambda: SimpleNamespace(info=print)),
    }
    for package in ("colossalai.amp", "colossalai.amp.naive_amp", "colossalai.amp.naive_amp.grad_scaler"):
        stubs[package] = stub(package)
    folder, package = "colossalai/amp/naive_amp/grad_scaler", "colossalai.amp.naive_amp.grad_scaler"
    stubs[f"{package}.base_grad_scaler"] = module_from(
        "colossalai", f"{folder}/base_grad_scaler.py", f"{package}.base_grad_scaler", stubs
    )
    return module_from("colossalai", f"{folder}/dynamic_grad_scaler.py", f"{package}.dynamic_grad_scaler", stubs)


class ColossalaiRun:
    """ColossalAI's ``DynamicGradScaler(**kwargs)`` as its mixed-precision optimizers drive it
    (``MixedPrecisionMixin.should_skip_step``): the loss scaled by ``scale``, the gradients checked for inf/NaN,
    ``update(found_inf)``, and the step skipped when an overflow was found."""

    def __init__(self, **kwargs: Any) -> None:
        self.scaler = colossalai_scaler().DynamicGradScaler(**kwargs)

    def step(self, m: float) -> Step:
        used = float(self.scaler.scale.item())
        found_inf = not math.isfinite(half(m, used))
        self.scaler.update(found_inf)
        return used, found_inf, float(self.scaler.scale.item())

    def saved(self) -> dict[str, Any]:
        return self.scaler.state_dict()


# ------------------------------------------------------------------------------------------------------------ jmp
@functools.cache
def jmp_modules() -> tuple[Any, Any, Any]:
    jax = pytest.importorskip("jax", reason="jax is not installed: pip install -e '.[peers]' (make test installs it)")
    jmp = pytest.importorskip("jmp", reason="jmp is not installed: pip install -e '.[peers]' (make test installs it)")
    return jax, jax.numpy, jmp


class JmpRun:
    """jmp's ``DynamicLossScale(loss_scale, **kwargs)`` as a JAX training step uses it: ``scale`` the loss,
    ``unscale`` the gradients, ``all_finite``, ``adjust``, and the update selected away (``select_tree``) where they
    were not finite. ``mode``: ``"eager"`` (op by op); ``"jit"`` (the step under ``jax.jit``, the scaler rebuilt
    inside from its leaves with its other fields as constants: fast, the same code); ``"pytree"`` (the scaler itself
    passed into and out of a jitted step, as training steps are written: jmp's pytree flattening then drops
    ``min_loss_scale``, which comes back as 1)."""

    def __init__(self, loss_scale: float, mode: str = "jit", **kwargs: Any) -> None:
        _, jnp, jmp = jmp_modules()
        if "min_loss_scale" in kwargs:
            kwargs["min_loss_scale"] = jnp.asarray(kwargs["min_loss_scale"], jnp.float32)
        if "counter" in kwargs:
            kwargs["counter"] = jnp.asarray(kwargs["counter"], jnp.int32)
        self.scaler = jmp.DynamicLossScale(jnp.asarray(loss_scale, jnp.float32), **kwargs)
        self.leaves = (self.scaler.loss_scale, self.scaler.counter)  # the scaler's state, in every mode
        self.mode = mode
        if mode == "jit":
            s = self.scaler
            fields = (jnp.asarray(s.period, jnp.int32), jnp.asarray(s.factor), s.min_loss_scale)
            self._leaf_step = functools.partial(_jmp_leaf_step(), period=fields[0], factor=fields[1], floor=fields[2])
        else:
            self._step = {"eager": _jmp_step, "pytree": _jmp_jitted_step()}[mode]

    def step(self, m: float) -> Step:
        _, jnp, _ = jmp_modules()
        used = float(self.leaves[0])
        grads = jnp.asarray([half(m, used)], jnp.float16)
        if self.mode == "jit":  # (building the dataclass on the host each step would cost milliseconds)
            *leaves, finite = self._leaf_step(*self.leaves, grads)
        else:
            self.scaler, finite = self._step(self.scaler, grads)
            leaves = [self.scaler.loss_scale, self.scaler.counter]
        self.leaves = (leaves[0], leaves[1])
        return used, not bool(finite), float(self.leaves[0])

    def saved(self) -> dict[str, Any]:
        """The scaler's pytree leaves, as a checkpoint of a JAX train state holds them (jax arrays)."""
        return {"loss_scale": self.leaves[0], "counter": self.leaves[1]}


def _jmp_step(loss_scale: Any, grads: Any) -> tuple[Any, Any]:
    _, _, jmp = jmp_modules()
    finite = jmp.all_finite(loss_scale.unscale(grads))
    return loss_scale.adjust(finite), finite


@functools.cache
def _jmp_jitted_step() -> Any:
    jax, _, _ = jmp_modules()
    return jax.jit(_jmp_step)


@functools.cache
def _jmp_leaf_step() -> Any:
    """One jitted step for every setting: the period, factor and floor are arguments (traced), so it compiles once."""
    jax, _, jmp = jmp_modules()

    def step(scale: Any, counter: Any, grads: Any, period: Any, factor: Any, floor: Any) -> tuple[Any, Any, Any]:
        adjusted, finite = _jmp_step(jmp.DynamicLossScale(scale, counter, period, factor, floor), grads)
        return adjusted.loss_scale, adjusted.counter, finite

    return jax.jit(step)


# ---------------------------------------------------------------------------------------------------------- Keras
@functools.cache
def keras_module() -> Any:
    """Keras 3 on its torch backend (on the CPU here). It reads its backend when first imported and writes a
    keras.json into $KERAS_HOME: both set for that import only, the file into a folder removed right after."""
    if "keras" not in sys.modules:
        with tempfile.TemporaryDirectory() as home:
            env = {"KERAS_BACKEND": "torch", "KERAS_HOME": home}
            with mock.patch.dict(os.environ, env):
                keras = pytest.importorskip(
                    "keras", reason="keras is not installed: pip install -e '.[peers]' (make test installs it)"
                )
    keras = sys.modules["keras"]
    assert keras.backend.backend() == "torch", keras.backend.backend()
    return keras


class KerasRun:
    """Keras' ``LossScaleOptimizer(SGD(), **kwargs)`` as ``Model.train_step`` drives it on the torch backend:
    ``scale_loss``, then ``apply(grads)``, which checks the gradients, applies them unscaled (the inner optimizer's
    ``iterations`` advances) or skips, and updates ``dynamic_scale`` and ``step_counter``."""

    def __init__(self, **kwargs: Any) -> None:
        keras = keras_module()
        self.ops = keras.ops
        self.var = keras.Variable(np.zeros((1,), np.float32))
        self.opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=1.0), **kwargs)
        self.opt.build([self.var])

    def _value(self, value: Any) -> Any:
        """A variable's value (its torch tensor: converting the variable to NumPy warns) or a tensor's, as a Python
        number."""
        return getattr(value, "value", value).item()

    def step(self, m: float) -> Step:
        used = self._value(self.opt.dynamic_scale)
        done = self._value(self.opt.inner_optimizer.iterations)
        scaled = self._value(self.opt.scale_loss(self.ops.convert_to_tensor(np.float32(1.0))))
        assert scaled == used, (scaled, used)
        grad = self.ops.convert_to_tensor(np.array([half(m, used)], np.float32))
        self.opt.apply([grad], [self.var])
        skipped = self._value(self.opt.inner_optimizer.iterations) == done
        return float(used), skipped, float(self._value(self.opt.dynamic_scale))

    def saved(self) -> dict[str, Any]:
        """The two variables ``LossScaleOptimizer`` adds to an optimizer's saved variables."""
        return {
            "dynamic_scale": self._value(self.opt.dynamic_scale),
            "step_counter": self._value(self.opt.step_counter),
        }


def drive(run: Any, trace: list[float]) -> tuple[list[Step], str | None]:
    """``run`` stepped through ``trace``: the steps, and the peer's message where it stopped training."""
    steps: list[Step] = []
    for m in trace:
        try:
            steps.append(run.step(m))
        except StoppedTraining as stop:
            return steps, str(stop)
    return steps, None


FLOAT32_TINY = torch.finfo(torch.float32).tiny
FLOAT32_MAX = torch.finfo(torch.float32).max


def in_float32(scale: float) -> bool:
    """Whether dls can hold ``scale``: a normal float32 (2**-126 to float32's max)."""
    return FLOAT32_TINY <= scale <= FLOAT32_MAX and not math.isnan(scale)


# ------------------------------------------------------------------------------------------- dls on the same steps
class DlsRule:
    """dls's rule for ``settings`` as ``GradScaler.update`` runs it (``dls.loss_scale.LossScale``: the rule with its
    host-side bounds, through the known-clean path where the host knows the flag, ``host_knows``), on the same
    gradients: ``step(m) -> (scale used, skipped, scale after)``."""

    def __init__(self, settings: Any, host_knows: bool = True) -> None:
        from dls.loss_scale import LossScale

        self.scale = LossScale(settings, torch.device("cpu"))
        self.host_knows = host_knows

    def step(self, m: float) -> Step:
        used = float(self.scale.state.loss_scale)
        overflow = not math.isfinite(half(m, used))
        self.scale.update(torch.tensor(float(overflow)), overflow if self.host_knows else None)
        return used, overflow, float(self.scale.state.loss_scale)


class DlsScaler:
    """A ``dls.GradScaler`` stepping a float16 parameter through its public API (``_peers.DlsRun``)."""

    def __init__(self, scaler: Any) -> None:
        from _peers import DlsRun

        self.run = DlsRun(scaler)

    def step(self, m: float) -> Step:
        used = self.run.scaler.get_scale()
        skipped, after = self.run.step(m)
        return used, skipped, after


def compare(peer: Any, ours: Any, trace: list[float], factor: float = 2.0) -> tuple[str, int]:
    """Step ``peer`` and ``ours`` through ``trace``; every step must be the same (scale used, skip decision, scale
    after) until the peer's scale leaves float32's normal range (``"top"``: dls dropped the growth; ``"bottom"``:
    dls stays at its floor, 2**-126) or the peer stops training (``"stopped"``: dls skipped that step at the scale
    it had), each asserted at the step where it happens; else ``"same"``. Returns the outcome and the number of
    steps that were the same."""
    for i, m in enumerate(trace):
        try:
            theirs = peer.step(m)
        except StoppedTraining:
            used, skipped, after = ours.step(m)
            assert skipped and after == used, (i, (used, skipped, after))
            return "stopped", i
        got = ours.step(m)
        if not in_float32(theirs[2]):
            assert got[:2] == theirs[:2], (i, theirs, got)
            if theirs[2] > FLOAT32_MAX:
                assert not got[1] and got[2] == got[0] and got[0] * factor > FLOAT32_MAX, (i, theirs, got)
                return "top", i
            assert got[2] == FLOAT32_TINY, (i, theirs, got)
            return "bottom", i
        assert got == theirs, (i, theirs, got, trace[max(0, i - 12) : i + 1])
    return "same", len(trace)
