"""The ``dls`` console command's entry point and the process's one SIGINT/SIGTERM handler.

Standard library only, so that :func:`main` installs the handler before the heavy imports: a signal during
start-up ends the command at once (one line, exit 130 or 143); once a command runs (:func:`signals`) it raises
``KeyboardInterrupt`` / :class:`Terminated`, and a training loop's stop request is asked first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Terminated", "main", "signals"]

_LINES = {signal.SIGINT: (130, "dls: interrupted"), signal.SIGTERM: (143, "dls: terminated (SIGTERM)")}
_starting = False  # between main()'s first line and the command's start: end at once
_request: Callable[[int], bool] | None = None  # the training loop's stop request


class Terminated(KeyboardInterrupt):
    """SIGTERM (exit status 143)."""


def _handle(signum: int, frame: Any) -> None:
    if _starting:
        status, line = _LINES[signal.Signals(signum)]
        os.write(2, line.encode() + b"\n")
        os._exit(status)
    if _request is not None and _request(signum):
        return
    raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt


@contextlib.contextmanager
def signals(request: Callable[[int], bool] | None = None) -> Iterator[None]:
    """SIGINT/SIGTERM go to the one handler while active (main thread only); ``request(signum)`` may take them."""
    global _starting, _request
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _handle) for s in _LINES}
    outer, _request = _request, request if request is not None else _request
    _starting = False
    try:
        yield
    finally:
        _request = outer
        for s, handler in previous.items():
            signal.signal(s, handler)


def main() -> None:
    """The ``dls`` command: the handler first, then ``dls.train.cli``."""
    global _starting
    _starting = True
    for s in _LINES:
        signal.signal(s, _handle)
    from dls.train.cli import main as command

    sys.exit(command())


if __name__ == "__main__":
    main()
