"""FP8 training recipes, emulated exactly on any hardware.

Loss scaling gives all gradients one scale; FP8 needs one per tensor (or per row, or per block of 32), because
E4M3 spans only ``2**-9`` .. 448 and E5M2 ``2**-16`` .. 57344. This package makes the FP8 recipes of
TransformerEngine and torchao runnable on a laptop, bit-exactly, so "will this model train in FP8, and with
which recipe?" can be answered before renting an FP8 GPU:

* [`scale_from_amax`][dls.fp8.scale_from_amax]: the current-scaling rule (float32-exact);
* recipes: [`CurrentScaling`][dls.fp8.CurrentScaling] (per tensor or per row, from the tensor itself: torchao's
  ``tensorwise`` / ``rowwise``), [`DelayedScaling`][dls.fp8.DelayedScaling] (TransformerEngine's amax history),
  [`MXFP8`][dls.fp8.MXFP8] (blocks of 32 with power-of-two E8M0 scales: torchao's ``to_mx``),
  [`StaticScaling`][dls.fp8.StaticScaling] (one fixed scale: FP8 without per-tensor scaling);
* [`emulate_recipe`][dls.fp8.gemm.emulate_recipe]: every ``nn.Linear`` computes its three GEMMs on FP8 operands per
  the recipe, with ``handle.stats``, ``handle.state_dict()`` for exact resume, DDP-consistent delayed scaling, and
  ``dls.GradScaler`` on top;
* [`mx_quantize`][dls.fp8.mx_quantize]: an MXFP8 cast, byte-compatible with torchao;
* [`compare_recipes`][dls.fp8.compare_recipes]: one model under each recipe on the same batches, without training: the
  shares of gradients saturated and flushed, and the loss beside float32's, as a table by ``to_text()`` (what
  ``dls audit --fp8-recipes`` prints).

::

    handle = dls.fp8.emulate_recipe(model, dls.fp8.DelayedScaling(margin=0, amax_history_len=16))
    for x, y in batches:
        loss = loss_fn(model(x), y)
        scaler.scale(loss).backward(); scaler.step(opt); scaler.update(); opt.zero_grad()
    print(handle.stats.as_dict()["net.0"]["grad_output"])   # amax, scale, saturated / flushed fractions

``dls.fp8.emulate_recipe`` was ``dls.fp8.emulate`` (and its module ``dls.fp8.emulate`` is ``dls.fp8.gemm``): renamed
so that it is not mistaken for ``dls.emulate``, which rounds a model's computation to a format. The old names work
for one release, with a ``DeprecationWarning``.
"""

from dls.deprecated import moved_module, renamed
from dls.fp8.compare import RecipeComparison, RecipeResult, compare_recipes
from dls.fp8.gemm import Fp8Handle, Fp8Stats, emulate_recipe
from dls.fp8.recipes import (
    MXFP8,
    RECIPE_NAMES,
    ROLES,
    CurrentScaling,
    DelayedScaling,
    Recipe,
    StaticScaling,
    recipe_from_dict,
)
from dls.fp8.scaling import mx_quantize, scale_from_amax

__all__ = [
    "MXFP8",
    "RECIPE_NAMES",
    "ROLES",
    "CurrentScaling",
    "DelayedScaling",
    "Fp8Handle",
    "Fp8Stats",
    "Recipe",
    "RecipeComparison",
    "RecipeResult",
    "StaticScaling",
    "compare_recipes",
    "emulate_recipe",
    "mx_quantize",
    "recipe_from_dict",
    "scale_from_amax",
]

emulate = renamed(emulate_recipe, "dls.fp8.emulate", "dls.fp8.emulate_recipe")
moved_module("dls.fp8.emulate", "dls.fp8.gemm", " (the function dls.fp8.emulate is dls.fp8.emulate_recipe)")
