"""cuda/dequantize.py: packed codes + scales -> float32 / bfloat16 / float16 on the GPU, equal
bit for bit to the numpy oracle and to the CPU path."""

import numpy as np
import pytest
from _devices import NP_DTYPES, to_gpu, to_host

import fp4_kernels as fk
from fp4_kernels.testing import adversarial_blocks, reference_quantization, same_bits


@pytest.mark.parametrize(
    "fmt,layout,out_dtype",
    [
        ("nvfp4", "linear", "float16"),
        ("nvfp4", "swizzled", "bfloat16"),
        ("mxfp4", "linear", "float32"),
        ("mxfp4", "swizzled", "float16"),
    ],
)
def test_dequantize_to_any_dtype_matches_oracle(kernels, rng, fmt, layout, out_dtype):
    block = fk.FORMATS[fmt]
    x = adversarial_blocks(rng, 3, 2 * block, block)
    q = fk.quantize(to_gpu(x, "numba"), fmt=fmt, scale_layout=layout)
    *_, deq = reference_quantization(x, fmt, scale_layout=layout)
    with np.errstate(over="ignore"):
        expect = deq.astype(NP_DTYPES[out_dtype])
    assert same_bits(to_host(fk.dequantize(q, dtype=out_dtype)), expect)


def test_cpu_quantized_tensor_decodes_identically_on_the_gpu(kernels, rng):
    x = rng.standard_normal((2, 64)).astype(np.float32)
    q = fk.quantize(x)
    q_gpu = fk.QuantizedTensor(
        data=to_gpu(q.data, "numba"),
        scales=to_gpu(q.scales, "numba"),
        global_scale=to_gpu(q.global_scale, "numba"),
        fmt=q.fmt,
        shape=q.shape,
        dtype=q.dtype,
        scale_layout=q.scale_layout,
    )
    assert same_bits(to_host(fk.dequantize(q_gpu)), fk.dequantize(q))


def test_mismatched_scales_are_rejected(kernels):
    q = fk.quantize(to_gpu(np.ones((2, 32), np.float32), "numba"))
    bad = fk.QuantizedTensor(
        data=q.data,
        scales=to_gpu(np.zeros((2, 3), np.uint8), "numba"),
        global_scale=q.global_scale,
        fmt=q.fmt,
        shape=q.shape,
        dtype=q.dtype,
        scale_layout=q.scale_layout,
    )
    with pytest.raises(ValueError, match="q.scales: shape"):
        fk.dequantize(bad)
