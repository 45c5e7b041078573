"""_autograd.py: quantize_dequantize of a torch tensor that requires grad records the
straight-through (identity) gradient, and its values are the bits of the no-grad call."""

import numpy as np
import pytest

import fp4_kernels as fk
from fp4_kernels.testing import adversarial_blocks

torch = pytest.importorskip("torch")

FORMATS = ["nvfp4", "mxfp4", fk.FP4Quant(32), fk.FP4Quant(64, hadamard=False)]


def _leaf(rng, dtype, rows=3, k=128, device="cpu"):
    x = torch.from_numpy(adversarial_blocks(rng, rows, k, 32)).to(dtype)
    x = torch.nan_to_num(x, nan=0.0, posinf=1e3, neginf=-1e3)  # a NaN gradient test is no test
    return x.to(device).requires_grad_()


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    width = torch.int32 if a.dtype == torch.float32 else torch.int16
    assert torch.equal(a.contiguous().view(width), b.contiguous().view(width))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_identity_gradient_and_no_grad_bits(rng, fmt, dtype, rounding):
    x = _leaf(rng, dtype)
    y = fk.quantize_dequantize(x, fmt=fmt, rounding=rounding, seed=2**40 + 5, step=9)
    assert y.requires_grad and y.grad_fn is not None and y.dtype == dtype
    with torch.no_grad():
        plain = fk.quantize_dequantize(x, fmt=fmt, rounding=rounding, seed=2**40 + 5, step=9)
    assert not plain.requires_grad
    _same_bits(y.detach(), plain)
    # the two-step path gives the same bits too
    _same_bits(y.detach(), fk.dequantize(fk.quantize(x.detach(), fmt, rounding, 2**40 + 5, 9)))
    g = torch.randn(x.shape).to(dtype)
    y.backward(g)
    _same_bits(x.grad, g)


def test_gradient_flows_through_a_graph(rng):
    # the gradient of sum(w * qdq(x)) is w wherever qdq sits in a larger graph
    x = _leaf(rng, torch.float32)
    w = torch.from_numpy(rng.standard_normal(tuple(x.shape)).astype(np.float32))
    (fk.quantize_dequantize(x * 2.0, fmt="nvfp4") * w).sum().backward()
    assert torch.equal(x.grad, 2.0 * w)


def test_global_amax_and_a_non_leaf_input(rng):
    x = _leaf(rng, torch.float32)
    h = x * 1.0  # a non-leaf: requires grad through the graph
    y = fk.quantize_dequantize(h, fmt="nvfp4", global_amax=100.0)
    with torch.no_grad():
        _same_bits(y.detach(), fk.quantize_dequantize(h, fmt="nvfp4", global_amax=100.0))
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_no_graph_without_grad_mode_or_requires_grad(rng):
    x = _leaf(rng, torch.float32)
    with torch.no_grad():
        assert fk.quantize_dequantize(x).grad_fn is None
    assert not fk.quantize_dequantize(x.detach()).requires_grad
    with torch.inference_mode():
        assert not fk.quantize_dequantize(x).requires_grad


def test_bad_input_raises_as_without_grad(rng):
    x = torch.ones(3, 48, requires_grad=True)  # K not a multiple of 32
    with pytest.raises(ValueError, match="x: last dimension K=48 is not a multiple"):
        fk.quantize_dequantize(x, fmt="mxfp4")
    x = _leaf(rng, torch.float32)
    with pytest.raises(ValueError, match="rounding: 'up' is not one of"):
        fk.quantize_dequantize(x, rounding="up")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_identity_gradient_on_cuda(gpu, rng, fmt):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA build of torch")
    x = _leaf(rng, torch.bfloat16, device="cuda")
    y = fk.quantize_dequantize(x, fmt=fmt, rounding="stochastic", seed=7)
    _same_bits(y.detach().cpu(), fk.quantize_dequantize(x.detach().cpu(), fmt, "stochastic", 7))
    g = torch.randn(x.shape, device="cuda").bfloat16()
    y.backward(g)  # the backward runs on autograd's own thread for CUDA tensors
    _same_bits(x.grad, g)
