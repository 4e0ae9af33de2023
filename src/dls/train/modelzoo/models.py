"""Model Zoo's models on Hugging Face's classes and its optimizer: :func:`build_model` (``fc_mnist``;
``gpt2``/``gpt3``/``llama`` on transformers' GPT-2 and Llama classes, configured from Model Zoo's keys and
initialised as Model Zoo does), :func:`fit_to_data` (can the model read its data), Model Zoo's parameter groups
(:func:`param_groups`: no weight decay on biases and norms, muP's learning-rate groups) and cstorch's Adam
(:class:`CerebrasAdam`).

A GPT model's ``loss(batch)`` is Model Zoo's GPTLMHeadModelLoss in float32: the summed token cross-entropy over the
loss mask divided by the number of unmasked tokens (``loss_scaling: num_tokens``; NaN for a batch without one, as
Model Zoo's) or by the batch size and multiplied by ``loss_weight`` (``batch_size``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from dls.train.batches import TrainModel
from dls.train.config.zoo_keys import FcMnistKeys, GptKeys, Initializer, parse_model
from dls.train.errors import ConfigError
from dls.train.modelzoo.data import IGNORE_INDEX, Batch, GptDataset
from dls.train.modelzoo.extra import require


class FcMnist(TrainModel):
    """Model Zoo's fc_mnist: Linear layers of ``hidden_sizes`` (else ``depth`` of ``hidden_size``), each then ReLU
    when ``activation_fn: relu``, then dropout; a Linear layer to 10 classes; the NLL loss of the log-softmax (of
    the raw logits with ``disable_softmax``)."""

    def __init__(self, k: FcMnistKeys) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = 784  # 28 x 28 pixels
        for size in k.hidden_sizes if k.hidden_sizes is not None else [k.hidden_size or 0] * (k.depth or 0):
            layers += [nn.Linear(width, size, bias=k.use_bias), *([nn.ReLU()] if k.activation_fn else [])]
            layers.append(nn.Dropout(k.dropout))
            width = size
        self.hidden = nn.Sequential(*layers)
        self.last_layer = nn.Linear(width, 10, bias=k.use_bias)
        self.disable_softmax = k.disable_softmax

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.last_layer(self.hidden(torch.flatten(images, 1)))

    def loss(self, batch: Batch) -> torch.Tensor:
        images, labels = batch
        logits = self(images).float()
        return F.nll_loss(logits if self.disable_softmax else F.log_softmax(logits, dim=1), labels)


class CausalLM(TrainModel):
    """Model Zoo's ``name``: llama as Hugging Face's LlamaForCausalLM (swiglu: its MLP gates with silu), gpt2 and
    gpt3 as GPT2LMHeadModel, whose ``Conv1D`` layers (``x @ W + b``) become ``nn.Linear`` layers so that every matrix
    product is an ``nn.Linear`` (what ``dls.fp8.emulate_recipe`` replaces); initialised by :func:`_initialize`, with
    Model Zoo's loss. A batch is ``(input_ids, labels)``, labels ``IGNORE_INDEX`` where Model Zoo's
    ``attention_mask`` (a loss mask) is 0."""

    def __init__(self, name: str, k: GptKeys) -> None:
        super().__init__()
        common = dict(
            vocab_size=k.vocab_size, initializer_range=k.initializer_range, use_cache=False, bos_token_id=None,
            eos_token_id=None, tie_word_embeddings=k.share_embedding_weights,
        )  # fmt: skip
        attention_dropout = k.dropout_rate if k.attention_dropout_rate is None else k.attention_dropout_rate
        if name == "llama":
            rope: dict[str, Any] = {"rope_type": "default", "rope_theta": k.rope_theta}
            if k.pos_scaling_type == "llama3":
                assert k.pos_scaling_extra_args is not None  # parse_model requires them
                rope.update(rope_type="llama3", factor=k.pos_scaling_factor, **k.pos_scaling_extra_args.model_dump())
            elif k.pos_scaling_factor != 1.0:  # linear position interpolation: positions / factor
                rope.update(rope_type="linear", factor=k.pos_scaling_factor)
            hf = require("transformers.models.llama.modeling_llama")
            self.hf = hf.LlamaForCausalLM(hf.LlamaConfig(
                hidden_size=k.hidden_size, intermediate_size=k.filter_size, num_hidden_layers=k.num_hidden_layers,
                num_attention_heads=k.num_heads, hidden_act="silu", max_position_embeddings=k.max_position_embeddings,
                num_key_value_heads=k.extra_attention_params.num_kv_groups or k.num_heads, rope_parameters=rope,
                rms_norm_eps=k.layer_norm_epsilon, attention_bias=k.use_projection_bias_in_attention,
                attention_dropout=attention_dropout, mlp_bias=k.use_ffn_bias, **common,
            ))  # fmt: skip
        else:
            hf = require("transformers.models.gpt2.modeling_gpt2")
            self.hf = hf.GPT2LMHeadModel(hf.GPT2Config(
                n_positions=k.max_position_embeddings, n_embd=k.hidden_size, n_layer=k.num_hidden_layers,
                n_head=k.num_heads, n_inner=k.filter_size,
                activation_function=k.nonlinearity,  # Model Zoo's gelu is the exact GELU: transformers' "gelu"
                resid_pdrop=k.dropout_rate, attn_pdrop=attention_dropout,
                embd_pdrop=k.dropout_rate if k.embedding_dropout_rate is None else k.embedding_dropout_rate,
                layer_norm_epsilon=k.layer_norm_epsilon, scale_attn_weights=k.attention_type == "scaled_dot_product",
                scale_attn_by_inverse_layer_idx=k.scale_qk_dot_by_layer_idx, **common,
            ))  # fmt: skip
            for parent in list(self.hf.modules()):
                for child_name, child in list(parent.named_children()):
                    if isinstance(child, hf.Conv1D):
                        setattr(parent, child_name, nn.Linear(child.nx, child.nf))
        _initialize(self.hf, k)
        self.keys = k
        self.loss_scaling = k.loss_scaling
        self.loss_weight = k.loss_weight if k.loss_scaling == "batch_size" else 1.0
        self.logits_scale = k.logits_scale
        if (factor := k.attention_factor) != 1.0:  # on the keys, as Model Zoo scales them: the logits follow
            keys = (h for m, h in self.hf.named_modules() if m.endswith(".k_proj" if name == "llama" else ".c_attn"))
            for projection in keys:  # GPT-2's c_attn holds the queries, keys and values side by side
                part = None if name == "llama" else (k.hidden_size, 2 * k.hidden_size)
                projection.register_forward_hook(_Times(factor, output=True, part=part))
        if k.embeddings_scale != 1.0:  # the embeddings (tokens plus positions), before GPT-2's embedding dropout
            llama = name == "llama"
            target = self.hf.model.embed_tokens if llama else self.hf.transformer.drop
            register = target.register_forward_hook if llama else target.register_forward_pre_hook
            register(_Times(k.embeddings_scale, output=llama))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.hf(input_ids=input_ids).logits
        if self.logits_scale:  # muP: in the logits' dtype, as Model Zoo multiplies them
            logits = logits * torch.tensor(self.logits_scale, dtype=logits.dtype, device=logits.device)
        return logits

    def loss(self, batch: Batch) -> torch.Tensor:
        input_ids, labels = batch
        logits = self(input_ids).float()
        total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        if self.loss_scaling == "num_tokens":
            return total / (labels != IGNORE_INDEX).sum()
        return total / labels.shape[0] * self.loss_weight


def _initializers(k: GptKeys) -> dict[str, Initializer]:
    """Model Zoo's initializer of each role (GPT2LMHeadModel): attention ``initializer``; FFN ``ffn_initializer``
    (else ``initializer``); the output layers of attention and FFN ``output_layer_initializer`` (``ffn_output_
    layer_initializer``), by default truncated normal with std initializer_range / sqrt(2 layers) unless
    ``initializer`` is set; all truncated normal with std initializer_range by default. muP scales them by the width
    multipliers: attention and FFN by its inverse square root, the output layers by that of the hidden (FFN output:
    the filter) width and of 2 layers."""
    default = Initializer(name="truncated_normal", std=k.initializer_range)
    depth = (2 * k.num_hidden_layers) ** -0.5
    attention, ffn = k.initializer or default, k.ffn_initializer or k.initializer or default
    output, ffn_output = k.output_layer_initializer, k.ffn_output_layer_initializer
    if k.mup_base_hidden_size is not None:
        width = (k.hidden_size / k.mup_base_hidden_size) ** -0.5
        attention, ffn, output = attention.scaled(width), ffn.scaled(width), (output or default).scaled(width * depth)
    if k.mup_base_filter_size is not None:
        ffn_output = (ffn_output or default).scaled((k.filter_size / k.mup_base_filter_size) ** -0.5 * depth)
    if output is None and k.initializer is None:
        output = default.scaled(depth)
    return {
        "embedding": k.embedding_initializer or default, "attention": attention, "ffn": ffn,
        "output": output or attention, "ffn_output": ffn_output or output or ffn,
    }  # fmt: skip


class _Times:
    """A hook multiplying a module's input (``output``: its output) by ``factor`` in its dtype, as Model Zoo multiplies
    by a tensor of it; ``part``: only the columns ``[start, stop)`` of the last dimension. Picklable."""

    def __init__(self, factor: float, output: bool, part: tuple[int, int] | None = None) -> None:
        self.factor, self.output, self.part = factor, output, part

    def __call__(self, module: nn.Module, args: tuple[Any, ...], *result: Any) -> Any:
        x = result[0] if self.output else args[0]
        factor = torch.tensor(self.factor, dtype=x.dtype, device=x.device)
        if self.part is None:
            scaled = x * factor
        else:
            start, stop = self.part
            scaled = torch.cat([x[..., :start], x[..., start:stop] * factor, x[..., stop:]], dim=-1)
        return scaled if self.output else (scaled, *args[1:])


@torch.no_grad()
def _initialize(hf: nn.Module, k: GptKeys) -> None:
    """Model Zoo's initialisation (:func:`_initializers`); an untied LM head normal(0, initializer_range); biases 0,
    norms 1."""
    init = _initializers(k)
    roles = {
        **dict.fromkeys(("c_attn", "q_proj", "k_proj", "v_proj"), init["attention"]),
        **dict.fromkeys(("attn.c_proj", "o_proj"), init["output"]),
        **dict.fromkeys(("c_fc", "gate_proj", "up_proj"), init["ffn"]),
        **dict.fromkeys(("mlp.c_proj", "down_proj"), init["ffn_output"]),
        "lm_head": Initializer(name="normal", std=k.initializer_range),
    }
    for name, module in hf.named_modules():
        if isinstance(module, nn.Embedding):
            init["embedding"].fill_(module.weight)
        elif isinstance(module, nn.Linear):
            if not (k.share_embedding_weights and name == "lm_head"):
                roles[next(r for r in roles if name == r or name.endswith("." + r))].fill_(module.weight)
            if module.bias is not None:
                module.bias.zero_()
        elif not list(module.children()):
            for pname, param in module.named_parameters(recurse=False):
                param.fill_(0.0 if pname == "bias" else 1.0)


def build_model(name: str, params: dict[str, Any], *, prefix: str = "model") -> FcMnist | CausalLM:
    """Model Zoo's model ``name`` (fc_mnist, gpt2, gpt3, llama) built from its ``params`` (the ``model`` section);
    ``ConfigError`` listing every key it cannot honour (as :func:`parse_model`, which builds nothing and says which
    keys are ignored here), ``MissingExtras`` without transformers."""
    keys = parse_model(name, params, prefix)[0]
    return FcMnist(keys) if isinstance(keys, FcMnistKeys) else CausalLM(name, keys)


# ----------------------------------------------------------------------------------- Model Zoo's parameter groups
# Model Zoo's learning-rate groups of its GPT models (GPT2LMHeadModelConfig.create_default_lr_adjustment_groups,
# patterns over its own parameter names), as the Hugging Face modules whose weights they hold: embedding
# ("*embedding*weight": token and position embeddings), decoder_attention ("*decoder*attn*dense*weight": the query,
# key, value and output projections), decoder_input_ffn and decoder_output_ffn (the FFN's first and last layers),
# decoder_kernel (every decoder weight: the three before, Model Zoo's group before Release 2.3).
_GROUP_MODULES = {
    "embedding": ("wte", "wpe", "embed_tokens"),
    "decoder_attention": ("c_attn", "attn.c_proj", "q_proj", "k_proj", "v_proj", "o_proj"),
    "decoder_input_ffn": ("c_fc", "gate_proj", "up_proj"),
    "decoder_output_ffn": ("mlp.c_proj", "down_proj"),
}
_GROUP_MODULES["decoder_kernel"] = sum((_GROUP_MODULES[g] for g in _GROUP_MODULES if g != "embedding"), ())
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, nn.RMSNorm)


def _is_norm(module: nn.Module) -> bool:
    """A normalisation layer (Model Zoo's list, and Hugging Face's RMSNorm classes, which Model Zoo's RMSNorm is)."""
    return isinstance(module, _NORMS) or type(module).__name__.endswith("RMSNorm")


def param_groups(
    model: nn.Module, weight_decay: float, adjust: dict[str, float], prefix: str = "optimizer.adjust_learning_rate"
) -> list[dict[str, Any]]:
    """The optimizer's parameter groups as Model Zoo's ``configure_param_groups`` makes them: no weight decay for
    biases and normalisation layers; each group's learning-rate factor (its ``lr``, which the LR schedule multiplies)
    from muP (:meth:`GptKeys.lr_scales`) overridden by ``adjust`` (``adjust_learning_rate``: :data:`LR_GROUPS`).
    Groups in Model Zoo's order (with weight decay first; adjusted ones first), empty and equal ones merged.
    ``ConfigError`` when a parameter would take two different factors (Model Zoo would put it in two groups)."""
    keys = getattr(model, "keys", None)
    scales = {**(keys.lr_scales() if isinstance(keys, GptKeys) else {}), **adjust}
    scales = {g: v for g, v in scales.items() if v != 1.0}
    norms = {f"{n}.{p}" for n, m in model.named_modules() if _is_norm(m) for p, _ in m.named_parameters(recurse=False)}
    order = [(decay, scale) for decay in (weight_decay, 0.0) for scale in [*dict.fromkeys(scales.values()), 1.0]]
    groups: dict[tuple[float, float], list[nn.Parameter]] = {key: [] for key in order}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        module = name.removeprefix("hf.").removesuffix(".weight")
        found = {g: v for g, v in scales.items() if name.endswith(".weight") and _holds(module, _GROUP_MODULES[g])}
        if len(set(found.values())) > 1:
            listed = ", ".join(f"{g} ({v:g})" for g, v in found.items())
            where = name.removeprefix("hf.")
            raise ConfigError([f"{prefix}: {where} is in groups of different factors: {listed}; give them one factor"])
        decay = 0.0 if "bias" in name or name in norms else weight_decay
        groups[(decay, next(iter(found.values()), 1.0))].append(param)
    return [{"params": p, "weight_decay": decay, "lr": scale} for (decay, scale), p in groups.items() if p]


def _holds(module: str, names: tuple[str, ...]) -> bool:
    return any(module == n or module.endswith("." + n) for n in names)


def fit_to_data(model: Any, dataset: Any, prefix: str = "model") -> None:
    """``ConfigError`` naming ``prefix``'s key when a Model Zoo language model cannot read ``dataset``'s sequences
    (longer than its positions, a larger vocabulary); a GPT data set then refuses a batch holding a token id outside
    the model's vocabulary, as it reads it (the files are not scanned up front)."""
    if not isinstance(model, CausalLM):
        return
    info, positions, vocab = dataset.info, model.hf.config.max_position_embeddings, model.hf.config.vocab_size
    if info.sequence_length > positions:
        data = f"shorter than the data's sequences of {info.sequence_length} tokens"
        raise ConfigError([f"{prefix}.max_position_embeddings: {positions}, {data}"])
    if info.vocab_size > vocab:
        raise ConfigError([f"{prefix}.vocab_size: {vocab}, smaller than the data's {info.vocab_size}"])
    if isinstance(dataset, GptDataset):
        dataset.vocab = (vocab, f"{prefix}.vocab_size")
