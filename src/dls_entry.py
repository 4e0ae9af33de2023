"""The ``dls`` console command's entry point and the process's one SIGINT/SIGTERM handler.

Standard library only, so that :func:`main` installs the handler before the heavy imports: a signal during
start-up ends the command at once (one line, exit 130 or 143); once a command runs (:func:`signals`) it raises
``KeyboardInterrupt`` / :class:`Terminated`, and a training loop's stop request is asked first; once the command has
ended (its failure being reported, the interpreter exiting) a signal changes nothing: the process exits with the
command's status.
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
_ended = False  # the command has ended (its outermost signals() exited): its status stands, a signal changes nothing
_depth = 0  # signals() blocks running
_request: Callable[[int], bool] | None = None  # the training loop's stop request


class Terminated(KeyboardInterrupt):
    """SIGTERM (exit status 143)."""


def _handle(signum: int, frame: Any) -> None:
    if _ended:  # the command's status is decided: it is reported and the process exits with it
        return
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
    global _starting, _ended, _depth, _request
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _handle) for s in _LINES}
    outer, _request = _request, request if request is not None else _request
    _starting = _ended = False
    _depth += 1
    try:
        yield
    finally:
        _request, _depth = outer, _depth - 1
        # The command is over once its outermost signals() exits: a signal while its failure is reported no longer
        # raises (an uncaught KeyboardInterrupt there ended the process by SIGINT, status -2, not 130).
        _ended = _depth == 0
        for s, handler in previous.items():
            signal.signal(s, handler)


def main() -> None:
    """The ``dls`` command: the handler first, then ``dls.train.cli``."""
    global _starting
    _starting = True
    for s in _LINES:
        signal.signal(s, _handle)
    from dls.train.cli import main as command

    status = command()
    # Ignored, not handled, while the interpreter exits: finalisation puts SIGINT's default action (death by the
    # signal) back in place of a Python handler, and freeing a large model takes a while; the status is decided.
    for s in _LINES:
        signal.signal(s, signal.SIG_IGN)
    sys.exit(status)


if __name__ == "__main__":
    main()
