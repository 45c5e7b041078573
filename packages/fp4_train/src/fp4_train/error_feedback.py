"""Error feedback: carry each element's rounding residual into its next quantization.

Quantizing the same slowly changing tensor again and again (a weight stored in FP4 and updated
in place, a gradient sent every step) discards, under round to nearest, every change smaller
than half a grid step: the same value comes back each time.  Error feedback keeps the residual
r = v - dequantize(quantize(v)) of each element and adds it to the next input, v = x + r, so
that the sum of what was sent equals the sum of what was asked for up to one residual:

    sum_t y_t = sum_t x_t - r_T        (|r_T| at most one grid step of its block)

and sub-step changes accumulate until they cross a grid point.
"""

from __future__ import annotations

import operator
import zlib
from collections.abc import Iterable
from typing import Any, Literal

import numpy as np
import torch

import fp4_kernels
from fp4_kernels.formats import e2m1

Array = torch.Tensor | np.ndarray

_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads names over the Philox key space
STEP_LIMIT = 2**32  # stochastic rounding's step counter: one 32-bit Philox counter word


def check_seed(seed: Any, name: str = "seed") -> int:
    """``seed`` as an int in [0, 2**64) (fp4_kernels' rule); TypeError / ValueError otherwise."""
    v = check_integer(seed, name)
    if not 0 <= v < 2**64:
        raise ValueError(f"{name}: {v} is outside [0, 2**64)")
    return v


def check_step(step: Any, name: str = "step") -> int:
    """``step`` as an int in [0, 2**32) (fp4_kernels' rule); TypeError / ValueError otherwise."""
    v = check_integer(step, name)
    if not 0 <= v < STEP_LIMIT:
        raise ValueError(
            f"{name}: {v} is outside [0, 2**32) (stochastic rounding's counter is 32 bits; "
            "pass the step modulo 2**32)"
        )
    return v


def check_storage(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` with its values in memory: a nested, sparse or meta tensor raises (TypeError /
    ValueError naming ``name``); a negative view (``torch._neg_view``, a lazy negation) is
    resolved, so the FP4 kernels read the values it stands for."""
    if t.is_nested:
        raise TypeError(
            f"{name}: a nested tensor; pass its tensors one by one (t.unbind()) or padded "
            "(torch.nested.to_padded_tensor)"
        )
    if t.layout != torch.strided:
        raise TypeError(f"{name}: layout {t.layout}; pass a dense tensor (t.to_dense())")
    if t.device.type == "meta":
        raise ValueError(
            f"{name}: a meta tensor (a shape without data); allocate it on a device and fill "
            "it first (module.to_empty(device=...) and an initialization, or a checkpoint)"
        )
    return t.resolve_neg()


def check_integer(value: Any, name: str) -> int:
    """``value`` as an int (``operator.index``: an int, a numpy integer, a 0-d integer tensor);
    TypeError naming ``name`` for anything else, bool included."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an integer, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__}") from None


def philox_key(seed: int, name: str) -> int:
    """The stochastic-rounding key of tensor ``name``: distinct names draw independent bits."""
    return (seed + (zlib.crc32(name.encode()) + 1) * _GOLDEN) % 2**64


def _is_torch(x):
    return isinstance(x, torch.Tensor)


_REAL_FLOATS = ("float64", "float32", "bfloat16", "float16")


def _check_input(x, name="x"):
    if isinstance(x, torch.Tensor):
        check_storage(x, name)
        dt = str(x.dtype).replace("torch.", "")
    elif isinstance(x, np.ndarray):
        dt = x.dtype.name
    else:
        raise TypeError(f"{name}: expected a torch tensor or a numpy array, got {type(x).__name__}")
    if dt not in _REAL_FLOATS:
        raise TypeError(
            f"{name}: dtype {dt} is not a real floating-point type; error feedback quantizes "
            "float32, bfloat16 or float16 (float64 is rounded to float32 first)"
        )


def _as_float32(x):
    if _is_torch(x):
        return x.detach().resolve_neg().float().contiguous()
    return np.ascontiguousarray(x, dtype=np.float32)


def _cast_like(y32, x):
    if _is_torch(x):
        return y32.to(x.dtype)
    return y32.astype(x.dtype, copy=False)


def _finite_or_zero(r):
    """The residual with its non-finite elements (blocks whose input held a NaN or an infinity,
    which decode to NaN) set to 0: such a block starts over instead of staying NaN forever."""
    if _is_torch(r):
        return torch.where(torch.isfinite(r), r, torch.zeros((), dtype=r.dtype, device=r.device))
    return np.where(np.isfinite(r), r, np.float32(0))


def _where(x):
    return str(x.device) if _is_torch(x) else "numpy"


class ErrorFeedback:
    """Per-tensor residuals for repeated FP4 quantization.

    Args:
        fmt: "nvfp4" or "mxfp4".
        rounding: "nearest" or "stochastic": how ``x + residual`` is rounded.
        seed: stochastic rounding's seed, an int in [0, 2**64); each name draws from its own
            Philox key (``philox_key(seed, name)``) with the step as counter.

    ``qdq(name, x)`` returns the quantized-dequantized ``x + residual[name]`` (same kind,
    device, shape and dtype as ``x``) and stores the new residual in float32 beside ``x``.
    ``quantize(name, x)`` does the same and returns the packed ``QuantizedTensor``.
    A residual holds one float32 per element: error feedback trades that memory for unbiased
    accumulation.

    Non-finite values: a block whose input (``x + residual``) holds a NaN or an infinity
    decodes to NaN (fp4_kernels' policy) and its residual restarts from zero, so that one
    overflowing step (a skipped step under a gradient scaler) does not poison the later ones.
    """

    def __init__(
        self,
        fmt: Literal["nvfp4", "mxfp4"] = "nvfp4",
        rounding: Literal["nearest", "stochastic"] = "nearest",
        seed: int = 0,
    ) -> None:
        if not isinstance(fmt, str) or fmt not in fp4_kernels.FORMATS:
            raise ValueError(
                f"fmt: {fmt!r} is not one of {tuple(fp4_kernels.FORMATS)} (error feedback "
                "keeps NVFP4 or MXFP4 residuals)"
            )
        if not isinstance(rounding, str) or rounding not in e2m1.ROUNDINGS:
            raise ValueError(f"rounding: {rounding!r} is not 'nearest' or 'stochastic'")
        self.fmt = fmt
        self.rounding = rounding
        self.seed = check_seed(seed)
        self._residuals: dict[str, Array] = {}
        self._steps: dict[str, int] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._residuals

    def names(self) -> list[str]:
        """The names that hold a residual."""
        return list(self._residuals)

    def residual(self, name: str) -> Array | None:
        """The float32 residual of ``name`` (None before its first quantization)."""
        return self._residuals.get(name)

    def _input(self, name, x, step):
        if not isinstance(name, str):
            raise TypeError(f"name: expected a str, got {type(name).__name__}")
        _check_input(x)
        if step is not None:
            step = check_step(step)
        v = _as_float32(x)
        r = self._residuals.get(name)
        if r is not None:
            if tuple(r.shape) != tuple(v.shape):
                raise ValueError(
                    f"error feedback {name!r}: the residual has shape {tuple(r.shape)} but x "
                    f"has shape {tuple(v.shape)}; call reset({name!r}) to start over"
                )
            if _where(r) != _where(v):
                raise ValueError(
                    f"error feedback {name!r}: the residual lives on {_where(r)} but x on "
                    f"{_where(v)}; move x, or reset({name!r})"
                )
            v = v + r
        if step is None:
            step = self._steps.get(name, 0)
        kw = {"fmt": self.fmt, "rounding": self.rounding, "step": step}
        if self.rounding == "stochastic":
            kw["seed"] = philox_key(self.seed, name)
        return v, kw

    def _done(self, name, residual, step):
        """After a quantization of ``name`` that succeeded: its residual, and its step count
        (a failed call changes neither).  The implicit counter wraps after 2**32 calls, as
        the 32-bit Philox counter would."""
        self._residuals[name] = _finite_or_zero(residual)
        self._steps[name] = (step + 1) % STEP_LIMIT

    def qdq(self, name: str, x: Array, step: int | None = None) -> Array:
        """Quantize-dequantize ``x + residual[name]``; store the new residual.

        ``x``: a torch tensor or numpy array of a real floating-point dtype, its last dimension
        a multiple of the block size.  ``step`` is stochastic rounding's counter, an int in
        [0, 2**32) (default: how many times ``name`` was quantized before).  Returns an array
        of ``x``'s kind, device, shape and dtype, outside autograd (``x`` is read detached).
        """
        v, kw = self._input(name, x, step)
        y = _cast_like(fp4_kernels.quantize_dequantize(v, **kw), x)
        self._done(name, v - _as_float32(y), kw["step"])
        return y

    def quantize(self, name: str, x: Array, step: int | None = None) -> fp4_kernels.QuantizedTensor:
        """Like ``qdq``, but return the packed ``QuantizedTensor`` (dequantizes to float32)."""
        v, kw = self._input(name, x, step)
        q = fp4_kernels.quantize(v, **kw)
        self._done(name, v - fp4_kernels.dequantize(q), kw["step"])
        return q

    def reset(self, name: str | None = None) -> None:
        """Drop the residual (and step count) of ``name``, or of every name."""
        if name is None:
            self._residuals.clear()
            self._steps.clear()
        else:
            self._residuals.pop(name, None)
            self._steps.pop(name, None)

    def state_dict(self) -> dict[str, Any]:
        """Format, rounding, seed, and a copy of every residual and step count."""
        return {
            "fmt": self.fmt,
            "rounding": self.rounding,
            "seed": self.seed,
            "residuals": {
                k: (v.clone() if _is_torch(v) else v.copy()) for k, v in self._residuals.items()
            },
            "steps": dict(self._steps),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict``; ValueError if it was saved with another format or rounding,
        holds a NaN or infinite residual, or is not an ``ErrorFeedback.state_dict()`` (names
        that are not str, a residual that is not a real floating-point array, a step outside
        [0, 2**32)): TypeError / ValueError naming the entry, and nothing changes then."""
        self._assign(self._checked_state(state))

    def _assign(self, checked):
        self.seed, self._residuals, self._steps = checked

    def _checked_state(self, state, where="state"):
        """(seed, residuals, steps) of ``state``, checked and copied; this object unchanged.
        ``where``: how the messages name ``state``."""
        check_state_keys(state, ("fmt", "rounding", "seed", "residuals"), "ErrorFeedback")
        for key, choices in (("fmt", tuple(fp4_kernels.FORMATS)), ("rounding", e2m1.ROUNDINGS)):
            value = state[key]
            if not isinstance(value, str) or value not in choices:  # (an array: no elementwise in)
                raise ValueError(
                    f"{where}[{key!r}]: {value!r} is not one of {', '.join(map(repr, choices))}"
                )
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"error feedback state has {key}={state[key]!r}, "
                    f"this one {getattr(self, key)!r}"
                )
        seed = check_seed(state["seed"], f"{where}['seed']")
        for key in ("residuals", "steps"):
            if not isinstance(state.get(key, {}), dict):
                raise TypeError(f"{where}[{key!r}]: expected a dict of name -> value (the one "
                                f"ErrorFeedback.state_dict() holds), got "
                                f"{type(state[key]).__name__}")  # fmt: skip
            for k in state.get(key, {}):
                if not isinstance(k, str):
                    raise TypeError(f"{where}[{key!r}]: name {k!r} is {type(k).__name__}; "
                                    "expected the str names that qdq / quantize take, as "
                                    "ErrorFeedback.state_dict() holds them")  # fmt: skip
        residuals = {}
        for k, v in dict(state["residuals"]).items():
            what = f"{where}['residuals'][{k!r}]"
            _check_input(v, what)
            with np.errstate(over="ignore"):  # a float64 value beyond float32: refused below
                r = v.detach().float().clone() if _is_torch(v) else np.array(v, np.float32)
            if not bool((torch.isfinite(r) if _is_torch(r) else np.isfinite(r)).all()):
                raise ValueError(
                    f"{what}: holds NaN or infinite values; a residual is finite (a block of "
                    "non-finite input has it reset to 0): the state is corrupt"
                )
            residuals[k] = r
        steps = {
            k: check_step(v, f"{where}['steps'][{k!r}]") for k, v in state.get("steps", {}).items()
        }
        return seed, residuals, steps


def check_state_keys(state: Any, keys: Iterable[str], what: str) -> None:
    """TypeError unless ``state`` is a dict, ValueError naming the missing ones unless it holds
    ``keys``: the checks of a ``load_state_dict`` (``what``: the class whose state it is)."""
    if not isinstance(state, dict):
        raise TypeError(
            f"state: expected the dict that {what}.state_dict() returns, got {type(state).__name__}"
        )
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(
            f"state: missing {', '.join(map(repr, missing))}; expected the dict that "
            f"{what}.state_dict() returns"
        )
