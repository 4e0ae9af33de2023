"""Model Zoo's models by name: ``fc_mnist`` here, ``gpt2``/``gpt3``/``llama`` on Hugging Face transformers' GPT-2
and Llama classes, configured from Model Zoo's keys and initialised as Model Zoo initialises them.

Each model's ``loss(batch)`` returns a float32 scalar: for the GPT models Model Zoo's GPTLMHeadModelLoss, the summed
token cross-entropy over the loss mask divided by the number of unmasked tokens (``loss_scaling: num_tokens``) or by
the batch size and multiplied by ``loss_weight`` (``batch_size``): ``loss_weight`` is already in it.
"""

from __future__ import annotations

import importlib
import logging
import math
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from dls.train.errors import MissingExtras
from dls.train.modelzoo.keys import IGNORE_INDEX, FcMnistKeys, GptKeys, Initializer, parse_model

Batch = tuple[torch.Tensor, torch.Tensor]
MNIST_PIXELS, MNIST_CLASSES = 784, 10


def require(module: str) -> ModuleType:
    """Import ``module`` of the ``modelzoo`` extra, or ``MissingExtras`` naming the extra."""
    # transformers' model classes import torchao, which logs warnings about its optional C extensions and pytree
    # registrations at import: nothing about this run, so they are silenced while the classes load.
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        imported = importlib.import_module(module)
        for name in ("GPT2LMHeadModel", "LlamaForCausalLM") if module == "transformers" else ():
            getattr(imported, name)  # transformers loads its classes on first use
        return imported
    except ImportError as exc:
        raise MissingExtras(
            f"{module} is not installed; Model Zoo models and data need the modelzoo extra: pip install 'dls[modelzoo]'"
        ) from exc
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


class FcMnist(nn.Module):
    """Model Zoo's fc_mnist: Linear layers of ``hidden_sizes`` (each then ReLU when ``activation_fn: relu``, then
    dropout), a Linear layer to 10 classes; the NLL loss of the log-softmax (of the raw logits with
    ``disable_softmax``)."""

    def __init__(self, k: FcMnistKeys) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = MNIST_PIXELS
        for size in k.sizes:
            layers += [nn.Linear(width, size, bias=k.use_bias), *([nn.ReLU()] if k.activation_fn else [])]
            layers.append(nn.Dropout(k.dropout))
            width = size
        self.hidden = nn.Sequential(*layers)
        self.last_layer = nn.Linear(width, MNIST_CLASSES, bias=k.use_bias)
        self.disable_softmax = k.disable_softmax
        self.ignored_keys: list[str] = []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.last_layer(self.hidden(torch.flatten(images, 1)))
        return out

    def loss(self, batch: Batch) -> torch.Tensor:
        images, labels = batch
        logits = self(images).float()
        return F.nll_loss(logits if self.disable_softmax else F.log_softmax(logits, dim=1), labels)


class CausalLM(nn.Module):
    """A Hugging Face causal LM (``hf``) with Model Zoo's loss. A batch is ``(input_ids, labels)``, with labels
    ``IGNORE_INDEX`` where Model Zoo's ``attention_mask`` (a loss mask) is 0."""

    def __init__(self, hf: nn.Module, k: GptKeys) -> None:
        super().__init__()
        self.hf = hf
        self.loss_scaling = k.loss_scaling
        self.loss_weight = k.loss_weight if k.loss_scaling == "batch_size" else 1.0
        self.max_positions = k.max_position_embeddings
        self.vocab_size = k.vocab_size
        self.ignored_keys: list[str] = []

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.max_positions:
            raise ValueError(
                f"sequences of {input_ids.shape[1]} tokens are longer than model.max_position_embeddings "
                f"({self.max_positions})"
            )
        logits: torch.Tensor = self.hf(input_ids=input_ids).logits
        return logits

    def loss(self, batch: Batch) -> torch.Tensor:
        input_ids, labels = batch
        logits = self(input_ids).float()
        total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        if self.loss_scaling == "num_tokens":
            return total / (labels != IGNORE_INDEX).sum()
        return total / labels.shape[0] * self.loss_weight


def _rope(k: GptKeys) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": k.rope_theta}
    if k.pos_scaling_type == "llama3":
        args = k.pos_scaling_extra_args
        assert args is not None  # parse_model requires them
        rope.update(rope_type="llama3", factor=k.pos_scaling_factor, **args.model_dump())
    elif k.pos_scaling_factor != 1.0:  # linear position interpolation: positions / factor
        rope.update(rope_type="linear", factor=k.pos_scaling_factor)
    return rope


def _linear_from_conv1d(model: nn.Module) -> None:
    """GPT-2's transformers ``Conv1D`` layers (``x @ W + b``) as ``nn.Linear`` (``W`` transposed, the same function),
    so that every matrix product is an ``nn.Linear`` (what ``dls.fp8.emulate`` replaces)."""
    conv1d = require("transformers.pytorch_utils").Conv1D
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, conv1d):
                linear = nn.Linear(child.nx, child.nf)
                with torch.no_grad():
                    linear.weight.copy_(child.weight.T)
                    linear.bias.copy_(child.bias)
                setattr(parent, child_name, linear)


def _hf_model(name: str, k: GptKeys) -> nn.Module:
    transformers = require("transformers")
    common = dict(
        vocab_size=k.vocab_size, initializer_range=k.initializer_range, tie_word_embeddings=k.share_embedding_weights,
        use_cache=False, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    attention_dropout = k.dropout_rate if k.attention_dropout_rate is None else k.attention_dropout_rate
    model: nn.Module
    if name == "llama":  # swiglu: LlamaMLP gates with silu
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=k.hidden_size, intermediate_size=k.filter_size, num_hidden_layers=k.num_hidden_layers,
            num_attention_heads=k.num_heads, num_key_value_heads=k.kv_heads, hidden_act="silu",
            max_position_embeddings=k.max_position_embeddings, rms_norm_eps=k.layer_norm_epsilon,
            rope_parameters=_rope(k), attention_bias=k.use_projection_bias_in_attention,
            attention_dropout=attention_dropout, mlp_bias=k.use_ffn_bias, **common,
        ))  # fmt: skip
        return model
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_positions=k.max_position_embeddings, n_embd=k.hidden_size, n_layer=k.num_hidden_layers,
        n_head=k.num_heads, n_inner=k.filter_size,
        activation_function=k.nonlinearity,  # Model Zoo's gelu is the exact GELU: transformers' "gelu"
        resid_pdrop=k.dropout_rate, attn_pdrop=attention_dropout,
        embd_pdrop=k.dropout_rate if k.embedding_dropout_rate is None else k.embedding_dropout_rate,
        layer_norm_epsilon=k.layer_norm_epsilon, scale_attn_weights=k.attention_type == "scaled_dot_product",
        scale_attn_by_inverse_layer_idx=k.scale_qk_dot_by_layer_idx, **common,
    ))  # fmt: skip
    _linear_from_conv1d(model)
    return model


@torch.no_grad()
def _initialize(hf: nn.Module, k: GptKeys) -> None:
    """Model Zoo's initialisation: embeddings ``embedding_initializer``; attention ``initializer``; FFN
    ``ffn_initializer`` (else ``initializer``); the output layers of attention and FFN ``output_layer_initializer``
    (``ffn_output_layer_initializer``), by default truncated normal with std initializer_range / sqrt(2 layers)
    unless ``initializer`` is set; an untied LM head normal(0, initializer_range); biases 0, norms 1."""
    default = Initializer(name="truncated_normal", std=k.initializer_range)
    attention = k.initializer or default
    ffn = k.ffn_initializer or k.initializer or default
    output = k.output_layer_initializer
    if output is None and k.initializer is None:
        output = Initializer(name="truncated_normal", std=k.initializer_range / math.sqrt(2 * k.num_hidden_layers))
    ffn_output = k.ffn_output_layer_initializer or output or ffn
    roles = {
        **dict.fromkeys(("c_attn", "q_proj", "k_proj", "v_proj"), attention),
        **dict.fromkeys(("attn.c_proj", "o_proj"), output or attention),
        **dict.fromkeys(("c_fc", "gate_proj", "up_proj"), ffn),
        **dict.fromkeys(("mlp.c_proj", "down_proj"), ffn_output),
        "lm_head": Initializer(name="normal", std=k.initializer_range),
    }
    tied = k.share_embedding_weights
    for name, module in hf.named_modules():
        if isinstance(module, nn.Embedding):
            (k.embedding_initializer or default).fill_(module.weight)
        elif isinstance(module, nn.Linear):
            role = roles[next(r for r in roles if name == r or name.endswith("." + r))]
            if not (tied and name == "lm_head"):
                role.fill_(module.weight)
            if module.bias is not None:
                module.bias.zero_()
        elif not list(module.children()):
            for pname, param in module.named_parameters(recurse=False):
                param.fill_(0.0 if pname == "bias" else 1.0)


def build_model(name: str, params: dict[str, Any], *, prefix: str = "model") -> FcMnist | CausalLM:
    """Model Zoo's model ``name`` (fc_mnist, gpt2, gpt3, llama) built from its ``params`` (the ``model`` section);
    ``ConfigError`` listing every key it cannot honour, ``MissingExtras`` without transformers. The module's
    ``ignored_keys`` lists the keys that matter only on Cerebras hardware (see :func:`check_model`)."""
    keys, ignored = parse_model(name, params, prefix)
    model: FcMnist | CausalLM
    if isinstance(keys, FcMnistKeys):
        model = FcMnist(keys)
    else:
        hf = _hf_model(name, keys)
        _initialize(hf, keys)
        model = CausalLM(hf, keys)
    model.ignored_keys = ignored
    return model


def check_model(name: str, params: dict[str, Any], *, prefix: str = "model") -> list[str]:
    """The key paths of ``params`` that dls accepts and ignores (Cerebras hardware only, inference); ``ConfigError``
    as :func:`build_model` raises it. Needs neither transformers nor torch work."""
    return parse_model(name, params, prefix)[1]
