"""Cerebras Model Zoo's models and data formats for ``dls train`` (the ``modelzoo`` extra: h5py, transformers):
:func:`build_model` (``fc_mnist``; ``gpt2``/``gpt3``/``llama`` on Hugging Face's GPT-2 and Llama classes, configured
from Model Zoo's keys and initialised as Model Zoo does), :func:`build_loader` (``GptHDF5DataProcessor``,
``GptHDF5MapDataProcessor``, ``MNISTDataProcessor`` as resumable batches), :func:`check_data`, :func:`fit_to_data`,
and :func:`write_tiny_data` / :func:`main` (``dls data {mnist,gpt} DIR``).

The keys of the ``model`` and data-loader sections (:func:`parse_model`, :func:`parse_loader`: no files read) are
validated with pydantic (strict numbers), defaults as Model Zoo's own config classes set them. Every key Model Zoo
knows for these models is honoured (a field below), ``_DEFAULT_ONLY`` (a feature the Hugging Face classes cannot
express: any value but Model Zoo's default is an error naming the key) or ``_IGNORED`` (for Cerebras hardware or
inference only: accepted and listed back); anything else is a misspelling, reported with "did you mean".

A GPT model's ``loss(batch)`` is Model Zoo's GPTLMHeadModelLoss in float32: the summed token cross-entropy over the
loss mask divided by the number of unmasked tokens (``loss_scaling: num_tokens``; NaN for a batch without one, as
Model Zoo's) or by the batch size and multiplied by ``loss_weight`` (``batch_size``)."""

from __future__ import annotations

import argparse
import gzip
import importlib
import inspect
import logging
import math
import zlib
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from torch import nn
from torch.nn import functional as F

from dls.train.config import ZOO_MODELS, ZOO_PROCESSORS, Finite, did_you_mean
from dls.train.data import BatchIterator, DataInfo, Dataset, TrainModel
from dls.train.errors import ConfigError, MissingExtras

Batch = tuple[torch.Tensor, torch.Tensor]


def require(module: str) -> ModuleType:
    """Import ``module`` of the ``modelzoo`` extra, or ``MissingExtras`` naming the extra."""
    # transformers' model modules import torchao, which logs warnings about its optional C extensions and pytree
    # registrations at import: nothing about this run, so logging is quiet while they load.
    quiet = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra = "Model Zoo models and data need the modelzoo extra: pip install 'dls[modelzoo]'"
        raise MissingExtras(f"{module.split('.')[0]} is not installed; {extra}") from exc
    finally:
        logging.disable(quiet)


Positive = Annotated[int, Field(gt=0)]
Number = Annotated[float, Finite()]  # finite, at most float32's max in size: as every float key of the config
PositiveFloat = Annotated[float, Finite(gt=0)]
Rate = Annotated[float, Finite(ge=0, le=1)]
IGNORE_INDEX = -100  # a label that the loss skips: where Model Zoo's attention_mask (a loss mask) is 0


class _Keys(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


_INIT_ARGS = {"truncated_normal": ("mean", "std", "a", "b"), "normal": ("mean", "std"), "uniform": ("a", "b")}


class Initializer(_Keys):
    """``{name, ...}`` or just the name; defaults as Model Zoo's (truncated_normal: std 0.05, a/b = -/+2 std)."""

    name: Literal[tuple(_INIT_ARGS)]  # type: ignore[valid-type]
    mean: Number = 0.0
    std: PositiveFloat = 0.05
    a: Number | None = None
    b: Number | None = None

    @model_validator(mode="before")
    @classmethod
    def _named(cls, data: Any) -> Any:
        data = {"name": data} if isinstance(data, str) else data
        if isinstance(data, dict) and data.get("name") in _INIT_ARGS:
            unused = sorted(set(data) - {"name", *_INIT_ARGS[data["name"]]})
            if unused:
                raise ValueError(f"{', '.join(unused)} not used by the {data['name']} initializer")
        return data

    def fill_(self, tensor: Any) -> None:
        if self.name == "truncated_normal":
            a, b = (-2 * self.std if self.a is None else self.a), (2 * self.std if self.b is None else self.b)
            nn.init.trunc_normal_(tensor, self.mean, self.std, a, b)
        elif self.name == "normal":
            nn.init.normal_(tensor, self.mean, self.std)
        else:
            nn.init.uniform_(tensor, -0.05 if self.a is None else self.a, 0.05 if self.b is None else self.b)


class FcMnistKeys(_Keys):
    name: Literal["fc_mnist"] = "fc_mnist"
    hidden_sizes: list[Positive] | None = None  # takes precedence over depth and hidden_size
    depth: Positive | None = None
    hidden_size: Positive | None = None
    activation_fn: Literal["relu"] | None = None  # None: no nonlinearity (the current layout's default)
    dropout: Rate = 0.0
    use_bias: bool = True
    disable_softmax: bool = False  # the NLL loss then reads the raw logits, as Model Zoo's does
    mixed_precision: bool | None = None  # read by the trainer's precision set-up
    fp16_type: Literal["float16", "bfloat16", "cbfloat16"] | None = None

    @model_validator(mode="after")
    def _sizes(self) -> FcMnistKeys:
        if self.hidden_sizes is None and (self.depth is None or self.hidden_size is None):
            raise ValueError("hidden_size and depth, or hidden_sizes, must be given")
        return self


class _AttentionParams(_Keys):
    num_kv_groups: Positive | None = None


class _PosScalingArgs(_Keys):
    low_freq_factor: PositiveFloat | None = None
    high_freq_factor: PositiveFloat | None = None
    original_max_position_embeddings: Positive | None = None


class GptKeys(_Keys):
    """Model Zoo's GPT2ModelConfig, shared by gpt2, gpt3 (Cerebras-GPT) and llama."""

    name: Literal["gpt2", "gpt3", "llama", "LlamaModel"] | None = None
    vocab_size: Annotated[int, Field(ge=1, le=512000)]
    hidden_size: Positive = 768
    num_hidden_layers: Positive = 12
    num_heads: Positive = 12
    filter_size: Positive = 3072
    max_position_embeddings: Positive = 1024
    position_embedding_type: Literal["learned", "fixed", "relative", "rotary", "alibi"] | None = "learned"
    share_embedding_weights: bool = True
    dropout_rate: Rate = 0.1
    embedding_dropout_rate: Rate | None = None  # None: dropout_rate
    attention_dropout_rate: Rate | None = None  # None: dropout_rate
    norm_type: str = "layernorm"
    layer_norm_epsilon: PositiveFloat = 1e-5
    nonlinearity: str = "gelu"
    attention_type: Literal["dot_product", "scaled_dot_product"] = "scaled_dot_product"
    attention_module: Literal["aiayn_attention", "multiquery_attention"] = "aiayn_attention"
    extra_attention_params: _AttentionParams = _AttentionParams()
    scale_qk_dot_by_layer_idx: bool = False
    use_projection_bias_in_attention: bool = True
    use_ffn_bias_in_attention: bool = True
    use_ffn_bias: bool = True
    use_bias_in_output: bool = False
    rotary_dim: Positive | None = None  # None: a quarter of the head size (Model Zoo's default)
    rope_theta: PositiveFloat = 10000.0
    pos_scaling_factor: PositiveFloat = 1.0
    pos_scaling_type: Literal["linear", "yarn", "YaRN", "llama3", "longrope"] = "linear"
    pos_scaling_extra_args: _PosScalingArgs | None = None
    initializer_range: PositiveFloat = 0.02
    embedding_initializer: Initializer | None = None
    initializer: Initializer | None = None
    output_layer_initializer: Initializer | None = None
    ffn_initializer: Initializer | None = None
    ffn_output_layer_initializer: Initializer | None = None
    loss_scaling: Literal["num_tokens", "batch_size"] = "num_tokens"
    loss_weight: PositiveFloat = 1.0
    mixed_precision: bool | None = None  # read by the trainer's precision set-up
    fp16_type: Literal["float16", "bfloat16", "cbfloat16"] | None = None


_GPT_DEFAULT_ONLY: dict[str, Any] = {
    **dict.fromkeys((
        "constant_pos_embedding", "attention_inner_dim", "attention_sliding_window_length", "attention_sink_tokens",
        "attention_vertical_column_spacing", "attention_vertical_column_width", "attention_chunk_size",
        "attention_qk_norm_layer", "attention_logit_softcapping", "final_logit_softcapping", "fixed_sparse_attention",
        "memory_tokens", "rel_distance_extra_args", "mup_base_hidden_size", "mup_base_filter_size",
        "scale_qk_dot_by_d", "output_logits_alpha", "output_logits_scale", "lr_adjustment_groups", "moe", "moe_params",
    ), None),
    **dict.fromkeys((
        "embedding_layer_norm", "alibi_trainable_slopes", "sliding_window_every_other_decoder_layer",
        "norm_first_sandwich",
    ), False),
    "position_embedding_offset": 0, "num_extra_input_vocab_tokens": 0, "extra_ffn_params": {},
    "cross_attention_layers": [], "rel_distance_mode": "default", "embeddings_scale": 1.0,
    "attention_logits_alpha": 1.0, "scale_output_logits_by_d": True,
}  # fmt: skip
_GPT_IGNORED = (
    "attention_kernel", "attention_softmax_fp32", "fold_rope_consts", "pad_rope", "use_experimental_flex_api",
    "num_relative_attention_buckets", "attention_qk_norm_eps", "compute_eval_metrics", "boundary_casting",
    "tf_summary", "dtype", "start_token", "stop_sequences", "max_tokens", "loop_dim", "temperature", "top_k", "top_p",
)  # fmt: skip
_FC_DEFAULT_ONLY: dict[str, Any] = {"to_float16": False}
_FC_IGNORED = ("compute_eval_metrics",)

_LOADER_DEFAULT_ONLY: dict[str, Any] = {
    "use_vsl": False, "mixture": None, "data_subset": None, "num_samples": None, "pad_last": False,
    "sort_files": True, "use_fake_data": False,
}  # fmt: skip
_LOADER_IGNORED = (
    "num_workers", "prefetch_factor", "persistent_workers", "use_worker_cache", "shuffle_buffer", "micro_batch_size",
    "to_float16", "fake_data_seed", "vocab_size", "repeat", "use_multiple_workers", "mixed_precision",
)  # fmt: skip


class LoaderKeys(_Keys):
    data_processor: Literal[ZOO_PROCESSORS] | None = None  # type: ignore[valid-type]
    data_dir: str | list[str] | None = None
    batch_size: Positive
    shuffle: bool | None = None
    shuffle_seed: int | None = None
    drop_last: bool | None = None
    drop_last_batch: bool | None = None  # the legacy layout's name of drop_last
    split: Literal["train", "val"] | None = None  # MNISTDataProcessor
    max_sequence_length: Positive | None = None  # GptHDF5MapDataProcessor, corpus (1-D) layout


def _validate(
    cls: type[_Keys], params: Any, prefix: str, default_only: dict[str, Any], ignored: tuple[str, ...], more: Callable
) -> tuple[Any, list[str]]:
    """``(keys, ignored key paths)``; ``ConfigError`` listing every problem, with those ``more(keys, ignored)``
    finds in keys that validate (it may add to ``ignored``)."""
    if not isinstance(params, dict):
        raise ConfigError([f"{prefix}: a mapping of keys is expected; got {type(params).__name__}"])
    why = "cannot be expressed by dls's Model Zoo models (only the default {!r} can)"
    changed = [k for k in params if k in default_only and params[k] != default_only[k]]
    problems = [f"{prefix}.{k}: {params[k]!r} {why.format(default_only[k])}" for k in changed]
    skipped = [f"{prefix}.{k}" for k in params if k in ignored]
    try:
        keys = cls.model_validate({k: v for k, v in params.items() if k not in default_only and k not in ignored})
        problems += more(keys, skipped)
    except ValidationError as exc:
        known = [*default_only, *ignored, *cls.model_fields, *Initializer.model_fields, *_PosScalingArgs.model_fields]
        for err in exc.errors():
            path = ".".join([prefix, *(str(p) for p in err["loc"])])
            if err["type"] == "extra_forbidden":
                problems.append(f"{path}: unknown key{did_you_mean(err['loc'][-1], known)}")
            else:
                got = f" (got {err['input']!r})" if err["type"] != "missing" else ""
                problems.append(f"{path}: {err['msg'].removeprefix('Value error, ')}{got}")
    if problems:
        raise ConfigError(problems)
    return keys, skipped


def _gpt_problems(name: str, prefix: str, k: GptKeys, ignored: list[str]) -> Iterator[str]:
    """What the Hugging Face class for ``name`` cannot express (``builds``: the values it builds, for the keys where
    it builds only some of Model Zoo's); the keys it does not use are added to ``ignored``."""
    llama, head = name == "llama", k.hidden_size // k.num_heads
    builds: dict[str, tuple[Any, ...]]
    if llama:  # it rotates whole heads, and has one attention_bias for all four projections
        hf, builds = "LlamaForCausalLM", {
            "position_embedding_type": ("rotary",), "norm_type": ("rmsnorm",), "nonlinearity": ("swiglu",),
            "attention_type": ("scaled_dot_product",), "dropout_rate": (0.0,), "embedding_dropout_rate": (0.0,),
            "pos_scaling_type": ("linear", "llama3"), "scale_qk_dot_by_layer_idx": (False,), "rotary_dim": (head,),
            "use_ffn_bias_in_attention": (k.use_projection_bias_in_attention,), "use_bias_in_output": (False,),
        }  # fmt: skip
    else:
        hf, builds = "GPT2LMHeadModel", {
            "position_embedding_type": ("learned",), "norm_type": ("layernorm",),
            "nonlinearity": ("gelu", "gelu_new", "relu", "silu", "tanh"),  # transformers' (gelu: the exact GELU)
            "attention_module": ("aiayn_attention",), "use_projection_bias_in_attention": (True,),
            "use_ffn_bias_in_attention": (True,), "use_ffn_bias": (True,), "use_bias_in_output": (False,),
        }  # fmt: skip
    values = dict(k)  # as Model Zoo reads them: the rates default to dropout_rate, rotary_dim to a quarter head
    values["embedding_dropout_rate"] = k.dropout_rate if k.embedding_dropout_rate is None else k.embedding_dropout_rate
    values["rotary_dim"] = k.rotary_dim if k.rotary_dim is not None else int(head * 0.25)
    yield from (
        f"{prefix}.{key}: {values[key]!r} cannot be built by Hugging Face's {hf} (only {' or '.join(map(repr, ok))})"
        for key, ok in builds.items()
        if values[key] not in ok
    )
    if k.hidden_size % k.num_heads:
        yield f"{prefix}.num_heads: {k.num_heads} does not divide hidden_size ({k.hidden_size})"
    if k.loss_scaling == "num_tokens" and k.loss_weight != 1.0:
        ignored.append(f"{prefix}.loss_weight (Model Zoo uses 1.0 with loss_scaling: num_tokens)")
    groups = k.extra_attention_params.num_kv_groups
    if k.attention_module == "multiquery_attention" and (groups is None or k.num_heads % groups):
        why = f"multiquery_attention needs a number of key/value heads that divides num_heads ({k.num_heads})"
        yield f"{prefix}.extra_attention_params.num_kv_groups: {groups!r}; {why}"
    elif k.attention_module != "multiquery_attention" and groups is not None:
        yield f"{prefix}.extra_attention_params.num_kv_groups: needs multiquery_attention"
    if not llama:
        fields = ("rotary_dim", "rope_theta", "pos_scaling_type", "pos_scaling_factor", "pos_scaling_extra_args")
        ignored += [f"{prefix}.{f} (learned positions)" for f in fields if f in k.model_fields_set]
    elif k.pos_scaling_type == "llama3":
        args = k.pos_scaling_extra_args or _PosScalingArgs()
        missing = [f for f in _PosScalingArgs.model_fields if getattr(args, f) is None]
        yield from (f"{prefix}.pos_scaling_extra_args.{f}: required with pos_scaling_type llama3" for f in missing)


def parse_model(name: str, params: Any, prefix: str = "model") -> tuple[FcMnistKeys | GptKeys, list[str]]:
    """The validated keys of model ``name`` and the key paths ignored here (for a GPT model, also the keys its Hugging
    Face class does not use); ``ConfigError`` listing every problem, every key that class cannot express included."""
    if name == "fc_mnist":
        return _validate(FcMnistKeys, params, prefix, _FC_DEFAULT_ONLY, _FC_IGNORED, lambda keys, ignored: [])
    if name not in ZOO_MODELS:
        raise ConfigError([f"{prefix}.name: {name!r} is not a Model Zoo model dls builds ({', '.join(ZOO_MODELS)})"])
    return _validate(GptKeys, params, prefix, _GPT_DEFAULT_ONLY, _GPT_IGNORED, partial(_gpt_problems, name, prefix))


def parse_loader(processor: str, params: Any, prefix: str) -> tuple[LoaderKeys, list[str]]:
    """The validated keys of a data loader section and the key paths ignored here; ``ConfigError`` otherwise."""
    if processor not in ZOO_PROCESSORS:
        raise ConfigError([f"{prefix}.data_processor: {processor!r} is not one of {', '.join(ZOO_PROCESSORS)}"])

    def problems(keys: LoaderKeys, ignored: list[str]) -> Iterator[str]:
        if processor == "GptHDF5DataProcessor" and keys.max_sequence_length is not None:
            ignored.append(f"{prefix}.max_sequence_length (GptHDF5DataProcessor reads it from the data)")
        if keys.data_processor not in (None, processor):
            yield f"{prefix}.data_processor: {keys.data_processor!r}, but {processor} is being built"
        if None not in (keys.drop_last, keys.drop_last_batch) and keys.drop_last != keys.drop_last_batch:
            yield f"{prefix}.drop_last_batch: contradicts drop_last"
        if keys.shuffle is None and processor == "GptHDF5DataProcessor":  # the others have a default
            yield f"{prefix}.shuffle: required by {processor}"
        if processor == "MNISTDataProcessor" and isinstance(keys.data_dir, list):
            yield f"{prefix}.data_dir: MNISTDataProcessor reads one directory, not a list"
        if processor != "MNISTDataProcessor" and not keys.data_dir:
            yield f"{prefix}.data_dir: required by {processor}"

    return _validate(LoaderKeys, params, prefix, _LOADER_DEFAULT_ONLY, _LOADER_IGNORED, problems)


# ---------------------------------------------------------------------- the models and data readers the keys build
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
    product is an ``nn.Linear`` (what ``dls.fp8.emulate`` replaces); initialised by :func:`_initialize`, with Model
    Zoo's loss. A batch is ``(input_ids, labels)``, labels ``IGNORE_INDEX`` where Model Zoo's ``attention_mask`` (a
    loss mask) is 0."""

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
        self.loss_scaling = k.loss_scaling
        self.loss_weight = k.loss_weight if k.loss_scaling == "batch_size" else 1.0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids).logits

    def loss(self, batch: Batch) -> torch.Tensor:
        input_ids, labels = batch
        logits = self(input_ids).float()
        total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        if self.loss_scaling == "num_tokens":
            return total / (labels != IGNORE_INDEX).sum()
        return total / labels.shape[0] * self.loss_weight


@torch.no_grad()
def _initialize(hf: nn.Module, k: GptKeys) -> None:
    """Model Zoo's initialisation: embeddings ``embedding_initializer``; attention ``initializer``; FFN
    ``ffn_initializer`` (else ``initializer``); the output layers of attention and FFN ``output_layer_initializer``
    (``ffn_output_layer_initializer``), by default truncated normal with std initializer_range / sqrt(2 layers)
    unless ``initializer`` is set; an untied LM head normal(0, initializer_range); biases 0, norms 1."""
    default = Initializer(name="truncated_normal", std=k.initializer_range)
    ffn = k.ffn_initializer or k.initializer or default
    output = k.output_layer_initializer
    if output is None and k.initializer is None:
        output = Initializer(name="truncated_normal", std=k.initializer_range / math.sqrt(2 * k.num_hidden_layers))
    roles = {
        **dict.fromkeys(("c_attn", "q_proj", "k_proj", "v_proj"), k.initializer or default),
        **dict.fromkeys(("attn.c_proj", "o_proj"), output or k.initializer or default),
        **dict.fromkeys(("c_fc", "gate_proj", "up_proj"), ffn),
        **dict.fromkeys(("mlp.c_proj", "down_proj"), k.ffn_output_layer_initializer or output or ffn),
        "lm_head": Initializer(name="normal", std=k.initializer_range),
    }
    for name, module in hf.named_modules():
        if isinstance(module, nn.Embedding):
            (k.embedding_initializer or default).fill_(module.weight)
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


def read_idx(path: Path, magic: int) -> np.ndarray:
    """An IDX file (big-endian magic and dimensions, then unsigned bytes), plain or gzip'd."""
    raw = path.read_bytes()
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, gzip.BadGzipFile, zlib.error) as exc:  # truncated, not gzip, corrupt
            raise ValueError(f"{path}: not a readable gzip file ({exc})") from None
    ndim = magic & 0xFF
    if len(raw) < 4 + 4 * ndim or int.from_bytes(raw[:4], "big") != magic:
        raise ValueError(f"{path}: not an IDX file with magic {magic}")
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != math.prod(dims):
        raise ValueError(f"{path}: {data.size} bytes of data for dimensions {dims}")
    return data.reshape(dims)


class MnistDataset(Dataset):
    """An images and a labels IDX file, normalised as Model Zoo does (mean 0.1307, std 0.3081)."""

    def __init__(self, images_file: Path, labels_file: Path) -> None:
        images, labels = read_idx(images_file, 2051), read_idx(labels_file, 2049)
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.x, self.y = torch.from_numpy(images.copy()), torch.from_numpy(labels.astype(np.int64))
        self.info = DataInfo(input_dim=images[0].size, output_dim=10)

    def batch(self, indices: torch.Tensor, epoch: int) -> Batch:
        return ((self.x[indices].float() / 255 - 0.1307) / 0.3081).unsqueeze(1), self.y[indices]


class GptDataset(Dataset):
    """Samples of ``[N, 3, msl]`` files, or windows of ``msl + 1`` tokens of a flat token stream over all files
    (``msl`` tokens apart). A batch holding a token id outside ``vocab`` (set by :func:`fit_to_data`) is refused."""

    def __init__(self, files: list[Any], msl: int | None) -> None:
        self.data = files
        self.starts = np.cumsum([0, *(len(d) for d in self.data)])
        self.flat = self.data[0].ndim == 1
        self.msl = int(msl if self.flat else self.data[0].shape[2])  # type: ignore[arg-type]
        self.info = DataInfo(sequence_length=self.msl)
        self.vocab: tuple[int, str] | None = None  # (vocab_size, its key)

    def __len__(self) -> int:
        return (int(self.starts[-1]) - 1) // self.msl if self.flat else int(self.starts[-1])

    def batch(self, indices: torch.Tensor, epoch: int) -> Batch:
        idx = indices.numpy()
        if self.flat:
            tokens = np.stack([self._read(i * self.msl, (i + 1) * self.msl + 1) for i in idx])
            ids, labels = tokens[:, :-1], tokens[:, 1:]
        else:
            order = np.argsort(idx)  # h5py reads increasing indices
            rows = np.empty((len(idx), 3, self.msl), dtype=np.int64)
            file_of = np.searchsorted(self.starts, idx[order], side="right") - 1
            for f in np.unique(file_of):
                take = order[file_of == f]
                rows[take] = self.data[f][idx[take] - self.starts[f]]
            ids, labels = rows[:, 0], np.where(rows[:, 1] == 0, IGNORE_INDEX, rows[:, 2])
        if self.vocab is not None:
            size, key = self.vocab
            seen = np.concatenate([ids.ravel(), labels[labels != IGNORE_INDEX]])
            if (bad := seen[(seen < 0) | (seen >= size)]).size:
                raise ConfigError([f"{key}: {size}, but the data holds token id {bad[0]} (ids must be in [0, {size}))"])
        return torch.from_numpy(ids), torch.from_numpy(labels)

    def _read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``start:stop`` of the stream of all files (a slice past a file's end stops at its end)."""
        files = [(data, lo) for data, lo in zip(self.data, self.starts) if lo < stop and start < lo + len(data)]
        return np.concatenate([data[max(start - lo, 0) : stop - lo] for data, lo in files]).astype(np.int64)


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


def _open(processor: str, keys: LoaderKeys, split: str, prefix: str, headers_only: bool) -> tuple[Any, list[str]]:
    """The data set of a loader section and the problems found (then no data set), one line each naming the
    section's data_dir and the layout expected: MNIST's images and labels files of ``split``; each GPT ``*.h5`` file
    (each directory sorted, as Model Zoo reads them), its header checked. ``headers_only``: the first GPT file's
    header only, and no data set."""
    files: list[Any] = []  # MNIST: the images and labels paths; GPT: each file's 'data'
    problems, mnist, map_style = [], processor == "MNISTDataProcessor", processor == "GptHDF5MapDataProcessor"
    if mnist:
        raw = Path(keys.data_dir if isinstance(keys.data_dir, str) else "./") / "MNIST" / "raw"
        stem = "train" if (keys.split or split) == "train" else "t10k"
        names = [f"{stem}-{kind}-ubyte" for kind in ("images-idx3", "labels-idx1")]
        files = [next((p for p in (raw / n, raw / f"{n}.gz") if p.is_file()), None) for n in names]
        if missing := [str(raw / n) for n, path in zip(names, files) if path is None]:
            problems.append(f"{' and '.join(missing)} missing")
    else:
        h5py = require("h5py")
        msl, dirs = keys.max_sequence_length, [keys.data_dir] if isinstance(keys.data_dir, str) else keys.data_dir or []
        problems = [f"{d} is not a directory" for d in dirs if not Path(d).is_dir()]
        paths = [p for d in dirs if Path(d).is_dir() for p in sorted(Path(d).glob("*.h5"))]
        if not paths and not problems:
            problems.append(f"no *.h5 files in {', '.join(dirs)}")
        for path in paths[:1] if headers_only else paths:
            try:
                data = h5py.File(path, "r")["data"]
            except (OSError, KeyError) as exc:
                problems.append(f"{path}: cannot read its dataset 'data' ({exc})")
                continue
            flat = map_style and data.ndim == 1
            if not (flat or (data.ndim == 3 and data.shape[1] == 3)) or data.dtype.kind not in "iu":
                problems.append(f"{path}: 'data' is {data.dtype}{list(data.shape)}, not integers of shape [N, 3, msl]")
            elif flat and msl is None:
                problems.append(f"{path}: a flat token stream needs max_sequence_length")
            elif not flat and msl not in (None, data.shape[2]):
                problems.append(f"{path}: sequences of {data.shape[2]} tokens, but max_sequence_length is {msl}")
            elif files and data.shape[1:] != files[0].shape[1:]:  # every file as the first read
                problems.append(f"{path}: 'data' of shape {list(data.shape)} unlike {files[0].file.filename}'s")
            files.append(data)
    dataset = None
    try:
        if not problems and not headers_only:
            dataset = MnistDataset(*files) if mnist else GptDataset(files, keys.max_sequence_length)
    except (OSError, ValueError) as exc:
        problems.append(str(exc))
    gpt_layout = "*.h5 files with a dataset 'data' of shape [N, 3, max_sequence_length]"
    layout = "<data_dir>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte (plain or .gz)" if mnist else gpt_layout
    write = "dls data " + ("mnist DIR" if mnist else "gpt DIR --corpus" if map_style else "gpt DIR")
    where = f"{prefix}.data_dir ({keys.data_dir or './'})"
    return dataset, [f"{where}: {p}; {processor} reads {layout} (a tiny set: {write})" for p in problems]


def check_data(processor: str, params: dict[str, Any], *, split: str = "train", prefix: str | None = None) -> list[str]:
    """What is missing or malformed in the data a loader section names (one line each, naming the path and the
    layout expected; empty when it looks right), reading only file headers; ``ConfigError`` for invalid keys."""
    prefix = prefix or ("train_input" if split == "train" else "eval_input")
    return _open(processor, parse_loader(processor, params, prefix)[0], split, prefix, headers_only=True)[1]


def build_loader(
    processor: str,
    params: dict[str, Any],
    *,
    split: str,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    prefix: str | None = None,
) -> BatchIterator:
    """Resumable batches of a Model Zoo loader section for ``split`` (an MNIST section's own ``split`` wins);
    ``seed`` when ``shuffle_seed`` is not set; ``prefix`` names the section in errors. ``ConfigError`` for invalid
    keys or data (the keys ignored here: :func:`parse_loader`)."""
    prefix = prefix or ("train_input" if split == "train" else "eval_input")
    keys = parse_loader(processor, params, prefix)[0]
    dataset, problems = _open(processor, keys, split, prefix, headers_only=False)
    if dataset is None:
        raise ConfigError(problems)
    shuffle = keys.shuffle if keys.shuffle is not None else processor == "MNISTDataProcessor"  # Model Zoo's defaults
    drop_last = next((v for v in (keys.drop_last, keys.drop_last_batch) if v is not None), True)
    seed = keys.shuffle_seed if keys.shuffle_seed is not None else seed
    return BatchIterator(dataset, keys.batch_size, shuffle, seed, rank, world_size, drop_last, f"{prefix}.batch_size")


def write_tiny_data(
    kind: str,
    directory: str | Path,
    *,
    train_samples: int = 2048,
    val_samples: int = 256,
    msl: int = 128,
    vocab: int = 512,
    files: int = 2,
    corpus: bool = False,
    compress: bool = False,
    seed: int = 0,
) -> list[Path]:
    """Write a tiny generated data set of ``kind`` (``mnist`` or ``gpt``) into ``directory``; the paths written.

    mnist: 28x28 seven-segment digits (random shift, stroke width and brightness, noise) and their labels in
    ``directory/MNIST/raw/{train,t10k}-*-ubyte`` (``compress``: ``.gz``), for ``MNISTDataProcessor``.
    gpt: ``directory/{train,val}/data_<i>.h5`` (``files`` files per split), each ``data`` of shape [N, 3, msl]
    (input_ids, attention_mask, labels) with the ``n_examples`` attribute Model Zoo's iterable reader reads; with
    ``corpus``, one flat token stream per file instead (for ``GptHDF5MapDataProcessor`` with
    ``max_sequence_length``)."""
    rng = np.random.default_rng(seed)
    root, written = Path(directory), []
    if kind == "mnist":  # each digit's lit segments, as on a seven-segment display
        segments = ("abcdef", "bc", "abdeg", "abcdg", "bcfg", "acdfg", "acdefg", "abc", "abcdefg", "abcdfg")
        (root / "MNIST" / "raw").mkdir(parents=True, exist_ok=True)
        for stem, count in (("train", train_samples), ("t10k", val_samples)):
            labels = rng.integers(0, 10, count).astype(np.uint8)
            images = rng.integers(0, 40, (count, 28, 28)).astype(np.float32)  # noise, then the lit segments
            for image, label in zip(images, labels):
                x, y, w = 8 + rng.integers(-3, 4), 4 + rng.integers(-3, 4), int(rng.integers(2, 4))
                boxes = {  # (top, height, left, width) of each segment, from the digit's top left corner (x, y)
                    "a": (0, w, 0, 12), "b": (0, 10, 12 - w, w), "c": (10, 10, 12 - w, w), "d": (20 - w, w, 0, 12),
                    "e": (10, 10, 0, w), "f": (0, 10, 0, w), "g": (10 - w // 2, w, 0, 12),
                }  # fmt: skip
                for segment in segments[label]:
                    top, height, left, width = boxes[segment]
                    image[y + top : y + top + height, x + left : x + left + width] += rng.uniform(150, 215)
            for name, array in zip(("images-idx3", "labels-idx1"), (np.clip(images, 0, 255).astype(np.uint8), labels)):
                path = root / "MNIST" / "raw" / f"{stem}-{name}-ubyte{'.gz' if compress else ''}"
                header = (0x800 + array.ndim).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
                path.write_bytes(gzip.compress(header + array.tobytes()) if compress else header + array.tobytes())
                written.append(path)
        return written
    if kind != "gpt":
        raise ValueError(f"kind must be 'mnist' or 'gpt'; got {kind!r}")
    h5py = require("h5py")
    for split, count in (("train", train_samples), ("val", val_samples)):
        (root / split).mkdir(parents=True, exist_ok=True)
        steps = rng.choice([1, 2, 3, 5, 7], count)[:, None]  # arithmetic progressions: quickly learnt
        tokens = (rng.integers(0, vocab, count)[:, None] + steps * np.arange(msl + 1)) % vocab
        pads = rng.integers(0, max(msl // 4, 1), count) * (rng.random(count) < 0.25)  # a quarter end in padding
        mask = (np.arange(msl) < msl - pads[:, None]).astype(np.int32)  # a loss mask: 0 on the padding
        sequences = np.stack([tokens[:, :-1] * mask, mask, tokens[:, 1:] * mask], axis=1).astype(np.int32)
        for i, part in enumerate(np.array_split(sequences, files)):
            written.append(root / split / f"data_{i}.h5")
            with h5py.File(written[-1], "w") as f:  # a corpus: the sequences' tokens back to back
                f.create_dataset("data", data=part[:, 0].ravel() if corpus else part)
                if not corpus:
                    f.attrs["n_examples"] = len(part)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """Write a tiny data set in a Model Zoo format, generated (nothing is downloaded): mnist, seven-segment digits in
    torchvision's MNIST layout; gpt, token sequences as HDF5 files in DIR/train and DIR/val. Prints what it wrote."""
    parser = argparse.ArgumentParser(prog="dls data", description=main.__doc__)
    parser.add_argument("kind", choices=["mnist", "gpt"])
    parser.add_argument("directory", help="where to write (created if missing)")
    options = {  # write_tiny_data's argument (its default is the option's): (option, least, help)
        "train_samples": ("train", 1, "training samples"), "val_samples": ("val", 1, "validation samples"),
        "msl": ("msl", 1, "gpt: tokens per sequence"), "vocab": ("vocab", 2, "gpt: vocabulary size"),
        "files": ("files", 1, "gpt: .h5 files per split"), "seed": ("seed", 0, "random seed"),
    }  # fmt: skip
    for name, (option, _, text) in options.items():
        default = inspect.signature(write_tiny_data).parameters[name].default
        parser.add_argument(f"--{option}", dest=name, type=int, default=default, help=f"{text} (default {default})")
    parser.add_argument("--corpus", action="store_true", help="gpt: flat token streams (GptHDF5MapDataProcessor)")
    parser.add_argument("--gzip", dest="compress", action="store_true", help="mnist: write .gz files")
    args = parser.parse_args(argv)
    for name, (option, least, _) in options.items():
        if getattr(args, name) < least:
            parser.error(f"--{option} must be at least {least}; got {getattr(args, name)}")
    print("\n".join(f"wrote {p}" for p in write_tiny_data(**vars(args))))
    return 0
