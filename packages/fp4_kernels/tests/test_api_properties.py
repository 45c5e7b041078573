"""Property tests of the CPU path against the oracle: hypothesis draws arbitrary float32 bit
patterns (NaN, Inf, subnormals, ties and huge values included), shapes and arguments."""

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import (  # noqa: E402
    given,
    settings,
    strategies as st,  # noqa: E402
)
from hypothesis.extra import numpy as hnp  # noqa: E402

import fp4_kernels as fk  # noqa: E402
from fp4_kernels.testing import reference_quantization, same_bits  # noqa: E402

# Any float32 bit pattern, biased towards the interesting ones.
_special = st.sampled_from(
    [0.0, -0.0, np.inf, -np.inf, np.nan, 0.25, 0.75, 2.5, 5.0, 6.0, 448.0, 464.0, 1e-45, 3e38]
)
_floats = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True), _special
)


@st.composite
def _case(draw):
    fmt = draw(st.sampled_from(["nvfp4", "mxfp4"]))
    block = fk.FORMATS[fmt]
    rows = draw(st.integers(1, 4))
    k = block * draw(st.integers(1, 3))
    x = draw(hnp.arrays(np.float32, (rows, k), elements=_floats))
    scale = draw(st.sampled_from([1.0, 2.0**-100, 2.0**60]))  # move whole tensors in range
    with np.errstate(all="ignore"):
        x = (x * np.float32(scale)).astype(np.float32)
    rounding = draw(st.sampled_from(["nearest", "stochastic"]))
    layout = draw(st.sampled_from(["linear", "swizzled"]))
    seed = draw(st.integers(0, 2**64 - 1))
    step = draw(st.integers(0, 2**32 - 1))
    amax = None
    if fmt == "nvfp4" and draw(st.booleans()):
        amax = draw(st.floats(0, float(np.float32(3e38)), width=32))
    return x, fmt, rounding, layout, seed, step, amax


@settings(max_examples=150, deadline=None)
@given(_case())
def test_cpu_path_equals_oracle_on_any_input(case):
    x, fmt, rounding, layout, seed, step, amax = case
    q = fk.quantize(
        x, fmt=fmt, rounding=rounding, seed=seed, step=step, global_amax=amax, scale_layout=layout
    )
    data, scales, gs, deq = reference_quantization(x, fmt, rounding, seed, step, amax, layout)
    np.testing.assert_array_equal(q.data, data)
    np.testing.assert_array_equal(q.scales, scales)
    assert q.global_scale.view(np.uint32)[0] == gs.view(np.uint32)
    assert same_bits(fk.dequantize(q), deq)
    fused = fk.quantize_dequantize(
        x, fmt=fmt, rounding=rounding, seed=seed, step=step, global_amax=amax
    )
    assert same_bits(fused, deq)
