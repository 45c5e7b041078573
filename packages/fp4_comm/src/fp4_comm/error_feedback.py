"""Error feedback for compressed reductions, per named buffer.

As in error-feedback SGD (Seide et al. 2014; Karimireddy et al. 2019): what one quantization of
a buffer lost, e = x_corrected - decode(encode(x_corrected)), is added to that buffer before
its next quantization, so the errors do not accumulate over steps: the sum over T steps of the
transmitted values differs from the sum of the inputs by one residual, not T of them.

A compressed all-reduce quantizes twice, so a buffer has two residuals: the worker residual
(each rank's whole input, before the exchange) and the server residual (the chunk a rank
reduces, before the all-gather).  Reduce-scatter has only the worker residual.
"""

from __future__ import annotations

import torch


class ErrorFeedback:
    """Residuals keyed by (buffer name, hop); float32, on the data's device, padded like the
    payload (the padding's residual stays 0: zeros encode exactly)."""

    def __init__(self):
        self._residuals: dict[tuple[str, str], torch.Tensor] = {}

    def corrected(self, name, hop, x):
        """``x`` (float, any shape) plus the stored residual of (name, hop), in float32; a new
        tensor.  The first call of a name starts from residual 0."""
        e = self._residuals.get((name, hop))
        if e is None:
            return x.clone() if x.dtype == torch.float32 else x.float()
        if e.shape != x.shape or e.device != x.device:
            raise ValueError(
                f"error feedback {name!r} ({hop}): the residual has shape {tuple(e.shape)} on "
                f"{e.device}, this payload {tuple(x.shape)} on {x.device}; use another name "
                "per buffer, or reset(name) when a buffer changes size"
            )
        return x + e  # bfloat16/float16 + float32 promotes to float32: one op, a new tensor

    def store(self, name, hop, corrected, decoded):
        """Keep corrected - decoded as the residual of (name, hop); ``corrected`` is consumed.

        An existing residual is overwritten in place, so a collective captured in a CUDA graph
        reads and writes the same residual tensor on every replay."""
        e = self._residuals.get((name, hop))
        if e is None:
            self._residuals[(name, hop)] = corrected.sub_(decoded)
        else:
            torch.sub(corrected, decoded, out=e)

    def residual(self, name, hop="worker"):
        """The stored residual (None before the first use of the name)."""
        return self._residuals.get((name, hop))

    def reset(self, name=None):
        """Forget the residuals of ``name`` (every name if None)."""
        if name is None:
            self._residuals.clear()
        else:
            for key in [k for k in self._residuals if k[0] == name]:
                del self._residuals[key]

    def names(self):
        return sorted({k[0] for k in self._residuals})
