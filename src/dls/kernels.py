"""Fused passes over gradients: unscale + inf/NaN check, global norm, clipping.

Every function takes gradients already grouped by (device, dtype) (see ``GradIndex`` and ``group_grads``) and
issues one multi-tensor call per group: no Python loop over elements, and no read back to the host.
Flags are float32 0-dim tensors (1.0 = found inf/NaN) because that is what torch's AMP kernels and fused
optimizers consume; they are only ever raised, never cleared, so several passes can share one flag.

Sparse gradients take part through their (coalesced) values, complex ones through their real view
(``torch.view_as_real``: same storage, so in-place passes reach the gradient). Half gradients are multiplied through
torch's AMP kernel, in float32 arithmetic, then rounded back: ``_foreach_mul_`` would round the float32 factor to
the half dtype first.

Overflow means: some element of the gradient *as the optimizer will receive it* (unscaled, and clipped when the
scaler clips) is inf/NaN in the gradient's dtype. torch's AMP kernel checks its input, before multiplying; with a
factor above 1 (a loss scale below 1) a finite scaled gradient can become inf only after it, so the passes below
take ``factor_may_exceed_one`` from the caller and check the result too in that case.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

GroupKey = tuple[torch.device, torch.dtype]
Groups = dict[GroupKey, list[torch.Tensor]]


def group_grads(params: Iterable[torch.Tensor]) -> Groups:
    """Group the gradients of ``params`` (parameters without one are left out) by device and dtype.

    A sparse gradient is coalesced in place (``p.grad = p.grad.coalesce()``) and represented by its values, so
    norms count each index once and in-place passes reach the gradient itself. A complex gradient is represented
    by its real view. Raises ``ValueError`` for a gradient that is not floating point or complex.
    """
    groups: Groups = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if g.is_sparse:
            if not g.is_coalesced():
                p.grad = g = g.coalesce()
            g = g._values()
        g = _real(g)
        groups.setdefault((g.device, g.dtype), []).append(g)
    return groups


def _real(grad: torch.Tensor) -> torch.Tensor:
    if grad.is_complex():
        return torch.view_as_real(grad)
    if not grad.is_floating_point():
        raise ValueError(f"gradients must be floating point or complex; got a {grad.dtype} gradient")
    return grad


class GradIndex:
    """Parameters grouped by (device, dtype) once, so each step only collects their current gradients.

    A gradient always has its parameter's dtype and device (torch refuses any other), so the grouping holds
    across steps. Sparse gradients, and parameters converted after the index was built (``model.half()``),
    take the general path of ``group_grads``.
    """

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.params = list(params)
        self._by_key: dict[GroupKey, list[torch.Tensor]] = {}
        for p in self.params:
            self._by_key.setdefault((p.device, p.dtype), []).append(p)

    def groups(self) -> Groups:
        groups: Groups = {}
        for key, params in self._by_key.items():
            grads = []
            for p in params:  # one read of .grad each (a comprehension filtering on it reads it twice)
                g = p.grad
                if g is not None:
                    grads.append(g)
            if not grads:
                continue
            g = grads[0]
            if (g.device, g.dtype) != key or not g.is_floating_point() or any(g.is_sparse for g in grads):
                return group_grads(self.params)  # converted, complex or sparse: the general path
            groups[key] = grads
        return groups


def per_device(value: torch.Tensor, devices: Iterable[torch.device]) -> dict[torch.device, torch.Tensor]:
    """``value`` copied to each device (one copy per device, not per group)."""
    # A loop, not a comprehension: on Python < 3.12 a comprehension is a frame of its own, which Dynamo, entering
    # it after a graph break in the caller (torch's Optimizer.step), cannot trace (a graph break inside dls).
    copies: dict[torch.device, torch.Tensor] = {}
    for d in devices:
        if d not in copies:
            copies[d] = value if value.device == d else value.to(d, non_blocking=True)
    return copies


def zero_flags(devices: Iterable[torch.device]) -> dict[torch.device, torch.Tensor]:
    """A clean overflow flag on each device."""
    flags: dict[torch.device, torch.Tensor] = {}
    for d in devices:  # a loop, not a comprehension: see per_device
        if d not in flags:
            flags[d] = torch.zeros((), dtype=torch.float32, device=d)
    return flags


def max_flag(flags: Iterable[torch.Tensor | None]) -> torch.Tensor:
    """One flag raised where any of ``flags`` (same device; ``None`` left out) is."""
    present = [f for f in flags if f is not None]
    return present[0] if len(present) == 1 else torch.stack(present).amax()


def gather_flags(found: dict[torch.device, torch.Tensor], home: torch.device) -> torch.Tensor:
    """The per-device flags of a pass as one flag on ``home``."""
    flags = [f.to(home, non_blocking=True) for f in found.values()]
    return max_flag(flags) if flags else torch.zeros((), dtype=torch.float32, device=home)


def mul_and_check_(
    groups: Groups,
    factor: dict[torch.device, torch.Tensor],
    found_inf: dict[torch.device, torch.Tensor],
    factor_may_exceed_one: bool,
) -> None:
    """``g *= factor[device]`` in float32 arithmetic, raising ``found_inf[device]`` if any element is inf/NaN
    before or after the multiply: one read+write pass, plus a check pass over the result when
    ``factor_may_exceed_one`` (only then can a finite gradient overflow).

    torch's AMP kernel is used for every dtype: ``_foreach_mul_`` would round a float32 factor to the
    gradient's half dtype first (2**-26 becomes 0 in float16), which silently zeroes unscaled gradients.
    """
    for (device, _dtype), grads in groups.items():
        try:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf[device], factor[device])
        except (RuntimeError, NotImplementedError):
            # Builds whose kernel lacks this dtype (bf16 on older CUDA): check, then multiply in float32.
            check_nonfinite(grads, found_inf[device])
            products = torch._foreach_mul([g.float() for g in grads], factor[device])
            torch._foreach_copy_(grads, products)
        if factor_may_exceed_one:
            check_nonfinite(grads, found_inf[device])


def mul_(
    groups: Groups,
    factor: dict[torch.device, torch.Tensor],
    found_inf: dict[torch.device, torch.Tensor] | None = None,
) -> None:
    """One read+write pass: ``g *= factor[device]``, in float32 arithmetic for half gradients; with ``found_inf``,
    then a check pass raising it where a product overflowed.

    float32/float64 gradients take ``_foreach_mul_`` (the bandwidth floor); half ones the AMP kernel, because
    ``_foreach_mul_`` would round the factor to the half dtype first (see ``mul_and_check_``).
    """
    for (device, dtype), grads in groups.items():
        if dtype in (torch.float32, torch.float64):
            torch._foreach_mul_(grads, factor[device])
        else:
            unused = {device: torch.zeros((), device=device)}
            mul_and_check_({(device, dtype): grads}, factor, unused, factor_may_exceed_one=False)
        if found_inf is not None:
            check_nonfinite(grads, found_inf[device])


def mul_and_raise(groups: Groups, factor: torch.Tensor, found_inf: torch.Tensor, check: bool) -> torch.Tensor:
    """``mul_`` by ``factor`` (0-dim, on ``found_inf``'s device); with ``check``, returns ``found_inf`` raised where a
    product overflowed, else ``found_inf`` itself."""
    devices = {d for d, _ in groups}
    flags = {d: found_inf.to(d) for d in devices} if check else None
    mul_(groups, per_device(factor, devices), flags)
    return found_inf if flags is None else max_flag([found_inf, *(f.to(found_inf.device) for f in flags.values())])


_AMP_KERNEL_LACKS: set[tuple[str, torch.dtype]] = set()  # (device type, dtype) the AMP kernel was not built for


def check_nonfinite(grads: Sequence[torch.Tensor], found_inf: torch.Tensor) -> None:
    """Raise ``found_inf`` if any element of ``grads`` (same device and dtype) is inf or NaN.

    torch's AMP kernel with a factor of 1 where it takes the dtype (it writes every value back unchanged: ``x * 1``
    is exact), as torch.amp checks for fused optimizers. On an H200 (2026-11-28, ``benchmarks/profile_gpu.py``) it
    took 9 us of host time against 181 us for the per-tensor max-abs norms over 10 tensors, 0.16 ms against 3.7 ms
    over 1,000, and less device time too (253 us against 508 us, 100M float32 elements in 100 tensors); on CPU it
    is 12-19x faster than the norms (benchmarks/RESULTS.md). Where the kernel lacks the dtype (bfloat16 on CUDA),
    one read pass of max-abs norms: inf for an inf element, NaN for a NaN element, finite otherwise.
    """
    if not grads:
        return
    grads = list(grads)
    key = (grads[0].device.type, grads[0].dtype)
    if key not in _AMP_KERNEL_LACKS:
        one = torch.ones((), dtype=torch.float32, device=grads[0].device)
        try:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, one)
            return
        except (RuntimeError, NotImplementedError) as error:
            if "implemented" not in str(error):  # "not implemented for", "not currently implemented for the MPS device"
                raise
            _AMP_KERNEL_LACKS.add(key)
    amax = torch.stack(torch._foreach_norm(grads, float("inf"), dtype=torch.float32))
    torch.maximum(found_inf, (~torch.isfinite(amax)).any().to(found_inf.dtype), out=found_inf)


def check_unscaled_(
    groups: Groups,
    factor: dict[torch.device, torch.Tensor] | None,
    found_inf: dict[torch.device, torch.Tensor],
    factor_may_exceed_one: bool,
) -> None:
    """Raise ``found_inf[device]`` where some ``g * factor[device]`` would be inf/NaN once rounded to ``g``'s dtype
    (what an unscale would write), leaving every value as it was: for optimizers that unscale inside their own kernel.

    One read pass: the largest ``|g|`` of each tensor (NaN if it holds a NaN) times the factor, rounded as the
    unscale would, is non-finite exactly when some element's product is (a float multiply is monotonic). When the
    factor cannot exceed 1 (the scale is at least 1: nearly always), ``check_nonfinite``, the faster check, which
    needs no factor (``None`` then: the caller computes no inverse scale).
    """
    for (device, dtype), all_grads in groups.items():
        grads = [g for g in all_grads if g.numel()]
        if not grads:
            continue
        if not factor_may_exceed_one:
            check_nonfinite(grads, found_inf[device])
            continue
        assert factor is not None, "a factor that may exceed 1 must be given"
        if device.type == "cpu":
            amax = torch.stack(torch._foreach_max(torch._foreach_abs(grads)))  # _foreach_norm(inf) is slow on CPU
        else:
            amax = torch.stack(torch._foreach_norm(grads, float("inf")))
        compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        unscaled = (amax.to(compute) * factor[device]).to(dtype)
        flag = found_inf[device]
        torch.maximum(flag, (~torch.isfinite(unscaled)).any().to(flag.dtype), out=flag)


def global_norm(groups: Groups, factor: dict[torch.device, torch.Tensor] | None, device: torch.device) -> torch.Tensor:
    """One read pass: the L2 norm (float32, on ``device``) of all gradients, each multiplied by
    ``factor[its device]`` (``None``: by nothing).

    ``norm(c * g) = c * norm(g)``, so the norm of still-scaled gradients times ``1/scale`` is the norm of the
    unscaled ones, without an unscale pass before it. Per-tensor norms are computed in float32 (half norms
    would overflow at 65504 while the true norm is finite). An inf/NaN element makes the norm inf/NaN. One group
    (nearly always) takes three operators, with no stack of a single norm.
    """
    norms = []
    for (dev, _dtype), grads in groups.items():
        tensor_norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
        group_norm = torch.linalg.vector_norm(torch.stack(tensor_norms))
        if factor is not None:
            group_norm = group_norm * factor[dev]
        norms.append(group_norm.to(device, non_blocking=True))
    if not norms:
        return torch.zeros((), dtype=torch.float32, device=device)
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (total_norm + 1e-6))`` in three operators, rounded as cstorch.amp's
    ``clip_gradients_and_return_isfinite`` rounds it (``float32(max_norm) / (global_norm + 1e-6)``: one division).
    torch's ``clip_grad_norm_`` computes ``max_norm / tensor`` as a reciprocal and a multiply, which rounds twice:
    about a quarter of coefficients differ from it by one ulp at some ``max_norm`` (0.3, 5.0; none at 1.0 or 0.5),
    within the rtol 1e-6 the clip tests hold dls to."""
    return torch.div(max_norm, total_norm + 1e-6).clamp_(max=1.0)
