"""The keys of Model Zoo's ``model`` and data-loader sections (:func:`parse_model`, :func:`parse_loader`: no files
read; an initializer's keys also apply it to a tensor), validated with pydantic (strict numbers), defaults as Model
Zoo's own config classes set them. Every key Model Zoo knows for these models is honoured (a field below),
``_DEFAULT_ONLY`` (a feature the Hugging Face classes cannot express: any value but Model Zoo's default is an error
naming the key) or ``_IGNORED`` (for Cerebras hardware or inference only: accepted and listed back); anything else is
a misspelling, reported with "did you mean"."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from torch import nn

from dls.train.config.schema import ZOO_MODELS, ZOO_PROCESSORS, Finite, did_you_mean
from dls.train.errors import ConfigError

Positive = Annotated[int, Field(gt=0)]
Number = Annotated[float, Finite()]  # finite, at most float32's max in size: as every float key of the config
PositiveFloat = Annotated[float, Finite(gt=0)]
Rate = Annotated[float, Finite(ge=0, le=1)]

# The learning-rate groups of Model Zoo's GPT models that ``optimizer.adjust_learning_rate`` may name
# (GPT2LMHeadModelConfig.create_default_lr_adjustment_groups); dls.train.modelzoo.models says which weights each holds.
LR_GROUPS = ("embedding", "decoder_kernel", "decoder_attention", "decoder_input_ffn", "decoder_output_ffn")


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
