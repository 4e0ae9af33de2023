"""The names that moved or were renamed, each kept for one release with a warning that says the new name.

A module path is kept by :func:`moved_module`, a function by :func:`renamed`, a method or property by
:func:`warn_renamed` in its body, each with a ``DeprecationWarning``. Every alias of the library warns through
here, so that the next release finds them in one place; ``tests/test_deprecated.py`` holds each warning. Today's,
all going in the next release:

* the module ``dls.emulate`` is ``dls.emulation`` (``dls.emulate`` is the function; ``dls/__init__.py``);
* ``dls.fp8.emulate`` is ``dls.fp8.emulate_recipe``, its module ``dls.fp8.gemm`` (``dls/fp8/__init__.py``);
* ``GradScaler.max_gradient_norm`` is ``GradScaler.settings.max_gradient_norm`` (``dls/scaler.py``);
* the validators and limits ``dls.policy`` had are ``dls.checks``' (``dls/policy.py``)."""

from __future__ import annotations

import functools
import importlib
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class _MovedModule(types.ModuleType):
    """A module path that moved: each name read from it is the new module's, with a warning."""

    def __init__(self, old: str, new: str, note: str) -> None:
        super().__init__(old)
        self._new, self._note = new, note

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):  # the import system's questions (__path__, __spec__): not a moved name
            raise AttributeError(name)
        warnings.warn(
            f"the module {self.__name__} is {self._new} now: import {name} from {self._new}{self._note}; the old "
            "path goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(self._new), name)


def moved_module(old: str, new: str, note: str = "") -> None:
    """``from old import name`` keeps working for one release (``name`` from ``new``, with a warning); ``note``
    follows the new path in the warning (why the old one was given up)."""
    sys.modules.setdefault(old, _MovedModule(old, new, note))


def warn_renamed(old: str, new_name: str) -> None:
    """The warning of a renamed name ``old`` (``new_name`` now), pointing at the caller's caller."""
    message = f"{old} is {new_name} now; the old name goes in the next release"
    warnings.warn(message, DeprecationWarning, stacklevel=3)


def renamed(new: F, old: str, new_name: str) -> F:
    """``new`` (``new_name``, as users call it) under its old name ``old``, warning at each call."""

    @functools.wraps(new)
    def alias(*args: Any, **kwargs: Any) -> Any:
        warn_renamed(old, new_name)
        return new(*args, **kwargs)

    alias.__doc__ = f"Deprecated: ``{old}`` is ``{new_name}`` now; the old name goes in the next release."
    return alias  # type: ignore[return-value]
