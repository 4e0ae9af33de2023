"""A step that does not fit, refused (``dls.master_weights``): what an optimizer step may change, kept so that the
step can be put back exactly, and the check that decides.

A finite step can take a float32 master where its parameter's format cannot follow (a float16 weight at 65000
moved to 65992 is inf in float16; a bfloat16 one beyond 3.39e38; a master beyond float32's range; beyond ``fmt``'s).
How such a step is put back:

* before the inner step, ``keep_state`` copies what it may change (the groups' tensors and their state) into kept
  buffers (``KeptCopies``: one ``_foreach_copy_``, the buffers reused while the tensors are the same), and each state
  entry as it was (``StateBefore``: tensors by reference, Python values copied);
* after it, the masters are written back and ``FitCheck.nonfinite_params`` runs the gradients' own check over the
  written parameters (``dls.kernels.check_nonfinite``: torch's fused AMP check, one pass per device and dtype);
* where the flag may be read (the default path while some master is within a factor 2 of its limit,
  ``FitCheck.near_limit``, which the scaler reads with the gradients' flag), it is, and only a refused step is put
  back (``StateBefore.put_back``); elsewhere (the default path far from every limit, where only a step moving a
  weight by half its format's range at once is refused, and the fused and sync-free paths), nothing is read: the kept
  values are selected on the device (``KeptCopies.select``: ``live * (1 - refused) + kept * refused`` on the
  tensors' bits as integers: exact, NaN and -0.0 included, and nothing overflows), unless the step made or replaced
  state (a parameter's first step) or changed a Python value of it, which only the host can put back (one read);
* ``FitCheck.first_unfit`` names the first master that does not fit, from each master's largest |value| (rounding
  is monotonic: a master fits exactly when its largest value does).

The price is memory and traffic: one more copy of the masters, the parameters passing through and the optimizer's
state, written each step (``benchmarks/bench_master_weights.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any

import torch

from dls import device_step, formats, kernels


def keep_state(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor], copies: KeptCopies | None
) -> tuple[StateBefore, KeptCopies]:
    """What a step of ``optimizer`` over ``params`` may change, kept: ``params`` and the tensors of their state
    copied into ``copies`` (new buffers when the tensors are not the ones ``copies`` was made for), and each state
    entry as it was."""
    state = optimizer.state
    entries = [(p, state.get(p)) for p in params]
    kept = [
        (p, None if entry is None else {k: v if isinstance(v, torch.Tensor) else _copied(v) for k, v in entry.items()})
        for p, entry in entries
    ]
    live = params + [v for _, entry in kept if entry for v in entry.values() if isinstance(v, torch.Tensor)]
    ids = tuple(map(id, live))
    if copies is None or copies.ids != ids:
        copies = KeptCopies.of(live, ids)
    with torch.no_grad():
        torch._foreach_copy_(copies.saved, live)
    return StateBefore(kept, [entry for _, entry in entries]), copies


def _bits(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s bits as integers (``dls.device_step.integer_bits``: a view), or ``None`` where there is none (sparse,
    quantized)."""
    if t.layout != torch.strided or t.is_quantized:
        return None
    return device_step.integer_bits(t)


def _copied(value: Any) -> Any:
    """A state value that is not a tensor, as it was: Python numbers as they are, anything else deep-copied (LBFGS
    keeps lists of tensors it changes in place)."""
    return value if isinstance(value, (numbers.Number, str, type(None))) else copy.deepcopy(value)


@dataclasses.dataclass(eq=False)
class KeptCopies:
    """Kept buffers for the tensors a step may change (``live``), reused while they are the same tensors; and both
    as integer bits grouped by device and width, so that ``select`` puts the old values back on the device exactly:
    ``live = live * (1 - refused) + saved * refused`` on integers never overflows and keeps NaN and -0.0."""

    ids: tuple[int, ...]
    live: list[torch.Tensor]
    saved: list[torch.Tensor]
    groups: list[tuple[torch.device, torch.dtype, list[torch.Tensor], list[torch.Tensor]]] | None
    exact: bool = True  # every tensor has a bits view

    @classmethod
    def of(cls, live: list[torch.Tensor], ids: tuple[int, ...]) -> KeptCopies:
        """New buffers for ``live`` (whose ids are ``ids``)."""
        return cls(ids, live, [torch.empty_like(t) for t in live], None)

    def select(self, refused: torch.Tensor) -> None:
        """Where ``refused``, the live tensors take their kept values back (on the device, no read)."""
        if self.groups is None:  # the bits views, made once: only the fused and sync-free paths select
            groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
            exact = True
            for t, c in zip(self.live, self.saved):
                bits, kept = _bits(t.detach()), _bits(c)
                if bits is None or kept is None:
                    exact = False
                    break
                pair = groups.setdefault((t.device, bits.dtype), ([], []))
                pair[0].append(bits)
                pair[1].append(kept)
            self.groups = [(d, dt, a, b) for (d, dt), (a, b) in groups.items()] if exact else []
            self.exact = exact
        if not self.exact:  # a tensor without a bits view: decide on the host
            if bool(refused):
                torch._foreach_copy_(self.live, self.saved)
            return
        for device, dtype, live, saved in self.groups:
            take = refused.to(device=device, dtype=dtype)
            torch._foreach_mul_(live, 1 - take)
            torch._foreach_mul_(saved, take)
            torch._foreach_add_(live, saved)


@dataclasses.dataclass(eq=False)
class StateBefore:
    """Each parameter's state entry before a step: ``kept`` (a copy of the dict, tensors by reference, Python values
    copied) and ``live_entries`` (the entry dicts themselves, or ``None`` where there was none)."""

    kept: list[tuple[torch.Tensor, dict[str, Any] | None]]
    live_entries: list[dict[str, Any] | None]

    def put_back(self, state: Any, copies: KeptCopies) -> None:
        """The state as it was (after a read found the step refused): the kept tensors copied back, each entry as
        it was, entries the step made removed."""
        with torch.no_grad():
            torch._foreach_copy_(copies.live, copies.saved)
        for (p, entry), _ in zip(self.kept, self.live_entries):
            if entry is None:
                state.pop(p, None)
            else:
                state[p] = entry

    def changed_on_host(self, state: Any) -> bool:
        """Whether the step changed what the device cannot put back: an entry made or replaced, a key added or
        removed, a tensor replaced, a Python value changed."""
        for (p, entry), live in zip(self.kept, self.live_entries):
            now = state.get(p)
            if entry is None or now is None or live is None:
                if entry is not None or now:
                    return True
                continue
            if now is not live or now.keys() != entry.keys():
                return True
            for key, value in entry.items():
                new = now[key]
                if isinstance(value, torch.Tensor):
                    if new is not value:
                        return True
                elif new is not value and not (isinstance(value, numbers.Number) and new == value):
                    return True
        return False


def _rounding_to(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    def round_to(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype)

    return round_to


@dataclasses.dataclass(eq=False)
class FitCheck:
    """The parameters a step checks, grouped by device and dtype for the check, and ordered by what they hold
    (float16, bfloat16, ``fmt``) for naming the first that does not fit; built once per change of the pairs."""

    pairs: int
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]
    order: list[Any]
    kinds: list[tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]]  # (start, stop, rounding) per kind

    @classmethod
    def of(cls, pairs: list[Any], fmt: formats.FloatFormat | None) -> FitCheck:
        """The check of ``pairs`` (``dls.master_weights``' parameter and master pairs: ``param``, ``master``,
        ``on_grid``), ``fmt`` the format of those on a grid."""
        order: list[Any] = []
        kinds = []
        rounding: dict[Any, Callable[[torch.Tensor], torch.Tensor]] = {}
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for pr in pairs:
            if pr.master.numel() == 0:
                continue
            groups.setdefault((pr.param.device, pr.param.dtype), []).append(pr.param.detach())
            key: Any = "fmt" if pr.on_grid else pr.param.dtype
            if key not in rounding:
                if pr.on_grid:
                    assert fmt is not None
                    rounding[key] = fmt.quantize
                else:
                    rounding[key] = _rounding_to(pr.param.dtype)
        for key, round_to in rounding.items():
            start = len(order)
            order += [pr for pr in pairs if pr.master.numel() and ("fmt" if pr.on_grid else pr.param.dtype) == key]
            kinds.append((start, len(order), round_to))
        return cls(len(pairs), groups, order, kinds)

    def nonfinite_params(self) -> torch.Tensor | None:
        """Whether some parameter, as written back, holds inf or NaN: a 0-dim bool on the first parameter's
        device, from ``dls.kernels.check_nonfinite`` (one fused pass per device and dtype); ``None`` without any."""
        if not self.groups:
            return None
        flags = kernels.zero_flags(d for d, _ in self.groups)
        for (device, _), params in self.groups.items():
            kernels.check_nonfinite(params, flags[device])
        return kernels.gather_flags(flags, self.order[0].master.device) > 0

    def near_limit(self) -> torch.Tensor | None:
        """Whether some master is within a factor 2 of what its parameter can hold (twice its largest |value| does
        not fit; NaN too), a 0-dim bool on the first master's device; ``None`` without any master. Only a step that
        moves a weight by half its format's range at once can take a master that is not near its limit past it."""
        if not self.order:
            return None
        largest = self._largest()
        return ~torch.cat([torch.isfinite(round_to(2 * largest[a:b])) for a, b, round_to in self.kinds]).all()

    def _largest(self) -> torch.Tensor:
        """Each master's largest |value| (``_foreach_norm``; NaN propagates), in ``order``, on the first's device."""
        masters = [pr.master.detach() for pr in self.order]
        home = masters[0].device
        norms = torch._foreach_norm(masters, math.inf)
        return torch.stack(norms if all(m.device == home for m in masters) else [n.to(home) for n in norms])

    def first_unfit(self, *, refused: torch.Tensor | None = None, read: bool = False) -> Any:
        """The first master (in ``order``) that does not fit its parameter, from each master's largest |value|
        (``_foreach_norm``; rounding is monotonic, so a master fits exactly when its largest value does, and NaN
        propagates): ``[refused, position, largest]`` as a float32 device tensor, or with ``read`` as
        ``(position, largest)`` on the host (after a read that found the step refused)."""
        largest = self._largest()
        fits = torch.cat([torch.isfinite(round_to(largest[a:b])) for a, b, round_to in self.kinds])
        first = torch.argmax((~fits).to(torch.uint8))
        if read:
            position, value = torch.stack([first.float(), largest[first].float()]).tolist()
            return int(position), value
        assert refused is not None
        return torch.stack([refused.float(), first.float(), largest[first].float()])


def refusal_warning(
    checks: FitCheck, param_groups: list[dict[str, Any]], fmt: Any, position: int, largest: float
) -> str:
    """The warning of a refused step: the master at ``position`` of ``checks.order`` (found in ``param_groups``)
    would reach ``largest`` in |value|, which its parameter (its dtype, or ``fmt`` on a grid) cannot hold."""
    pair = checks.order[position] if position < len(checks.order) else None
    where, kind = "a parameter", "its format"
    if pair is not None:
        for g, group in enumerate(param_groups):
            for i, p in enumerate(group["params"]):
                if p is pair.master:
                    where = f"param_groups[{g}]['params'][{i}] (shape {tuple(pair.param.shape)})"
        kind = fmt.name if pair.on_grid and fmt else str(pair.param.dtype).removeprefix("torch.")
    kept = "Parameters, masters and optimizer state are as before the step, and a scaler counts it as skipped"
    if math.isnan(largest):  # not a weight beyond a range: a NaN learning rate or state, unchecked gradients
        what, advice = "would be NaN", "look at the learning rate, the optimizer's state and the gradients"
    elif math.isinf(largest):
        what = "would be inf in float32 already"
        advice = "no format holds it: make the updates smaller (learning rate, weight decay)"
    else:
        what, advice = (
            f"would reach |value| {largest:.6g}, which {kind} cannot hold (written back, the parameter would be inf)",
            f"a weight beyond {kind}'s range cannot live in {kind}: keep the module holding it in float32 "
            "(dls.keep_in_float32), or make the updates smaller (learning rate, weight decay)",
        )
    return f"dls.master_weights: a step was not applied: the float32 master of {where} {what}. {kept}. {advice}"
