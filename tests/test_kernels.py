"""The pure passes of ``dls.kernels`` on their own: unscale + check, check without writing, global norm, clipping."""

from __future__ import annotations

import math

import pytest
import torch

from dls import kernels

CPU = torch.device("cpu")


def _flag() -> dict[torch.device, torch.Tensor]:
    return {CPU: torch.zeros(())}


def _factor(value: float) -> dict[torch.device, torch.Tensor]:
    return {CPU: torch.tensor(value)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mul_and_check_unscales_in_float32_and_raises_the_flag(dtype: torch.dtype) -> None:
    grads = [torch.full((3,), 4.0, dtype=dtype), torch.full((2, 2), 8.0, dtype=dtype)]
    flag = _flag()
    kernels.mul_and_check_(kernels.group_grads(_params(grads)), _factor(0.25), flag, factor_may_exceed_one=False)
    assert flag[CPU].item() == 0 and grads[0].tolist() == [1.0] * 3 and grads[1].eq(2.0).all()
    grads[0][1] = math.inf
    kernels.mul_and_check_(kernels.group_grads(_params(grads)), _factor(1.0), flag, factor_may_exceed_one=False)
    assert flag[CPU].item() == 1


def test_a_factor_above_one_is_checked_after_the_multiply() -> None:
    grads = [torch.tensor([60000.0], dtype=torch.float16)]  # finite, but beyond float16 once doubled
    for may_exceed, expected in ((False, 0), (True, 1)):
        g = [grads[0].clone()]
        flag = _flag()
        kernels.mul_and_check_(kernels.group_grads(_params(g)), _factor(2.0), flag, factor_may_exceed_one=may_exceed)
        assert flag[CPU].item() == expected


def test_check_unscaled_writes_nothing_and_rounds_as_an_unscale_would() -> None:
    g = torch.tensor([40000.0, 1.0], dtype=torch.float16)
    before = g.clone()
    flag = _flag()
    kernels.check_unscaled_(kernels.group_grads(_params([g])), _factor(2.0), flag, factor_may_exceed_one=True)
    assert flag[CPU].item() == 1 and torch.equal(g, before)
    flag = _flag()
    kernels.check_unscaled_(kernels.group_grads(_params([g])), _factor(0.5), flag, factor_may_exceed_one=False)
    assert flag[CPU].item() == 0


def test_global_norm_of_scaled_gradients_times_the_inverse_scale() -> None:
    grads = [torch.tensor([3.0 * 8]), torch.tensor([4.0 * 8], dtype=torch.float16)]
    norm = kernels.global_norm(kernels.group_grads(_params(grads)), _factor(1 / 8), CPU)
    assert norm.item() == pytest.approx(5.0)
    grads[1][0] = math.nan
    assert math.isnan(kernels.global_norm(kernels.group_grads(_params(grads)), _factor(1 / 8), CPU).item())


def test_clip_coefficient_is_torchs() -> None:
    assert kernels.clip_coefficient(torch.tensor(10.0), 1.0).item() == pytest.approx(1 / (10 + 1e-6))
    assert kernels.clip_coefficient(torch.tensor(0.5), 1.0).item() == 1.0


def test_sparse_and_complex_gradients_take_part_through_values_and_real_views() -> None:
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 0]]), torch.tensor([2.0, 2.0]), (3,))  # uncoalesced
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = sparse
    c = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    c.grad = torch.tensor([2 + 2j, 0j], dtype=torch.complex64)
    groups = kernels.group_grads([p, c])
    kernels.mul_and_check_(groups, _factor(0.5), _flag(), factor_may_exceed_one=False)
    assert p.grad.is_coalesced() and p.grad.to_dense().tolist() == [2.0, 0.0, 0.0]
    assert c.grad.tolist() == [1 + 1j, 0j]  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="floating point or complex"):
        q = torch.zeros(1, dtype=torch.int64)
        q.grad = torch.zeros(1, dtype=torch.int64)
        kernels.group_grads([q])


def test_grad_index_follows_new_gradients_and_converted_parameters() -> None:
    ps = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]
    index = kernels.GradIndex(ps)
    assert index.groups() == {}
    ps[1].grad = torch.ones(2)
    assert list(index.groups()) == [(CPU, torch.float32)] and index.groups()[(CPU, torch.float32)][0] is ps[1].grad
    ps[0].data = ps[0].data.double()
    ps[0].grad = torch.ones(2, dtype=torch.float64)
    assert set(index.groups()) == {(CPU, torch.float32), (CPU, torch.float64)}


def _params(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    out = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g
        out.append(p)
    return out


def test_check_nonfinite_falls_back_to_norms_where_the_amp_kernel_lacks_the_dtype(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CUDA builds have no bfloat16 AMP kernel ("not implemented for 'BFloat16'"): the check then takes the max-abs
    norms, remembers the refusal, and still finds inf and NaN; any other error is not swallowed."""
    calls = []

    def refuse(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
        calls.append(len(grads))
        raise NotImplementedError("\"_amp_foreach_non_finite_check_and_unscale_cuda\" not implemented for 'BFloat16'")

    monkeypatch.setattr(kernels, "_AMP_KERNEL_LACKS", set())
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", refuse)
    for bad, expected in ((1.0, 0.0), (math.inf, 1.0), (math.nan, 1.0)):
        grads = [torch.ones(3, dtype=torch.bfloat16), torch.tensor([2.0, bad], dtype=torch.bfloat16)]
        found = torch.zeros(())
        kernels.check_nonfinite(grads, found)
        assert found.item() == expected
    assert calls == [2]  # asked once, then remembered
    assert {("cpu", torch.bfloat16)} == kernels._AMP_KERNEL_LACKS

    def broken(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
        raise RuntimeError("Expected all tensors to be on the same device")

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", broken)
    with pytest.raises(RuntimeError, match="same device"):
        kernels.check_nonfinite([torch.ones(2)], torch.zeros(()))
