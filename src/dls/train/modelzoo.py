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
import io
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
from dls.train.launch import free_memory

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

    def scaled(self, factor: float) -> Initializer:
        """The initializer with its std (and truncation bounds) times ``factor``: Model Zoo's muP scaling
        (scale_initializers_by_dimension)."""
        bounds = {k: None if getattr(self, k) is None else getattr(self, k) * factor for k in ("a", "b")}
        return self.model_copy(update={"std": self.std * factor, **(bounds if self.name == "truncated_normal" else {})})

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
    # muP (Model Zoo's GPT2LMHeadModel): the base model's widths, and what they scale
    mup_base_hidden_size: PositiveFloat | None = None
    mup_base_filter_size: PositiveFloat | None = None
    embeddings_scale: Number = 1.0  # multiplies the embeddings (token plus position), muP or not
    scale_qk_dot_by_d: bool | None = None  # None: with muP
    attention_logits_alpha: Number = 1.0  # multiplies the attention logits, muP or not
    scale_output_logits_by_d: bool = True
    output_logits_alpha: Number | None = None
    output_logits_scale: Number | None = None  # muP before Release 2.3: the logits' factor itself

    @model_validator(mode="after")
    def _mup(self) -> GptKeys:
        widths = [k for k in ("mup_base_hidden_size", "mup_base_filter_size") if getattr(self, k) is not None]
        if len(widths) == 1:
            raise ValueError(f"{widths[0]} needs mup_base_hidden_size and mup_base_filter_size both (Model Zoo's muP)")
        if widths and self.output_logits_scale is not None:
            raise ValueError("output_logits_scale is muP before Release 2.3: with mup_base_hidden_size, give "
                             "output_logits_alpha (Model Zoo refuses both)")  # fmt: skip
        inits = [
            self.initializer,
            self.ffn_initializer,
            self.output_layer_initializer,
            self.ffn_output_layer_initializer,
        ]
        if widths and any(i is not None and i.name == "uniform" for i in inits):
            raise ValueError("muP scales normal and truncated_normal initializers only (as Model Zoo)")
        return self

    @property
    def mup(self) -> bool:
        return self.mup_base_hidden_size is not None

    @property
    def logits_scale(self) -> float | None:
        """What multiplies the output logits: muP's ``output_logits_alpha / width multiplier`` (its square root
        without ``scale_output_logits_by_d``), else ``output_logits_scale``."""
        if self.mup_base_hidden_size is None:
            return self.output_logits_scale or None  # Model Zoo: a factor of 0 is none
        alpha, widening = self.output_logits_alpha or 1.0, self.hidden_size / self.mup_base_hidden_size
        return alpha / widening if self.scale_output_logits_by_d else alpha / widening**0.5

    @property
    def attention_factor(self) -> float:
        """What multiplies the query-key products beyond the usual 1/sqrt(head size) of scaled_dot_product attention
        (and 1/(layer+1) of scale_qk_dot_by_layer_idx): ``attention_logits_alpha``, and 1/sqrt(head size) more with
        ``scale_qk_dot_by_d`` (on with muP; scaled_dot_product only), so that the logits are divided by the head
        size."""
        by_d = self.mup if self.scale_qk_dot_by_d is None else self.scale_qk_dot_by_d
        head = self.hidden_size // self.num_heads
        return self.attention_logits_alpha * (head**-0.5 if by_d and self.attention_type == "scaled_dot_product" else 1)

    def lr_scales(self) -> dict[str, float]:
        """muP's learning-rate factors of Model Zoo's parameter groups (:data:`LR_GROUPS`): 1 / width multiplier of
        the attention and the FFN input, 1 / filter multiplier of the FFN output."""
        if self.mup_base_hidden_size is None or self.mup_base_filter_size is None:
            return {}
        width, filter_ = self.hidden_size / self.mup_base_hidden_size, self.filter_size / self.mup_base_filter_size
        return {"decoder_attention": 1 / width, "decoder_input_ffn": 1 / width, "decoder_output_ffn": 1 / filter_}


_GPT_DEFAULT_ONLY: dict[str, Any] = {
    **dict.fromkeys((
        "constant_pos_embedding", "attention_inner_dim", "attention_sliding_window_length", "attention_sink_tokens",
        "attention_vertical_column_spacing", "attention_vertical_column_width", "attention_chunk_size",
        "attention_qk_norm_layer", "attention_logit_softcapping", "final_logit_softcapping", "fixed_sparse_attention",
        "memory_tokens", "rel_distance_extra_args", "lr_adjustment_groups", "moe", "moe_params",
    ), None),
    **dict.fromkeys((
        "embedding_layer_norm", "alibi_trainable_slopes", "sliding_window_every_other_decoder_layer",
        "norm_first_sandwich",
    ), False),
    "position_embedding_offset": 0, "num_extra_input_vocab_tokens": 0, "extra_ffn_params": {},
    "cross_attention_layers": [], "rel_distance_mode": "default",
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


# ---------------------------------------------------------------------- Model Zoo's optimizer: groups, cstorch's Adam
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
LR_GROUPS = ("embedding", "decoder_kernel", "decoder_attention", "decoder_input_ffn", "decoder_output_ffn")
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
        if missing := [str(d) for d in dirs if not Path(d).is_dir()]:  # one problem, however many directories
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            problems.append(f"{shown} {'is not a directory' if len(missing) == 1 else 'are not directories'}")
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
    where = f"{prefix}.data_dir" + ("" if isinstance(keys.data_dir, list) else f" ({keys.data_dir or './'})")
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
    """Write a tiny generated data set of ``kind`` (``mnist`` or ``gpt``) into ``directory`` (created if missing,
    locked while written); the paths written. Every file is new: an existing file or link under a name it writes
    (or a link where one of its directories goes) refuses it before anything is written (``ModelDirError``, naming
    the path); nothing is replaced and no link followed.

    mnist: 28x28 seven-segment digits (random shift, stroke width and brightness, noise) and their labels in
    ``directory/MNIST/raw/{train,t10k}-*-ubyte`` (``compress``: ``.gz``), for ``MNISTDataProcessor``.
    gpt: ``directory/{train,val}/data_<i>.h5`` (``files`` files per split), each ``data`` of shape [N, 3, msl]
    (input_ids, attention_mask, labels) with the ``n_examples`` attribute Model Zoo's iterable reader reads; with
    ``corpus``, one flat token stream per file instead (for ``GptHDF5MapDataProcessor`` with
    ``max_sequence_length``)."""
    from dls.train.rundir import RunDir, resolve_model_dir

    args = dict(train_samples=train_samples, val_samples=val_samples, msl=msl, vocab=vocab, files=files)
    contents = tiny_data_files(kind, **args, corpus=corpus, compress=compress, seed=seed)
    with RunDir(resolve_model_dir(directory, "DIR"), "DIR") as target:
        return target.create_all(contents)


# What one sample of each kind costs in memory while it is generated (bytes; gpt: per token of a sequence), so that
# a data set beyond the free memory is refused before NumPy tries (or refuses an array beyond its index range).
_BYTES_PER_SAMPLE = {"mnist": 28 * 28 * 4 * 3, "gpt": 8 * 12}
MAX_VOCAB = 2**31  # token ids are stored as int32


def tiny_data_files(
    kind: str, *, train_samples: int, val_samples: int, msl: int, vocab: int, files: int, corpus: bool,
    compress: bool, seed: int,
) -> dict[str, bytes]:  # fmt: skip
    """The files of :func:`write_tiny_data`, generated in memory: relative path -> bytes. ``MemoryError`` when they
    need more memory than is free (before anything is allocated); ``ValueError`` for arguments no file can hold."""
    if kind not in ("mnist", "gpt"):
        raise ValueError(f"kind must be 'mnist' or 'gpt'; got {kind!r}")
    if kind == "gpt" and not 2 <= vocab <= MAX_VOCAB:
        raise ValueError(f"vocab must be in [2, {MAX_VOCAB}] (token ids are int32); got {vocab}")
    if kind == "gpt" and not 1 <= files <= min(train_samples, val_samples):
        raise ValueError(f"files must be in [1, {min(train_samples, val_samples)}] (each holds a sample); got {files}")
    need = max(train_samples, val_samples) * _BYTES_PER_SAMPLE[kind] * ((msl + 1) if kind == "gpt" else 1)
    if (free := free_memory()) is not None and need > free:
        raise MemoryError(f"dls data {kind} needs about {need / 2**30:,.1f} GiB; {free / 2**30:.1f} GiB are free here")
    rng = np.random.default_rng(seed)
    written: dict[str, bytes] = {}
    if kind == "mnist":  # each digit's lit segments, as on a seven-segment display
        segments = ("abcdef", "bc", "abdeg", "abcdg", "bcfg", "acdfg", "acdefg", "abc", "abcdefg", "abcdfg")
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
                header = (0x800 + array.ndim).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
                data = header + array.tobytes()
                written[f"MNIST/raw/{stem}-{name}-ubyte{'.gz' if compress else ''}"] = (
                    gzip.compress(data) if compress else data
                )
        return written
    h5py = require("h5py")
    for split, count in (("train", train_samples), ("val", val_samples)):
        steps = rng.choice([1, 2, 3, 5, 7], count)[:, None]  # arithmetic progressions: quickly learnt
        tokens = (rng.integers(0, vocab, count)[:, None] + steps * np.arange(msl + 1)) % vocab
        pads = rng.integers(0, max(msl // 4, 1), count) * (rng.random(count) < 0.25)  # a quarter end in padding
        mask = (np.arange(msl) < msl - pads[:, None]).astype(np.int32)  # a loss mask: 0 on the padding
        sequences = np.stack([tokens[:, :-1] * mask, mask, tokens[:, 1:] * mask], axis=1).astype(np.int32)
        for i, part in enumerate(np.array_split(sequences, files)):
            buffer = io.BytesIO()
            with h5py.File(buffer, "w") as f:  # a corpus: the sequences' tokens back to back
                f.create_dataset("data", data=part[:, 0].ravel() if corpus else part)
                if not corpus:
                    f.attrs["n_examples"] = len(part)
            written[f"{split}/data_{i}.h5"] = buffer.getvalue()
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
    if args.kind == "gpt" and args.vocab > MAX_VOCAB:
        parser.error(f"--vocab must be at most {MAX_VOCAB} (token ids are int32); got {args.vocab}")
    if args.kind == "gpt" and args.files > (most := min(args.train_samples, args.val_samples)):
        parser.error(f"--files must be at most {most}, --train's and --val's smaller (each file holds a sample)")
    print("\n".join(f"wrote {p}" for p in write_tiny_data(**vars(args))))
    return 0
