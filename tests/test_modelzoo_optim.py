"""Model Zoo's optimizers in dls: cstorch's Adam and AdamW (``correct_bias`` included) against a transcription of
cerebras-pytorch 2.10.0's ``AdamBase.step``, bit for bit; their checkpoints; the real Llama 3.1 8B config (``Adam`` with
``correct_bias``) and a Cerebras-GPT config (``AdamW``) building them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dls.train.config import load_config
from dls.train.modelzoo import CerebrasAdam

ZOO = Path(__file__).resolve().parent / "data" / "modelzoo"


class ReferenceAdamBase:
    """cerebras.pytorch.optim.AdamBase.step (Release 2.10.0), one parameter at a time, as its source does it: the
    powers ``beta1_power``/``beta2_power`` float32 tensors started at beta and multiplied by it after each step."""

    def __init__(self, params, lr, betas, eps, weight_decay, l2_regularization_rate, correct_bias):
        self.params, self.lr, self.betas, self.eps = params, lr, betas, eps
        self.weight_decay, self.l2, self.correct_bias = weight_decay, l2_regularization_rate, correct_bias
        self.state = [
            {
                "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p),
                "beta1_power": torch.tensor(betas[0]), "beta2_power": torch.tensor(betas[1]),
            }
            for p in params
        ]  # fmt: skip

    @torch.no_grad()
    def step(self) -> None:
        for p, state in zip(self.params, self.state):
            grad = p.grad
            if self.l2 > 0.0:
                grad = grad.add(p, alpha=self.l2)
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            beta1, beta2 = self.betas
            exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
            denom = exp_avg_sq.sqrt().add_(self.eps)
            update = exp_avg / denom
            if self.correct_bias:
                one = torch.tensor(1.0, dtype=torch.float32)
                bias_correction1 = one - state["beta1_power"]
                bias_correction2 = one - state["beta2_power"]
                step_size = torch.sqrt(bias_correction2) / bias_correction1
                update *= step_size
                state["beta1_power"] *= beta1
                state["beta2_power"] *= beta2
            update.add_(p * self.weight_decay)
            update *= self.lr
            p.sub_(update)


def params_and_grads(steps: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(7, 5, generator=gen), torch.randn(11, generator=gen), torch.randn((), generator=gen)]
    grads = [[torch.randn(p.shape, generator=gen) * 10.0 ** float(i % 5 - 3) for p in params] for i in range(steps)]
    return params, grads


@pytest.mark.parametrize(
    ("kind", "weight_decay", "correct_bias"),
    [("AdamW", 0.1, True), ("AdamW", 0.1, False), ("AdamW", 0.0, False), ("Adam", 0.01, True), ("Adam", 0.0, True)],
)
def test_cstorchs_adam_and_adamw_bit_for_bit(kind: str, weight_decay: float, correct_bias: bool) -> None:
    start, grads = params_and_grads(30)
    ours = [p.clone() for p in start]
    theirs = [p.clone() for p in start]
    decoupled = kind == "AdamW"
    betas, eps, lr = (0.9, 0.95), 1e-3, 0.01  # a large eps: where it is added shows
    optimizer = CerebrasAdam(ours, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             correct_bias=correct_bias, decoupled_weight_decay=decoupled)  # fmt: skip
    reference = ReferenceAdamBase(
        theirs, lr, betas, eps, weight_decay if decoupled else 0.0, 0.0 if decoupled else weight_decay,
        correct_bias or not decoupled,  # cstorch's Adam always corrects
    )  # fmt: skip
    for step_grads in grads:
        for p, q, g in zip(ours, theirs, step_grads):
            p.grad, q.grad = g.clone(), g.clone()
        optimizer.step()
        reference.step()
        for p, q in zip(ours, theirs):
            assert torch.equal(p, q)
    assert all(float(s["step"]) == 30 for s in optimizer.state.values())
    if correct_bias and decoupled:  # and it is not torch's AdamW, which adds eps after the correction
        torch_params = [p.clone() for p in start]
        torch_adamw = torch.optim.AdamW(torch_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        for step_grads in grads:
            for p, g in zip(torch_params, step_grads):
                p.grad = g.clone()
            torch_adamw.step()
        assert not torch.allclose(torch_params[0], ours[0], rtol=1e-4, atol=0)


def test_a_checkpoint_continues_bit_for_bit_and_a_torch_state_loads() -> None:
    start, grads = params_and_grads(12)
    straight = [p.clone() for p in start]
    opt = CerebrasAdam(straight, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
    split = [p.clone() for p in start]
    first = CerebrasAdam(split, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
    for i, step_grads in enumerate(grads):
        if i == 6:  # a new optimizer from the state dict, as a resumed run builds it
            state = first.state_dict()
            first = CerebrasAdam(split, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
            first.load_state_dict(state)
        for p, q, g in zip(straight, split, step_grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        first.step()
    assert all(torch.equal(p, q) for p, q in zip(straight, split))
    # torch's AdamW state (a run before dls took cstorch's optimizer): the powers from its step count, as cstorch
    torch_params = [p.clone() for p in start]
    torch_adamw = torch.optim.AdamW(torch_params, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
    for step_grads in grads[:5]:
        for p, g in zip(torch_params, step_grads):
            p.grad = g.clone()
        torch_adamw.step()
    converted = CerebrasAdam(torch_params, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
    converted.load_state_dict(torch_adamw.state_dict())
    group = converted.param_groups[0]
    assert group["correct_bias"] and group["decoupled_weight_decay"]
    assert group["beta1_power"] == float(torch.tensor(0.9**6)) and group["beta2_power"] == float(torch.tensor(0.99**6))
    converted.step()  # and it steps


@pytest.mark.parametrize(
    ("name", "kind", "correct_bias", "note"),
    [
        ("llama3p1_8b_msl_8k.yaml", "Adam", True, "trainer.init.optimizer.Adam.correct_bias is not used: cstorch's"),
        ("gpt3_cerebras_gpt_111m.yaml", "AdamW", True, None),
    ],
)
def test_real_configs_build_cstorchs_optimizers(name: str, kind: str, correct_bias: bool, note: str | None) -> None:
    from dls.train.modelzoo import build_model
    from dls.train.trainer import build_optimizer

    at = "trainer.init.model"
    tiny = {"hidden_size": 16, "num_heads": 2, "filter_size": 32, "num_hidden_layers": 1, "vocab_size": 32}
    overrides = [f"{at}.{k}={v}" for k, v in tiny.items()] + [f"{at}.extra_attention_params.num_kv_groups=1"] * (
        "llama" in name
    )
    overrides += [f"{at}.rotary_dim=8"] * ("llama" in name)
    cfg = load_config(ZOO / name, overrides)
    assert cfg.optimizer.optimizer_type == kind and cfg.optimizer.correct_bias is correct_bias
    if note is not None:
        assert any(n.startswith(note) for n in cfg.notes), cfg.notes
    written = load_config(ZOO / name).optimizer.eps
    assert written == (1e-8 if "gpt3" in name else 1e-6)  # Cerebras-GPT writes 1e-8; Llama takes cstorch's default
    optimizer = build_optimizer(cfg, build_model(cfg.model.name, dict(cfg.model.params)))
    assert isinstance(optimizer, CerebrasAdam)
    assert all(g["decoupled_weight_decay"] is (kind == "AdamW") and g["eps"] == written for g in optimizer.param_groups)
    assert {g["weight_decay"] for g in optimizer.param_groups} == {0.0, cfg.optimizer.weight_decay}  # not on norms


def test_correct_bias_false_is_cstorchs_in_model_zoos_layout_and_refused_in_dls_own() -> None:
    cfg = load_config(ZOO / "gpt3_cerebras_gpt_111m.yaml", ["trainer.init.optimizer.AdamW.correct_bias=false"])
    assert cfg.optimizer.correct_bias is False
    from dls.train.config import parse_config
    from dls.train.errors import ConfigError

    raw = {"model": {"name": "mlp"}, "optimizer": {"optimizer_type": "AdamW", "correct_bias": False}}
    with pytest.raises(ConfigError, match=r"optimizer\.correct_bias: false is cstorch's AdamW"):
        parse_config(raw)


def test_a_model_zoo_run_resumes_bit_identically_with_cstorchs_adamw(tmp_path: Path) -> None:
    """Cerebras-GPT muP (AdamW, muP groups, weight decay off for biases and norms) in float16 with dynamic loss
    scaling: 4 steps straight, and 2 then 2 more from the checkpoint in the same model_dir, end bit-identical."""
    from dls.train.modelzoo import write_tiny_data
    from dls.train.trainer import Trainer

    write_tiny_data("gpt", tmp_path / "gpt", train_samples=32, val_samples=8, msl=16, vocab=32)
    at = "trainer.init.model"
    sizes = {"hidden_size": 32, "num_heads": 2, "filter_size": 64, "num_hidden_layers": 1, "vocab_size": 32,
             "max_position_embeddings": 16}  # fmt: skip
    base = [f"{at}.{k}={v}" for k, v in sizes.items()] + [
        f"trainer.fit.train_dataloader.data_dir={tmp_path / 'gpt' / 'train'}",
        f"trainer.fit.val_dataloader.data_dir={tmp_path / 'gpt' / 'val'}",
        "trainer.fit.train_dataloader.batch_size=4", "trainer.fit.val_dataloader.batch_size=4",
        "trainer.init.precision.fp16_type=float16", "trainer.init.precision.loss_scaling_factor=dynamic",
        "trainer.init.schedulers=[{ConstantLR: {learning_rate: 0.01}}]", "trainer.init.loop.eval_frequency=null",
    ]  # fmt: skip
    states = []
    for name, stops in (("straight", [4]), ("split", [2, 4])):
        for steps in stops:
            run = [f"trainer.init.model_dir={tmp_path / name}", f"trainer.init.loop.max_steps={steps}"]
            cfg = load_config(ZOO / "gpt3_cerebras_gpt_111m_mup.yaml", [*base, *run])
            trainer = Trainer(cfg, progress=False, summary=False, plot=False)
            trainer.train()  # autoload_last_checkpoint (Model Zoo's default): the second continues the first
        assert isinstance(trainer.optimizer, CerebrasAdam) and trainer.global_step == 4
        states.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
        states.append([g.get("beta1_power") for g in trainer.optimizer.param_groups])
    assert all(torch.equal(states[0][n], states[2][n]) for n in states[0])
    assert states[1] == states[3] and all(p is not None for p in states[1])
