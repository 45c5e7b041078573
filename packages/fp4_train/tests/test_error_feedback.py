"""ErrorFeedback: residual bookkeeping, sub-step accumulation, state, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _oracle import U32, requires_cuda

import fp4_kernels
from fp4_train import ErrorFeedback

# An MXFP4 block of amax 6 has the scale 2^(floor(log2 6) - 2) = 1: the e2m1 grid itself, with
# steps 0.5 / 1 / 2.  (NVFP4 would decode through the float32 tensor scale 1/448, which is not
# exact, and the anchor's own residual would move the tensor amax: a grid off by an ulp.)
UNIT_BLOCK = np.zeros(32, np.float32)
UNIT_BLOCK[0] = 6.0


def _block_with(value):
    x = UNIT_BLOCK.copy()
    x[1] = value
    return x.reshape(1, 32)


def test_first_call_is_plain_quantize_dequantize():
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    ef = ErrorFeedback()
    assert np.array_equal(ef.qdq("w", x), fp4_kernels.quantize_dequantize(x))
    assert np.array_equal(ef.residual("w"), x - fp4_kernels.quantize_dequantize(x))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_what_was_sent_sums_to_what_was_asked_for(fmt, rounding):
    # sum_t y_t + r_T = sum_t x_t, up to the float32 rounding of each v_t = x_t + r_{t-1}
    rng = np.random.default_rng([7, len(fmt), len(rounding)])
    ef = ErrorFeedback(fmt=fmt, rounding=rounding, seed=3)
    xs = [rng.standard_normal((8, 64)).astype(np.float32) * 0.1 for _ in range(50)]
    sent = np.zeros((8, 64))
    bound = np.zeros((8, 64))
    for x in xs:
        r_prev = ef.residual("g")
        v = x.astype(np.float64) + (0 if r_prev is None else r_prev)
        sent += ef.qdq("g", x)
        bound += np.abs(v) * U32
    asked = np.sum(np.array(xs, np.float64), axis=0)
    assert np.all(np.abs(sent + ef.residual("g") - asked) <= bound)


def test_a_value_between_grid_points_is_reached_on_average():
    # 2.3 lies between the grid points 2 and 3: nearest alone always gives 2; with error
    # feedback the time-average after T steps is within |r_T| / T <= 0.5 / T of 2.3
    steps = 100
    x = _block_with(2.3)
    ef = ErrorFeedback(fmt="mxfp4")
    ys = [ef.qdq("w", x)[0, 1] for _ in range(steps)]
    assert fp4_kernels.quantize_dequantize(x, fmt="mxfp4")[0, 1] == 2.0
    assert abs(np.mean(ys, dtype=np.float64) - np.float32(2.3)) <= 0.5 / steps
    assert set(ys) == {2.0, 3.0}


def test_residual_stays_within_one_grid_step_under_stochastic_rounding():
    x = _block_with(0.55)  # grid step 0.5 around 0.55
    ef = ErrorFeedback(fmt="mxfp4", rounding="stochastic", seed=1)
    for _ in range(200):
        ef.qdq("w", x)
        assert abs(ef.residual("w")[0, 1]) <= 0.5


def test_default_step_counts_calls_per_name():
    x = np.random.default_rng(2).standard_normal((2, 32)).astype(np.float32)
    implicit, explicit = ErrorFeedback(rounding="stochastic"), ErrorFeedback(rounding="stochastic")
    for t in range(3):
        assert np.array_equal(implicit.qdq("w", x), explicit.qdq("w", x, step=t))


def test_names_draw_independent_rounding_bits():
    x = np.random.default_rng(4).standard_normal((16, 64)).astype(np.float32)
    ef = ErrorFeedback(rounding="stochastic")
    assert not np.array_equal(ef.qdq("a", x, step=0), ef.qdq("b", x, step=0))
    again = ErrorFeedback(rounding="stochastic")
    assert np.array_equal(
        again.qdq("a", x, step=0), ErrorFeedback(rounding="stochastic").qdq("a", x, step=0)
    )


def test_quantize_matches_qdq():
    x = np.random.default_rng(5).standard_normal((4, 64)).astype(np.float32)
    ef_q, ef_qdq = ErrorFeedback(), ErrorFeedback()
    for _ in range(3):
        q = ef_q.quantize("w", x * 0.01)
        assert isinstance(q, fp4_kernels.QuantizedTensor)
        assert np.array_equal(fp4_kernels.dequantize(q), ef_qdq.qdq("w", x * 0.01))
        assert np.array_equal(ef_q.residual("w"), ef_qdq.residual("w"))


def test_torch_bfloat16_keeps_its_dtype_and_a_float32_residual():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    ef = ErrorFeedback()
    y = ef.qdq("w", x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    r = ef.residual("w")
    assert r.dtype == torch.float32
    assert torch.equal(r, x.float() - y.float())


def test_state_dict_round_trip_continues_identically():
    rng = np.random.default_rng(6)
    xs = [torch.from_numpy(rng.standard_normal((4, 32)).astype(np.float32)) for _ in range(6)]
    whole = ErrorFeedback(rounding="stochastic", seed=9)
    first = ErrorFeedback(rounding="stochastic", seed=9)
    for x in xs[:3]:
        whole.qdq("w", x)
        first.qdq("w", x)
    resumed = ErrorFeedback(rounding="stochastic")
    resumed.load_state_dict(first.state_dict())
    first.reset()  # the saved state is a copy
    for x in xs[3:]:
        assert torch.equal(whole.qdq("w", x), resumed.qdq("w", x))


def test_loading_another_format_is_rejected():
    with pytest.raises(ValueError, match="fmt='mxfp4'"):
        ErrorFeedback().load_state_dict(ErrorFeedback(fmt="mxfp4").state_dict())


def test_shape_change_is_a_clear_error_and_reset_recovers():
    ef = ErrorFeedback()
    ef.qdq("w", np.ones((2, 16), np.float32))
    with pytest.raises(ValueError, match=r"residual has shape \(2, 16\).*reset\('w'\)"):
        ef.qdq("w", np.ones((3, 16), np.float32))
    ef.reset("w")
    assert "w" not in ef
    assert ef.qdq("w", np.ones((3, 16), np.float32)).shape == (3, 16)


@pytest.mark.parametrize(
    "kw", [{"fmt": "fp8"}, {"rounding": "up"}, {"seed": -1}], ids=["fmt", "rounding", "seed"]
)
def test_bad_options_are_rejected(kw):
    with pytest.raises(ValueError):
        ErrorFeedback(**kw)


@pytest.mark.gpu
@requires_cuda
def test_cuda_matches_the_cpu_bit_for_bit():
    rng = np.random.default_rng(8)
    xs = [torch.from_numpy(rng.standard_normal((64, 256)).astype(np.float32)) for _ in range(4)]
    cpu, gpu = ErrorFeedback(rounding="stochastic"), ErrorFeedback(rounding="stochastic")
    for x in xs:
        assert torch.equal(cpu.qdq("w", x), gpu.qdq("w", x.cuda()).cpu())
    assert torch.equal(cpu.residual("w"), gpu.residual("w").cpu())
