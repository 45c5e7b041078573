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

import zlib

import numpy as np

import fp4_kernels

_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads names over the Philox key space


def philox_key(seed: int, name: str) -> int:
    """The stochastic-rounding key of tensor ``name``: distinct names draw independent bits."""
    return (seed + (zlib.crc32(name.encode()) + 1) * _GOLDEN) % 2**64


def _is_torch(x):
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return isinstance(x, torch.Tensor)


def _as_float32(x):
    if _is_torch(x):
        return x.detach().float()
    return np.asarray(x, dtype=np.float32)


def _cast_like(y32, x):
    if _is_torch(x):
        return y32.to(x.dtype)
    return y32.astype(x.dtype, copy=False)


def _where(x):
    return str(x.device) if _is_torch(x) else "numpy"


class ErrorFeedback:
    """Per-tensor residuals for repeated FP4 quantization.

    Args:
        fmt: "nvfp4" or "mxfp4".
        rounding: "nearest" or "stochastic": how ``x + residual`` is rounded.
        seed: stochastic rounding's seed; each name draws from its own Philox key
            (``philox_key(seed, name)``) with the step as counter.

    ``qdq(name, x)`` returns the quantized-dequantized ``x + residual[name]`` (same kind,
    device, shape and dtype as ``x``) and stores the new residual in float32 beside ``x``.
    ``quantize(name, x)`` does the same and returns the packed ``QuantizedTensor``.
    A residual holds one float32 per element: error feedback trades that memory for unbiased
    accumulation.  A NaN or infinity in ``x`` stays in its block's residual until ``reset``.
    """

    def __init__(self, fmt="nvfp4", rounding="nearest", seed=0):
        if fmt not in fp4_kernels.FORMATS:
            raise ValueError(f"fmt: {fmt!r} is not one of {tuple(fp4_kernels.FORMATS)}")
        if rounding not in ("nearest", "stochastic"):
            raise ValueError(f"rounding: {rounding!r} is not 'nearest' or 'stochastic'")
        if not 0 <= int(seed) < 2**64:
            raise ValueError(f"seed: {seed} is outside [0, 2**64)")
        self.fmt = fmt
        self.rounding = rounding
        self.seed = int(seed)
        self._residuals = {}
        self._steps = {}

    def __contains__(self, name):
        return name in self._residuals

    def names(self):
        """The names that hold a residual."""
        return list(self._residuals)

    def residual(self, name):
        """The float32 residual of ``name`` (None before its first quantization)."""
        return self._residuals.get(name)

    def _input(self, name, x, step):
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
        self._steps[name] = int(step) + 1
        kw = {"fmt": self.fmt, "rounding": self.rounding, "step": int(step) % 2**32}
        if self.rounding == "stochastic":
            kw["seed"] = philox_key(self.seed, name)
        return v, kw

    def qdq(self, name, x, step=None):
        """Quantize-dequantize ``x + residual[name]``; store the new residual.

        ``step`` is stochastic rounding's counter (default: how many times ``name`` was
        quantized before).  Returns an array of ``x``'s kind, device, shape and dtype.
        """
        v, kw = self._input(name, x, step)
        y = _cast_like(fp4_kernels.quantize_dequantize(v, **kw), x)
        self._residuals[name] = v - _as_float32(y)
        return y

    def quantize(self, name, x, step=None):
        """Like ``qdq``, but return the packed ``QuantizedTensor`` (dequantizes to float32)."""
        v, kw = self._input(name, x, step)
        q = fp4_kernels.quantize(v, **kw)
        self._residuals[name] = v - fp4_kernels.dequantize(q)
        return q

    def reset(self, name=None):
        """Drop the residual (and step count) of ``name``, or of every name."""
        if name is None:
            self._residuals.clear()
            self._steps.clear()
        else:
            self._residuals.pop(name, None)
            self._steps.pop(name, None)

    def state_dict(self):
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

    def load_state_dict(self, state):
        """Restore a ``state_dict``; ValueError if it was saved with another format or rounding."""
        for key in ("fmt", "rounding"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"error feedback state has {key}={state[key]!r}, "
                    f"this one {getattr(self, key)!r}"
                )
        self.seed = int(state["seed"])
        self._residuals = {
            k: (v.clone() if _is_torch(v) else np.array(v, np.float32))
            for k, v in state["residuals"].items()
        }
        self._steps = {k: int(v) for k, v in state.get("steps", {}).items()}
