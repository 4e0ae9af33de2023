"""The names that moved or were renamed (``dls.deprecated``): each old name still works for one release, does what
the new one does, and says with a ``DeprecationWarning`` what to call instead."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

import dls
import dls.fp8
from dls.fp8 import CurrentScaling, gemm


def _linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4)


def test_dls_fp8_emulate_is_emulate_recipe_with_a_warning() -> None:
    x = torch.randn(3, 8)
    new, old = _linear(), _linear()
    with dls.fp8.emulate_recipe(new, CurrentScaling()):
        expected = new(x)
    with pytest.warns(DeprecationWarning, match=r"dls\.fp8\.emulate is dls\.fp8\.emulate_recipe now"):
        handle = dls.fp8.emulate(old, CurrentScaling())
    with handle:
        assert isinstance(handle, dls.fp8.Fp8Handle)
        assert torch.equal(old(x), expected)
    assert torch.equal(old(x), torch.nn.functional.linear(x, old.weight, old.bias))  # removed: float32 again


def test_the_module_dls_fp8_emulate_is_dls_fp8_gemm_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match=r"dls\.fp8\.emulate is dls\.fp8\.gemm now: import Fp8Handle"):
        from dls.fp8.emulate import Fp8Handle
    assert Fp8Handle is gemm.Fp8Handle
    with pytest.warns(DeprecationWarning, match="emulate_recipe"):
        assert importlib.import_module("dls.fp8.emulate").emulate_recipe is gemm.emulate_recipe


def test_the_module_dls_emulate_is_dls_emulation_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match=r"dls\.emulate is dls\.emulation now: import EmulationHandle"):
        from dls.emulate import EmulationHandle
    assert EmulationHandle is importlib.import_module("dls.emulation").EmulationHandle
    assert callable(dls.emulate)  # the function keeps its name


def test_from_megatron_is_like_megatron_and_not_deprecated() -> None:
    arguments = {"initial_scale": 2.0**16, "min_scale": 1.0, "hysteresis": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # from_megatron stays, beside from_deepspeed
        old = dls.GradScaler.from_megatron("cpu", **arguments)
    assert old.settings == dls.GradScaler.like("megatron", "cpu", **arguments).settings
    with pytest.raises(ValueError, match=r"^hysteresis must"):
        dls.GradScaler.from_megatron("cpu", **{**arguments, "hysteresis": 0})


def test_max_gradient_norm_is_the_settings_with_a_warning() -> None:
    scaler = dls.GradScaler("dynamic", max_gradient_norm=2.5)
    with pytest.warns(DeprecationWarning, match=r"GradScaler\.max_gradient_norm is GradScaler\.settings\.max_gradient"):
        assert scaler.max_gradient_norm == scaler.settings.max_gradient_norm == 2.5


def test_the_warnings_point_at_the_callers_line() -> None:
    with pytest.warns(DeprecationWarning) as caught:
        assert dls.GradScaler("dynamic").max_gradient_norm is None
        dls.fp8.emulate(_linear(), CurrentScaling()).remove()
    assert [w.filename for w in caught] == [__file__, __file__]


def test_the_validators_that_left_dls_policy_are_dls_checks_with_a_warning() -> None:
    import dls.checks
    import dls.policy

    with pytest.warns(DeprecationWarning, match=r"dls\.policy\.count_problem is dls\.checks\.count_problem now"):
        assert dls.policy.count_problem is dls.checks.count_problem
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        dls.policy.not_a_name  # noqa: B018
