"""cstorch's Adam and AdamW, the optimizers of Model Zoo's configs (:class:`CerebrasAdam`): here, below both the
config (whose validation steps the run's optimizer once) and the Model Zoo models that train with it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class CerebrasAdam(torch.optim.Optimizer):
    """cstorch's Adam and AdamW (``cerebras.pytorch.optim.AdamBase``, Release 2.10), the optimizers of Model Zoo's
    configs: ``exp_avg`` and ``exp_avg_sq`` as torch's Adam; the update ``exp_avg / (sqrt(exp_avg_sq) + eps)`` (eps
    added before the bias correction, unlike torch's), times ``sqrt(1 - beta2^t) / (1 - beta1^t)`` with
    ``correct_bias`` (the powers kept in float32, multiplied by beta each step, as cstorch keeps them; per group
    here, for the parameters step together); then decoupled weight decay (AdamW: ``+ weight_decay * p``) or none
    (Adam: its ``weight_decay`` is an L2 term added to the gradient, and it always corrects the bias); times ``lr``,
    subtracted. Each parameter's ``step`` is counted as torch's Adam counts it. Foreach operations per group."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        correct_bias: bool = True,
        decoupled_weight_decay: bool = True,
    ) -> None:
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, correct_bias=correct_bias,
            decoupled_weight_decay=decoupled_weight_decay,
        )  # fmt: skip
        super().__init__(params, defaults)

    @staticmethod
    def _power(value: float, beta: float) -> float:
        """``value * beta`` in float32, as cstorch multiplies its float32 power by beta."""
        return float(torch.tensor(value, dtype=torch.float32) * beta)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._step_group(group, params)
        return loss

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        for p in params:  # the state of a parameter's first step (not on the hot path afterwards)
            if not self.state[p]:
                zeros = torch.zeros_like(p, memory_format=torch.preserve_format)
                self.state[p].update(step=torch.tensor(0.0), exp_avg=zeros, exp_avg_sq=zeros.clone())
        states = [self.state[p] for p in params]
        grads: list[torch.Tensor] | tuple[torch.Tensor, ...] = [p.grad for p in params if p.grad is not None]
        if not group["decoupled_weight_decay"] and group["weight_decay"]:  # Adam: an L2 term
            grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
        exp_avg, exp_avg_sq = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        torch._foreach_mul_(exp_avg, beta1)
        torch._foreach_add_(exp_avg, grads, alpha=1.0 - beta1)
        torch._foreach_mul_(exp_avg_sq, beta2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1.0 - beta2)
        denom = torch._foreach_sqrt(exp_avg_sq)
        torch._foreach_add_(denom, group["eps"])
        update = torch._foreach_div(exp_avg, denom)
        if group["correct_bias"] or not group["decoupled_weight_decay"]:  # cstorch's Adam always corrects
            power1 = group.setdefault("beta1_power", float(torch.tensor(beta1, dtype=torch.float32)))
            power2 = group.setdefault("beta2_power", float(torch.tensor(beta2, dtype=torch.float32)))
            one = torch.tensor(1.0, dtype=torch.float32)
            size = torch.sqrt(one - power2) / (one - power1)  # float32, as cstorch's
            torch._foreach_mul_(update, float(size))
            group["beta1_power"], group["beta2_power"] = self._power(power1, beta1), self._power(power2, beta2)
        if group["decoupled_weight_decay"] and group["weight_decay"]:
            torch._foreach_add_(update, torch._foreach_mul(params, group["weight_decay"]))
        torch._foreach_mul_(update, group["lr"])
        torch._foreach_sub_(params, update)
        torch._foreach_add_([s["step"] for s in states], 1.0)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A state saved by this class, or by torch's Adam/AdamW (as cstorch loads one): a group without this class's
        keys takes the constructor's, and its bias-correction powers come from the parameters' step count ``t``:
        ``beta ** (t + 1)`` in float32, the powers of the next step."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            steps = [self.state[p]["step"] for p in group["params"] if "step" in self.state[p]]
            if steps and "beta1_power" not in group:
                count = float(steps[0])
                for i, beta in enumerate(group["betas"], 1):
                    group[f"beta{i}_power"] = float(torch.tensor(beta ** (count + 1), dtype=torch.float32))
