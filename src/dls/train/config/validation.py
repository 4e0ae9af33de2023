"""Validating a config: :func:`parse_config` reads a parsed config of any layout (``dls.train.config.layouts``) onto
dls's sections, builds each with its pydantic schema (``dls.train.config.schema``), says each problem under the key
as the file wrote it, and judges what one section alone cannot: the loss-scaling keys by the library itself
(``ScalerSettings.cerebras``, so the config accepts exactly what ``GradScaler`` accepts), the combinations of
keys, a Model Zoo model's and data processor's own keys (``dls.train.config.zoo_keys``), the FP8 recipe, one step
of the optimizer at its largest learning rate. Then the memory the run needs of the machine (:func:`memory_problem`:
a note for ``dls validate``, an error for ``dls train``; its data files are ``dls.train.data.missing_paths``')."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from dls.checks import FLOAT32_MAX, INT64_MAX
from dls.settings import TORCH_INIT_SCALE, ScalerSettings, SettingsError
from dls.train.cerebras_adam import CerebrasAdam
from dls.train.config.layouts import (
    CURRENT_LAYOUT,
    RELEASE_1_KEYS,
    Reader,
    apply_defaults,
    from_release_1,
    refused_whole,
)
from dls.train.config.manager import apply_overrides
from dls.train.config.schema import (
    MODEL_DATASETS,
    SCALER_KEYS,
    SECTION_CLASSES,
    ZOO_MODELS,
    DataConfig,
    OptimizerConfig,
    SchedulePiece,
    Section,
    TrainConfig,
    did_you_mean,
    unknown_key,
)
from dls.train.config.zoo_keys import LR_GROUPS, parse_loader, parse_model
from dls.train.errors import ConfigError
from dls.train.launch import free_memory

# ---------------------------------------------------------------------- pydantic's errors, as the config wrote them
SHAPES = {  # what a compound key allows, in words
    "learning_rate": "a number >= 0 or a schedule (a list of {scheduler: Linear|CosineDecay|Constant, ...})",
    "betas": "a list of two numbers in [0, 1), e.g. [0.9, 0.999]",
    "fp8": "null (no FP8) or a mapping {recipe: current | delayed | mxfp8 | static, <the recipe's fields>}",
}
_KINDS = {"boolean": "true or false", "string": "text", "object": "a mapping", "array": "a list of names"}


def schema_in_words(schema: dict[str, Any], big: bool) -> str:
    """A key's JSON schema in words (``an integer in [0, 4294967295] or null``); ``big``: name a bound of 2**63-1."""
    if "anyOf" in schema:
        return " or ".join(schema_in_words(s, big) for s in schema["anyOf"])
    if "enum" in schema or "const" in schema:
        return "one of " + ", ".join(map(repr, schema["enum"])) if "enum" in schema else str(schema["const"]).lower()
    kind = schema.get("type", "null")
    if kind not in ("integer", "number"):
        return "non-empty text" if schema.get("minLength") else _KINDS.get(kind, kind)
    text = "an integer" if kind == "integer" else "a number"
    lows = [
        (k, schema[k]) for k in ("minimum", "ge", "exclusiveMinimum") if schema.get(k, -FLOAT32_MAX) != -FLOAT32_MAX
    ]
    highs = [(k, schema[k]) for k in ("maximum", "le", "exclusiveMaximum") if schema.get(k, FLOAT32_MAX) != FLOAT32_MAX]
    low_key, low = lows[0] if lows else ("", None)
    high_key, high = highs[0] if highs else ("", None)
    open_low, open_high = low_key.startswith("exclusive"), high_key.startswith("exclusive")
    if low is not None and high is not None and (big or high != INT64_MAX):
        return f"{text} in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
    return f"{text} {'>' if open_low else '>='} {low}" if low is not None else text


def _problems(exc: ValidationError, section: str, r: Reader) -> None:
    """One error per key of ``section`` pydantic refused: the key as written, what it allows and what it got."""
    cls, values = SECTION_CLASSES[section.removeprefix("eval_")], r.sections[section]
    errors: list[tuple[list[Any], Any]] = [
        ([p for p in e["loc"] if isinstance(p, int) or p.isidentifier()], e) for e in exc.errors()
    ]
    pieces = {loc[0] for loc, _ in errors if len(loc) > 1 and loc[0] == "learning_rate"}  # said in the pieces
    for loc, err in errors:
        inner = loc[0] in pieces
        if inner and len(loc) == 1:
            continue
        path = r.at(section, loc[0]) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:] if inner)
        value, key, model = (err["input"], loc[2:3], SchedulePiece) if inner else (values[loc[0]], loc[:1], cls)
        if err["type"] == "extra_forbidden":
            r.errors.append(unknown_key(path.rsplit(".", 1)[0], loc[-1], list(model.model_fields)))
        elif err["type"] == "missing" and inner:
            r.errors.append(f"{path} is required")
        elif err["type"] == "value_error":
            r.errors.append(f"{path}: {err['msg'].removeprefix('Value error, ')}")
        else:
            schema = model.model_json_schema()["properties"][key[0]] if key else {"type": "object"}
            big = isinstance(value, int) and not isinstance(value, bool) and value > INT64_MAX
            allowed = SHAPES.get(str(loc[0])) if not inner else None
            allowed = allowed or schema_in_words(schema, big)
            if isinstance(value, (int, float)) and abs(value) > FLOAT32_MAX and "a number" in allowed:
                allowed += ", at most float32's max 3.4e38 in size"
            names = [n for s in [schema, *schema.get("anyOf", [])] for n in s.get("enum", [])]
            hint = did_you_mean(value, names) if isinstance(value, str) and names else ""
            r.errors.append(f"{path} must be {allowed}; got {value!r}{hint}")


def parse_config(raw: Mapping[str, Any], source: str | None = None, notes: Sequence[str] = ()) -> TrainConfig:
    """Validate a config dict (the parsed YAML, either layout) and build the :class:`TrainConfig`. Raises
    :class:`ConfigError` listing every problem, each naming its key as written. ``notes``: what the run should say
    first (from reading the file: :func:`read_config`)."""
    raw = apply_overrides(raw, (), source)  # a mapping, aliases expanded into copies
    layout = "current" if "trainer" in raw else "legacy"
    holder = raw if layout == "legacy" else (raw["trainer"] if isinstance(raw["trainer"], Mapping) else {}).get("init")
    model = holder.get("model") if isinstance(holder, Mapping) else None
    name = model.get("name") if isinstance(model, Mapping) else None
    if problem := refused_whole(raw, layout, model):  # said first, alone: every other key would be misread
        raise ConfigError([problem], source)
    release_1: list[str] = []
    if layout == "legacy" and any(
        isinstance(raw.get(s), Mapping) and set(ks) & set(raw[s]) for s, ks in RELEASE_1_KEYS.items()
    ):
        raw, release_1, problems = from_release_1(dict(raw))
        if problems:
            raise ConfigError(problems, source)
    r = Reader(name in ZOO_MODELS)
    r.notes.extend([*notes, *release_1])
    if layout == "current":
        r.errors += [f"unknown section {n}: the current layout has trainer: alone" for n in raw if n != "trainer"]
        r.walk(raw.get("trainer"), "trainer", CURRENT_LAYOUT)
    else:
        r.legacy(raw)
    r.layout = apply_defaults(r, layout)
    built = _build(r)
    if built["optimizer"] is not None:
        _check_loss_scaling(built, r)
    if not r.errors:
        _check_combinations(built, r)
        _check_zoo(built, r)
    if not r.errors:
        _check_optimizer_step(built, r)
    if not r.errors and built["precision"].fp8 is not None:
        built["precision"] = built["precision"].model_copy(update={"fp8": _fp8(built["precision"].fp8, r)})
    if r.errors:
        raise ConfigError(list(dict.fromkeys(r.errors)), source)
    if r.ignored:
        r.notes.append(f"ignored on this hardware (Cerebras only): {', '.join(dict.fromkeys(r.ignored))}")
    if r.not_done:
        table = "docs/guides/trainer.md, Model Zoo's keys"
        r.notes.append(f"not done by dls (what each means: {table}): {', '.join(dict.fromkeys(r.not_done))}")
    return TrainConfig(**built, notes=tuple(r.notes), layout=r.layout, sources=r.written)


def _build(r: Reader) -> dict[str, Any]:
    """Each section built from what was read (``None``: refused, its problems said; ``eval_data``: also when not
    given)."""
    s = r.sections
    built: dict[str, Any] = {"eval_data": None}
    classes: dict[str, type[Section]] = {**SECTION_CLASSES, **({"eval_data": DataConfig} if s["eval_data"] else {})}
    for section, cls in classes.items():
        try:
            built[section] = cls(**s[section])
        except ValidationError as exc:
            built[section] = None
            _problems(exc, section, r)
    return built


def _fp8(recipe: Mapping[str, Any], r: Reader) -> Any:
    """``{recipe: current|delayed|mxfp8|static, <fields>}`` judged field by field by ``dls.fp8``'s recipe classes."""
    from dls.fp8 import RECIPE_NAMES, recipe_from_dict

    path = r.at("precision", "fp8")
    cls = RECIPE_NAMES.get(recipe["recipe"]) if isinstance(recipe.get("recipe"), str) else None
    if cls is None:
        got = repr(recipe["recipe"]) if "recipe" in recipe else "nothing"
        r.errors.append(f"{path}.recipe must be one of {', '.join(map(repr, RECIPE_NAMES))}; got {got}")
        return None
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    fields = {f: v for f, v in recipe.items() if f != "recipe"}
    for key, value in fields.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key not in types:
            r.errors.append(unknown_key(path, key, ["recipe", *types]))
        elif key == "amax_history_len" and not (number and isinstance(value, int) and 1 <= value <= 65536):
            r.errors.append(f"{path}.amax_history_len must be an integer in [1, 65536]; got {value!r}")
        else:
            try:
                cls(**{key: value})
            except (ValueError, TypeError) as exc:
                message = str(exc)
                r.errors.append(f"{path}.{message}" if message.startswith(f"{key} ") else f"{path}.{key}: {message}")
            else:
                if number and abs(value) > FLOAT32_MAX:  # the recipe takes any finite float; the config, float32's
                    r.errors.append(f"{path}.{key} must be at most float32's max 3.4e38 in size; got {value!r}")
    return None if r.errors else recipe_from_dict({"recipe": recipe["recipe"], **fields}).to_dict()


def _check_combinations(b: dict[str, Any], r: Reader) -> None:
    model, data, prec, opt, run = b["model"], b["data"], b["precision"], b["optimizer"], b["runconfig"]
    at, refuse, note = r.at, r.errors.append, r.notes.append
    builtin = MODEL_DATASETS.get(model.name)
    if builtin and data.data_processor is not None:
        refuse(f"{at('data', 'data_processor')}: model.name {model.name!r} trains on dls's built-in data ({builtin})")
    elif builtin and data.dataset != builtin:
        refuse(f"{at('data', 'dataset')} {data.dataset!r} does not fit model.name {model.name!r}; allowed: {builtin}")
    if data.dataset is not None and not data.drop_last_batch:
        refuse(f"{at('data', 'drop_last_batch')}: false is not supported for built-in data sets (they drop it)")
    if model.name == "transformer_lm" and model.hidden_size % model.num_heads:
        refuse(f"{at('model', 'num_heads')} ({model.num_heads}) must divide model.hidden_size ({model.hidden_size})")
    if model.name == "transformer_lm" and data.max_sequence_length > model.max_position_embeddings:
        length, most = data.max_sequence_length, model.max_position_embeddings
        refuse(f"{at('data', 'max_sequence_length')} ({length}) exceeds model.max_position_embeddings ({most})")
    if not prec.mixed_precision and "precision.fp16_type" in r.written and prec.fp16_type != "float32":
        note(f"{at('precision', 'fp16_type')} ({prec.fp16_type!r}) has no effect: mixed_precision is off")
    if prec.half_params and prec.compute_dtype == "float32":
        why = "(precision.mixed_precision: true and a half fp16_type): without it the parameters are float32"
        refuse(f"{at('precision', 'half_params')} needs a half-precision run {why}")
    if prec.half_params and prec.fp16_type == "cbfloat16" and not prec.master_weights:
        refuse(f"{at('precision', 'master_weights')}: false does not work with cbfloat16 half_params")
    if prec.fp8 is not None and prec.emulated:
        refuse(f"{at('precision', 'fp8')} cannot be combined with dls.emulate (cbfloat16 or precision.emulate)")
    if opt.max_gradient_norm is not None and opt.max_gradient_value is not None:
        refuse(f"give {at('optimizer', 'max_gradient_norm')} or {at('optimizer', 'max_gradient_value')}, not both")
    if "master_weights" in prec.model_fields_set and not prec.half_params:
        note(f"{at('precision', 'master_weights')} has no effect without precision.half_params: true")
    if prec.half_params and prec.emulate and prec.fp16_type != "cbfloat16":
        note(f"{at('precision', 'emulate')} has no effect: with half_params the model computes natively")
        b["precision"] = prec = prec.model_copy(update={"emulate": False})
    if prec.fallback and prec.compute_dtype not in ("float16", "cbfloat16"):
        note(f"{at('precision', 'fallback')} has no effect: the run computes in {prec.compute_dtype}")
    if run.eval_steps is not None and b["eval_data"] is None:
        note(f"{at('runconfig', 'eval_steps')}: no eval_input / val_dataloader: evaluation reads the training data")


def _check_zoo(b: dict[str, Any], r: Reader) -> None:
    """A Model Zoo model's and readers' own keys, judged by ``dls.train.config.zoo_keys``' parsers (no files read),
    and the optimizer keys of Model Zoo's optimizers."""
    for section, default in (("model", "model"), ("data", "train_input"), ("eval_data", "eval_input")):
        part, where = b[section], r.written.get(f"{section}.params", default)
        try:
            if section == "model" and part.name in ZOO_MODELS:
                r.ignored.extend(parse_model(part.name, dict(part.params), where)[1])
            elif section != "model" and part is not None and part.data_processor is not None:
                r.ignored.extend(parse_loader(part.data_processor, part.loader_params, where)[1])
        except ConfigError as exc:
            r.errors.extend(exc.errors)
    opt, name = b["optimizer"], b["model"].name
    if opt.adjust_learning_rate and name not in ("gpt2", "gpt3", "llama"):
        r.errors.append(f"{r.at('optimizer', 'adjust_learning_rate')} applies to gpt2, gpt3 and llama; this is {name}")
    elif bad := [k for k in opt.adjust_learning_rate if k not in LR_GROUPS]:
        key = f"{r.at('optimizer', 'adjust_learning_rate')}.{bad[0]}"
        r.errors.append(f"{key}: not a group of Model Zoo's {name}{did_you_mean(bad[0], LR_GROUPS)}; its groups: "
                        f"{', '.join(LR_GROUPS)}")  # fmt: skip
    if opt.optimizer_type == "Adam" and "optimizer.correct_bias" in r.written:
        how = "cstorch's Adam always corrects the bias (Model Zoo warns that the key is unused)"
        r.notes.append(f"{r.at('optimizer', 'correct_bias')} is not used: {how}")
    if not opt.correct_bias and opt.optimizer_type == "AdamW" and r.layout == "dls":
        torch_s = "dls's own layout trains with torch's AdamW, which always corrects the bias"
        r.errors.append(
            f"{r.at('optimizer', 'correct_bias')}: false is cstorch's AdamW, Model Zoo's layouts'; {torch_s}"
        )
    if opt.force_loss_scaling and r.layout == "dls":
        r.notes.append(f"{r.at('optimizer', 'force_loss_scaling')} has no effect: dls's own layout scales bfloat16 as "
                       "loss_scaling_factor says")  # fmt: skip


def step_once(cls: type, hyper: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """One step of the optimizer ``cls`` with the hyperparameters ``hyper`` on a throwaway one-element parameter (1,
    gradient 1): its group as it then is, and whether the parameter stayed finite. What the optimizer refuses (a
    ``ValueError``, or torch's ``RuntimeError`` for a step size beyond float32) is raised."""
    import inspect

    import torch

    param = torch.ones(1, requires_grad=True)
    param.grad = torch.ones(1)
    accepted = inspect.signature(cls).parameters
    optimizer = cls([param], **{k: v for k, v in hyper.items() if k in accepted})
    optimizer.param_groups[0].update(hyper)  # also what the constructor does not take (initial_lr, kept state)
    optimizer.step()
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    return group, bool(torch.isfinite(param).all())


def optimizer_class(opt: OptimizerConfig, model: str) -> tuple[type, dict[str, Any]]:
    """The optimizer class that ``optimizer:`` (``opt``) builds for the model ``model`` and its hyperparameters but
    the learning rate: Model Zoo's models take cstorch's Adam and AdamW (``dls.train.cerebras_adam.CerebrasAdam``, which
    honours ``correct_bias``), dls's own models torch's; SGD is torch's for both (as cstorch's)."""
    import torch

    if opt.optimizer_type == "SGD":
        return torch.optim.SGD, {"momentum": opt.momentum, "weight_decay": opt.weight_decay}
    hyper = {"betas": opt.betas, "eps": opt.eps, "weight_decay": opt.weight_decay}
    if model in ZOO_MODELS:
        decoupled = opt.optimizer_type == "AdamW"
        return CerebrasAdam, {**hyper, "correct_bias": opt.correct_bias, "decoupled_weight_decay": decoupled}
    return torch.optim.Adam if opt.optimizer_type == "Adam" else torch.optim.AdamW, hyper


def _check_optimizer_step(b: dict[str, Any], r: Reader) -> None:
    """One step of the run's optimizer at the schedule's largest learning rate (times the largest
    ``adjust_learning_rate`` factor), on a weight of 1 with a gradient of 1, is taken and finite: else the learning
    rate (and the weight decay, when it takes part) is refused, before anything is built. A learning rate of 1e38
    passes the bound of every float key, but Adam's first step size (``lr / (1 - beta1)``) is beyond float32."""
    opt, lr = b["optimizer"], b["optimizer"].learning_rate
    rates = [lr] if isinstance(lr, (int, float)) else [
        v for piece in lr for v in (piece.learning_rate, piece.initial_learning_rate, piece.end_learning_rate)
        if v is not None
    ]  # fmt: skip
    largest = max(rates) * max([1.0, *opt.adjust_learning_rate.values()])
    cls, hyper = optimizer_class(opt, b["model"].name)
    try:
        if step_once(cls, {**hyper, "lr": largest})[1]:
            return
        why = "gives inf/NaN"
    except (ValueError, RuntimeError) as exc:
        why = f"fails ({' '.join(str(exc).split())})"
    keys = r.at("optimizer", "learning_rate")
    with contextlib.suppress(ValueError, RuntimeError):
        if hyper.get("weight_decay") and step_once(cls, {**hyper, "weight_decay": 0.0, "lr": largest})[1]:
            keys += f" with {r.at('optimizer', 'weight_decay')} {opt.weight_decay:g}"
    r.errors.append(
        f"{keys}: one step of {cls.__name__} at the learning rate {largest:g} on a weight of 1 with a gradient of 1 "
        f"{why}; give a smaller learning rate"
    )


# ---------------------------------------------------------------------- loss scaling
def _check_loss_scaling(b: dict[str, Any], r: Reader) -> None:
    """``ScalerSettings`` judges every loss-scaling key given, each problem under its key as written; the keys
    without effect in the run's mode are noted and dropped."""
    opt, prec, factor = b["optimizer"], b["precision"], b["optimizer"].loss_scaling_factor
    names = {arg: r.at("optimizer", key) for key, arg in SCALER_KEYS.items()}
    if isinstance(factor, str) and factor != "dynamic":
        hint = did_you_mean(factor, ["dynamic"])
        r.errors.append(f"{names['loss_scale']} must be 'dynamic' (lower case), a number or null; got {factor!r}{hint}")
        return
    if prec is None:  # the precision section's own errors are said
        return
    half = "float16" if prec.fp16_type == "float32" else prec.fp16_type
    given = {arg: getattr(opt, key) for key, arg in SCALER_KEYS.items() if getattr(opt, key) is not None}
    try:
        mode = ScalerSettings.cerebras(factor, half_dtype=half).mode  # the scaler's own rule for the mode
        ScalerSettings.cerebras(**{**given, "loss_scale": "dynamic"}, half_dtype=half)  # the others, as dynamic
    except SettingsError as exc:
        pattern = re.compile(r"\b(" + "|".join(sorted(names, key=len, reverse=True)) + r")\b")
        kept = [m for arg, m in exc.problems if arg in given] or [m for _, m in exc.problems]  # the keys written
        r.errors.extend(pattern.sub(lambda m: names[m.group(1)], m) for m in kept)
        return
    if (norm := opt.max_gradient_norm) is not None and norm > FLOAT32_MAX:  # the scaler takes any finite norm
        r.errors.append(f"{names['max_gradient_norm']} must be at most float32's max 3.4e38; got {norm!r}")
    if r.layout != "dls" and prec.compute_dtype == "bfloat16" and not opt.force_loss_scaling:
        _bfloat16_as_model_zoo(b, r, names)
        return
    if prec.compute_dtype == "float32":
        mode, why = "off", "the run computes in float32, without loss scaling"
    elif prec.fp16_type == "cbfloat16" and mode != "dynamic":
        r.errors.append(f"{names['loss_scale']} must be 'dynamic' for cbfloat16 (as on Cerebras); got {factor!r}")
        return
    else:
        why = f"loss_scaling_factor is a static {factor:g}" if mode == "static" else f"loss scaling is off for {half}"
    update: dict[str, Any] = {"loss_scaling_factor": float(factor)} if isinstance(factor, (int, float)) else {}
    dynamic_only = [k for k, arg in SCALER_KEYS.items() if arg not in ("loss_scale", "max_gradient_norm")]
    ignored = [k for k in ["loss_scaling_factor"] * (mode == "off") + dynamic_only if getattr(opt, k) is not None]
    if mode != "dynamic":
        r.notes.extend(f"{names[SCALER_KEYS[k]]} is ignored: {why}" for k in ignored)
        update.update(dict.fromkeys(ignored))
    b["optimizer"] = opt.model_copy(update=update)
    if mode != "off":
        _backend_notes(b, r, names)


def _bfloat16_as_model_zoo(b: dict[str, Any], r: Reader, names: dict[str, str]) -> None:
    """Model Zoo's layouts in bfloat16: no loss scaling, as Model Zoo's trainer (its precision callback drops the
    grad scaler for bfloat16); one note when a loss-scaling key written is not used."""
    opt = b["optimizer"]
    unused = [k for k, arg in SCALER_KEYS.items() if arg != "max_gradient_norm" and getattr(opt, k) is not None]
    b["optimizer"] = opt.model_copy(update=dict.fromkeys(unused))
    if [k for k in unused if k != "loss_scaling_factor" or opt.loss_scaling_factor != 1.0]:
        current = r.layout == "current"
        force = r.written.get("optimizer.force_loss_scaling", f"{'trainer.init.precision' if current else 'optimizer'}"
                              ".force_loss_scaling")  # fmt: skip
        half = r.written.get("precision.fp16_type", f"{'trainer.init.precision' if current else 'model'}.fp16_type")
        listed = ", ".join(names[SCALER_KEYS[k]] for k in unused)
        r.notes.append(
            f"{half} bfloat16: no loss scaling, as Model Zoo trains bfloat16 ({listed} not "
            f"used; {force}: true scales the loss)"
        )


def _backend_notes(b: dict[str, Any], r: Reader, names: dict[str, str]) -> None:
    """What a Model Zoo backend_type means for a run with loss scaling: GPU, Model Zoo's torch.amp rule (the bounds
    unused); CPU, CSX's numerics here, unlike Model Zoo's own CPU path."""
    opt, where = b["optimizer"], r.at("runconfig", "backend")
    backend = b["runconfig"].backend if b["runconfig"] is not None else None
    if backend == "GPU":
        bounds = [k for k in ("min_loss_scale", "max_loss_scale") if getattr(opt, k) is not None]
        if bounds:
            b["optimizer"] = opt.model_copy(update=dict.fromkeys(bounds))
            listed = " and ".join(names[SCALER_KEYS[k]] for k in bounds)
            r.notes.append(f"{listed} not used: {where} GPU scales as Model Zoo's GPU path, torch.amp.GradScaler")
        if b["precision"].compute_dtype == "cbfloat16":
            r.notes.append(
                f"{where} GPU: the run computes cbfloat16 (dls.emulate); Model Zoo's GPU path computes bfloat16"
            )
        if isinstance(opt.loss_scaling_factor, float):
            r.notes.append(
                f"{where} GPU: the static {names['loss_scale']} {opt.loss_scaling_factor:g} is torch.amp.GradScaler's "
                "starting scale, as in Model Zoo's GPU path: it backs off on overflow and never grows (dls: growth "
                f"every {GPU_NEVER:,} clean steps, which a run of at most {GPU_NEVER - 1:,} steps never reaches)"
            )
    elif backend == "CPU":
        half = b["precision"].compute_dtype
        r.notes.append(
            f"{where} CPU: the run computes {half} with cstorch.amp's loss scaling, as on CSX; Model Zoo's own CPU "
            "path would compute in bfloat16 without loss scaling"
        )


# Model Zoo's GPU path never grows a static scale (torch.amp's growth_interval 2**63 - 1); dls's count of clean steps
# is int32, as torch's: its largest growth interval, which a run of fewer steps (the trainer's limit) never reaches.
GPU_NEVER = 2**31 - 1


def scaler_settings(cfg: TrainConfig) -> ScalerSettings:
    """The loss scaler's settings of ``cfg``: cstorch.amp's (Cerebras' dialect, ``precision.fp16_type`` as the half
    dtype); with ``backend_type: GPU``, what Model Zoo's GPU path builds, ``torch.amp.GradScaler``: dynamic from
    ``initial_loss_scale`` (else 2**16) growing every ``steps_per_increase`` clean steps, or a static factor as a
    starting scale that backs off and never grows (:data:`GPU_NEVER`), without bounds."""
    opt, fp16_type = cfg.optimizer, cfg.precision.fp16_type
    half = "float16" if fp16_type == "float32" else fp16_type
    args = {arg: getattr(opt, key) for key, arg in SCALER_KEYS.items() if getattr(opt, key) is not None}
    settings = ScalerSettings.cerebras(**args, half_dtype=half)
    if cfg.runconfig.backend != "GPU" or settings.mode == "off":
        return settings
    rule = {k: v for k, v in args.items() if k not in ("loss_scale", "init_scale", "steps_per_increase")}
    if settings.mode == "static":
        return ScalerSettings.torch(init_scale=args["loss_scale"], growth_interval=GPU_NEVER, half_dtype=half, **rule)
    start, interval = (
        args.get("init_scale", TORCH_INIT_SCALE),
        args.get("steps_per_increase", settings.steps_per_increase),
    )
    return ScalerSettings.torch(init_scale=start, growth_interval=interval, half_dtype=half, **rule)


def loss_scaling_mode(cfg: TrainConfig) -> str:
    """``"dynamic"``, ``"static"`` or ``"off"`` (``"off"`` when the run computes in float32)."""
    return "off" if cfg.precision.compute_dtype == "float32" else scaler_settings(cfg).mode


# float32 weights, gradients and Adam's two states (16 bytes), and a checkpoint's weights and Adam states serialised
# in memory before it is written (12; see dls.train.checkpoint): measured 28 bytes per parameter at the peak.
BYTES_PER_PARAMETER = 28.0


def memory_problem(cfg: TrainConfig) -> str | None:
    """What of ``cfg`` will not fit this machine's free memory (the generated data set; the model with its
    gradients, Adam's two states and a checkpoint being written), naming the key as written; ``None`` when it
    fits. A note for ``validate``, exit status 3 for ``train``."""
    m, d, p = cfg.model, cfg.data, cfg.model.params
    need: dict[str, float] = {}
    if d.dataset == "teacher_regression":
        need["data.num_samples"] = 4.0 * d.num_samples * (d.input_dim + d.output_dim)
    h = p.get("hidden_size", m.hidden_size)
    if m.name in ("gpt2", "gpt3", "llama") and all(isinstance(p.get(k), int) for k in ("hidden_size", "filter_size")):
        embeddings = p.get("vocab_size", 1) * h * (1 if p.get("share_embedding_weights", True) else 2)
        block = 4 * h + (3 if p.get("nonlinearity") == "swiglu" else 2) * p["filter_size"]  # attention and MLP
        blocks = p.get("num_hidden_layers", 1) * h * block
        need[cfg.sources.get("model.params", "model") + ".hidden_size"] = BYTES_PER_PARAMETER * (embeddings + blocks)
    elif m.name == "mlp":
        need["model.hidden_size"] = BYTES_PER_PARAMETER * h * (d.input_dim + h * (m.depth - 1) + d.output_dim)
    if (free := free_memory()) is None or sum(need.values()) <= free:
        return None
    key = max(need, key=need.__getitem__)
    gib = f"about {sum(need.values()) / 2**30:.1f} GiB, {free / 2**30:.1f} GiB are free here"
    return f"{cfg.sources.get(key, key)}: this run needs {gib}"
