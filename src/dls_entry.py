"""The ``dls`` console command's entry point (``[project.scripts] dls = "dls_entry:main"``) and the process's one
SIGINT/SIGTERM handler.

A top-level module of the standard library alone (``import dls`` imports torch, which takes seconds), so that
:func:`main` installs the handler on its first line: Ctrl-C (SIGINT) or SIGTERM at any moment from there on ends
the command with one line on stderr and exit status 130 or 143.

* While the command starts (imports, the command line) nothing has been written: the process ends at once.
* Once the command runs (:func:`signals` active, entered by ``dls.train.cli.main``), the signal raises
  ``KeyboardInterrupt`` (:class:`Terminated` for SIGTERM) where the program is, and the command reports it.
* While a training loop runs it adds its stop request (``signals(request)``): the first signal asks the loop to
  stop after the current step (it checkpoints first), a second one raises at once.

Handlers can only be set in the main thread; elsewhere :func:`signals` changes nothing.
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
    """SIGTERM arrived; the run checkpointed the last finished step (when it had started one). Exit status 143."""


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
    """While active, SIGINT and SIGTERM go to the one handler (the handlers before are put back after);
    ``request(signum)`` is asked first and takes the signal when it returns ``True``."""
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
    """The ``dls`` command: the handler first, then the command (``dls.train.cli``)."""
    global _starting
    _starting = True
    for s in _LINES:
        signal.signal(s, _handle)
    from dls.train.cli import main as command

    sys.exit(command())


if __name__ == "__main__":
    main()
