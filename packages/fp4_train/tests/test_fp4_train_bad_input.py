"""Bad inputs to every public function of fp4_train: a clear exception naming the argument (and
how to fix it), or the documented policy, never a crash or a silent difference.

``REJECTED`` lists the inputs that must raise: each case gives the call, the exception type and a
regex the message must match.  The ``test_policy_*`` tests pin what the documentation promises
for inputs that are accepted: NaN / infinity, empty tensors, non-contiguous and non-native
layouts, float64.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np
import pytest
import torch

import fp4_kernels
from fp4_train import (
    ErrorFeedback,
    FP4Linear,
    FP4StoredWeights,
    NativeGemmUnavailable,
    fp4_gemm,
    fp4_linear,
)

NAN, INF = float("nan"), float("inf")


def _q(rows=4, k=64, fmt="nvfp4", lib="torch", layout="linear"):
    x = np.random.default_rng(rows * k).standard_normal((rows, k)).astype(np.float32)
    return fp4_kernels.quantize(
        torch.from_numpy(x) if lib == "torch" else x, fmt=fmt, scale_layout=layout
    )


def _with(q, **fields):
    return dataclasses.replace(q, **fields)


def _sw(params=None, **kw):
    params = params if params is not None else [torch.nn.Parameter(torch.randn(32, 32))]
    return FP4StoredWeights(torch.optim.SGD(params, lr=0.1), **kw)


def _param(*shape, dtype=torch.float32):
    return torch.nn.Parameter(
        torch.zeros(*shape, dtype=dtype), requires_grad=dtype.is_floating_point
    )


X = torch.randn(4, 32)
W = torch.randn(16, 32)
Q = _q()
Q_FP4QUANT = fp4_kernels.quantize(torch.randn(4, 64), fmt=fp4_kernels.FP4Quant(group_size=64))

# (id, call, exception type, message regex)
_CASES = [
    # -- fp4_gemm: operands --------------------------------------------------------------
    ("gemm/a-not-quantized", lambda: fp4_gemm(torch.ones(4, 64), Q), TypeError,
     r"^a: expected an fp4_kernels.QuantizedTensor"),
    ("gemm/b-numpy-array", lambda: fp4_gemm(Q, np.ones((4, 64))), TypeError,
     r"^b: expected an fp4_kernels.QuantizedTensor"),
    ("gemm/a-fp4quant", lambda: fp4_gemm(Q_FP4QUANT, Q), ValueError,
     r"^a: fp4_gemm multiplies NVFP4 or MXFP4 operands; a is FP4Quant.*fmt='nvfp4'"),
    ("gemm/b-fp4quant", lambda: fp4_gemm(Q, Q_FP4QUANT), ValueError, r"^b: .* b is FP4Quant"),
    ("gemm/both-fp4quant", lambda: fp4_gemm(Q_FP4QUANT, Q_FP4QUANT), ValueError, r"^a: .*FP4Quant"),
    ("gemm/fmt-unknown", lambda: fp4_gemm(_with(Q, fmt="fp8"), Q), ValueError,
     r"^a: .* a.fmt is 'fp8'"),
    ("gemm/mixed-formats", lambda: fp4_gemm(Q, _q(fmt="mxfp4")), ValueError,
     r"a is NVFP4 and b is MXFP4"),
    ("gemm/mixed-libraries", lambda: fp4_gemm(Q, _q(lib="numpy")), ValueError,
     r"different devices or libraries: cpu vs numpy"),
    ("gemm/3d", lambda: fp4_gemm(fp4_kernels.quantize(torch.ones(2, 3, 64)), Q), ValueError,
     r"^a: fp4_gemm takes 2-D operands.*reshape"),
    ("gemm/1d", lambda: fp4_gemm(Q, fp4_kernels.quantize(torch.ones(64))), ValueError,
     r"^b: fp4_gemm takes 2-D operands"),
    ("gemm/k-mismatch", lambda: fp4_gemm(_q(4, 32), _q(4, 64)), ValueError, r"same K"),
    ("gemm/k-not-block-multiple",
     lambda: fp4_gemm(_with(Q, shape=(4, 24), data=Q.data[:, :12]), Q),
     ValueError, r"^a: K=24 is not a multiple of the NVFP4 block size 16"),
    ("gemm/shape-not-tuple", lambda: fp4_gemm(_with(Q, shape=[4, 64]), Q), TypeError,
     r"^a.shape: expected a tuple"),
    ("gemm/shape-negative", lambda: fp4_gemm(_with(Q, shape=(-4, 64)), Q), TypeError,
     r"^a.shape: expected a tuple of non-negative ints"),
    ("gemm/scale-layout", lambda: fp4_gemm(_with(Q, scale_layout="tiled"), Q), ValueError,
     r"^a.scale_layout: 'tiled' is not one of"),
    ("gemm/data-uint16", lambda: fp4_gemm(_with(Q, data=Q.data.view(torch.uint16)), Q), TypeError,
     r"^a.data: dtype torch.uint16, expected uint8"),
    ("gemm/data-float32", lambda: fp4_gemm(Q, _with(Q, data=Q.data.float())), TypeError,
     r"^b.data: dtype torch.float32, expected uint8"),
    ("gemm/data-short", lambda: fp4_gemm(_with(Q, data=Q.data[:3]), Q), ValueError,
     r"^a.data: shape \(3, 32\), expected \(4, 32\)"),
    ("gemm/data-non-contiguous",
     lambda: fp4_gemm(_with(Q, data=torch.zeros(32, 4, dtype=torch.uint8).t()), Q),
     ValueError, r"^a.data: must be C-contiguous"),
    ("gemm/data-list", lambda: fp4_gemm(_with(Q, data=[0] * 128), Q), TypeError,
     r"^a.data: fp4_gemm takes operands held by torch tensors"),
    ("gemm/data-meta",
     lambda: fp4_gemm(_with(Q, data=torch.empty(4, 32, dtype=torch.uint8, device="meta")), Q),
     TypeError,
     r"^a.data: a meta torch.strided tensor; fp4_gemm reads the operands' fields as dense"),
    ("gemm/scales-nested", lambda: fp4_gemm(Q, _with(Q, scales=_nested())), TypeError,
     r"^b.scales: a nested tensor"),
    ("gemm/scales-int64", lambda: fp4_gemm(_with(Q, scales=Q.scales.long()), Q), TypeError,
     r"^a.scales: dtype torch.int64, expected uint8"),
    ("gemm/scales-uint16",
     lambda: fp4_gemm(_with(Q_FP4QUANT, fmt="nvfp4", data=Q.data), Q),
     TypeError, r"^a.scales: dtype torch.uint16"),
    ("gemm/scales-short", lambda: fp4_gemm(_with(Q, scales=Q.scales[:2]), Q), ValueError,
     r"^a.scales: shape \(2, 4\), expected \(4, 4\)"),
    ("gemm/swizzled-scales-linear-size",
     lambda: fp4_gemm(_with(_q(layout="swizzled"), scales=Q.scales.reshape(-1)), Q),
     ValueError, r"^a.scales: shape \(16,\), expected \(512,\)"),
    ("gemm/scales-numpy-data-torch",
     lambda: fp4_gemm(_with(Q, scales=Q.scales.numpy()), Q),
     ValueError, r"^a.scales: lives on numpy but the operand's data on cpu"),
    ("gemm/global-scale-none", lambda: fp4_gemm(_with(Q, global_scale=None), Q), ValueError,
     r"^a.global_scale: NVFP4 needs its tensor decode scale"),
    ("gemm/global-scale-two", lambda: fp4_gemm(Q, _with(Q, global_scale=torch.ones(2))), ValueError,
     r"^b.global_scale: shape \(2,\), expected \(1,\)"),
    ("gemm/global-scale-float64",
     lambda: fp4_gemm(_with(Q, global_scale=Q.global_scale.double()), Q),
     TypeError, r"^a.global_scale: dtype torch.float64, expected float32"),
    ("gemm/global-scale-python-float", lambda: fp4_gemm(_with(Q, global_scale=1.0), Q), TypeError,
     r"^a.global_scale: fp4_gemm takes operands held by torch tensors"),
    ("gemm/numpy-big-endian-scale",
     lambda: fp4_gemm(_with(_q(lib="numpy"), global_scale=np.ones(1, ">f4")), _q(lib="numpy")),
     TypeError, r"^a.global_scale: dtype >f4, expected float32"),
    ("gemm/backend", lambda: fp4_gemm(Q, Q, backend="cutlass"), ValueError,
     r"^backend: 'cutlass' is not one of"),
    ("gemm/out-dtype", lambda: fp4_gemm(Q, Q, out_dtype="float16"), ValueError,
     r"^out_dtype: 'float16' is not one of"),
    ("gemm/out-dtype-torch-dtype", lambda: fp4_gemm(Q, Q, out_dtype=torch.float32), ValueError,
     r"^out_dtype: torch.float32 is not one of"),
    ("gemm/bf16-numpy",
     lambda: fp4_gemm(_q(lib="numpy"), _q(lib="numpy"), out_dtype="bfloat16"),
     TypeError, r"numpy has no bfloat16"),
    ("gemm/native-on-cpu",
     lambda: fp4_gemm(_q(layout="swizzled"), _q(layout="swizzled"), backend="native"),
     NativeGemmUnavailable, r"CUDA tensors only.*backend='exact'"),
    # -- fp4_linear ----------------------------------------------------------------------
    ("linear/x-numpy", lambda: fp4_linear(X.numpy(), W), TypeError,
     r"^fp4_linear: x must be a torch tensor, got ndarray"),
    ("linear/x-meta", lambda: fp4_linear(torch.ones(4, 32, device="meta"), W), ValueError,
     r"^fp4_linear: x: a meta tensor \(a shape without data\)"),
    ("linear/weight-meta", lambda: fp4_linear(X, W.to("meta")), ValueError,
     r"^fp4_linear: weight: a meta tensor"),
    ("linear/x-nested", lambda: fp4_linear(_nested(), W), TypeError,
     r"^fp4_linear: x: a nested tensor; pass its tensors one by one"),
    ("linear/bias-sparse", lambda: fp4_linear(X, W, torch.ones(16).to_sparse()), TypeError,
     r"^fp4_linear: bias: layout torch.sparse_coo; pass a dense tensor"),
    ("linear/bias-numpy", lambda: fp4_linear(X, W, np.ones(16, np.float32)), TypeError,
     r"^fp4_linear: bias must be a torch tensor, got ndarray"),
    ("linear/x-int", lambda: fp4_linear(X.long(), W), TypeError,
     r"^fp4_linear: x has dtype torch.int64; use float32"),
    ("linear/x-float64", lambda: fp4_linear(X.double(), W), TypeError,
     r"^fp4_linear: x has dtype torch.float64"),
    ("linear/weight-complex", lambda: fp4_linear(X, W.to(torch.complex64)), TypeError,
     r"^fp4_linear: weight has dtype torch.complex64"),
    ("linear/x-0d", lambda: fp4_linear(torch.tensor(1.0), W), ValueError,
     r"^fp4_linear: x has shape \(\), expected \(\.\.\., 32\)"),
    ("linear/x-wrong-k", lambda: fp4_linear(torch.ones(4, 48), W), ValueError,
     r"x has shape \(4, 48\), expected \(\.\.\., 32\)"),
    ("linear/weight-1d", lambda: fp4_linear(X, torch.ones(32)), ValueError,
     r"weight must be \(out_features, in_features\)"),
    ("linear/in-features-ragged",
     lambda: fp4_linear(torch.ones(4, 24), torch.ones(16, 24)),
     ValueError, r"in_features=24 is not a multiple of the NVFP4 block size 16"),
    ("linear/out-features-ragged", lambda: fp4_linear(X, torch.ones(20, 32)), ValueError,
     r"out_features=20 is not a multiple"),
    ("linear/bias-shape", lambda: fp4_linear(X, W, torch.ones(1, 16)), ValueError,
     r"bias has shape \(1, 16\), expected \(16,\)"),
    ("linear/rounding", lambda: fp4_linear(X, W, rounding="up"), ValueError,
     r"rounding='up' is not one of"),
    ("linear/grad-rounding", lambda: fp4_linear(X, W, grad_rounding=None), ValueError,
     r"grad_rounding=None is not one of"),
    # (a one-element numpy array compared equal to a rounding, was kept and failed later; a
    # longer one met numpy's "truth value of an array is ambiguous")
    *(
        (f"{where}/{name}-ndarray{len(value)}", functools.partial(call, **{name: value}),
         ValueError, rf"{name}(: |=)array\(")
        for where, call, name in (
            ("linear", functools.partial(fp4_linear, X, W), "rounding"),
            ("linear", functools.partial(fp4_linear, X, W), "grad_rounding"),
            ("FP4Linear", functools.partial(FP4Linear, 16, 16), "rounding"),
            ("FP4Linear", functools.partial(FP4Linear, 16, 16), "grad_rounding"),
            ("ef", ErrorFeedback, "rounding"),
            ("sw", _sw, "rounding"),
        )
        for value in (np.array(["nearest"]), np.array(["nearest", "stochastic"]))
    ),
    ("linear/hadamard-int", lambda: fp4_linear(X, W, hadamard_wgrad=1), TypeError,
     r"hadamard_wgrad is True or False, got 1"),
    ("linear/quantize-backward-str", lambda: fp4_linear(X, W, quantize_backward="no"), TypeError,
     r"quantize_backward is True or False"),
    # -- FP4Linear -----------------------------------------------------------------------
    ("FP4Linear/in-ragged", lambda: FP4Linear(10, 16), ValueError,
     r"in_features=10 is not a positive multiple of 16"),
    ("FP4Linear/in-zero", lambda: FP4Linear(0, 16), ValueError,
     r"in_features=0 is not a positive multiple of 16"),
    ("FP4Linear/out-negative", lambda: FP4Linear(16, -16), ValueError,
     r"out_features=-16 is not a positive multiple"),
    ("FP4Linear/in-float", lambda: FP4Linear(16.0, 16), TypeError,
     r"^FP4Linear: in_features: expected an integer, got float"),
    ("FP4Linear/out-bool", lambda: FP4Linear(16, True), TypeError,
     r"^FP4Linear: out_features: expected an integer, got bool"),
    ("FP4Linear/in-numpy-float", lambda: FP4Linear(np.float64(32), 16), TypeError,
     r"^FP4Linear: in_features: expected an integer, got float64"),
    ("FP4Linear/forward-meta",
     lambda: FP4Linear(32, 16, device="meta")(torch.ones(2, 32, device="meta")),
     ValueError, r"^fp4_linear: x: a meta tensor"),
    ("FP4Linear/bias-str", lambda: FP4Linear(16, 16, bias="yes"), TypeError,
     r"bias is True or False"),
    ("FP4Linear/dtype-int", lambda: FP4Linear(16, 16, dtype=torch.int32), TypeError,
     r"dtype=torch.int32; the master weights are float32, bfloat16 or float16"),
    ("FP4Linear/rounding", lambda: FP4Linear(16, 16, rounding="x"), ValueError,
     r"rounding='x' is not one of"),
    ("FP4Linear/hadamard-str", lambda: FP4Linear(16, 16, hadamard_wgrad="yes"), TypeError,
     r"hadamard_wgrad is True or False"),
    ("FP4Linear/forward-wrong-k", lambda: FP4Linear(16, 16)(torch.ones(3, 32)), ValueError,
     r"x has shape \(3, 32\), expected \(\.\.\., 16\)"),
    ("FP4Linear/from-conv", lambda: FP4Linear.from_linear(torch.nn.Conv1d(16, 16, 1)), TypeError,
     r"from_linear: expected a torch.nn.Linear, got Conv1d"),
    ("FP4Linear/from-ragged-linear",
     lambda: FP4Linear.from_linear(torch.nn.Linear(10, 16)),
     ValueError, r"in_features=10"),
    # (float64 was accepted and failed at the first forward, a LazyLinear met the constructor's
    # "in_features=0", bias= Python's "got multiple values for argument")
    ("FP4Linear/from-float64-linear",
     lambda: FP4Linear.from_linear(torch.nn.Linear(32, 16, dtype=torch.float64)), TypeError,
     r"^FP4Linear.from_linear: linear's weight has dtype torch.float64; .*float32, bfloat16 or "
         r"float16.*linear.float\(\)"),
    ("FP4Linear/from-lazy-linear", lambda: FP4Linear.from_linear(_lazy_linear(16)), ValueError,
     r"^FP4Linear.from_linear: linear is a LazyLinear whose weight is not initialized yet"),
    *(
        (f"FP4Linear/from-linear-{name}",
         functools.partial(FP4Linear.from_linear, torch.nn.Linear(32, 16), **{name: value}),
         TypeError, rf"^FP4Linear.from_linear: {name}: it is linear's")
        for name, value in (("bias", False), ("in_features", 64), ("out_features", 32))
    ),
    ("FP4Linear/extra-state-empty", lambda: FP4Linear(16, 16).set_extra_state({}), ValueError,
     r"extra state: expected \{'step': \.\.\., 'seed': \.\.\.\}"),
    ("FP4Linear/extra-state-negative-step",
     lambda: FP4Linear(16, 16).set_extra_state({"step": -1, "seed": 0}),
     ValueError, r"step must be an int >= 0"),
    # -- ErrorFeedback -------------------------------------------------------------------
    ("ef/fmt", lambda: ErrorFeedback(fmt="fp8"), ValueError, r"^fmt: 'fp8' is not one of"),
    ("ef/fmt-fp4quant", lambda: ErrorFeedback(fmt=fp4_kernels.FP4Quant()), ValueError,
     r"^fmt: FP4Quant.*NVFP4 or MXFP4"),
    ("ef/rounding", lambda: ErrorFeedback(rounding="up"), ValueError, r"^rounding: 'up' is not"),
    ("ef/x-int", lambda: ErrorFeedback().qdq("w", np.arange(32)), TypeError,
     r"^x: dtype int64 is not a real floating-point type"),
    ("ef/x-bool", lambda: ErrorFeedback().qdq("w", torch.ones(32, dtype=torch.bool)), TypeError,
     r"^x: dtype bool is not a real floating-point type"),
    ("ef/x-complex",
     lambda: ErrorFeedback().qdq("w", torch.ones(32, dtype=torch.complex64)),
     TypeError, r"^x: dtype complex64"),
    ("ef/x-list", lambda: ErrorFeedback().qdq("w", [1.0] * 32), TypeError,
     r"^x: expected a torch tensor or a numpy array, got list"),
    ("ef/x-meta", lambda: ErrorFeedback().qdq("w", torch.ones(32, device="meta")), ValueError,
     r"^x: a meta tensor"),
    ("ef/x-nested", lambda: ErrorFeedback().quantize("w", _nested()), TypeError,
     r"^x: a nested tensor"),
    ("ef/x-0d", lambda: ErrorFeedback().qdq("w", torch.tensor(1.0)), ValueError,
     r"^x: a 0-d array has no last dimension"),
    ("ef/x-ragged-k", lambda: ErrorFeedback().qdq("w", torch.ones(4, 10)), ValueError,
     r"^x: last dimension K=10 is not a multiple of the NVFP4 block size 16"),
    ("ef/name-int", lambda: ErrorFeedback().qdq(3, torch.ones(32)), TypeError,
     r"^name: expected a str, got int"),
    ("ef/load-empty", lambda: ErrorFeedback().load_state_dict({}), ValueError,
     r"^state: missing 'fmt', 'rounding', 'seed', 'residuals'; expected the dict that Error"),
    ("ef/load-none", lambda: ErrorFeedback().load_state_dict(None), TypeError,
     r"^state: expected the dict that ErrorFeedback.state_dict\(\) returns, got NoneType"),
    ("ef/load-other-format",
     lambda: ErrorFeedback().load_state_dict(ErrorFeedback(fmt="mxfp4").state_dict()),
     ValueError, r"fmt='mxfp4'"),
    ("ef/load-int-residual",
     lambda: ErrorFeedback().load_state_dict(
             {
                 "fmt": "nvfp4",
                 "rounding": "nearest",
                 "seed": 0,
                 "residuals": {"w": torch.ones(16, dtype=torch.int32)},
             }
         ),
     TypeError, r"^state\['residuals'\]\['w'\]: dtype int32"),
    ("ef/load-negative-step",
     lambda: ErrorFeedback().load_state_dict(
             {"fmt": "nvfp4", "rounding": "nearest", "seed": 0, "residuals": {}, "steps": {"w": -1}}
         ),
     ValueError, r"^state\['steps'\]\['w'\]: -1 is outside"),
    # (a NaN residual made the next output's block NaN; other names and numpy fmt / rounding
    # were kept or met numpy's "truth value of an array is ambiguous")
    ("ef/load-nan-residual", lambda: _ef_load(residuals={"w": torch.full((16,), NAN)}),
     ValueError, r"^state\['residuals'\]\['w'\]: holds NaN or infinite values"),
    ("ef/load-inf-numpy-residual", lambda: _ef_load(residuals={"w": np.full(16, INF, np.float32)}),
     ValueError, r"^state\['residuals'\]\['w'\]: holds NaN or infinite values"),
    ("ef/load-residual-beyond-float32",
     lambda: _ef_load(residuals={"w": np.full(16, 1e300)}),
     ValueError, r"^state\['residuals'\]\['w'\]: holds NaN or infinite values"),
    ("ef/load-int-residual-name", lambda: _ef_load(residuals={3: torch.zeros(16)}), TypeError,
     r"^state\['residuals'\]: name 3 is int; expected the str names"),
    ("ef/load-int-step-name", lambda: _ef_load(steps={3: 1}), TypeError,
     r"^state\['steps'\]: name 3 is int; expected the str names"),
    ("ef/load-fmt-ndarray", lambda: _ef_load(fmt=np.array(["nvfp4", "mxfp4"])), ValueError,
     r"^state\['fmt'\]: array\(.*\) is not one of 'nvfp4', 'mxfp4'"),
    ("ef/load-rounding-ndarray", lambda: _ef_load(rounding=np.array(["nearest"])), ValueError,
     r"^state\['rounding'\]: array\(.*\) is not one of 'nearest', 'stochastic'"),
    ("sw/load-nan-residual-named",
     lambda: _ef_residual_load(torch.full((1024,), NAN)),
     ValueError, r"^state\['error_feedback'\]\['residuals'\]\['param0'\]: holds NaN"),
    # -- FP4StoredWeights ----------------------------------------------------------------
    ("sw/optimizer-list", lambda: FP4StoredWeights([_param(32)]), TypeError,
     r"^optimizer: expected a torch.optim.Optimizer.*torch.optim.SGD\(params"),
    ("sw/rounding", lambda: _sw(rounding="up"), ValueError,
     r"^rounding: 'up' is not one of \('nearest', 'stochastic', 'error_feedback'\)"),
    ("sw/fmt", lambda: _sw(fmt="fp8"), ValueError, r"^fmt: 'fp8' is not one of"),
    ("sw/fmt-fp4quant", lambda: _sw(fmt=fp4_kernels.FP4Quant()), ValueError, r"^fmt: FP4Quant"),
    ("sw/release-str", lambda: _sw(release="no"), TypeError,
     r"^release: expected True or False, got 'no'"),
    ("sw/param-complex", lambda: _sw([_param(32, dtype=torch.complex64)]), TypeError,
     r"^parameter 0 \(shape \(32,\)\) has dtype torch.complex64; FP4 storage holds real"),
    ("sw/param-int", lambda: _sw([torch.ones(32), _param(8, dtype=torch.int64)]), TypeError,
     r"^parameter 1 \(shape \(8,\)\) has dtype torch.int64"),
    ("sw/param-meta", lambda: _sw([torch.nn.Parameter(torch.ones(32, device="meta"))]), ValueError,
     r"^parameter 0: a meta tensor"),
    ("sw/param-nested", lambda: _sw([torch.ones(16), torch.nn.Parameter(_nested())]), TypeError,
     r"^parameter 1: a nested tensor"),
    ("sw/attach-non-module", lambda: _sw().attach("model"), TypeError,
     r"^module: expected a torch.nn.Module, got str"),
    ("sw/load-empty", lambda: _sw().load_state_dict({}), ValueError,
     r"^state: missing 'rounding', .*; expected the dict that FP4StoredWeights.state_dict"),
    ("sw/load-list", lambda: _sw().load_state_dict([]), TypeError,
     r"^state: expected the dict that FP4StoredWeights.state_dict\(\) returns, got list"),
    ("sw/load-other-shape",
     lambda: _sw([_param(16, 32)]).load_state_dict(_sw([_param(32, 16)]).state_dict()),
     ValueError, r"parameter 0 has shape \(16, 32\) here but \(32, 16\) in the state"),
    ("sw/load-other-count",
     lambda: _sw([_param(32)]).load_state_dict(_sw([_param(32), _param(32)]).state_dict()),
     ValueError, r"the state holds 2 parameters, this optimizer has 1"),
    ("sw/load-other-rounding",
     lambda: _sw(rounding="nearest").load_state_dict(_sw(rounding="stochastic").state_dict()),
     ValueError, r"the state has rounding='stochastic', this one 'nearest'"),
    ("sw/load-tampered-scales",
     lambda: _sw().load_state_dict(_tampered(scales=torch.zeros(3, dtype=torch.uint8))),
     ValueError, r"q.scales: shape \(3,\)"),
    ("sw/load-tampered-data-dtype",
     lambda: _sw().load_state_dict(_tampered(data=torch.zeros(512, dtype=torch.int16))),
     TypeError, r"q.data: dtype int16, expected uint8"),
    ("sw/load-tampered-shape", lambda: _sw().load_state_dict(_tampered(shape=(2048,))), ValueError,
     r"state\['packed'\]\[0\]: shape \(2048,\), expected \(1024,\)"),
    ("sw/load-numpy-field",
     lambda: _sw().load_state_dict(_tampered(data=np.zeros(512, np.uint8))),
     TypeError, r"state\['packed'\]\[0\]: data, scales and global_scale must be torch tensors"),
    ("sw/load-missing-residuals",
     lambda: _sw(rounding="error_feedback").load_state_dict(
             {**_sw(rounding="error_feedback").state_dict(), "error_feedback": None}
         ),
     ValueError, r"no 'error_feedback' entry for rounding='error_feedback'"),
    ("sw/load-sgd-into-adamw",
     lambda: _sw_adamw().load_state_dict(_sw().state_dict()),
     ValueError, r"^state\['optimizer'\] was saved by an optimizer of class SGD, but this "
         r"FP4StoredWeights wraps one of class AdamW"),
    # a state without the class name (as a hand-made one): the groups give it away
    ("sw/load-sgd-groups-into-adamw",
     lambda: _sw_adamw().load_state_dict(_without_class(_sw().state_dict())),
     ValueError, r"^state\['optimizer'\] has parameter groups without 'betas', 'eps', which "
         r"AdamW.step\(\) needs.*'momentum'"),
    ("sw/load-adamw-groups-into-sgd",
     lambda: _sw().load_state_dict(_without_class(_sw_adamw().state_dict())),
     ValueError, r"without 'dampening', .*'momentum', .*which SGD.step\(\) needs"),
    ("sw/load-step-count-float",
     lambda: _sw().load_state_dict({**_sw().state_dict(), "step_count": 2.9}),
     TypeError, r"^state\['step_count'\]: expected an integer, got float"),
    ("sw/load-step-count-negative",
     lambda: _sw().load_state_dict({**_sw().state_dict(), "step_count": -7}),
     ValueError, r"^state\['step_count'\]: -7 is negative"),
    ("sw/load-optimizer-list",
     lambda: _sw().load_state_dict({**_sw().state_dict(), "optimizer": [1]}),
     ValueError, r"^state\['optimizer'\]: expected the dict that torch.optim.Optimizer.state_dict"),
    ("sw/forward-without-attach",
     lambda: _unattached_linear()(X),
     RuntimeError, r"^a parameter that FP4StoredWeights released was used.*"
         r"Call FP4StoredWeights.attach\(model\) once.*mat2 must be a matrix"),
    ("sw/released-parameter-updated",
     # (the model held while add_ runs: a dropped wrapper gives its parameters back)
     lambda: (m := _unattached_linear(torch.optim.AdamW)).weight.add_(1.0) and m,
     RuntimeError,
     r"^a parameter that FP4StoredWeights released .*FP4StoredWeights.step\(\), not the "
         r"wrapped optimizer's own step\(\)"),
    ("sw/module-load-assign",
     lambda: _attached_linear().load_state_dict(
             torch.nn.Linear(32, 16).state_dict(), assign=True
         ),
     ValueError, r"load_state_dict\(assign=True\) would replace the parameters"),
    ("linear/in-features-0", lambda: fp4_linear(torch.ones(4, 0), torch.ones(16, 0)),
     ValueError, r"^fp4_linear: in_features is 0 .*torch.nn.functional.linear"),
    ("linear/double-backward", lambda: _double_backward(), RuntimeError,
     r"^fp4_linear: a double backward \(create_graph=True\) is not supported"),
    ("sw/load-shapes-none", lambda: _sw().load_state_dict({**_sw().state_dict(), "shapes": None}),
     TypeError, r"^state\['shapes'\]: expected a list of the parameters' shapes"),
    ("sw/load-shapes-ints", lambda: _sw().load_state_dict({**_sw().state_dict(), "shapes": [32]}),
     TypeError, r"^state\['shapes'\]: expected a list"),
    ("sw/load-packed-none", lambda: _sw().load_state_dict({**_sw().state_dict(), "packed": None}),
     TypeError, r"^state\['packed'\]: expected a list of the packed parameters' fields"),
    ("sw/load-packed-entry-none",
     lambda: _sw().load_state_dict({**_sw().state_dict(), "packed": [None]}),
     TypeError, r"^state\['packed'\]: expected a list"),
    ("sw/load-packed-without-shape", lambda: _sw().load_state_dict(_packed_without("shape")),
     TypeError, r"^state\['packed'\]: expected a list"),
    ("sw/load-packed-data-meta", lambda: _sw().load_state_dict(_packed_data_on_meta()),
     TypeError, r"^state\['packed'\]\[0\]: data, scales and global_scale must be torch "
         r"tensors holding values"),
    ("sw/load-residual-wrong-shape", lambda: _ef_residual_load(torch.ones(5)), ValueError,
     r"^state\['error_feedback'\]\['residuals'\]\['param0'\]: shape \(5,\), expected "
         r"\(1024,\)"),
    ("sw/load-residual-unknown-name", lambda: _ef_residual_load(torch.ones(1024), "param7"),
     ValueError, r"^state\['error_feedback'\]\['residuals'\]\['param7'\]: no such parameter"),
    ("sw/wrap-twice", lambda: _wrapped_twice(release=True), ValueError,
     r"^optimizer: it is wrapped by an FP4StoredWeights already"),
    ("sw/wrap-twice-kept", lambda: _wrapped_twice(release=False), ValueError,
     r"^optimizer: it is wrapped by an FP4StoredWeights already"),
    ("sw/parameter-of-another", lambda: _parameter_of_another(), ValueError,
     r"^parameter 0 is stored in FP4 by another FP4StoredWeights"),
    ("sw/group-added-after-wrapping", lambda: _group_added_then_step(), ValueError,
     r"^step: the wrapped optimizer's parameters changed .*\(1 then, 2 now: add_param_group\?\)"),
    ("ef/load-residuals-none",
     lambda: ErrorFeedback().load_state_dict({**ErrorFeedback().state_dict(), "residuals": None}),
     TypeError, r"^state\['residuals'\]: expected a dict of name -> value"),
    ("ef/load-residuals-list",
     lambda: ErrorFeedback().load_state_dict({**ErrorFeedback().state_dict(), "residuals": [1]}),
     TypeError, r"^state\['residuals'\]: expected a dict"),
    ("ef/load-steps-none",
     lambda: ErrorFeedback().load_state_dict({**ErrorFeedback().state_dict(), "steps": None}),
     TypeError, r"^state\['steps'\]: expected a dict"),
    ("sw/module-load-wrong-shape",
     lambda: _attached_linear().load_state_dict(torch.nn.Linear(16, 32).state_dict()),
     RuntimeError,
     r"size mismatch for weight: copying a param with shape torch.Size\(\[32, 16\]\)"),
]  # fmt: skip
REJECTED = [pytest.param(call, error, message, id=case) for case, call, error, message in _CASES]


def _double_backward():
    """A gradient penalty through fp4_linear (the input gradient built with create_graph)."""
    x = torch.randn(4, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    torch.autograd.grad(fp4_linear(x, w).sum(), x, create_graph=True)


def _packed_without(key):
    state = _sw().state_dict()
    state["packed"][0] = {k: v for k, v in state["packed"][0].items() if k != key}
    return state


def _packed_data_on_meta():
    state = _sw().state_dict()
    state["packed"][0] = {**state["packed"][0], "data": state["packed"][0]["data"].to("meta")}
    return state


def _lazy_linear(out_features):
    import warnings

    with warnings.catch_warnings():  # torch's "lazy modules are a new feature" warning
        warnings.simplefilter("ignore")
        return torch.nn.LazyLinear(out_features)


def _ef_load(**entries):
    """``ErrorFeedback().load_state_dict`` of a valid state with ``entries`` replaced."""
    ErrorFeedback().load_state_dict({**ErrorFeedback().state_dict(), **entries})


def _ef_residual_load(residual, name="param0"):
    state = _sw(rounding="error_feedback").state_dict()
    state["error_feedback"] = {**state["error_feedback"], "residuals": {name: residual}}
    _sw(rounding="error_feedback").load_state_dict(state)


def _wrapped_twice(release):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.randn(32))], lr=0.1)
    first = FP4StoredWeights(opt, release=release)
    FP4StoredWeights(opt)
    return first


def _parameter_of_another():
    p = torch.nn.Parameter(torch.randn(32))
    first = FP4StoredWeights(torch.optim.SGD([p], lr=0.1))
    FP4StoredWeights(torch.optim.SGD([p], lr=0.1))
    return first


def _group_added_then_step():
    s = _sw([torch.nn.Parameter(torch.randn(32))])
    s.optimizer.add_param_group({"params": [torch.nn.Parameter(torch.randn(16))]})
    s.step()


def _bad_counter_values(name, bits, negative, too_large, too_large_id, hint=""):
    """Every entry point that takes the stochastic-rounding seed or step checks it alike: an int
    (not a bool) in [0, 2**bits), the message naming the argument (after the entry point's name
    where it gives one).  (bad value, exception type, message regex, id)"""
    outside = rf"is outside \[0, 2\*\*{bits}\)"
    return [
        (negative, ValueError, rf"{name}: {negative} {outside}{hint}", "negative"),
        (too_large, ValueError, rf"{name}: {too_large} {outside}", too_large_id),
        *(
            (value, TypeError, rf"{name}: expected an integer, got {type(value).__name__}",
             type(value).__name__)
            for value in (1.5, "3", True)
        ),
    ]  # fmt: skip


BAD_SEEDS = _bad_counter_values("seed", 64, -1, 2**64, "too-large")
BAD_STEPS = _bad_counter_values("step", 32, -5, 2**40, "2**40", hint=r".*modulo 2\*\*32")
# id prefix -> (the call taking the argument as a keyword, the message's prefix)
SEED_TAKERS = {
    "linear": (lambda **kw: fp4_linear(X, W, **kw), "fp4_linear: "),
    "FP4Linear": (lambda **kw: FP4Linear(16, 16, **kw), "FP4Linear: "),
    "ef": (ErrorFeedback, ""),
    "sw": (_sw, ""),
}
STEP_TAKERS = {
    "linear": (lambda **kw: fp4_linear(X, W, **kw), "fp4_linear: "),
    "ef/qdq": (lambda **kw: ErrorFeedback().qdq("w", torch.ones(32), **kw), ""),
    "ef/quantize": (lambda **kw: ErrorFeedback().quantize("w", torch.ones(32), **kw), ""),
}
REJECTED += [
    pytest.param(
        functools.partial(call, **{name: value}),
        error,
        f"^{re.escape(prefix)}{message}",
        id=f"{where}/{name}-{label}",
    )
    for name, takers, bad in (("seed", SEED_TAKERS, BAD_SEEDS), ("step", STEP_TAKERS, BAD_STEPS))
    for where, (call, prefix) in takers.items()
    for value, error, message, label in bad
]


def _nested():
    return torch.nested.nested_tensor([torch.ones(2, 32), torch.ones(3, 32)], layout=torch.jagged)


def _tampered(**fields):
    state = _sw().state_dict()
    state["packed"][0].update(fields)
    return state


def _attached_linear():
    model = torch.nn.Linear(32, 16)
    FP4StoredWeights(torch.optim.SGD(model.parameters(), lr=0.1)).attach(model)
    return model


def _unattached_linear(optimizer=torch.optim.SGD):
    model = torch.nn.Linear(32, 16)
    model.fp4 = FP4StoredWeights(optimizer(model.parameters(), lr=0.1))  # kept alive, no attach
    return model


def _sw_adamw(**kw):
    return FP4StoredWeights(torch.optim.AdamW([_param(32, 32)], lr=0.1), **kw)


def _without_class(state):
    return {k: v for k, v in state.items() if k != "optimizer_class"}


@pytest.mark.parametrize("call, error, message", REJECTED)
def test_rejected(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_the_corpus_covers_every_public_name():
    import fp4_train

    covered = {case.id.split("/")[0] for case in REJECTED}
    prefixes = {
        "ErrorFeedback": "ef",
        "FP4Linear": "FP4Linear",
        "FP4StoredWeights": "sw",
        "fp4_linear": "linear",
        "fp4_gemm": "gemm",
    }
    public = set(fp4_train.__all__) - {"__version__", "NativeGemmUnavailable"}
    assert public == set(prefixes)
    assert {prefixes[name] for name in public} <= covered


# -- documented policies for inputs that are accepted ----------------------------------------


def test_policy_gemm_nan_and_inf_propagate_like_a_gemm():
    # a non-finite element makes its block decode to NaN (fp4_kernels), and a NaN operand
    # element makes every product it takes part in NaN: row 0 of a @ b^T, nothing else
    x = torch.randn(4, 64)
    x[0, 3], x[0, 40] = NAN, INF
    a, b = fp4_kernels.quantize(x), _q(rows=5)
    out = fp4_gemm(a, b)
    assert bool(out[0].isnan().all()) and bool(out[1:].isfinite().all())


@pytest.mark.parametrize("m, n", [(0, 5), (3, 0), (0, 0)])
def test_policy_gemm_of_empty_operands_is_empty(m, n):
    a, b = fp4_kernels.quantize(torch.randn(m, 64)), fp4_kernels.quantize(torch.randn(n, 64))
    assert fp4_gemm(a, b).shape == (m, n)


def test_policy_gemm_mxfp4_tensor_scale_may_be_none():
    a, b = _q(fmt="mxfp4"), _q(rows=3, fmt="mxfp4")
    assert torch.equal(fp4_gemm(_with(a, global_scale=None), b), fp4_gemm(a, b))


def test_policy_linear_nan_propagates_as_in_full_precision():
    x = torch.randn(4, 32)
    x[1, 5] = NAN
    y = fp4_linear(x, W)
    assert bool(y[1].isnan().all()) and bool(y[[0, 2, 3]].isfinite().all())


def test_policy_linear_empty_batch_gives_empty_output_and_zero_gradients():
    x = torch.zeros(0, 32, requires_grad=True)
    w = W.clone().requires_grad_()
    y = fp4_linear(x, w, hadamard_wgrad=True)
    assert y.shape == (0, 16)
    y.sum().backward()
    assert x.grad.shape == (0, 32) and torch.equal(w.grad, torch.zeros_like(w))


def test_policy_linear_non_contiguous_operands_give_the_contiguous_result():
    xt, wt = torch.randn(32, 4), torch.randn(32, 16)
    assert torch.equal(
        fp4_linear(xt.t(), wt.t()), fp4_linear(xt.t().contiguous(), wt.t().contiguous())
    )


def test_policy_fp4linear_step_counter_wraps_at_2_32():
    layer = FP4Linear(16, 16, rounding="stochastic")
    layer.set_extra_state({"step": 2**32 + 5, "seed": 0})
    x = torch.randn(3, 16)
    y = layer(x)
    expected = fp4_linear(x, layer.weight, layer.bias, rounding="stochastic", step=5)
    assert torch.equal(y, expected)


def test_policy_error_feedback_accepts_non_contiguous_and_non_native_arrays():
    x = np.random.default_rng(0).standard_normal((32, 4)).astype(np.float32)
    plain = ErrorFeedback().qdq("w", np.ascontiguousarray(x.T))
    assert np.array_equal(ErrorFeedback().qdq("w", x.T), plain)
    swapped = ErrorFeedback().qdq("w", np.ascontiguousarray(x.T).astype(">f4"))
    assert swapped.dtype == np.dtype(">f4") and np.array_equal(swapped.astype(np.float32), plain)


def test_policy_error_feedback_float64_is_rounded_to_float32_first():
    x = np.random.default_rng(1).standard_normal(64)
    y = ErrorFeedback().qdq("w", x)
    assert y.dtype == np.float64
    assert np.array_equal(y, ErrorFeedback().qdq("w", x.astype(np.float32)).astype(np.float64))


def test_policy_error_feedback_non_finite_block_restarts_its_residual():
    # MXFP4: blocks have no shared tensor scale, so block 0 can be compared on its own
    ef = ErrorFeedback(fmt="mxfp4")
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(2))
    ef.qdq("g", x)  # a finite residual in both blocks
    bad = x.clone()
    bad[0, 4] = INF
    y = ef.qdq("g", bad)
    assert bool(y[0].isnan().all()) and bool(y[1].isfinite().all())
    r = ef.residual("g")
    assert torch.equal(r[0], torch.zeros(32)) and bool(r[1].ne(0).any())
    # the next step is finite again, block 0 as from a fresh start
    nxt = ef.qdq("g", x)
    assert bool(nxt.isfinite().all())
    assert torch.equal(nxt[0], ErrorFeedback(fmt="mxfp4").qdq("g", x)[0])


def test_policy_negative_views_give_the_values_they_stand_for():
    # torch._neg_view (what conj() of a real view can give): a lazy negation, accepted as the
    # negated values (fp4_kernels' kernels read memory, which holds the values un-negated)
    x = torch.linspace(-3, 5, 4 * 32).view(4, 32)
    neg, plain = torch._neg_view(x), -x
    assert neg.is_neg()
    assert torch.equal(fp4_linear(neg, W), fp4_linear(plain, W))
    assert torch.equal(fp4_linear(plain, torch._neg_view(W)), fp4_linear(plain, -W))
    for method in ("qdq", "quantize"):
        a, b = (
            getattr(ErrorFeedback(), method)("x", neg),
            getattr(ErrorFeedback(), method)("x", plain),
        )
        assert torch.equal(a, b) if method == "qdq" else torch.equal(a.data, b.data)
    p = torch.nn.Parameter(x.clone())
    w = torch.nn.Parameter(W.clone())
    fp4_linear(torch._neg_view(p), torch._neg_view(w)).sum().backward()
    q, v = torch.nn.Parameter(x.clone()), torch.nn.Parameter(W.clone())
    fp4_linear(-q, -v).sum().backward()
    assert torch.equal(p.grad, q.grad) and torch.equal(w.grad, v.grad)


def test_policy_fp4linear_takes_numpy_integers():
    layer = FP4Linear(np.int64(32), np.int32(16))
    assert type(layer.in_features) is int and type(layer.out_features) is int
    assert layer(X).shape == (4, 16)


def test_policy_fp4linear_and_linear_state_dicts():
    # nn.Linear -> FP4Linear loads strictly and keeps the counters; the other way nn.Linear
    # does not know _extra_state (documented: strict=False, or drop the key)
    plain, layer = torch.nn.Linear(32, 16), FP4Linear(32, 16, seed=7)
    layer.step = 5
    layer.load_state_dict(plain.state_dict())  # strict
    assert torch.equal(layer.weight, plain.weight) and torch.equal(layer.bias, plain.bias)
    assert layer.get_extra_state() == {"step": 5, "seed": 7}
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), FP4Linear(32, 16))
    model.load_state_dict(torch.nn.Sequential(torch.nn.Linear(32, 32), plain).state_dict())
    with pytest.raises(RuntimeError, match="Unexpected key.*_extra_state"):
        torch.nn.Linear(32, 16).load_state_dict(layer.state_dict())
    back = torch.nn.Linear(32, 16)
    assert back.load_state_dict(layer.state_dict(), strict=False).unexpected_keys == [
        "_extra_state"
    ]
    assert torch.equal(back.weight, layer.weight)
    # a missing weight is still missing
    with pytest.raises(RuntimeError, match='Missing key.*"weight"'):
        FP4Linear(32, 16).load_state_dict({"bias": plain.bias})


@pytest.mark.parametrize(
    "entries",
    [
        {"residuals": {"w": torch.full((16,), NAN)}},
        {"residuals": {"w": torch.zeros(16), 3: torch.zeros(16)}},
        {"steps": {"w": 1, 3: 1}},
        {"rounding": np.array(["nearest"])},
    ],
    ids=["nan", "int-name", "int-step-name", "rounding-ndarray"],
)
def test_a_refused_error_feedback_state_changes_nothing(entries):
    ef = ErrorFeedback(seed=5)
    x = torch.linspace(-1, 1, 16)
    ef.qdq("w", x)
    before = ef.state_dict()
    good = {**before, "seed": 9, "residuals": {"w": torch.ones(16)}, "steps": {"w": 4}}
    with pytest.raises((TypeError, ValueError)):
        ef.load_state_dict({**good, **entries})
    assert _same(ef.state_dict(), before)


def test_policy_failed_error_feedback_call_changes_no_step():
    ef = ErrorFeedback(rounding="stochastic", seed=3)
    with pytest.raises(ValueError, match="not a multiple of the NVFP4 block size"):
        ef.qdq("w", torch.ones(3))  # fp4_kernels refuses K = 3, after ErrorFeedback's checks
    with pytest.raises(ValueError, match="not a multiple of the NVFP4 block size"):
        ef.quantize("w", torch.ones(3))
    assert ef.state_dict()["steps"] == {} and "w" not in ef
    x = torch.linspace(-1, 1, 32)
    assert torch.equal(ef.qdq("w", x), ErrorFeedback(rounding="stochastic", seed=3).qdq("w", x))


def test_policy_stored_weights_empty_and_float64_parameters():
    empty, wide = _param(0, 4), torch.nn.Parameter(torch.randn(3, 5, dtype=torch.float64))
    w0 = wide.detach().clone()
    opt = _sw([empty, wide], rounding="nearest", release=False)
    assert empty.shape == (0, 4) and wide.dtype == torch.float64 and wide.shape == (3, 5)
    # stored as float32 in FP4: 15 weights padded to one NVFP4 block
    flat = torch.nn.functional.pad(w0.reshape(-1).float(), (0, 1))
    expected = fp4_kernels.quantize_dequantize(flat)[:15].view(3, 5).double()
    assert torch.equal(wide.detach(), expected)
    assert opt.memory_report()["parameters"] == 15


def test_policy_stored_weights_nan_weight_makes_its_block_nan():
    w = torch.randn(2, 16)
    w[0, 3] = NAN
    p = torch.nn.Parameter(w)
    _sw([p], rounding="nearest", release=False)
    assert bool(p[0].isnan().all()) and bool(p[1].isfinite().all())


def _trained(opt, model, steps=2):
    for i in range(steps):
        opt.zero_grad()
        model(torch.linspace(-1, 1, 64).view(2, 32) * (i + 1)).square().sum().backward()
        opt.step()
    return opt


def _snapshot(opt):
    """Every part of ``opt``'s state, as nested plain values and tensors."""
    return opt.state_dict(), [(p.dtype, tuple(p.shape), type(p)) for p in opt.params]


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _ef_pair(optimizer=torch.optim.AdamW):
    """Two error-feedback FP4StoredWeights over models of one shape, trained 1 and 3 steps."""
    models = [torch.nn.Linear(32, 16) for _ in range(2)]
    opts = []
    for model, steps in zip(models, (1, 3), strict=True):
        opt = FP4StoredWeights(optimizer(model.parameters(), lr=0.05), rounding="error_feedback")
        opt.attach(model)
        opts.append(_trained(opt, model, steps))
    return models, opts


def _adamw_state_of_shapes(*shapes):
    """The AdamW state (two steps) of parameters of ``shapes``."""
    params = [_param(*shape) for shape in shapes]
    opt = FP4StoredWeights(torch.optim.AdamW(params, lr=0.05), rounding="error_feedback",
                           release=False)  # fmt: skip
    for _ in range(2):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    return opt.state_dict()["optimizer"]


@pytest.mark.parametrize(
    "corrupt",
    [
        # each passes every check before the optimizer part, which torch or FP4StoredWeights
        # then refuses: the residuals, seed and step count had been replaced by then
        lambda s: {**s, "optimizer": {**s["optimizer"], "param_groups": []}},
        lambda s: {**s, "optimizer_class": "SGD"},
        lambda s: {**_without_class(s), "optimizer": _ef_pair(torch.optim.SGD)[1][1]
                   .state_dict()["optimizer"]},
        lambda s: {**s, "optimizer": None},
        # Adam's moments of another model's parameters: torch loads them, and step() raised
        # after it had counted the step
        lambda s: {**s, "optimizer": _adamw_state_of_shapes((32, 16), (16,))},
    ],
    ids=["group-count", "class", "sgd-groups", "none", "moment-shapes"],
)  # fmt: skip
def test_failed_load_leaves_the_stored_weights_unchanged(corrupt):
    (model, _), (opt, other) = _ef_pair()
    bad = corrupt(other.state_dict())
    assert bad["step_count"] != opt.step_count
    before = _snapshot(opt)
    with pytest.raises(ValueError):
        opt.load_state_dict(bad)
    assert _same(_snapshot(opt), before)
    _trained(opt, model, steps=1)  # and it trains on


def _momentum_of_another_shape():
    a, b = (_param(32, 32), _param(32)), (_param(32, 32), _param(16))
    for p in a + b:
        p.grad = torch.ones_like(p)
    sw = _sw(list(a), release=False)
    sw.optimizer.param_groups[0]["momentum"] = 0.9
    other = _sw(list(b))
    other.optimizer.param_groups[0]["momentum"] = 0.9
    other.step()
    return sw, {**sw.state_dict(), "optimizer": other.state_dict()["optimizer"]}


def test_a_momentum_of_another_shape_is_refused_at_load():
    # torch loads it; step() then updated parameter 0's momentum and raised at parameter 1's
    sw, state = _momentum_of_another_shape()
    with pytest.raises(ValueError, match=r"^state\['optimizer'\]: parameter 1 has shape \(32,\) "
                                         r"but its momentum_buffer \(16,\)"):  # fmt: skip
        sw.load_state_dict(state)
    assert sw.optimizer.state_dict()["state"] == {}
    sw.step()  # as before the refused load


class _ProjectedMoments(torch.optim.Optimizer):
    """An optimizer of another library, without 'differentiable' in its defaults, that keeps
    exp_avg in a shape of its own (as low-rank projections do)."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                s = self.state[p]
                s["exp_avg"] = s.get("exp_avg", torch.zeros(2)) + p.grad.sum()
                p.sub_(group["lr"] * s["exp_avg"].mean())


@pytest.mark.parametrize("optimizer", [_ProjectedMoments, torch.optim.Adafactor])
def test_the_state_of_an_optimizer_without_differentiable_in_its_groups_loads(optimizer):
    # torch's load adds 'differentiable' to the optimizer's defaults, not to its groups: the
    # check for another optimizer's groups took it for a missing hyperparameter.  The factored
    # Adafactor moments, and an exp_avg of its own shape in an optimizer that is not torch's,
    # are loaded as they are (the shape check covers torch's optimizers only)
    models = [torch.nn.Linear(32, 16) for _ in range(2)]
    opts = [FP4StoredWeights(optimizer(m.parameters())) for m in models]
    for opt, model in zip(opts, models, strict=True):
        opt.attach(model)
    _trained(opts[0], models[0])
    for _ in range(2):  # and again, with 'differentiable' in the defaults now
        opts[1].load_state_dict(opts[0].state_dict())
    _trained(opts[1], models[1], steps=1)


def test_a_refused_sgd_state_leaves_adamw_working():
    (model, _), (opt, _) = _ef_pair()
    sgd_state = _ef_pair(torch.optim.SGD)[1][1].state_dict()
    with pytest.raises(ValueError, match="which AdamW.step"):
        opt.load_state_dict(_without_class(sgd_state))
    _trained(opt, model, steps=1)  # before the check: KeyError: 'betas'


# -- the CUDA path ----------------------------------------------------------------------------

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)"
)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("field", ["scales", "global_scale"])
def test_gpu_gemm_field_on_another_device_is_rejected(field):
    q = fp4_kernels.quantize(torch.randn(4, 64, device="cuda"))
    bad = _with(q, **{field: getattr(q, field).cpu()})
    with pytest.raises(
        ValueError, match=rf"^a.{field}: lives on cpu but the operand's data on cuda"
    ):
        fp4_gemm(bad, q)


@pytest.mark.gpu
@requires_cuda
def test_gpu_gemm_operands_on_cpu_and_cuda_are_rejected():
    with pytest.raises(ValueError, match="different devices or libraries: cuda:0 vs cpu"):
        fp4_gemm(fp4_kernels.quantize(torch.randn(4, 64, device="cuda")), Q)


@pytest.mark.gpu
@requires_cuda
def test_gpu_module_state_dict_loads_into_a_cpu_model():
    model = torch.nn.Linear(32, 20, device="cuda")
    opt = FP4StoredWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.attach(model)
    state = {k: v.cpu() for k, v in model.state_dict().items()}
    assert model.weight.numel() == 0  # released again after saving
    plain = torch.nn.Linear(32, 20)
    plain.load_state_dict(state)
    opt.materialize()
    assert torch.equal(plain.weight, model.weight.cpu())
    assert torch.equal(plain.bias, model.bias.cpu())


# ------------------------------------------------------------------ gemm and linear (more)


@pytest.mark.parametrize("lib", ["torch", "numpy"])
@pytest.mark.parametrize("value", [-1.0, 0.0, float("nan"), float("inf")])
def test_fp4_gemm_refuses_an_nvfp4_tensor_scale_dequantize_refuses(lib, value):
    """fp4_gemm swaps the tensor scales out of its operands before decoding them, so the check
    dequantize makes of a scale never ran: a negative scale gave -(a @ b^T), 0 zeros, NaN NaN."""
    import dataclasses

    import fp4_kernels
    from fp4_train import fp4_gemm

    x, y = torch.randn(4, 64), torch.randn(3, 64)
    if lib == "numpy":
        x, y = x.numpy(), y.numpy()
    a, b = fp4_kernels.quantize(x), fp4_kernels.quantize(y)
    bad = dataclasses.replace(a, global_scale=a.global_scale * 0 + value)
    with pytest.raises(ValueError, match=r"a.global_scale: .* positive and finite"):
        fp4_gemm(bad, b)
    with pytest.raises(ValueError, match=r"b.global_scale: .* positive and finite"):
        fp4_gemm(b, dataclasses.replace(bad, shape=bad.shape))


def test_native_supported_answers_for_any_device():
    from fp4_train.gemm import native_supported

    assert native_supported("cpu") is False and native_supported(torch.device("cpu")) is False
    if not torch.cuda.is_available():
        assert native_supported("cuda") is False and native_supported(0) is False
    with pytest.raises(TypeError, match="device: a torch.device"):
        native_supported(None)


def test_fp4_linear_names_a_missing_input_or_weight():
    from fp4_train import fp4_linear

    with pytest.raises(TypeError, match="fp4_linear: weight must be a torch tensor, got None"):
        fp4_linear(torch.randn(4, 32), None)
    with pytest.raises(TypeError, match="fp4_linear: x must be a torch tensor, got None"):
        fp4_linear(None, torch.randn(16, 32))


def test_from_linear_refuses_a_dtype_or_device_it_would_ignore():
    from fp4_train import FP4Linear

    lin = torch.nn.Linear(32, 16)
    for option in ({"dtype": torch.float16}, {"device": "meta"}):
        with pytest.raises(TypeError, match="convert linear first"):
            FP4Linear.from_linear(lin, **option)
