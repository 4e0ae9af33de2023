"""dls: dynamic loss scaling for mixed-precision training in PyTorch."""

from dls import deprecated as _deprecated
from dls import formats, fp8, integrations
from dls.diagnostics import OverflowReport, OverflowWatch, audit
from dls.emulation import emulate
from dls.formats import get_half_dtype, get_half_dtype_str, get_half_format, set_half_dtype
from dls.keep import keep_in_float32
from dls.master_weights import MasterWeights, master_weights
from dls.scaler import GradScaler, Stage
from dls.settings import ScalerSettings
from dls.sharded import ShardedGradScaler
from dls.skip import SkipAware, skip_aware
from dls.step import StepResult, optimizer_step

__all__ = [
    "GradScaler",
    "MasterWeights",
    "OverflowReport",
    "OverflowWatch",
    "ScalerSettings",
    "ShardedGradScaler",
    "SkipAware",
    "Stage",
    "StepResult",
    "audit",
    "emulate",
    "formats",
    "fp8",
    "get_half_dtype",
    "get_half_dtype_str",
    "get_half_format",
    "integrations",
    "keep_in_float32",
    "master_weights",
    "optimizer_step",
    "set_half_dtype",
    "skip_aware",
]

__version__ = "0.1.0"


# dls.emulate is the function; the module holding it was dls.emulate too and is dls.emulation now.
_deprecated.moved_module("dls.emulate", "dls.emulation", " (dls.emulate is the function)")
