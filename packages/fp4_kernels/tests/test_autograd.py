"""_autograd.py: quantize_dequantize of a torch tensor that requires grad records the
straight-through (identity) gradient, hadamard its adjoint transform, and the values are the
bits of the no-grad call; quantize itself is not differentiable (integer codes)."""

import numpy as np
import pytest
import scipy.linalg

import fp4_kernels as fk
from fp4_kernels.formats.hadamard import hadamard_signs
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


def test_under_torch_compile_through_compiler_disable(rng):
    """The README's recipe: a compiled function calls quantize_dequantize through
    torch.compiler.disable (a graph break) and gets the eager bits and gradient."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        pytest.skip("torch.compile is not supported on this Python")
    torch._dynamo.reset()
    qdq = torch.compiler.disable(fk.quantize_dequantize)
    x = _leaf(rng, torch.float32)
    compiled = torch.compile(lambda t: qdq(t, "mxfp4") * 3.0, backend="aot_eager")
    y = compiled(x)
    y.backward(torch.ones_like(y))
    _same_bits(y.detach(), fk.quantize_dequantize(x.detach(), "mxfp4") * 3.0)
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


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
    assert y.device == x.device  # computed where x lives (a CPU result would compare equal)
    _same_bits(y.detach().cpu(), fk.quantize_dequantize(x.detach().cpu(), fmt, "stochastic", 7))
    g = torch.randn(x.shape, device="cuda").bfloat16()
    y.backward(g)  # the backward runs on autograd's own thread for CUDA tensors
    _same_bits(x.grad, g)


# ------------------------------------------------------------------ quantize, dequantize


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_quantize_is_not_differentiable(rng, fmt):
    """Codes are integers (as torch.argmax's indices): quantize of a tensor that requires grad
    gives fields without a graph and dequantize a tensor without one, the bits of the no-grad
    call; quantize_dequantize is the differentiable route (documented in both docstrings)."""
    x = _leaf(rng, torch.bfloat16)
    q = fk.quantize(x, fmt=fmt)
    fields = [q.data, q.scales, q.global_scale, q.payload]
    assert not any(f.requires_grad for f in fields if f is not None)
    y = fk.dequantize(q)
    assert not y.requires_grad and y.grad_fn is None
    _same_bits(y, fk.dequantize(fk.quantize(x.detach(), fmt=fmt)))
    assert fk.quantize_dequantize(x, fmt=fmt).requires_grad


# ------------------------------------------------------------------ hadamard

# (group size, inverse, signs: None, a seed or a ±1 list)
HADAMARD_CASES = [
    (16, False, None),
    (16, True, None),
    (32, False, 1234),
    (32, True, 1234),
    (64, False, "vector"),
    (64, True, "vector"),
]


def _signs(g, signs):
    """(the signs argument, its ±1 values)."""
    if signs is None:
        return None, np.ones(g)
    values = hadamard_signs(g, 77 if signs == "vector" else signs).astype(np.float64)
    return ([int(v) for v in values] if signs == "vector" else signs), values


def _matrix(g, inverse, values):
    """The transform's matrix M (y = x @ M per group) in float32: D H or H D, times
    float32(1/sqrt(g)) (exact: every entry is that constant or its negative)."""
    h = scipy.linalg.hadamard(g).astype(np.float64)
    m = h @ np.diag(values) if inverse else np.diag(values) @ h
    return torch.from_numpy((m * np.float32(1 / np.sqrt(g))).astype(np.float32))


@pytest.mark.parametrize("g, inverse, signs", HADAMARD_CASES)
def test_hadamard_jacobian_is_the_transposed_matrix(g, inverse, signs):
    """Each row of the Jacobian is a backward pass of a unit gradient: bit for bit the
    transposed matrix (atol = 0: each entry is +-float32(1/sqrt(g)) exactly)."""
    arg, values = _signs(g, signs)

    def f(t):
        return fk.hadamard(t, group_size=g, inverse=inverse, signs=arg)

    m = _matrix(g, inverse, values)
    assert torch.equal(f(torch.eye(g)), m)  # the forward transform's matrix, for reference
    jac = torch.autograd.functional.jacobian(f, torch.zeros(1, g))  # d y[0, i] / d x[0, k]
    assert torch.equal(jac.reshape(g, g), m.T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("g, inverse, signs", HADAMARD_CASES)
def test_hadamard_gradient_is_the_other_direction_and_values_the_no_grad_bits(
    rng, g, inverse, signs, dtype
):
    arg, _ = _signs(g, signs)
    x = torch.from_numpy(rng.standard_normal((3, 2 * g)).astype(np.float32)).to(dtype)
    x.requires_grad_()
    y = fk.hadamard(x, group_size=g, inverse=inverse, signs=arg)
    assert y.requires_grad and y.dtype == dtype
    _same_bits(y.detach(), fk.hadamard(x.detach(), group_size=g, inverse=inverse, signs=arg))
    w = torch.from_numpy(rng.standard_normal((3, 2 * g)).astype(np.float32)).to(dtype)
    y.backward(w)
    _same_bits(x.grad, fk.hadamard(w, group_size=g, inverse=not inverse, signs=arg))


def test_hadamard_gradient_of_a_sum_in_a_graph(rng):
    """sum(H(H^-1(5 x))) = sum(5 x): the gradient is 5 everywhere (a gradient that skipped
    the transforms would be 1).  The gradient of a sum arrives expanded (stride 0)."""
    x = torch.ones(1, 16, requires_grad=True)
    y = fk.hadamard(x * 5.0, group_size=16, inverse=True)
    fk.hadamard(y, group_size=16).sum().backward()  # the pair is the identity
    assert torch.equal(x.grad, torch.full((1, 16), 5.0))


def test_hadamard_second_order_gradient(rng):
    """The backward pass is itself recorded (create_graph): the gradient of <grad, v> with
    respect to the incoming gradient w is the forward transform of v."""
    g = 32
    x = torch.from_numpy(rng.standard_normal((2, g)).astype(np.float32)).requires_grad_()
    w = torch.from_numpy(rng.standard_normal((2, g)).astype(np.float32)).requires_grad_()
    v = torch.from_numpy(rng.standard_normal((2, g)).astype(np.float32))
    y = fk.hadamard(x, group_size=g, signs=9)
    (gx,) = torch.autograd.grad(y, x, w, create_graph=True)
    assert gx.requires_grad
    (gw,) = torch.autograd.grad((gx * v).sum(), w)
    _same_bits(gw, fk.hadamard(v, group_size=g, signs=9))


def test_hadamard_without_grad_mode_records_nothing(rng):
    x = torch.ones(2, 16, requires_grad=True)
    with torch.no_grad():
        assert fk.hadamard(x, group_size=16).grad_fn is None
    assert not fk.hadamard(x.detach(), group_size=16).requires_grad
    with torch.inference_mode():
        assert not fk.hadamard(x, group_size=16).requires_grad


def test_hadamard_bad_input_raises_as_without_grad():
    x = torch.ones(2, 48, requires_grad=True)
    with pytest.raises(ValueError, match="not a multiple of group_size=32"):
        fk.hadamard(x, group_size=32)
    with pytest.raises(TypeError, match="inverse: expected True or False"):
        fk.hadamard(torch.ones(2, 32, requires_grad=True), group_size=32, inverse=1)


@pytest.mark.gpu
@pytest.mark.parametrize("g, inverse, signs", HADAMARD_CASES)
def test_hadamard_gradient_on_cuda(gpu, rng, g, inverse, signs):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA build of torch")
    arg, _ = _signs(g, signs)
    x = torch.randn(64, 4 * g, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = fk.hadamard(x, group_size=g, inverse=inverse, signs=arg)
    assert y.device == x.device  # computed where x lives (a CPU result would compare equal)
    _same_bits(
        y.detach().cpu(), fk.hadamard(x.detach().cpu(), group_size=g, inverse=inverse, signs=arg)
    )
    w = torch.randn(x.shape, device="cuda").bfloat16()
    y.backward(w)  # on autograd's own thread for CUDA tensors
    assert x.grad.device == x.device
    _same_bits(x.grad.cpu(), fk.hadamard(w.cpu(), group_size=g, inverse=not inverse, signs=arg))
    for _ in range(2):  # planned calls (the second takes the plan) record the graph too
        x.grad = None
        fk.hadamard(x, group_size=g, inverse=inverse, signs=arg).backward(w)
        _same_bits(x.grad.cpu(), fk.hadamard(w.cpu(), group_size=g, inverse=not inverse, signs=arg))


def test_results_can_be_modified_in_place():
    """A CPU result is its bits viewed as its dtype: returned as such a view from the autograd
    function, an in-place op on it (a residual add, a scaling) was refused by torch."""
    x = torch.randn(4, 64, requires_grad=True)
    y = fk.quantize_dequantize(x)
    y.mul_(2)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))  # straight through, then the scaling
    x.grad = None
    z = fk.hadamard(x, group_size=64)
    z.add_(1)
    z.sum().backward()
    assert torch.equal(x.grad, fk.hadamard(torch.ones_like(x), group_size=64, inverse=True))
