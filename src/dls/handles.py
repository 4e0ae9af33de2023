"""What every removable handle of dls shares (``dls.emulate``, ``dls.fp8.emulate_recipe``, ``scaler.watch``):
``remove()`` is idempotent, and the handle is a context manager that removes itself on exit."""

from __future__ import annotations

from types import TracebackType
from typing import TypeVar

_H = TypeVar("_H", bound="Removable")


class Removable:
    """Base of removable handles: subclasses define ``remove()`` (safe to call repeatedly) and ``active``."""

    @property
    def active(self) -> bool:
        raise NotImplementedError

    def remove(self) -> None:
        raise NotImplementedError

    def __enter__(self: _H) -> _H:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()

    def _state(self) -> str:
        return "active" if self.active else "removed"
