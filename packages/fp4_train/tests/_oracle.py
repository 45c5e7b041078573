"""Shared oracles for the fp4_train tests (importable as ``_oracle``): exact float64
dequantization, GEMM error bounds, the CUDA skip."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import fp4_kernels

# float32 unit roundoff: the relative error of one rounding to float32
U32 = 2.0**-24
# bfloat16 unit roundoff (8 significant bits)
U_BF16 = 2.0**-8


def _numpy(t):
    return t.detach().cpu().numpy() if hasattr(t, "detach") else np.asarray(t)


def dequantize_f64(q):
    """The exact value of every element of ``q`` as float64: (e2m1 x block scale) x tensor scale.

    The product without the tensor scale is exact in float32 (at most 6 significant bits), and
    the float64 product with the tensor scale is exact too (at most 6 + 24 bits).
    """
    ones = np.ones(1, np.float32)
    q_cpu = dataclasses.replace(
        q,
        data=_numpy(q.data),
        scales=_numpy(q.scales),
        global_scale=ones,
    )
    unscaled = fp4_kernels.dequantize(q_cpu, dtype=np.float32).astype(np.float64)
    return unscaled * np.float64(_numpy(q.global_scale).reshape(-1)[0])


def gemm_bound(a64, b64, k):
    """|fp32 GEMM - exact| bound for a @ b^T of exactly representable operands.

    Each product is exact in float32; any summation order of K terms in float32 errs by at most
    gamma_{K-1} * sum |a_i b_i|; the float32 alpha = fl(gs_a gs_b) and the final alpha * acc add
    one rounding each, so gamma_{K+1} = (K+1) u / (1 - (K+1) u) bounds the whole.
    """
    n = k + 1
    gamma = n * U32 / (1 - n * U32)
    return gamma * (np.abs(a64) @ np.abs(b64).T)


def bf16_result_bound(bound, exact):
    """|bf16 result - exact| bound for a float32 result within ``bound`` of ``exact``, rounded
    once to bfloat16: |fl(y) - y| <= U_BF16 |y| <= U_BF16 (|exact| + bound).

    Half a bfloat16 ulp is U_BF16 = 2^-8 relative at the bottom of a binade (ulp 2^-7 at 1.0),
    not 2^-9: a bound with 2^-9 fails for about 3% of correctly rounded results.
    """
    return bound * (1 + U_BF16) + U_BF16 * np.abs(exact)


def has_cuda():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


requires_cuda = pytest.mark.skipif(not has_cuda(), reason="needs a CUDA GPU (none visible)")
