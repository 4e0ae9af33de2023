"""muP as Model Zoo defines it (GPT2LMHeadModel and configure_param_groups, Releases 2.3.1 and 2.10.0), on real
Cerebras-GPT muP configs (tests/data/modelzoo) shrunk by overrides: the logits, the attention logits and the embeddings
computed by hand from the model's weights with Model Zoo's formulas; the initialisers' spread; each parameter's
learning rate, the schedule's times its group's factor."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from dls.train.config import load_config, parse_config
from dls.train.errors import ConfigError
from dls.train.modelzoo import LR_GROUPS, CausalLM, build_model, param_groups, parse_model
from dls.train.trainer import learning_rate_at

ZOO = Path(__file__).resolve().parent / "data" / "modelzoo"
MUP = ZOO / "gpt3_cerebras_gpt_111m_mup.yaml"  # Release 2.10.0: mup_base_hidden_size, mup_base_filter_size
MUP_LEGACY = ZOO / "gpt3_cerebras_gpt_111m_mup_2.3.1.yaml"  # Release 2.3.1: output_logits_scale, adjust_learning_rate
HIDDEN, HEADS, FILTER, LAYERS, VOCAB, POSITIONS = 64, 4, 128, 2, 61, 16


def shrunk(path: Path, **more: Any) -> dict[str, Any]:
    """The model section of a real config at a tiny size (its muP keys as written)."""
    at = "trainer.init.model" if "trainer:" in path.read_text() else "model"
    sizes = {**dict(hidden_size=HIDDEN, num_heads=HEADS, filter_size=FILTER, num_hidden_layers=LAYERS,
                    vocab_size=VOCAB, max_position_embeddings=POSITIONS), **more}  # fmt: skip
    overrides = [f"{at}.{k}={v}" for k, v in sizes.items()] + (["model.name=gpt3"] if at == "model" else [])
    cfg = load_config(path, overrides)
    return {"name": cfg.model.name, **cfg.model.params}


def by_hand(model: CausalLM, ids: torch.Tensor, alpha: float, head_divisor: float) -> torch.Tensor:
    """GPT-2's forward written out with Model Zoo's muP factors: embeddings times ``embeddings_scale``, attention
    logits ``alpha * q.k / head_divisor``, the LM head's logits times ``output_logits_scale``."""
    hf, k = model.hf.transformer, model.keys
    x = (hf.wte(ids) + hf.wpe(torch.arange(ids.shape[1]))) * k.embeddings_scale
    causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
    for block in hf.h:
        qkv = F.linear(block.ln_1(x), block.attn.c_attn.weight, block.attn.c_attn.bias)  # without the model's hooks
        q, key, v = qkv.split(HIDDEN, dim=-1)
        q, key, v = (t.view(*t.shape[:2], HEADS, -1).transpose(1, 2) for t in (q, key, v))
        logits = alpha * (q @ key.transpose(-1, -2)) / head_divisor
        attention = F.softmax(logits.masked_fill(~causal, -math.inf), dim=-1) @ v
        x = x + block.attn.c_proj(attention.transpose(1, 2).reshape(x.shape))
        x = x + block.mlp.c_proj(F.gelu(block.mlp.c_fc(block.ln_2(x))))
    return model.hf.lm_head(hf.ln_f(x)) * (k.logits_scale or 1.0)


def test_the_logits_attention_and_embeddings_follow_model_zoos_formulas() -> None:
    params = shrunk(MUP)
    model = build_model("gpt3", params)
    assert isinstance(model, CausalLM) and model.keys.mup
    width = HIDDEN / 256  # mup_base_hidden_size
    assert model.keys.logits_scale == pytest.approx(1.0 / width)  # output_logits_alpha / width multiplier
    head = HIDDEN // HEADS  # scale_qk_dot_by_d: logits divided by the head size, not its square root
    assert model.keys.attention_factor == pytest.approx(head**-0.5)
    ids = torch.randint(0, VOCAB, (3, POSITIONS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = by_hand(model, ids, 1.0, head)
        assert torch.allclose(model(ids), expected, atol=1e-5, rtol=1e-5)
        # The same weights without muP's factors differ: the test can tell
        assert not torch.allclose(model(ids), by_hand(model, ids, 1.0, head**0.5), atol=1e-3)


def test_attention_logits_alpha_and_the_square_root_without_mup() -> None:
    params = shrunk(ZOO / "gpt3_cerebras_gpt_111m.yaml", attention_logits_alpha=0.5, embeddings_scale=3.0)
    model = build_model("gpt3", params)
    assert not model.keys.mup and model.keys.logits_scale is None
    ids = torch.randint(0, VOCAB, (2, POSITIONS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(model(ids), by_hand(model, ids, 0.5, (HIDDEN // HEADS) ** 0.5), atol=1e-5, rtol=1e-5)


def test_model_zoos_muP_before_release_2_3_uses_its_logits_scale() -> None:
    params = shrunk(MUP_LEGACY)
    model = build_model("gpt3", params)
    assert not model.keys.mup and model.keys.logits_scale == params["output_logits_scale"] == 1 / 3
    ids = torch.randint(0, VOCAB, (2, POSITIONS), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # scale_qk_dot_by_d: true, embeddings_scale: 10, as written
        assert torch.allclose(model(ids), by_hand(model, ids, 1.0, HIDDEN // HEADS), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["gpt3", "llama"])
def test_the_attention_factor_is_the_keys_as_model_zoo_scales_them(family: str) -> None:
    """Multiplying the key projection's weights (and bias) by the factor, without muP, computes the same: the factor
    multiplies the keys, hence the attention logits, and nothing else."""
    more = {"position_embedding_type": "rotary", "norm_type": "rmsnorm", "nonlinearity": "swiglu",
            "rotary_dim": HIDDEN // HEADS, "dropout_rate": 0.0} if family == "llama" else {}  # fmt: skip
    base = {**shrunk(ZOO / "gpt3_cerebras_gpt_111m.yaml"), **more, "name": family}
    torch.manual_seed(3)
    mup = build_model(family, {**base, "scale_qk_dot_by_d": True, "attention_logits_alpha": 2.0})
    plain = build_model(family, base)
    plain.load_state_dict(mup.state_dict())
    factor = 2.0 * (HIDDEN // HEADS) ** -0.5
    with torch.no_grad():
        for name, module in plain.named_modules():
            if name.endswith(".k_proj"):
                module.weight *= factor
            elif name.endswith(".c_attn"):
                module.weight[HIDDEN : 2 * HIDDEN] *= factor
                module.bias[HIDDEN : 2 * HIDDEN] *= factor
        ids = torch.randint(0, VOCAB, (2, POSITIONS), generator=torch.Generator().manual_seed(4))
        assert torch.allclose(mup(ids), plain(ids), atol=1e-5, rtol=1e-4)
        assert not torch.allclose(mup(ids), build_model(family, base)(ids), atol=1e-3)


def truncated_std(std: float, bound: float) -> float:
    """The standard deviation of a normal of ``std`` truncated at ``+-bound``."""
    z = bound / std
    pdf, mass = math.exp(-z * z / 2) / math.sqrt(2 * math.pi), math.erf(z / math.sqrt(2))
    return std * math.sqrt(1 - 2 * z * pdf / mass)


def test_mup_scales_the_initialisers_by_the_width_multipliers() -> None:
    """Model Zoo's 111m_mup (Release 2.10.0): initializer and output_layer_initializer truncated normal std 0.08 at
    +-0.16; muP scales attention and FFN by width**-0.5, the output layers also by (2 layers)**-0.5 (the FFN's output
    by the filter's width, from the default initializer: it names no ffn_output_layer_initializer), the bounds with
    them; the embeddings are not scaled."""
    torch.manual_seed(5)
    model = build_model("gpt3", shrunk(MUP, hidden_size=128, filter_size=512, num_heads=4))
    width, filter_, depth = 128 / 256, 512 / 1024, (2 * LAYERS) ** -0.5
    expected = {
        "attn.c_attn": 0.08 * width**-0.5, "mlp.c_fc": 0.08 * width**-0.5,
        "attn.c_proj": 0.08 * width**-0.5 * depth, "wte": 0.08,
        "mlp.c_proj": 0.02 * filter_**-0.5 * depth,  # no ffn_output_layer_initializer: initializer_range's default
    }  # fmt: skip
    for role, std in expected.items():
        weights = torch.cat([p.detach().flatten() for n, p in model.hf.named_parameters() if f"{role}.weight" in n])
        assert weights.abs().max() <= 2 * std * (1 + 1e-6) and weights.abs().max() > 1.9 * std, role
        assert float(weights.std()) == pytest.approx(truncated_std(std, 2 * std), rel=0.05), role


def factors(cfg_path: Path, overrides: list[str]) -> tuple[dict[str, float], dict[str, float]]:
    """Each parameter's learning-rate factor and weight decay, as ``param_groups`` sets them for the config."""
    cfg = load_config(cfg_path, overrides)
    model = build_model(cfg.model.name, dict(cfg.model.params))
    groups = param_groups(model, cfg.optimizer.weight_decay, dict(cfg.optimizer.adjust_learning_rate))
    of = {id(p): g for g in groups for p in g["params"]}
    assert len(of) == sum(len(g["params"]) for g in groups)  # each parameter once
    named = dict(model.named_parameters())
    return {n: of[id(p)]["lr"] for n, p in named.items()}, {n: of[id(p)]["weight_decay"] for n, p in named.items()}


SHRINK = [f"trainer.init.model.{k}={v}" for k, v in dict(hidden_size=HIDDEN, num_heads=HEADS, filter_size=FILTER,
          num_hidden_layers=LAYERS, vocab_size=VOCAB, max_position_embeddings=POSITIONS).items()]  # fmt: skip


def test_each_group_learns_at_the_schedule_times_its_mup_factor() -> None:
    """Model Zoo: decoder_attention and decoder_input_ffn at 1/width, decoder_output_ffn at 1/filter width, the rest
    at 1; weight decay on weights only (not biases, not norms)."""
    lr, decay = factors(MUP, SHRINK)
    width, filter_ = HIDDEN / 256, FILTER / 1024
    for name, factor in lr.items():
        role = (
            1 / width if name.endswith(("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight"))
            else 1 / filter_ if name.endswith("mlp.c_proj.weight") else 1.0
        )  # fmt: skip
        assert factor == pytest.approx(role), name
        assert decay[name] == (0.0 if name.endswith(".bias") or ".ln_" in name else 0.1), name
    assert {lr[n] for n in lr} == {1.0, 1 / width, 1 / filter_}


def test_the_learning_rates_of_a_training_run_are_the_formulas(tmp_path: Path) -> None:
    from dls.train.modelzoo import write_tiny_data
    from dls.train.trainer import Trainer

    write_tiny_data("gpt", tmp_path / "gpt", train_samples=32, val_samples=8, msl=POSITIONS, vocab=VOCAB)
    overrides = [
        *SHRINK, f"trainer.init.model_dir={tmp_path / 'run'}", "trainer.init.loop.max_steps=3",
        f"trainer.fit.train_dataloader.data_dir={tmp_path / 'gpt' / 'train'}",
        f"trainer.fit.val_dataloader.data_dir={tmp_path / 'gpt' / 'val'}",
        "trainer.fit.train_dataloader.batch_size=4", "trainer.fit.val_dataloader.batch_size=4",
        "trainer.init.precision.enabled=false",
    ]  # fmt: skip
    cfg = load_config(MUP, overrides)
    trainer = Trainer(cfg, progress=False, summary=False, plot=False)
    trainer.train()
    expected, _ = factors(MUP, SHRINK)
    schedule = learning_rate_at(cfg.optimizer.learning_rate, 3)  # after 3 applied steps
    of = {id(p): g for g in trainer.optimizer.param_groups for p in g["params"]}
    for name, param in trainer.model.named_parameters():
        assert of[id(param)]["lr"] == pytest.approx(schedule * expected[name]), name


def test_model_zoos_adjust_learning_rate_before_release_2_3() -> None:
    """2.3.1's muP: ``adjust_learning_rate: {decoder_kernel: 1/3}``, every decoder weight (attention and FFN)."""
    lr, _ = factors(MUP_LEGACY, [f"model.{s.split('.', 3)[3]}" for s in SHRINK] + ["model.name=gpt3"])
    kernels = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    for name, factor in lr.items():
        assert factor == pytest.approx(1 / 3 if name.endswith(kernels) else 1.0), name


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mup_base_filter_size": None}, "mup_base_hidden_size needs mup_base_hidden_size and mup_base_filter_size"),
        ({"output_logits_scale": 0.5}, "output_logits_scale is muP before Release 2.3"),
        ({"initializer": {"name": "uniform", "a": -0.1, "b": 0.1}}, "muP scales normal and truncated_normal"),
        ({"lr_adjustment_groups": {"x": 1}}, "lr_adjustment_groups: {'x': 1} cannot be expressed"),
    ],
)
def test_mup_keys_model_zoo_refuses_are_refused_naming_them(change: dict[str, Any], message: str) -> None:
    params = {**shrunk(MUP), **change}
    with pytest.raises(ConfigError) as info:
        parse_model("gpt3", {k: v for k, v in params.items() if v is not None})
    assert message in str(info.value)


def test_adjust_learning_rate_names_model_zoos_groups() -> None:
    raw = load_config(MUP, SHRINK).model_dump()
    with pytest.raises(ConfigError) as info:
        load_config(MUP, [*SHRINK, "trainer.init.optimizer.AdamW.adjust_learning_rate={decoder_atention: 0.5}"])
    assert (
        "trainer.init.optimizer.AdamW.adjust_learning_rate.decoder_atention: not a group of Model Zoo's gpt3 (did"
        in str(info.value)
        and all(g in str(info.value) for g in LR_GROUPS)
    )
    # decoder_kernel at 0.5 and muP's decoder_attention at 4: a parameter in both (Model Zoo would crash)
    cfg = load_config(MUP, [*SHRINK, "trainer.init.optimizer.AdamW.adjust_learning_rate={decoder_kernel: 0.5}"])
    model = build_model("gpt3", dict(cfg.model.params))
    different = (
        r"transformer.h.0.attn.c_attn.weight is in groups of different factors: decoder_attention \(4\), decoder_k"
    )
    with pytest.raises(ConfigError, match=different):
        param_groups(model, 0.1, dict(cfg.optimizer.adjust_learning_rate))
    assert raw["optimizer"]["adjust_learning_rate"] == {}
    # The config's own factor overrides muP's, as in Model Zoo
    lr, _ = factors(MUP, [*SHRINK, "trainer.init.optimizer.AdamW.adjust_learning_rate={decoder_output_ffn: 2}"])
    assert {f for n, f in lr.items() if n.endswith("mlp.c_proj.weight")} == {2.0}


def test_adjust_learning_rate_is_for_gpt_models() -> None:
    raw = {
        "model": {"name": "fc_mnist", "depth": 1, "hidden_size": 8},
        "optimizer": {"adjust_learning_rate": {"embedding": 2}},
    }
    with pytest.raises(ConfigError, match=r"optimizer\.adjust_learning_rate applies to gpt2, gpt3 and llama; this is"):
        parse_config(raw)
