"""Model Zoo's models by name (dls.train.modelzoo): the keys as Model Zoo means them, the loss as its loss code
computes it, refusals naming the key, and a loss that falls under plain AdamW."""

from __future__ import annotations

import math
import sys

import pytest
import torch
import transformers
from torch.nn import functional as F

from dls.train.errors import ConfigError, MissingExtras
from dls.train.modelzoo import build_model, parse_model

# transformers loads its model classes on first use: at collection, not inside the first test
assert transformers.GPT2LMHeadModel and transformers.LlamaForCausalLM


def cerebras_gpt(**changes: object) -> dict[str, object]:
    """The model section of Model Zoo's Cerebras_GPT/111m.yaml, sizes shrunk."""
    trunc = {"mean": 0.0, "name": "truncated_normal", "std": 0.02, "a": -0.04, "b": 0.04}
    section = {
        "hidden_size": 64, "position_embedding_type": "learned", "share_embedding_weights": True,
        "max_position_embeddings": 32, "vocab_size": 96, "num_hidden_layers": 2, "dropout_rate": 0.0,
        "layer_norm_epsilon": 1.0e-5, "num_heads": 4, "attention_type": "scaled_dot_product",
        "attention_dropout_rate": 0.0, "use_projection_bias_in_attention": True, "use_ffn_bias_in_attention": True,
        "filter_size": 128, "nonlinearity": "gelu", "use_ffn_bias": True,
        "embedding_initializer": dict(trunc), "initializer": dict(trunc),
        "output_layer_initializer": {"mean": 0.0, "name": "truncated_normal", "std": 0.004472135954999579,
                                     "a": -0.008944271909999158, "b": 0.008944271909999158},
        "loss_scaling": "batch_size", "loss_weight": 1 / 32, "use_bias_in_output": False,
        "mixed_precision": True, "fp16_type": "bfloat16",
    }  # fmt: skip
    return {**section, **changes}


def llama(**changes: object) -> dict[str, object]:
    """The model section of Model Zoo's params_llama3p2_1b_msl_8k.yaml, sizes shrunk (head size 16)."""
    section = {
        "attention_dropout_rate": 0.0, "attention_module": "multiquery_attention",
        "attention_type": "scaled_dot_product", "dropout_rate": 0.0, "embedding_dropout_rate": 0.0,
        "embedding_layer_norm": False, "extra_attention_params": {"num_kv_groups": 2}, "filter_size": 128,
        "hidden_size": 64, "initializer_range": 0.02, "layer_norm_epsilon": 1.0e-05, "loss_scaling": "num_tokens",
        "loss_weight": 1.0, "max_position_embeddings": 64, "name": "llama", "nonlinearity": "swiglu",
        "norm_type": "rmsnorm", "num_heads": 4, "num_hidden_layers": 2,
        "pos_scaling_extra_args": {"high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                   "original_max_position_embeddings": 32},
        "pos_scaling_factor": 32.0, "pos_scaling_type": "llama3", "position_embedding_type": "rotary",
        "rope_theta": 500000.0, "rotary_dim": 16, "share_embedding_weights": True, "use_bias_in_output": False,
        "use_ffn_bias": False, "use_ffn_bias_in_attention": False, "use_projection_bias_in_attention": False,
        "vocab_size": 96,
    }  # fmt: skip
    return {**section, **changes}


def fc_mnist(**changes: object) -> dict[str, object]:
    """The model section of Model Zoo's fc_mnist params.yaml."""
    section = {"name": "fc_mnist", "mixed_precision": True, "depth": 10, "hidden_size": 50, "dropout": 0.0,
               "activation_fn": "relu", "to_float16": False}  # fmt: skip
    return {**section, **changes}


def problems(name: str, params: dict[str, object]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_model(name, params)
    return info.value.errors


def token_batch(vocab: int = 96, length: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (4, length), generator=gen)
    labels = torch.randint(0, vocab, (4, length), generator=gen)
    labels[1, 10:] = -100  # masked tail (Model Zoo's attention_mask 0)
    labels[3, :3] = -100
    return ids, labels


def test_cerebras_gpt_keys_reach_gpt2() -> None:
    torch.manual_seed(0)
    model = build_model("gpt3", cerebras_gpt())
    hf = model.hf
    assert type(hf).__name__ == "GPT2LMHeadModel"
    cfg = hf.config
    assert (cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.n_inner, cfg.n_positions) == (64, 2, 4, 128, 32)
    assert cfg.activation_function == "gelu"  # the exact GELU, not gelu_new
    assert cfg.layer_norm_epsilon == 1e-5 and cfg.scale_attn_weights
    assert hf.lm_head.weight is hf.transformer.wte.weight  # share_embedding_weights
    # initializers: truncated normal with the config's bounds
    assert hf.transformer.wte.weight.abs().max() <= 0.04
    proj = torch.cat([hf.transformer.h[i].attn.c_proj.weight.flatten() for i in range(2)])
    assert proj.abs().max() <= 0.008944271909999158 and 0.003 < proj.std() < 0.0045
    assert all(layer.mlp.c_proj.weight.abs().max() <= 0.0090 for layer in hf.transformer.h)
    assert not hf.transformer.h[0].attn.c_attn.bias.any()
    assert isinstance(hf.transformer.h[0].mlp.c_fc, torch.nn.Linear)  # Conv1D rebuilt as Linear (FP8-able)
    assert parse_model("gpt3", cerebras_gpt())[1] == []  # no key ignored


def test_gpt2_untied_head_and_dropouts() -> None:
    params = cerebras_gpt(share_embedding_weights=False, dropout_rate=0.25, attention_dropout_rate=None)
    params.pop("output_layer_initializer")
    params.pop("initializer")
    hf = build_model("gpt2", params).hf
    assert hf.lm_head.weight is not hf.transformer.wte.weight
    assert (hf.config.resid_pdrop, hf.config.embd_pdrop, hf.config.attn_pdrop) == (0.25, 0.25, 0.25)
    # no initializer: output layers truncated normal with std 0.02 / sqrt(2 * layers), within 2 std
    assert hf.transformer.h[0].attn.c_proj.weight.abs().max() <= 2 * 0.02 / math.sqrt(4)


def test_llama_gqa_and_llama3_scaling_reach_hf_config() -> None:
    model = build_model("llama", llama())
    cfg = model.hf.config
    assert type(model.hf).__name__ == "LlamaForCausalLM"
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (4, 2, 128)
    assert cfg.hidden_act == "silu" and cfg.rms_norm_eps == 1e-5 and cfg.tie_word_embeddings
    assert cfg.rope_parameters == {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
    }  # fmt: skip
    assert not cfg.attention_bias and not cfg.mlp_bias
    assert model.hf.model.layers[0].self_attn.k_proj.weight.shape == (2 * 16, 64)
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())


@pytest.mark.parametrize(("scaling", "weight"), [("num_tokens", 1.0), ("batch_size", 1 / 16)])
def test_loss_is_model_zoos_formula(scaling: str, weight: float) -> None:
    model = build_model("gpt2", cerebras_gpt(loss_scaling=scaling, loss_weight=weight))
    ids, labels = token_batch()
    mask = (labels != -100).float()
    ce = F.cross_entropy(model(ids).float().flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none")
    summed = (ce * mask.flatten()).sum()  # GPTLMHeadModelLoss: CE * attention_mask, summed
    expected = summed / mask.sum() if scaling == "num_tokens" else summed / ids.shape[0] * weight
    loss = model.loss((ids, labels))
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss, expected)


def test_a_batch_without_unmasked_tokens_is_nan_under_num_tokens_as_in_model_zoo() -> None:
    """GPTLMHeadModelLoss divides by sum(attention_mask), unclamped: a fully masked batch is 0/0 there too;
    batch_size scaling gives 0."""
    ids, labels = token_batch()
    labels[:] = -100
    assert build_model("gpt2", cerebras_gpt(loss_scaling="num_tokens", loss_weight=1.0)).loss((ids, labels)).isnan()
    assert build_model("gpt2", cerebras_gpt()).loss((ids, labels)) == 0


def test_loss_weight_with_num_tokens_is_reported_not_applied() -> None:
    params = cerebras_gpt(loss_scaling="num_tokens", loss_weight=0.5)
    assert build_model("gpt3", params).loss_weight == 1.0
    assert parse_model("gpt3", params)[1] == ["model.loss_weight (Model Zoo uses 1.0 with loss_scaling: num_tokens)"]


def test_keys_gpt2_cannot_express_are_refused_by_name() -> None:
    errors = problems("gpt3", cerebras_gpt(use_ffn_bias=False, use_bias_in_output=True, embedding_layer_norm=True))
    assert [e.split(":")[0] for e in errors] == [
        "model.embedding_layer_norm", "model.use_ffn_bias", "model.use_bias_in_output",
    ]  # fmt: skip
    assert "model.position_embedding_type" in problems("gpt2", cerebras_gpt(position_embedding_type="rotary"))[0]
    assert "model.nonlinearity" in problems("gpt2", cerebras_gpt(nonlinearity="swiglu"))[0]
    assert problems("gpt2", cerebras_gpt(extra_attention_params={"num_kv_groups": 4})) == [
        "model.extra_attention_params.num_kv_groups: needs multiquery_attention"
    ]


def test_keys_llama_cannot_express_are_refused_by_name() -> None:
    assert problems("llama", llama(rotary_dim=8))[0].startswith("model.rotary_dim: 8 ")
    no_rotary_dim = llama()
    del no_rotary_dim["rotary_dim"]  # Model Zoo's default is a quarter of the head size
    assert problems("llama", no_rotary_dim)[0].startswith("model.rotary_dim: 4 ")
    assert problems("llama", llama(dropout_rate=0.1))[0].startswith("model.dropout_rate")
    bad_groups = problems("llama", llama(extra_attention_params={"num_kv_groups": 3}))
    assert bad_groups[0].startswith("model.extra_attention_params.num_kv_groups")
    missing = llama(pos_scaling_extra_args={"low_freq_factor": 1.0})
    assert [e.split(":")[0] for e in problems("llama", missing)] == [
        "model.pos_scaling_extra_args.high_freq_factor",
        "model.pos_scaling_extra_args.original_max_position_embeddings",
    ]
    assert problems("llama", llama(pos_scaling_type="yarn"))[0].startswith("model.pos_scaling_type")
    for key in ("use_bias_in_output", "scale_qk_dot_by_layer_idx"):  # LlamaForCausalLM has neither
        assert problems("llama", llama(**{key: True}))[0].startswith(f"model.{key}: True cannot be built")


def test_misspelt_and_loose_values_are_errors() -> None:
    assert problems("gpt3", cerebras_gpt(hiden_size=64)) == [
        "model.hiden_size: unknown key (did you mean 'hidden_size'?)"
    ]
    assert problems("gpt3", cerebras_gpt(hidden_size=True))[0].startswith("model.hidden_size: Input should be")
    assert problems("gpt3", cerebras_gpt(hidden_size="1024"))[0].startswith("model.hidden_size:")
    stdd = cerebras_gpt(initializer={"name": "truncated_normal", "stdd": 0.02})
    assert problems("gpt3", stdd)[0].startswith("model.initializer: stdd not used by the truncated_normal")
    assert problems("fc_mnist", fc_mnist(activation_fn="tanh"))[0].startswith("model.activation_fn")
    assert problems("fc_mnist", {"name": "fc_mnist", "depth": 2})[0].startswith("model: hidden_size and depth")
    assert problems("fc_mnist", fc_mnist(to_float16=True))[0].startswith("model.to_float16: True cannot")
    with pytest.raises(ConfigError, match=r"model\.name: 'resnet'"):
        build_model("resnet", {})


@pytest.mark.parametrize(
    ("key", "value"),
    [("loss_weight", -1.0), ("loss_weight", 0.0), ("loss_weight", 1e39), ("loss_weight", float("nan")),
     ("layer_norm_epsilon", float("inf")), ("rope_theta", 1e300), ("initializer_range", float("nan")),
     ("dropout_rate", float("nan"))],
)  # fmt: skip
def test_float_keys_are_finite_and_in_float32s_range(key: str, value: float) -> None:
    assert problems("gpt3", cerebras_gpt(**{key: value}))[0].startswith(f"model.{key}:")


def test_hardware_only_keys_are_accepted_and_listed() -> None:
    params = cerebras_gpt(attention_kernel="optimized_beta", fold_rope_consts=True, rope_theta=10000.0)
    assert parse_model("gpt3", params, prefix="trainer.init.model")[1] == [
        "trainer.init.model.attention_kernel", "trainer.init.model.fold_rope_consts",
        "trainer.init.model.rope_theta (learned positions)",
    ]  # fmt: skip


def test_fc_mnist_as_model_zoo_builds_it() -> None:
    model = build_model("fc_mnist", fc_mnist(hidden_sizes=[20, 30], use_bias=False, activation_fn=None))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(784, 20), (20, 30), (30, 10)]
    assert all(m.bias is None for m in linears)
    assert not any(isinstance(m, torch.nn.ReLU) for m in model.modules())  # activation_fn None: linear network
    images, labels = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    raw = build_model("fc_mnist", fc_mnist(depth=1, disable_softmax=True))
    torch.testing.assert_close(raw.loss((images, labels)), F.nll_loss(raw(images), labels))


def test_missing_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m.split(".")[0] == "transformers"]:  # as if not installed
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MissingExtras, match=r"transformers is not installed.*dls\[modelzoo\]"):
        build_model("gpt3", cerebras_gpt())
    assert parse_model("gpt3", cerebras_gpt())[1] == []  # validation alone needs no transformers


@pytest.mark.parametrize("name", ["fc_mnist", "gpt3", "llama"])
def test_loss_falls_with_adamw(name: str) -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name == "fc_mnist":
        model = build_model(name, fc_mnist(depth=2, hidden_size=32))
        images = torch.randn(64, 1, 28, 28, generator=gen)
        data = (images, (images.flatten(1)[:, :10].argmax(1)))
    else:
        model = build_model(name, llama() if name == "llama" else cerebras_gpt())
        start, step = torch.randint(0, 96, (16, 1), generator=gen), torch.randint(1, 4, (16, 1), generator=gen)
        tokens = (start + step * torch.arange(17)) % 96
        data = (tokens[:, :-1], tokens[:, 1:])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = model.loss(data)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0], losses
