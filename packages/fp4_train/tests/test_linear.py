"""fp4_linear / FP4Linear: forward and the three backward GEMMs against float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _oracle import U32, requires_cuda

import fp4_kernels
from fp4_train import FP4Linear, fp4_gemm, fp4_linear
from fp4_train.error_feedback import philox_key

E2M1_BELOW_MAX = np.float32([0.5, 1.0, 1.5, 2.0, 3.0, 4.0])


def grid_matrix(rows, cols, rng):
    """A matrix that NVFP4 holds exactly along either dimension: e2m1 values, with ±6 at every
    (i, j) with i = j mod 4, so that every block of 16 (or 4 or more after zero padding) along
    a row or a column has amax 6: tensor scale 448, block scale 448 (an e4m3 value)."""
    x = rng.choice(E2M1_BELOW_MAX, size=(rows, cols)) * rng.choice([-1, 1], size=(rows, cols))
    i, j = np.indices((rows, cols))
    x[i % 4 == j % 4] = 6.0 * np.sign(x[i % 4 == j % 4])
    return torch.from_numpy(x.astype(np.float32))


def _bound(a, b, k):
    # float32 accumulation over k exact products, alpha = fl(gs_a gs_b) and alpha * acc, and
    # the decode scale 448 * fl(1/448) of each operand differing from 1 by at most u
    n = k + 3
    return n * U32 / (1 - n * U32) * (a.abs().double() @ b.abs().double().T)


@pytest.mark.parametrize("tokens", [32, 20])  # 20: the wgrad pads the tokens to 32
def test_grid_exact_operands_give_exact_gradients(tokens):
    rng = np.random.default_rng(tokens)
    x = grid_matrix(tokens, 64, rng).requires_grad_()
    w = grid_matrix(48, 64, rng).requires_grad_()
    b = torch.from_numpy(rng.standard_normal(48).astype(np.float32)).requires_grad_()
    dy = grid_matrix(tokens, 48, rng)
    y = fp4_linear(x, w, b)  # grad_rounding="stochastic": grid values have nothing to round
    y.backward(dy)
    exact_y = x.double() @ w.double().T + b.double()
    assert torch.all((y.double() - exact_y).abs() <= _bound(x, w, 64) + U32 * exact_y.abs())
    assert torch.all((x.grad.double() - dy.double() @ w.double()).abs() <= _bound(dy, w.T, 48))
    exact_w = dy.double().T @ x.double()
    assert torch.all((w.grad.double() - exact_w).abs() <= _bound(dy.T, x.T, tokens))
    assert torch.equal(b.grad, dy.sum(0))


def test_hadamard_rotation_cancels_in_the_weight_gradient():
    # Build x^T and dy^T as the inverse rotation of grid matrices Z: the backward rotates them
    # back onto the grid (up to float32 rounding, which round to nearest removes), so the
    # weight gradient is Z_dy Z_x^T, the product with the rotations cancelled, up to float32
    # accumulation and each operand's decode scale 448 / S = amax / 6 (amax a few ulps off 6).
    rng = np.random.default_rng(9)
    tokens = 32
    key = philox_key(0, "hadamard")
    z_xt, z_dyt = grid_matrix(64, tokens, rng), grid_matrix(48, tokens, rng)
    rotate = lambda t, inverse: fp4_kernels.hadamard(t, group_size=16, signs=key, inverse=inverse)  # noqa: E731
    x = rotate(z_xt, True).T.contiguous().requires_grad_()
    dy = rotate(z_dyt, True).T.contiguous()
    w = torch.zeros(48, 64, requires_grad=True)
    fp4_linear(x, w, hadamard_wgrad=True, grad_rounding="nearest").backward(dy)
    eps = [
        abs(rotate(t.detach().T.contiguous(), False).abs().max().item() / 6 - 1) for t in (x, dy)
    ]
    product = z_dyt.abs().double() @ z_xt.abs().double().T
    scale_err = (1 + eps[0]) * (1 + eps[1]) - 1
    bound = _bound(z_dyt, z_xt, tokens) + scale_err * product
    assert torch.all((w.grad.double() - z_dyt.double() @ z_xt.double().T).abs() <= bound)
    # without the rotation the same operands are off the grid: a visible quantization error
    w.grad = None
    fp4_linear(x, w, grad_rounding="nearest").backward(dy)
    assert not torch.all((w.grad.double() - z_dyt.double() @ z_xt.double().T).abs() <= bound)


def test_forward_is_fp4_gemm_of_the_quantized_operands():
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.standard_normal((2, 5, 32)).astype(np.float32))
    w = torch.from_numpy(rng.standard_normal((16, 32)).astype(np.float32))
    y = fp4_linear(x, w)
    expected = fp4_gemm(fp4_kernels.quantize(x.reshape(10, 32)), fp4_kernels.quantize(w))
    assert y.shape == (2, 5, 16) and torch.equal(y.reshape(10, 16), expected)


def test_full_precision_backward_goes_through_the_quantized_operands():
    rng = np.random.default_rng(2)
    x = torch.from_numpy(rng.standard_normal((24, 32)).astype(np.float32)).requires_grad_()
    w = torch.from_numpy(rng.standard_normal((16, 32)).astype(np.float32)).requires_grad_()
    dy = torch.from_numpy(rng.standard_normal((24, 16)).astype(np.float32))
    fp4_linear(x, w, quantize_backward=False).backward(dy)
    xq = fp4_kernels.quantize_dequantize(x.detach()).double()
    wq = fp4_kernels.quantize_dequantize(w.detach()).double()
    gamma = lambda k: k * U32 / (1 - k * U32)  # noqa: E731
    assert torch.all(
        (x.grad.double() - dy.double() @ wq).abs() <= gamma(16) * dy.abs().double() @ wq.abs()
    )
    assert torch.all(
        (w.grad.double() - dy.double().T @ xq).abs() <= gamma(24) * dy.abs().double().T @ xq.abs()
    )


def test_stochastic_gradient_rounding_is_unbiased_on_average():
    rng = np.random.default_rng(4)
    x = torch.from_numpy(rng.standard_normal((32, 32)).astype(np.float32))
    dy = torch.from_numpy(rng.standard_normal((32, 16)).astype(np.float32))
    w = torch.zeros(16, 32)

    def grad_x(rounding, step):
        xr = x.clone().requires_grad_()
        fp4_linear(xr, w + 1, grad_rounding=rounding, step=step).backward(dy)
        return xr.grad.double()

    nearest = grad_x("nearest", 0)
    exact_w = fp4_kernels.quantize_dequantize((w + 1).T.contiguous()).T.double()
    exact = dy.double() @ exact_w
    mean = sum(grad_x("stochastic", t) for t in range(64)) / 64
    # averaging 64 independent roundings removes most of the rounding error of dy
    assert (mean - exact).norm() < 0.5 * (nearest - exact).norm()


def test_module_counts_training_steps_and_saves_them():
    layer = FP4Linear(32, 16, seed=3)
    x = torch.randn(4, 32)
    layer(x)
    layer(x)
    layer.eval()
    layer(x)
    assert layer.step == 2
    other = FP4Linear(32, 16)
    other.load_state_dict(layer.state_dict())
    assert other.step == 2 and other.seed == 3 and torch.equal(other.weight, layer.weight)


def test_from_linear_shares_the_master_weights():
    linear = torch.nn.Linear(32, 16)
    layer = FP4Linear.from_linear(linear, grad_rounding="nearest")
    assert layer.weight is linear.weight and layer.bias is linear.bias


@pytest.mark.parametrize("training", [True, False])
def test_from_linear_takes_the_training_mode_of_linear(training):
    # a model converted in eval mode stays in eval mode: its forwards count no steps
    linear = torch.nn.Linear(32, 16).train(training)
    layer = FP4Linear.from_linear(linear)
    assert layer.training is training
    layer(torch.ones(2, 32))
    assert layer.step == int(training)


def test_bfloat16_activations_keep_their_dtype():
    x = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    layer = FP4Linear(32, 16)
    y = layer(x)
    y.sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert layer.weight.grad.dtype == torch.float32


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((torch.ones(4, 24), torch.ones(16, 24)), ValueError, "in_features=24"),
        ((torch.ones(4, 32), torch.ones(16, 64)), ValueError, r"expected \(\.\.\., 64\)"),
        ((torch.ones(4, 32), torch.ones(16, 32), torch.ones(8)), ValueError, "bias has shape"),
        ((torch.ones(4, 32, dtype=torch.int32), torch.ones(16, 32)), TypeError, "int32"),
    ],
)
def test_bad_input_is_rejected(args, error, match):
    with pytest.raises(error, match=match):
        fp4_linear(*args)


def test_module_rejects_unaligned_features():
    with pytest.raises(ValueError, match="out_features=10"):
        FP4Linear(32, 10)


@pytest.mark.gpu
@requires_cuda
def test_cuda_gradients_are_exact_on_grid_operands():
    rng = np.random.default_rng(5)
    x = grid_matrix(64, 128, rng).cuda().requires_grad_()
    w = grid_matrix(32, 128, rng).cuda().requires_grad_()
    dy = grid_matrix(64, 32, rng).cuda()
    fp4_linear(x, w).backward(dy)
    xc, wc, dyc = x.detach().cpu(), w.detach().cpu(), dy.cpu()
    assert torch.all(
        (x.grad.cpu().double() - dyc.double() @ wc.double()).abs() <= _bound(dyc, wc.T, 32)
    )
    assert torch.all(
        (w.grad.cpu().double() - dyc.double().T @ xc.double()).abs() <= _bound(dyc.T, xc.T, 64)
    )
