"""The warnings fp4_kernels gives about its kernels, each of a category of its own so that it
can be silenced alone (``warnings.filterwarnings("ignore", category=...)``), and each also
logged at INFO on the ``fp4_kernels`` logger (every time, not only once)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings

log = logging.getLogger("fp4_kernels")


class KernelCompileWarning(UserWarning):
    """Kernels are being compiled: the call takes seconds (CPU kernels once, then they load
    from the on-disk cache; CUDA kernels once per process and configuration).  Given once per
    process and target.  Silence it with
    ``warnings.filterwarnings("ignore", category=fp4_kernels.KernelCompileWarning)``, or from
    the command line by its message, ``python -W "ignore:fp4_kernels is compiling"`` (also in
    ``PYTHONWARNINGS``: Python resolves no third-party category there)."""


class KernelCacheWarning(UserWarning):
    """An entry of the on-disk kernel cache could not be read (a truncated, garbled or emptied
    file): it was deleted and the kernel compiled again.  Given once per process."""


_GIVEN = set()
_LOCK = threading.Lock()


def notify(key: str, message: str, category: type[Warning]) -> None:
    """Log ``message`` at INFO; warn with it the first time ``key`` comes in this process."""
    log.info(message)
    with _LOCK:
        if key in _GIVEN:
            return
        _GIVEN.add(key)
    warnings.warn(message, category, stacklevel=_caller_level())


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _caller_level():
    """The ``stacklevel`` that points a warning given in ``notify`` at the code that called
    fp4_kernels (the frame above the outermost one of this package), not into numba."""
    frame, level, outermost = sys._getframe(1), 1, 1  # notify's frame is level 1
    while frame is not None:
        if os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
            outermost = level
        frame, level = frame.f_back, level + 1
    return outermost + 1
