"""``--check-finite``: stop a run at the first torch operation that turns finite inputs into a
non-finite output, and say which operation it was and where the code called it.

A NaN loss says that something went wrong, not where.  Under ``check_finite()`` every torch
function that this thread calls (linears, norms, attention, the optimizer's updates, tensor
methods) is checked: its floating-point tensor arguments before the call, its floating-point
tensor results after.  Finite arguments and a non-finite result raise ``NonFiniteError``
naming the function, the result's shape and dtype, how many of its elements are not finite, and
the innermost frames of the caller's code; a non-finite argument seen first raises too, since
it was made by code the mode does not see (another thread, such as the emulated ranks', a kernel
launched outside torch, or the data).  The backward runs under
``torch.autograd.detect_anomaly(check_nan=True)``, which names the backward function whose
output holds a NaN and the forward call that made it.

Every check synchronizes with the device: a debugging mode, many times slower than a plain
step, and not possible inside a CUDA-graph capture.
"""

from __future__ import annotations

import contextlib
import os
import traceback

import torch
from torch.overrides import TorchFunctionMode

#: Frames of the caller's code shown in the error.
FRAMES = 4
_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)


class NonFiniteError(FloatingPointError):
    """A torch operation made a NaN or an infinity from finite arguments (or was handed one)."""


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _first_not_finite(obj):
    """The first floating-point tensor in ``obj`` (nested lists, tuples, dicts) holding a NaN
    or an infinity, and how many it holds; None if there is none."""
    for t in _tensors(obj):
        if t.is_floating_point() and t.numel():
            n = int((~torch.isfinite(t)).sum())
            if n:
                return t, n
    return None


def _where():
    """The innermost frames outside torch and this module: where the model called the op."""
    frames = [
        f
        for f in traceback.extract_stack()
        if not f.filename.startswith(_TORCH_DIR) and os.path.abspath(f.filename) != _THIS_FILE
    ]
    return "".join(traceback.format_list(frames[-FRAMES:])).rstrip()


def _describe(t, n):
    dtype = str(t.dtype).replace("torch.", "")
    return f"{tuple(t.shape)} {dtype} on {t.device}: {n} of {t.numel()} not finite"


def _name(func):
    """torch.log -> "torch.log", Tensor.div_ -> "Tensor.div_", F.linear -> "linear"."""
    name = getattr(func, "__name__", None) or repr(func)
    owner = (getattr(func, "__qualname__", "") or "").rpartition(".")[0]
    if owner == "_VariableFunctionsClass":
        return f"torch.{name}"
    if owner in ("TensorBase", "Tensor"):
        return f"Tensor.{name}"
    return name


class FirstNonFinite(TorchFunctionMode):
    """The torch-function mode of ``check_finite``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        given = _first_not_finite((args, kwargs))
        if given is not None:
            raise NonFiniteError(
                f"{_name(func)} was handed a non-finite argument ({_describe(*given)}), made "
                f"where check_finite does not look (another thread, a kernel launched outside "
                f"torch, or the data); called at:\n{_where()}"
            )
        out = func(*args, **kwargs)
        made = _first_not_finite(out)
        if made is not None:
            t, n = made
            source = (
                "finite arguments"
                if next(_tensors((args, kwargs)), None) is not None
                else "Python data"
            )
            raise NonFiniteError(
                f"{_name(func)} made a non-finite result ({_describe(t, n)}) from {source}; "
                f"called at:\n{_where()}"
            )
        return out


@contextlib.contextmanager
def check_finite():
    """Check every torch call of this thread for the first non-finite result (the module's
    docstring says how); the backward under anomaly detection."""
    with torch.autograd.detect_anomaly(check_nan=True), FirstNonFinite():
        yield
