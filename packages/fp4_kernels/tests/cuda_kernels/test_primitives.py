"""cuda/_primitives.py: the scalar codec as compiled for the GPU (on a real GPU the block-scale
encoder is the hardware cvt.rn.satfinite.e4m3x2.f32) against the numpy oracle: every
non-negative bf16 and fp16 pattern on a real GPU, a sample of them in the simulator."""

import numpy as np
from numba import config, cuda

from fp4_kernels.cuda._primitives import OPS
from fp4_kernels.formats import e2m1, e4m3

_e4m3 = OPS.e4m3_encode_positive
_e2m1 = OPS.e2m1_encode
_e4m3_dec = OPS.e4m3_decode


@cuda.jit
def _map(v, scale_codes, elem_codes, decoded):
    for i in range(cuda.grid(1), v.size, cuda.gridsize(1)):
        scale_codes[i] = _e4m3(v[i])
        elem_codes[i] = _e2m1(v[i])
        decoded[i] = _e4m3_dec(np.uint8(i & 0x7F))


def _patterns(rng):
    bf16 = (np.arange(1 << 15, dtype=np.uint32) << 16).view(np.float32)
    f16 = np.arange(0x7C01, dtype=np.uint16).view(np.float16).astype(np.float32)
    v = np.concatenate([bf16, f16])
    v = v[~np.isnan(v)]
    if config.ENABLE_CUDASIM:  # one Python thread per CUDA thread: a sample
        v = np.concatenate([v[rng.integers(0, v.size, 192)], [0.0, 448.0, 464.0, np.inf]])
    return np.ascontiguousarray(v, np.float32)


def test_device_codecs_match_oracle(kernels, rng):
    v = _patterns(rng)
    sc = cuda.device_array(v.size, np.uint8)
    ec = cuda.device_array(v.size, np.uint8)
    dec = cuda.device_array(v.size, np.float32)
    blocks = 2 if config.ENABLE_CUDASIM else 256
    _map[blocks, 64](cuda.to_device(v), sc, ec, dec)
    np.testing.assert_array_equal(sc.copy_to_host(), e4m3.encode_e4m3(v))
    np.testing.assert_array_equal(ec.copy_to_host(), e2m1.encode_e2m1(v))
    idx = (np.arange(v.size) & 0x7F).astype(np.uint8)
    np.testing.assert_array_equal(dec.copy_to_host(), e4m3.decode_e4m3(idx))
