"""FP8 recipes: defaults, formats per role, validation (errors name the argument), and a round trip through
plain dicts (what a checkpoint stores)."""

from __future__ import annotations

from typing import Any

import pytest

import dls.fp8
from dls.fp8 import MXFP8, CurrentScaling, DelayedScaling, StaticScaling


def test_defaults_follow_transformer_engine_and_torchao() -> None:
    assert CurrentScaling() == CurrentScaling(
        power_2_scales=False, amax_epsilon=0.0, granularity="tensor", fp8_format="hybrid", saturate_gradients=True
    )
    assert DelayedScaling() == DelayedScaling(margin=0, amax_history_len=1024, amax_compute_algo="max")
    assert MXFP8().scale_mode == "rceil"
    assert StaticScaling().scale == 1.0


@pytest.mark.parametrize("recipe", [CurrentScaling(), DelayedScaling(), MXFP8(), StaticScaling()])
def test_hybrid_casts_gradients_to_e5m2_and_e4m3_casts_everything_to_e4m3(recipe: Any) -> None:
    assert [recipe.dtype_name(r) for r in dls.fp8.ROLES] == ["float8_e4m3fn", "float8_e4m3fn", "float8_e5m2"]
    e4m3 = type(recipe)(fp8_format="e4m3")
    assert {e4m3.dtype_name(r) for r in dls.fp8.ROLES} == {"float8_e4m3fn"}


@pytest.mark.parametrize(
    ("cls", "kwargs", "name"),
    [
        (CurrentScaling, {"power_2_scales": 1}, "power_2_scales"),
        (CurrentScaling, {"amax_epsilon": -1e-12}, "amax_epsilon"),
        (CurrentScaling, {"amax_epsilon": float("nan")}, "amax_epsilon"),
        (CurrentScaling, {"granularity": "block"}, "granularity"),
        (CurrentScaling, {"fp8_format": "e5m2"}, "fp8_format"),
        (CurrentScaling, {"saturate_gradients": "yes"}, "saturate_gradients"),
        (DelayedScaling, {"margin": 0.5}, "margin"),
        (DelayedScaling, {"margin": 2000}, "margin"),
        (DelayedScaling, {"amax_history_len": 0}, "amax_history_len"),
        (DelayedScaling, {"amax_history_len": 16.0}, "amax_history_len"),
        (DelayedScaling, {"amax_compute_algo": "mean"}, "amax_compute_algo"),
        (DelayedScaling, {"fp8_format": "HYBRID"}, "fp8_format"),
        (MXFP8, {"scale_mode": "even"}, "scale_mode"),
        (MXFP8, {"fp8_format": None}, "fp8_format"),
        (StaticScaling, {"scale": 0.0}, "scale"),
        (StaticScaling, {"scale": float("inf")}, "scale"),
        (StaticScaling, {"scale": True}, "scale"),
    ],
)
def test_invalid_arguments_raise_value_errors_naming_them(cls: Any, kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        cls(**kwargs)


@pytest.mark.parametrize(
    "recipe",
    [
        CurrentScaling(power_2_scales=True, amax_epsilon=1e-12, granularity="row", fp8_format="e4m3"),
        DelayedScaling(margin=-2, amax_history_len=16, amax_compute_algo="most_recent", saturate_gradients=False),
        MXFP8(scale_mode="floor"),
        StaticScaling(scale=256),
    ],
)
def test_recipes_round_trip_through_plain_dicts(recipe: Any) -> None:
    d = recipe.to_dict()
    assert dls.fp8.RECIPE_NAMES[d["recipe"]] is type(recipe)
    assert all(isinstance(v, (str, int, float, bool)) for v in d.values())
    assert dls.fp8.recipe_from_dict(d) == recipe


def test_recipe_from_dict_reads_config_sections_and_names_bad_keys() -> None:
    assert dls.fp8.recipe_from_dict({"recipe": "delayed", "amax_history_len": 16}) == DelayedScaling(
        amax_history_len=16
    )
    assert dls.fp8.recipe_from_dict({"recipe": "mxfp8"}) == MXFP8()
    with pytest.raises(ValueError, match="recipe must be one of 'current', 'delayed', 'mxfp8', 'static'"):
        dls.fp8.recipe_from_dict({"recipe": "DelayedScaling"})
    with pytest.raises(ValueError, match="'interval' for recipe 'delayed'; allowed: margin, amax_history_len"):
        dls.fp8.recipe_from_dict({"recipe": "delayed", "interval": 1})
    with pytest.raises(ValueError, match="margin"):
        dls.fp8.recipe_from_dict({"recipe": "delayed", "margin": "2"})


def test_recipes_are_frozen_and_hashable() -> None:
    recipe = DelayedScaling()
    with pytest.raises(AttributeError):
        recipe.margin = 1  # type: ignore[misc]
    assert len({CurrentScaling(), CurrentScaling(), MXFP8()}) == 2


def test_describe_names_the_recipe_and_the_fields_that_differ_from_its_defaults() -> None:
    assert CurrentScaling().describe() == "current scaling"
    assert DelayedScaling(margin=2, amax_history_len=16).describe() == "delayed scaling, margin 2, amax_history_len 16"
    assert StaticScaling(scale=2).describe() == "static scaling, scale 2.0"
    assert MXFP8(fp8_format="e4m3").describe() == "mxfp8 scaling, fp8_format e4m3"
