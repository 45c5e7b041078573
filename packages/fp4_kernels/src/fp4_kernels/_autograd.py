"""The torch autograd functions of the public ops.

``quantize_dequantize`` of a torch tensor that requires grad (with grad mode on) goes through
``FakeQuantize``: the forward pass is the fused quantize-dequantize, bit for bit the no-grad
call; the backward pass is the identity, the straight-through estimator of torchao's and
Transformer Engine's fake quantization (rounding has zero derivative almost everywhere, so
the gradient of the unquantized value is passed on as it is).

``hadamard`` goes through ``LinearTransform``: the transform is linear, so its backward pass
is its adjoint (the transposed matrix) applied to the incoming gradient.

torch is an optional dependency of fp4_kernels: it is imported only when a torch tensor that
requires grad arrives, and then it is already loaded.
"""

from __future__ import annotations

import functools


def requires_autograd(x) -> bool:
    """Whether ``quantize_dequantize(x)`` must record a gradient: ``x`` is a torch tensor with
    ``requires_grad`` and grad mode is on."""
    if not getattr(x, "requires_grad", False):
        return False
    import torch

    return isinstance(x, torch.Tensor) and torch.is_grad_enabled()


def fake_quantize(x, qdq):
    """``qdq(x)`` (a fused quantize-dequantize of a torch tensor) with the identity gradient."""
    return _function().apply(x, qdq)


@functools.cache
def _function():
    import torch

    class FakeQuantize(torch.autograd.Function):
        """forward: ``qdq(x)``; backward: the incoming gradient as it is (straight through)."""

        @staticmethod
        def forward(ctx, x, qdq):
            return _not_a_view(qdq(x.detach()))

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    return FakeQuantize


def _not_a_view(y):
    """``y`` as a tensor of its own memory's (no copy): a result that is a view of a buffer made
    in the forward pass (a CPU result is its bits viewed as its dtype) could not be modified in
    place afterwards (torch refuses in-place changes to a custom Function's view outputs)."""
    return y.detach() if y._is_view() else y


def linear_transform(x, forward, adjoint):
    """``forward(x)`` (a linear map of a torch tensor) whose gradient is ``adjoint(grad)``."""
    return _linear_function().apply(x, forward, adjoint)


@functools.cache
def _linear_function():
    import torch

    class LinearTransform(torch.autograd.Function):
        """forward: ``forward(x)``; backward: ``adjoint(grad)``, itself recorded when the
        backward pass builds a graph (``create_graph=True``: the adjoint's adjoint is the
        forward map again)."""

        @staticmethod
        def forward(ctx, x, forward, adjoint):
            ctx.adjoint = adjoint
            return _not_a_view(forward(x.detach()))

        @staticmethod
        def backward(ctx, grad):
            # autograd may hand over an expanded (stride-0) or lazily negated gradient
            return ctx.adjoint(grad.resolve_neg().contiguous()), None, None

    return LinearTransform
