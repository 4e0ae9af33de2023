"""dls: dynamic loss scaling for mixed-precision training in PyTorch."""

import sys as _sys
import types as _types
import warnings as _warnings

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


class _MovedModule(_types.ModuleType):
    """``dls.emulate`` is the function; the module holding it was ``dls.emulate`` too and is ``dls.emulation`` now.
    ``from dls.emulate import EmulationHandle`` keeps working for one release, with a ``DeprecationWarning``."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):  # the import system's questions (__path__, __spec__): not a moved name
            raise AttributeError(name)
        from dls import emulation

        _warnings.warn(
            f"the module dls.emulate is dls.emulation now: import {name} from dls.emulation (dls.emulate is the "
            "function); the old path goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(emulation, name)


_sys.modules.setdefault("dls.emulate", _MovedModule("dls.emulate"))
