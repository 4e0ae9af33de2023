"""dls.train.config: YAML → validated config → GradScaler settings."""

from __future__ import annotations

import inspect
import io
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

import dls
from dls.settings import ScalerSettings, SettingsError
from dls.train import config as C
from dls.train.config import SECTION_CLASSES, load_config, load_yaml, parse_config, scaler_settings
from dls.train.errors import ConfigError

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


def mlp(**sections: dict) -> dict:
    """An MLP config in float16 mixed precision (loss scaling on by default), ``sections`` replacing sections."""
    raw: dict = {"model": {"name": "mlp"}, "precision": {"mixed_precision": True}}
    for name, body in sections.items():
        raw[name] = body
    return raw


def errors_of(raw: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(raw)  # type: ignore[arg-type]
    return info.value.errors


# ---------------------------------------------------------------------- good files
@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_validate_and_build_a_scaler(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.notes == ()
    scaler = dls.GradScaler.from_settings(scaler_settings(cfg))
    assert scaler.mode == "dynamic"


def test_shipped_configs_cover_the_issue() -> None:
    names = {p.name for p in CONFIGS}
    assert {"mlp_fp16_dls.yaml", "transformer_lm_fp16_dls.yaml", "mlp_cbfloat16_dls.yaml"} <= names


def test_cerebras_spelling_dynamic_in_yaml(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        'model: {name: mlp, mixed_precision: true, fp16_type: float16}\noptimizer:\n  loss_scaling_factor: "dynamic"\n'
        "  learning_rate: 1e-3\n  initial_loss_scale: 2e4\n"
    )
    cfg = load_config(path)
    assert cfg.optimizer.loss_scaling_factor == "dynamic"
    assert cfg.optimizer.learning_rate == pytest.approx(1e-3)  # YAML 1.1 would read 1e-3 as a string
    settings = scaler_settings(cfg)
    assert settings.mode == "dynamic" and settings.init_scale == 2e4 and settings.max_loss_scale == 2.0**15


def test_defaults_follow_the_precision() -> None:
    def mode(precision: dict, optimizer: dict | None = None) -> str:
        return C.loss_scaling_mode(parse_config(mlp(precision=precision, optimizer=optimizer or {})))

    assert mode({"mixed_precision": True, "fp16_type": "float16"}) == "dynamic"
    assert mode({"mixed_precision": True, "fp16_type": "cbfloat16"}) == "dynamic"
    assert mode({"mixed_precision": True, "fp16_type": "bfloat16"}) == "off"
    assert mode({"mixed_precision": False}) == "off"
    assert mode({"mixed_precision": True, "fp16_type": "bfloat16"}, {"loss_scaling_factor": "dynamic"}) == "dynamic"
    assert mode({"mixed_precision": True, "fp16_type": "float16"}, {"loss_scaling_factor": 1.0}) == "static"


def test_scaler_settings_for_each_mode() -> None:
    off = parse_config(mlp(precision={"mixed_precision": True, "fp16_type": "bfloat16"}))
    assert C.loss_scaling_mode(off) == "off" and scaler_settings(off).mode == "off"

    static = parse_config(mlp(precision={"mixed_precision": True}, optimizer={"loss_scaling_factor": 128}))
    assert scaler_settings(static) == ScalerSettings.cerebras(loss_scale=128.0, half_dtype="float16")

    cb = parse_config(mlp(precision={"mixed_precision": True, "fp16_type": "cbfloat16"}))
    assert scaler_settings(cb) == ScalerSettings.cerebras(half_dtype="cbfloat16")  # the scaler's defaults
    assert scaler_settings(cb).init_scale == scaler_settings(cb).max_loss_scale == 2.0**31

    keys = {
        "loss_scaling_factor": "dynamic",
        "initial_loss_scale": 1024,
        "steps_per_increase": 7,
        "min_loss_scale": 0.5,
        "max_loss_scale": 4096,
        "overflow_tolerance": 0.25,
        "hysteresis": 2,
        "growth_factor": 4,
        "backoff_factor": 0.25,
        "max_gradient_norm": 3.0,
    }
    full = parse_config(mlp(precision={"mixed_precision": True, "fp16_type": "float16"}, optimizer=keys))
    assert scaler_settings(full) == ScalerSettings.cerebras(
        "dynamic", 1024, 7, 0.5, 4096, 0.25, 3.0, growth_factor=4, backoff_factor=0.25, hysteresis=2,
        half_dtype="float16",
    )  # fmt: skip


def test_a_float32_run_has_no_loss_scaling_and_says_which_keys_it_ignores() -> None:
    keys = {"loss_scaling_factor": "dynamic", "steps_per_increase": 3, "max_gradient_norm": 1}
    cfg = parse_config(mlp(precision={}, optimizer=keys))
    assert C.loss_scaling_mode(cfg) == "off" and cfg.optimizer.max_gradient_norm == 1  # clipping still applies
    assert cfg.optimizer.loss_scaling_factor is None and cfg.optimizer.steps_per_increase is None
    assert [w.split(" is ignored")[0] for w in cfg.notes] == [
        "optimizer.loss_scaling_factor",
        "optimizer.steps_per_increase",
    ]
    assert all("computes in float32" in w for w in cfg.notes)


def test_model_zoo_aliases() -> None:
    cfg = parse_config(
        {
            "model": {"name": "mlp", "mixed_precision": True, "fp16_type": "bfloat16"},
            "train_input": {"batch_size": 8},
            "optimizer": {"optimizer_type": "adamw", "weight_decay_rate": 0.1},
        }
    )
    assert cfg.precision.mixed_precision and cfg.precision.fp16_type == "bfloat16"
    assert cfg.data.batch_size == 8 and cfg.optimizer.optimizer_type == "AdamW"
    assert cfg.optimizer.weight_decay == 0.1
    # The same value in both places is fine.
    parse_config(
        {
            "model": {"name": "mlp", "fp16_type": "float16"},
            "precision": {"fp16_type": "float16", "mixed_precision": True},
        }
    )


def test_learning_rate_schedules() -> None:
    cfg = parse_config(
        mlp(
            optimizer={
                "learning_rate": [
                    {"scheduler": "Linear", "initial_learning_rate": 0, "end_learning_rate": 1e-3, "total_iters": 10},
                    {
                        "scheduler": "cosinedecay",
                        "initial_learning_rate": 1e-3,
                        "end_learning_rate": 0,
                        "total_iters": 5,
                    },
                    {"scheduler": "Constant", "learning_rate": 1e-5},
                ]
            }
        )
    )
    schedule = cfg.optimizer.learning_rate
    assert isinstance(schedule, tuple) and schedule[1].scheduler == "CosineDecay"
    from dls.train.trainer import learning_rate_at

    assert learning_rate_at(schedule, 0) == 0.0
    assert learning_rate_at(schedule, 5) == pytest.approx(5e-4)
    assert learning_rate_at(schedule, 10) == pytest.approx(1e-3)
    assert learning_rate_at(schedule, 15) == 1e-5
    assert learning_rate_at(schedule, 10_000) == 1e-5
    assert learning_rate_at(0.1, 3) == 0.1


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_round_trip_through_plain_dict(path: Path) -> None:
    cfg = load_config(path)
    assert parse_config(C.to_dict(cfg)).model_dump(exclude={"sources"}) == cfg.model_dump(exclude={"sources"})


@pytest.mark.parametrize(
    "raw",
    [
        mlp(),
        mlp(precision={}),
        mlp(optimizer={"loss_scaling_factor": 8.0}),
        mlp(precision={"mixed_precision": True, "fp16_type": "bfloat16"}),
        {"model": {"name": "transformer_lm"}, "optimizer": {"optimizer_type": "SGD", "momentum": 0.5}},
    ],
)
def test_round_trip_of_every_mode(raw: dict) -> None:
    cfg = parse_config(raw)
    assert parse_config(C.to_dict(cfg)).model_dump(exclude={"sources"}) == cfg.model_dump(exclude={"sources"})


def test_describe_keys_lists_every_key() -> None:
    text = C.describe_keys()
    for section, cls in SECTION_CLASSES.items():
        assert f"{section}:" in text
        for key in cls.model_fields:
            assert f"  {key} " in text
    # A loss-scaling key shows the scaler's default, for cbfloat16 too, read from the settings.
    (line,) = [line for line in text.splitlines() if line.strip().startswith("max_loss_scale ")]
    assert "null: 2^15" in line and "(cbfloat16: 2^31)" in line


# ---------------------------------------------------------------------- bad files
def test_unknown_key_names_it_and_the_allowed_keys() -> None:
    (msg,) = errors_of(mlp(optimizer={"loss_scaling_facter": "dynamic"}))
    assert "optimizer.loss_scaling_facter" in msg
    assert "did you mean 'loss_scaling_factor'" in msg
    assert "allowed keys:" in msg and "steps_per_increase" in msg


def test_foreign_names_point_to_the_one_key() -> None:
    errs = errors_of(mlp(optimizer={"growth_interval": 100, "init_scale": 4.0, "lr": 0.1}))
    assert any("growth_interval" in e and "steps_per_increase" in e for e in errs)
    assert any("init_scale" in e and "initial_loss_scale" in e for e in errs)
    assert any("optimizer.lr" in e and "learning_rate" in e for e in errs)


def test_unknown_section() -> None:
    (msg,) = errors_of({"model": {"name": "mlp"}, "evaluation": {}})
    assert "unknown section evaluation" in msg and "runconfig" in msg


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (mlp(runconfig={"max_steps": "ten"}), "runconfig.max_steps must be an integer >= 1; got 'ten'"),
        (mlp(runconfig={"max_steps": 0}), "runconfig.max_steps must be an integer >= 1"),
        (mlp(runconfig={"max_steps": True}), "runconfig.max_steps must be an integer"),
        (mlp(optimizer={"loss_scaling_factor": -2}), "optimizer.loss_scaling_factor must be a number from 2**-126"),
        (mlp(optimizer={"loss_scaling_factor": "auto"}), "optimizer.loss_scaling_factor must be 'dynamic'"),
        (mlp(optimizer={"optimizer_type": "LAMB"}), "optimizer.optimizer_type must be one of 'SGD', 'Adam', 'AdamW'"),
        (mlp(optimizer={"betas": [0.9]}), "optimizer.betas must be a list of two numbers"),
        (mlp(optimizer={"min_loss_scale": 0}), "optimizer.min_loss_scale must be a number from 2**-126 to float32"),
        (mlp(optimizer={"overflow_tolerance": 1.5}), "optimizer.overflow_tolerance must be a number in [0, 1)"),
        (mlp(optimizer={"log_summaries": "yes please"}), "optimizer.log_summaries must be true or false"),
        (mlp(precision={"fp16_type": "float8"}), "precision.fp16_type must be one of 'float16', 'bfloat16'"),
        (mlp(runconfig={"device": "tpu"}), "runconfig.device must be one of 'auto', 'cpu', 'cuda'"),
        (mlp(runconfig={"load_checkpoint_states": "model,weights"}), "unknown checkpoint state(s) 'weights'"),
        ({"model": {"name": "resnet"}}, "model.name: fc_mnist, gpt2, gpt3, llama are supported (and dls's own mlp"),
        ({"model": {}}, "model.name is required"),
        # These two crashed (exit 4) before: a name or a state list that is not text.
        ({"model": {"name": ["mlp"]}}, "model.name must be one of 'mlp', 'transformer_lm'"),
        (mlp(runconfig={"load_checkpoint_states": 3}), "runconfig.load_checkpoint_states: expected a comma-separated"),
        (mlp(data="big"), "section data must be a mapping"),
        (["model"], "the top level must be a mapping"),
    ],
)
def test_wrong_types_and_values(raw: object, needle: str) -> None:
    errs = errors_of(raw)
    assert any(needle in e for e in errs), errs


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (
            {"model": {"name": "mlp", "fp16_type": "bfloat16"}, "precision": {"fp16_type": "float16"}},
            "model.fp16_type ('bfloat16') and precision.fp16_type ('float16') disagree",
        ),
        ({"model": {"name": "mlp"}, "data": {}, "train_input": {}}, "give section 'data' once"),
        (mlp(optimizer={"weight_decay": 0.1, "weight_decay_rate": 0.1}), "are the same setting"),
        # Model Zoo's weight_decay_rate belongs to optimizer: it set the weight decay from any legacy section.
        (mlp(data={"weight_decay_rate": 0.1}), "unknown key data.weight_decay_rate"),
        (
            mlp(precision={"mixed_precision": True, "fp16_type": "cbfloat16"}, optimizer={"loss_scaling_factor": 8}),
            "must be 'dynamic' for cbfloat16",
        ),
        (
            mlp(optimizer={"loss_scaling_factor": "dynamic", "min_loss_scale": 8, "max_loss_scale": 4}),
            "must not exceed optimizer.max_loss_scale",
        ),
        (
            mlp(optimizer={"loss_scaling_factor": "dynamic", "initial_loss_scale": 0.5, "min_loss_scale": 1}),
            "must not be below optimizer.min_loss_scale",
        ),
        (mlp(optimizer={"max_gradient_norm": 1, "max_gradient_value": 1}), "not both"),
        (mlp(optimizer={"momentum": 0.9}), "optimizer.momentum applies only when optimizer.optimizer_type is 'SGD'"),
        (mlp(model={"name": "mlp", "num_heads": 2}), "model.num_heads applies only when model.name is"),
        (mlp(data={"max_sequence_length": 8}), "data.max_sequence_length applies only when data.dataset is"),
        (mlp(data={"dataset": "char_corpus"}), "does not fit model.name 'mlp'"),
        ({"model": {"name": "transformer_lm", "hidden_size": 30, "num_heads": 4}}, "must divide model.hidden_size"),
        (
            {"model": {"name": "transformer_lm", "max_position_embeddings": 8}, "data": {"max_sequence_length": 9}},
            "exceeds model.max_position_embeddings",
        ),
        (
            mlp(optimizer={"learning_rate": {"scheduler": "Step"}}),
            "learning_rate[0].scheduler must be one of 'Constant'",
        ),
        (
            mlp(optimizer={"learning_rate": {"scheduler": "Linear", "initial_learning_rate": 1}}),
            "optimizer.learning_rate[0]: end_learning_rate is required for Linear",
        ),
        (
            mlp(optimizer={"learning_rate": [{"scheduler": "Constant", "learning_rate": 1, "gamma": 2}]}),
            "unknown key optimizer.learning_rate[0].gamma",
        ),
        (mlp(optimizer={"learning_rate": "fast"}), "optimizer.learning_rate must be a number >= 0 or a schedule"),
    ],
)
def test_inconsistent_combinations(raw: dict, needle: str) -> None:
    errs = errors_of(raw)
    assert any(needle in e for e in errs), errs


def test_every_problem_is_reported_at_once() -> None:
    raw = mlp(
        optimizer={"lr": 1, "loss_scaling_factor": "sometimes"},
        runconfig={"max_steps": -1, "log_stepz": 3},
        precision={"emulate": 1},
    )
    with pytest.raises(ConfigError) as info:
        parse_config(raw, source="bad.yaml")
    assert len(info.value.errors) == 5, info.value.errors
    assert str(info.value).startswith("invalid config in bad.yaml (5 problems):")
    assert isinstance(info.value, ValueError)


def test_keys_that_do_nothing_warn() -> None:
    bf16 = parse_config(
        mlp(precision={"mixed_precision": True, "fp16_type": "bfloat16"}, optimizer={"steps_per_increase": 10})
    )
    assert any("steps_per_increase is ignored" in w and "bfloat16" in w for w in bf16.notes)
    static = parse_config(mlp(optimizer={"loss_scaling_factor": 64, "initial_loss_scale": 8}))
    assert any("initial_loss_scale is ignored" in w and "static" in w for w in static.notes)
    fp32 = parse_config(mlp(precision={"fp16_type": "float16"}))
    assert fp32.precision.compute_dtype == "float32"
    assert any("fp16_type ('float16') has no effect" in w for w in fp32.notes)
    assert static.optimizer.initial_loss_scale is None  # dropped: ScalerSettings refuses it with a static scale
    assert scaler_settings(static).mode == "static"


def test_intervals_longer_than_the_run_are_fine() -> None:
    """The last step is always checkpointed and logged: no warning."""
    cfg = parse_config(mlp(runconfig={"max_steps": 5, "checkpoint_steps": 100, "log_steps": 100}))
    assert cfg.notes == ()


# ---------------------------------------------------------------------- files and overrides
def test_overrides_are_yaml_scalars(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  name: mlp\nprecision:\n  mixed_precision: true\n")
    cfg = load_config(
        path,
        [
            "runconfig.max_steps=20",
            "optimizer.loss_scaling_factor=dynamic",
            "optimizer.learning_rate=3e-4",
            "optimizer.betas=[0.8, 0.95]",
            "optimizer.max_loss_scale=null",
            "train_input.batch_size=4",
        ],
    )
    assert cfg.runconfig.max_steps == 20 and cfg.optimizer.loss_scaling_factor == "dynamic"
    assert cfg.optimizer.learning_rate == pytest.approx(3e-4) and cfg.optimizer.betas == (0.8, 0.95)
    assert cfg.data.batch_size == 4


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("runconfig.max_steps", "must look like section.key=value"),
        ("max_steps=3", "must look like section.key=value"),
        ("model.name.x=3", "model.name is not a section"),
        ("runconfig.max_steps=[1", "not valid YAML"),
    ],
)
def test_bad_overrides(tmp_path: Path, override: str, needle: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("model: {name: mlp}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, [override])
    assert needle in str(info.value)


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name: mlp\n   depth: 3\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ConfigError, match=r"model\.name is required"):
        load_config(empty)


def test_parse_checkpoint_states() -> None:
    assert C.parse_checkpoint_states("model, optimizer") == ("model", "optimizer")
    assert C.parse_checkpoint_states("all") == C.CHECKPOINT_STATES
    assert C.parse_checkpoint_states(["grad_scaler"]) == ("grad_scaler",)
    with pytest.raises(ValueError, match="allowed: model, optimizer, dataloader"):
        C.parse_checkpoint_states("model,scaler")


# ---------------------------------------------------------------------- the loss-scaling keys are the scaler's
YAML_NAMES = {"loss_scale": "loss_scaling_factor", "init_scale": "initial_loss_scale"}
SCALER_NAMES = {v: k for k, v in YAML_NAMES.items()}


def scaler_kwargs(optimizer: dict) -> dict:
    """The ``dls.GradScaler`` arguments of the optimizer keys, as written (a count written 100.0 is not a count)."""
    return {SCALER_NAMES.get(k, k): v for k, v in optimizer.items()}


@pytest.mark.parametrize(
    "optimizer",
    [
        {"loss_scaling_factor": 3.402e38},  # accepted: a static scale below float32's max
        {"loss_scaling_factor": 3.4028234663852886e38},
        {"loss_scaling_factor": 1e-300},
        {"loss_scaling_factor": 1e-45},  # a float32 subnormal: 1/scale is inf
        {"loss_scaling_factor": 3.5e38},  # inf in float32
        {"max_loss_scale": 1e39},
        {"min_loss_scale": 1e-300},
        {"min_loss_scale": 2.0**-127},
        {"min_loss_scale": 2.0**-126, "initial_loss_scale": 2.0**-126},
        {"initial_loss_scale": 1e-39},
        {"initial_loss_scale": 2.0**20},  # above the default max: raises the max
        {"initial_loss_scale": 2.0**20, "max_loss_scale": 2.0**16},
        {"min_loss_scale": 8, "max_loss_scale": 4},
        {"initial_loss_scale": 0.5, "min_loss_scale": 1},
        {"steps_per_increase": 1e10},
        {"steps_per_increase": 100.0},  # a count is an integer, as GradScaler's (it was read as 100)
        {"hysteresis": 2.0},
        {"steps_per_increase": 2**31},  # torch's growth tracker is an int32
        {"steps_per_increase": 2**31 - 1},
        {"steps_per_increase": 2.5},
        {"hysteresis": 0},
        {"growth_factor": 1.0},
        {"backoff_factor": 1.0},
        {"overflow_tolerance": 1.0},
        {"overflow_tolerance": "none"},
        {"max_gradient_norm": -1.0},
    ],
    ids=str,
)
def test_the_config_accepts_exactly_what_the_scaler_accepts(optimizer: dict) -> None:
    """``dls validate`` and ``dls.GradScaler`` agree, and each problem is the scaler's, under its YAML key."""
    try:
        dls.GradScaler(**{"loss_scale": None, **scaler_kwargs(optimizer)})  # the config's dialect: cstorch.amp's
    except SettingsError as exc:
        problems = exc.problems
    else:
        problems = []
    if not problems:
        assert parse_config(mlp(optimizer=optimizer)).notes == ()
        return
    errors = errors_of(mlp(optimizer=optimizer))
    relabelled = []
    for _, message in problems:
        for name in sorted(inspect.signature(ScalerSettings.cerebras).parameters, key=len, reverse=True):
            message = re.sub(rf"\b{name}\b", f"optimizer.{YAML_NAMES.get(name, name)}", message)
        relabelled.append(message)
    assert errors and set(errors) <= set(relabelled), (errors, relabelled)
    given = {f"optimizer.{k}" for k in optimizer}
    assert all(any(key in e for key in given) for e in errors)  # every error names a key the file gave


@pytest.mark.parametrize(
    ("precision", "optimizer"),
    [
        ({}, {"max_loss_scale": 1e39}),  # float32: loss scaling off
        ({"mixed_precision": True, "fp16_type": "bfloat16"}, {"steps_per_increase": 0}),  # off for bfloat16
        ({"mixed_precision": True}, {"loss_scaling_factor": 8.0, "initial_loss_scale": -1.0}),  # static
    ],
)
def test_a_key_without_effect_is_still_checked(precision: dict, optimizer: dict) -> None:
    (error,) = errors_of(mlp(precision=precision, optimizer=optimizer))
    assert error.startswith(f"optimizer.{next(k for k in optimizer if k != 'loss_scaling_factor')} must be")


def test_a_loss_scale_error_names_the_key_and_the_range() -> None:
    (error,) = errors_of(mlp(optimizer={"max_loss_scale": 1e39}))
    assert error == (
        "optimizer.max_loss_scale must be a number from 2**-126 to float32's max 3.4028e38 (a normal float32); "
        "got 1e+39"
    )


@pytest.mark.parametrize(
    ("section", "key", "value", "needle"),
    [
        ("runconfig", "seed", 1e20, "runconfig.seed must be an integer in [0, 4294967295]"),
        ("data", "shuffle_seed", 2**32, "data.shuffle_seed must be an integer in [0, 4294967295] or null"),
        ("runconfig", "max_steps", 2**63, "runconfig.max_steps must be an integer in [1, 9223372036854775807]"),
        ("runconfig", "num_threads", 0, "runconfig.num_threads must be an integer in [1, 1024] or null"),
    ],
)
def test_integer_keys_fit_the_integers_they_feed(section: str, key: str, value: object, needle: str) -> None:
    (error,) = errors_of(mlp(**{section: {key: value}}))
    assert error.startswith(needle)


# ---------------------------------------------------------------------- hostile files
def billion_laughs(levels: int) -> str:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\nmodel: {name: mlp}\n"


def test_an_alias_bomb_is_rejected_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(billion_laughs(9))  # 9**10 strings once expanded
    with pytest.raises(ConfigError, match="expands to more than 100,000 values") as info:
        load_config(path, ["runconfig.max_steps=3"])
    assert info.value.source == str(path)


def test_anchors_and_merge_keys_still_work(tmp_path: Path) -> None:
    path = tmp_path / "anchors.yaml"
    path.write_text(
        "base: &base {optimizer_type: AdamW, learning_rate: 1e-3}\n"
        "model: {name: mlp}\n"
        "optimizer: {<<: *base, learning_rate: 2e-3}\n"
    )
    raw = C.read_config(path)
    raw.pop("base")
    assert parse_config(raw).optimizer.learning_rate == 2e-3
    assert parse_config(raw).optimizer.optimizer_type == "AdamW"


def test_repeated_merge_keys_do_not_multiply() -> None:
    lines = ["m0: &m0 {x: 1}"] + [
        f"m{i}: &m{i} {{<<: [{', '.join([f'*m{i - 1}'] * 9)}], y{i}: {i}}}" for i in range(1, 30)
    ]
    data = load_yaml("\n".join(lines))  # without de-duplication, 9**29 merged pairs
    assert data["m29"] == {"x": 1, **{f"y{i}": i for i in range(1, 30)}}


def test_recursive_aliases_and_deep_nesting_are_rejected() -> None:
    with pytest.raises(ConfigError, match="contains itself"):
        load_yaml("a: &a [*a]")
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_yaml("[" * 1000 + "]" * 1000)


def test_aliases_are_expanded_into_copies_so_an_override_changes_one_path(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("model: {name: mlp}\ntrain_input: &d {batch_size: 8, shuffle: false}\neval_input: *d\n")
    cfg = load_config(path, ["train_input.batch_size=4"])
    assert cfg.data.batch_size == 4 and cfg.eval_data is not None and cfg.eval_data.batch_size == 8
    raw = {"model": {"name": "mlp"}, "data": {"batch_size": 8}}
    out = C.apply_overrides(raw, ["data.batch_size=2", "runconfig.max_steps=3"])
    assert raw == {"model": {"name": "mlp"}, "data": {"batch_size": 8}}  # the input is not changed
    assert out["data"] == {"batch_size": 2} and out["runconfig"] == {"max_steps": 3}


def test_config_files_that_are_not_utf8_or_too_large_name_the_file(tmp_path: Path) -> None:
    latin = tmp_path / "latin1.yaml"
    latin.write_bytes("model: {name: mlp}  # caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.yaml: not UTF-8 text \(byte 0xe9 at offset 25\)"):
        load_config(latin)
    big = tmp_path / "big.yaml"
    big.write_bytes(b"# " + b"x" * (1 << 20) + b"\n")
    with pytest.raises(ConfigError, match=r"big\.yaml: larger than 1 MiB"):
        load_config(big)


# ---------------------------------------------------------------------- half parameters and FP8
def test_half_params_need_a_half_precision_run() -> None:
    (msg,) = errors_of(mlp(precision={"half_params": True}))
    assert msg.startswith("precision.half_params needs a half-precision run") and "mixed_precision: true" in msg
    cfg = parse_config(mlp(precision={"mixed_precision": True, "fp16_type": "bfloat16", "half_params": True}))
    assert cfg.precision.param_dtype == "bfloat16" and cfg.precision.master_weights
    cb = parse_config(mlp(precision={"mixed_precision": True, "fp16_type": "cbfloat16", "half_params": True}))
    assert cb.precision.param_dtype == "float32" and cb.precision.emulated  # float32 values on the cbfloat16 grid
    (msg,) = errors_of(
        mlp(precision={"mixed_precision": True, "fp16_type": "cbfloat16", "half_params": True, "master_weights": False})
    )
    assert "master_weights: false does not work with cbfloat16" in msg


def test_keys_without_effect_in_the_half_params_modes_warn() -> None:
    cfg = parse_config(mlp(precision={"mixed_precision": True, "master_weights": False}))
    assert cfg.notes == ("precision.master_weights has no effect without precision.half_params: true",)
    native = parse_config(mlp(precision={"mixed_precision": True, "half_params": True, "emulate": True}))
    assert not native.precision.emulated and any("precision.emulate has no effect" in w for w in native.notes)


@pytest.mark.parametrize(
    ("fp8", "needle"),
    [
        ("delayed", "precision.fp8 must be null (no FP8) or a mapping {recipe: current | delayed | mxfp8 | static"),
        ({"margin": 1}, "precision.fp8.recipe must be one of 'current', 'delayed', 'mxfp8', 'static'; got nothing"),
        ({"recipe": "tensorwise"}, "precision.fp8.recipe must be one of"),
        ({"recipe": "delayed", "margin": 0.5}, "precision.fp8.margin must be an int from -1000 to 1000; got 0.5"),
        (
            {"recipe": "delayed", "amax_history_len": 0},
            "precision.fp8.amax_history_len must be an integer in [1, 65536]",
        ),
        (
            {"recipe": "delayed", "amax_history_len": 10**7},
            "precision.fp8.amax_history_len must be an integer in [1, 65536]",
        ),
        ({"recipe": "delayed", "amax_compute_algo": "mean"}, "precision.fp8.amax_compute_algo must be one of"),
        ({"recipe": "current", "margin": 2}, "unknown key precision.fp8.margin; allowed keys: recipe, power_2"),
        ({"recipe": "mxfp8", "scale_mod": "floor"}, "unknown key precision.fp8.scale_mod (did you mean 'scale_mode'?)"),
        ({"recipe": "static", "scale": -1}, "precision.fp8.scale must be a finite float > 0; got -1"),
        ({"recipe": "static", "fp8_format": "e5m2"}, "precision.fp8.fp8_format must be one of 'hybrid', 'e4m3'"),
    ],
)
def test_fp8_errors_name_the_key(fp8: object, needle: str) -> None:
    (msg,) = errors_of(mlp(precision={"fp8": fp8}))
    assert needle in msg, msg


def test_fp8_config_holds_every_field_and_round_trips() -> None:
    (msg,) = errors_of(mlp(precision={"fp8": {"recipe": "delayed", "amax_history_len": 16.0}}))
    assert msg == "precision.fp8.amax_history_len must be an integer in [1, 65536]; got 16.0"  # as DelayedScaling
    cfg = parse_config(mlp(precision={"fp8": {"recipe": "delayed", "amax_history_len": 16, "margin": 1}}))
    assert cfg.precision.fp8 == {
        "recipe": "delayed",
        "margin": 1,
        "amax_history_len": 16,
        "amax_compute_algo": "max",
        "fp8_format": "hybrid",
        "saturate_gradients": True,
    }
    assert parse_config(C.to_dict(cfg)).model_dump(exclude={"sources"}) == cfg.model_dump(exclude={"sources"})
    (msg,) = errors_of(mlp(precision={"mixed_precision": True, "fp16_type": "cbfloat16", "fp8": {"recipe": "current"}}))
    assert msg.startswith("precision.fp8 cannot be combined with dls.emulate")
    assert parse_config(mlp(precision={"mixed_precision": True, "fp8": {"recipe": "mxfp8"}})).notes == ()


def test_fp8_keys_come_from_overrides_too(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  name: mlp\n")
    cfg = load_config(path, ["precision.fp8.recipe=static", "precision.fp8.scale=4", "runconfig.tensorboard=true"])
    assert cfg.precision.fp8 is not None and cfg.precision.fp8["scale"] == 4.0 and cfg.runconfig.tensorboard


# ---------------------------------------------------------------------- Model Zoo layouts, as written
MODELZOO = Path(__file__).resolve().parent / "data" / "modelzoo"
# Copied unchanged from the Cerebras/modelzoo repository (tests/data/modelzoo/README.md: each file's release tag).
MODELS, NLP = "src/cerebras/modelzoo/models", "src/cerebras/modelzoo/models/nlp"
SOURCES = {
    "fc_mnist_legacy_params.yaml": "Release_1.8.0:modelzoo/fc_mnist/pytorch/configs/params.yaml",
    "fc_mnist_1.9.1.yaml": "Release_1.9.1:modelzoo/fc_mnist/pytorch/configs/params.yaml",
    "fc_mnist_params.yaml": f"Release_2.10.0:{MODELS}/vision/fc_mnist/configs/params.yaml",
    "fc_mnist_cszoov2.yaml": f"Release_2.10.0:{MODELS}/vision/fc_mnist/configs/params_cszoov2.yaml",
    "gpt2_small_2.3.1.yaml": f"Release_2.3.1:{NLP}/gpt2/configs/params_gpt2_small.yaml",
    "gpt2_small_ws_1.8.0.yaml": "Release_1.8.0:modelzoo/transformers/pytorch/gpt2/configs/params_gpt2_small_ws.yaml",
    "gpt3_125m_rigl75.yaml": f"Release_2.10.0:{NLP}/gpt3/configs/sparsity/pretraining/params_gpt3_125m_rigl75.yaml",
    "gpt3_20b_2.3.1.yaml": f"Release_2.3.1:{NLP}/gpt3/configs/params_gpt3_20b.yaml",
    "gpt3_cerebras_gpt_111m.yaml": f"Release_2.10.0:{NLP}/gpt3/configs/Cerebras_GPT/111m.yaml",
    "gpt3_cerebras_gpt_111m_mup.yaml": f"Release_2.10.0:{NLP}/gpt3/configs/Cerebras_GPT/111m_mup.yaml",
    "gpt3_cerebras_gpt_111m_mup_2.3.1.yaml": f"Release_2.3.1:{NLP}/gpt3/configs/Cerebras_GPT/111m_mup.yaml",
    "gpt3_cerebras_gpt_256m_mup_2.3.1.yaml": f"Release_2.3.1:{NLP}/gpt3/configs/Cerebras_GPT/256m_mup.yaml",
    "gpt3_mup_40m_2.3.1.yaml": f"Release_2.3.1:{NLP}/gpt3/configs/muP/params_gpt3_40M.yaml",
    "llama3p1_70b_msl_8k_2.3.1.yaml": f"Release_2.3.1:{NLP}/llama/configs/params_llama3p1_70b_msl_8k.yaml",
    "llama3p1_8b_msl_8k.yaml": f"Release_2.10.0:{NLP}/llama/configs/params_llama3p1_8b_msl_8k.yaml",
    "llama3p1_8b_msl_32k_swa_8k_sink_512.yaml": (
        f"Release_2.10.0:{NLP}/llama/configs/params_llama3p1_8b_msl_32k_swa_8k_sink_512.yaml"
    ),
    "llama3p2_1b_msl_8k.yaml": f"Release_2.10.0:{NLP}/llama/configs/params_llama3p2_1b_msl_8k.yaml",
    "llama3p3_70b_msl_128k.yaml": f"Release_2.10.0:{NLP}/llama/configs/params_llama3p3_70b_msl_128k.yaml",
    "llama_7b_1.9.1.yaml": "Release_1.9.1:modelzoo/transformers/pytorch/llama/configs/params_llama_7b.yaml",
    **{
        f"runconfig_schema_{r}.yaml": f"Release_{r}:{where}/schema/runconfig_schema.yaml"
        for r, where in [(r, "modelzoo/common/pytorch") for r in ("1.8.0", "1.9.1")]
        + [(r, "src/cerebras/modelzoo/common") for r in ("2.3.1", "2.10.0")]
    },
}
# The configs that name their model and validate as written (the data elsewhere: a note).
VALID = ["fc_mnist_legacy_params.yaml", "fc_mnist_params.yaml", "gpt3_cerebras_gpt_111m.yaml"]
VALID.append("llama3p2_1b_msl_8k.yaml")


def test_the_model_zoo_copies_are_all_listed() -> None:
    assert sorted(p.name for p in MODELZOO.glob("*.yaml")) == sorted(SOURCES)
    readme = (MODELZOO / "README.md").read_text()
    for name, source in SOURCES.items():
        release, path = source.split(":")
        row = next(line for line in readme.splitlines() if line.startswith(f"| `{name}` |"))
        assert release in row and f"`{path}`" in row, name


@pytest.mark.parametrize("name", VALID)
def test_real_model_zoo_configs_validate_as_written(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    from dls.train.cli import main

    assert main(["validate", str(MODELZOO / name)]) == 0
    out = capsys.readouterr().out
    assert "# note: on this machine:" in out and "data_dir" in out  # the data is elsewhere: a note, not an error
    cfg = load_config(MODELZOO / name)
    assert cfg.layout == ("current" if "trainer" in (MODELZOO / name).read_text() else "legacy")
    assert cfg.model.name in ("fc_mnist", "gpt3", "llama") and cfg.model.params


def test_the_current_layout_maps_key_by_key() -> None:
    cfg = load_config(MODELZOO / "llama3p2_1b_msl_8k.yaml")
    assert cfg.precision.compute_dtype == "cbfloat16" and C.loss_scaling_mode(cfg) == "dynamic"
    assert cfg.optimizer.optimizer_type == "AdamW" and cfg.optimizer.betas == (0.9, 0.95)
    assert cfg.optimizer.weight_decay == 0.1 and cfg.optimizer.max_gradient_norm == 1.0
    pieces = cfg.optimizer.learning_rate
    assert isinstance(pieces, tuple) and [p.scheduler for p in pieces] == ["CosineDecay", "CosineDecay"]
    from dls.train.trainer import learning_rate_at

    assert learning_rate_at(pieces, 34) == pytest.approx(3e-4) and learning_rate_at(pieces, 700) == pytest.approx(3e-5)
    rc = cfg.runconfig
    assert (rc.max_steps, rc.checkpoint_steps, rc.log_steps, rc.eval_steps, rc.seed) == (700, 70, 1, 10, 1)
    assert rc.load_checkpoint_states == ("model",) and rc.disable_strict_checkpoint_loading
    assert rc.autoload_last_checkpoint and rc.device == "auto"  # CSX: the best device here
    assert cfg.data.data_processor == "GptHDF5MapDataProcessor" and cfg.data.shuffle_seed == 1337
    assert cfg.eval_data is not None and cfg.eval_data.batch_size == 1024 and not cfg.eval_data.shuffle
    assert cfg.model.params["extra_attention_params"] == {"num_kv_groups": 8}
    (ignored,) = [n for n in cfg.notes if n.startswith("ignored on this hardware")]
    assert "trainer.init.callbacks[0].ScopedTrainFlags" in ignored and "num_workers" in ignored
    gpt = load_config(MODELZOO / "gpt3_cerebras_gpt_111m.yaml")
    assert gpt.precision.compute_dtype == "bfloat16" and gpt.runconfig.eval_frequency == 903
    assert any("loss_scaling_factor: 1.0, Model Zoo's default in the current layout" in n for n in gpt.notes)


def test_legacy_model_zoo_defaults_are_model_zoos_and_logged() -> None:
    cfg = load_config(MODELZOO / "fc_mnist_legacy_params.yaml")
    assert cfg.data.data_processor == "MNISTDataProcessor"  # implied by the model, as Model Zoo's run.py does
    assert cfg.precision.fp16_type == "float16" and cfg.optimizer.loss_scaling_factor == 1.0
    assert any(n.startswith("model.fp16_type: 'float16', Model Zoo's default") for n in cfg.notes)
    assert cfg.model.params == {"depth": 10, "hidden_size": 50, "dropout": 0.0, "activation_fn": "relu"}


def test_a_model_zoo_reader_keeps_its_own_drop_last() -> None:
    section = {"data_processor": "GptHDF5DataProcessor", "data_dir": "d", "batch_size": 4, "shuffle": False}
    raw = {"train_input": {**section, "drop_last": False}, "model": {"name": "gpt2", "vocab_size": 16}}
    assert parse_config(raw).data.loader_params["drop_last"] is False  # dls's default drop_last_batch is not written
    raw["train_input"]["drop_last_batch"] = True
    assert "train_input.drop_last_batch: contradicts drop_last" in errors_of(raw)[0]


def test_a_legacy_config_without_a_model_name_says_how_to_name_it() -> None:
    raw = {"train_input": {"data_processor": "GptHDF5DataProcessor", "data_dir": "d"}, "model": {"hidden_size": 8}}
    (msg,) = errors_of(raw)
    assert "model.name is required" in msg and "-o model.name=gpt2" in msg
    named = C.apply_overrides(raw, ["model.name=gpt2", "model.num_heads=2", "model.vocab_size=16"])
    assert parse_config(named).model.params == {"hidden_size": 8, "num_heads": 2, "vocab_size": 16}


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("trainer.init.loop.max_stpes=3", "unknown key trainer.init.loop.max_stpes (did you mean 'max_steps'?)"),
        ("trainer.init.optimizer.AdamW.betaz=[0.9, 0.9]", "unknown key trainer.init.optimizer.AdamW.betaz"),
        ("trainer.init.precision.loss_scaling_factor=Dynamic", "(did you mean 'dynamic'?)"),
        ("trainer.init.precision.enabled=1", "trainer.init.precision.enabled must be true or false"),
        ("trainer.init.precision.max_gradient_norm=true", "trainer.init.precision.max_gradient_norm must be"),
        ("trainer.init.loop.max_steps='1024'", "trainer.init.loop.max_steps must be an integer >= 1; got '1024'"),
        ("trainer.init.backend.backend_type=TPU", "trainer.init.backend.backend_type must be CSX, CPU or GPU"),
        ("trainer.init.backend.backend_type=gpu", "got 'gpu' (did you mean 'GPU'?)"),  # the hint named no type
        ("trainer.init.callbacks=[{Lora: {}}]", "dls does not run the callback 'Lora'"),
        ("trainer.init.schedulers=[{StepLR: {}}]", "trainer.init.schedulers[0] must be one of ConstantLR"),
        # A misspelt callback key was ignored (every state loaded); now it is refused, naming the key.
        (
            "trainer.init.callbacks=[{LoadCheckpointStates: {load_checkpoint_state: model}}]",
            "unknown key trainer.init.callbacks[0].LoadCheckpointStates.load_checkpoint_state (did you mean",
        ),
        ("trainer.init.loop.grad_accum_steps=0", "trainer.init.loop.grad_accum_steps must be an integer in [1, 65536]"),
        ("trainer.init.optimizer.AdamW.correct_bias=maybe", "trainer.init.optimizer.AdamW.correct_bias must be"),
        ("trainer.init.precision.max_gradient_value=1e300", "at most float32's max"),
    ],
)
def test_current_layout_errors_name_the_key_as_written(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(MODELZOO / "gpt3_cerebras_gpt_111m.yaml", [override])
    assert needle in str(info.value)


def test_a_default_reader_names_its_keys_where_written() -> None:
    raw = C.read_config(MODELZOO / "gpt3_cerebras_gpt_111m.yaml", ["trainer.fit.train_dataloader.bogus=1"])
    del raw["trainer"]["fit"]["train_dataloader"]["data_processor"]  # GptHDF5DataProcessor, gpt3's reader
    assert errors_of(raw) == ["trainer.fit.train_dataloader.bogus: unknown key"]  # was train_input.bogus


def test_a_malformed_schedule_is_one_error() -> None:
    for value, needle in [
        ("[{SequentialLR: {}}]", "trainer.init.schedulers[0].SequentialLR must hold schedulers"),
        ("[{ConstantLR: {}}, {ConstantLR: {}}]", "trainer.init.schedulers must be one scheduler"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(MODELZOO / "gpt3_cerebras_gpt_111m.yaml", [f"trainer.init.schedulers={value}"])
        assert len(info.value.errors) == 1 and needle in info.value.errors[0]


def test_overrides_address_keys_as_written_and_aliases_are_copies(tmp_path: Path) -> None:
    path = MODELZOO / "gpt3_cerebras_gpt_111m.yaml"
    overrides = [
        "trainer.init.model.hidden_size=64",
        "trainer.init.model.num_heads=4",
        f"trainer.fit.train_dataloader.data_dir={tmp_path}",
        "trainer.fit.val_dataloader.batch_size=2",
        "trainer.init.schedulers=[{ConstantLR: {learning_rate: 0.001}}]",
        "trainer.init.backend.backend_type=CPU",
    ]
    raw = C.read_config(path, overrides)
    assert raw["trainer"]["validate"]["val_dataloader"]["batch_size"] == 120  # the alias's other use is untouched
    cfg = parse_config(raw)
    assert cfg.model.params["hidden_size"] == 64 and cfg.data.params["data_dir"] == str(tmp_path)
    assert cfg.eval_data is not None and cfg.eval_data.batch_size == 2 and cfg.runconfig.device == "cpu"
    assert isinstance(cfg.optimizer.learning_rate, tuple) and cfg.optimizer.learning_rate[0].learning_rate == 1e-3


# ---------------------------------------------------------------------- hostile input (issue 18)
@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (
            "runconfig:\n  max_steps: 3\nmodel: {name: mlp}\nrunconfig:\n  seed: 1\n",
            "section 'runconfig' is given twice: lines 1 and 4",
        ),
        (
            "model:\n  name: mlp\n  optimizer: {a: 1}\n  optimizer: 2\n",
            "section 'optimizer' is given twice: lines 3 and 4",
        ),
        ("trainer:\n  init:\n    loop: {}\n    loop: {max_steps: 2}\n", "section 'loop' is given twice: lines 3 and 4"),
    ],
)
def test_a_section_given_twice_is_refused_naming_it_and_both_lines(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert needle in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize(
    ("text", "key", "lines"),
    [
        ("model:\n  name: mlp\n  depth: 2\n  depth: 3\n", "depth", (3, 4)),
        ("model: {name: mlp}\nrunconfig: {max_steps: 1, max_steps: 3}\n", "max_steps", (2, 2)),
        ("model: {name: mlp}\noptimizer:\n  betas: [0.5, 0.5]\n  betas:\n    - 0.9\n    - 0.9\n", "betas", (3, 4)),
    ],
)
def test_a_value_given_twice_takes_the_last_as_model_zoo_does_with_one_note(
    tmp_path: Path, text: str, key: str, lines: tuple[int, int]
) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    cfg = load_config(path)
    said = [n for n in cfg.notes if "given twice" in n]
    assert said == [
        f"{path}: {key!r} is given twice (lines {lines[0]} and {lines[1]}); the value of line {lines[1]} is used, as "
        "Model Zoo's YAML loader does"
    ]
    reference = yaml.safe_load(text)  # PyYAML's loader, Model Zoo's: the last value
    section = next(s for s in reference.values() if isinstance(s, dict) and key in s)
    value = {"depth": cfg.model.depth, "max_steps": cfg.runconfig.max_steps, "betas": list(cfg.optimizer.betas)}[key]
    assert value == section[key]


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(fifo)


@pytest.mark.parametrize("value", ["Dynamic", "DYNAMIC", "dynamics"])
def test_only_lower_case_dynamic(value: str) -> None:
    (msg,) = errors_of(mlp(optimizer={"loss_scaling_factor": value}))
    assert "must be 'dynamic' (lower case)" in msg and "did you mean 'dynamic'?" in msg


def test_amax_history_len_has_a_fixed_bound_in_validate(capsys: pytest.CaptureFixture[str]) -> None:
    from dls.train.cli import main

    config = str(CONFIGS[0].parent / "mlp_fp8_delayed_dls.yaml")
    assert main(["validate", config, "-o", "precision.fp8.amax_history_len=10000000"]) == 2
    assert "precision.fp8.amax_history_len must be an integer in [1, 65536]" in capsys.readouterr().err


def test_size_dependent_values_are_a_note_in_validate_and_exit_3_in_train(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dls.train.cli import main

    config = str(CONFIGS[0].parent / "mlp_fp16_dls.yaml")
    assert main(["validate", config, "-o", "data.num_samples=100000000000"]) == 0
    assert "# note: on this machine: data.num_samples: this run needs about" in capsys.readouterr().out
    assert main(["train", config, "-o", "data.num_samples=100000000000", f"runconfig.model_dir={tmp_path / 'r'}"]) == 3
    assert "data.num_samples" in capsys.readouterr().err and not (tmp_path / "r").exists()


def test_the_memory_estimate_counts_the_checkpoint_written_from_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    # Measured: a Llama of 165M parameters (float32, one checkpoint) peaked at 4.5 GB, 28 bytes per parameter more
    # for each parameter added; the estimate of Model Zoo's Llama 3.2 1B (1.34e9 parameters) at 16 bytes per
    # parameter fitted a machine with 23 GiB free, where the kernel then killed the run.
    import os

    from dls.train import config as config_module

    cfg = load_config(Path(__file__).parent / "data" / "modelzoo" / "llama3p2_1b_msl_8k.yaml")
    count = 128256 * 2048 + 16 * 2048 * (4 * 2048 + 3 * 8192)
    monkeypatch.setattr(os, "sysconf", lambda name: 1)  # nothing free: the estimate is reported
    monkeypatch.setattr("builtins.open", lambda *a, **k: io.BytesIO(b"MemAvailable: 0 kB\n"))
    problem = config_module.memory_problem(cfg)
    assert problem is not None and problem.startswith("trainer.init.model.hidden_size: this run needs about")
    assert f"{28 * count / 2**30:.1f} GiB" in problem


# ---------------------------------------------------------------------- validate agrees with train (issue 18.6)
def _numeric_keys() -> list[str]:
    from dls.train.config import SCALER_KEYS

    def numeric(schema: dict) -> bool:
        return schema.get("type") in ("integer", "number") or any(map(numeric, schema.get("anyOf", [])))

    keys = [
        f"{section}.{name}"
        for section, cls in SECTION_CLASSES.items()
        for name, schema in cls.model_json_schema()["properties"].items()
        if numeric(schema) or (section == "optimizer" and name in SCALER_KEYS)
    ]
    return [*keys, "precision.fp8.amax_history_len", "precision.fp8.margin"]


FUZZ = ["0", "-1", "1e-300", "1e300", ".inf", ".nan", str(2**63), "true", "'1'"]


# The float16 fallback (on by default) says what it kept or that it gave up: expected here, not the subject.
@pytest.mark.filterwarnings("ignore:dls fallback:UserWarning")
@pytest.mark.parametrize("key", _numeric_keys())
def test_validate_agrees_with_train_on_every_numeric_key(
    key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each hostile value: ``validate`` exits 0 or 2; ``train`` exits 2 exactly when ``validate`` did, and never 4
    (its start-up and first three steps: a value such as ``max_steps: 2**63`` is a run that never ends)."""
    from dls.train.cli import main
    from dls.train.trainer import Trainer

    original = Trainer.__init__

    def capped(self: Trainer, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.max_steps, self.write_plot = min(self.max_steps, 3), False

    monkeypatch.setattr(Trainer, "__init__", capped)
    config = tmp_path / "c.yaml"
    base = "model: {name: mlp, hidden_size: 8, depth: 1}\n"
    base += "data: {batch_size: 4, num_samples: 16, input_dim: 2, output_dim: 2}\n"
    fp8 = "  fp8: {recipe: delayed}\n" if ".fp8." in key else ""
    config.write_text(
        base + "precision:\n  mixed_precision: true\n" + fp8 + "runconfig: {max_steps: 3, log_steps: 1}\n"
    )
    for i, value in enumerate(FUZZ):
        override = [f"{key}={value}", f"runconfig.model_dir={tmp_path / str(i)}"]
        checked = main(["validate", str(config), "-o", *override])
        trained = main(["train", str(config), "--no_progress", "-o", *override])
        err = capsys.readouterr().err
        assert checked in (0, 2) and trained != 4, (value, checked, trained, err)
        assert (checked == 2) == (trained == 2), (value, checked, trained, err)


@pytest.mark.parametrize("name", VALID)
def test_a_model_zoo_config_round_trips_through_the_saved_config(name: str) -> None:
    """What a run saves (config.yaml, the checkpoint's config) reads back to the same run."""
    cfg = load_config(MODELZOO / name)
    again = parse_config(C.to_dict(cfg))
    same = {"sources", "notes", "layout"}
    assert again.model_dump(exclude=same) == cfg.model_dump(exclude=same)
