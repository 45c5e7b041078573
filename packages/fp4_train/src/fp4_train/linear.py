"""``FP4Linear`` and ``fp4_linear``: a linear layer whose three GEMMs run on NVFP4 operands.

Forward, y = x W^T + b: x and W are quantized to NVFP4 along in_features (K) and multiplied
by ``fp4_gemm``.  Backward, with the straight-through estimator (the quantizer's derivative
taken as the identity), as NVIDIA's NVFP4 training recipe does it:

- dgrad, dx = dy W: dy quantized along out_features (N), W re-quantized along N (W^T);
- wgrad, dW = dy^T x: dy^T and x^T quantized along the tokens (M, zero-padded to whole
  blocks: zero rows add nothing to the product);
- the gradient operand dy rounded stochastically by default (``grad_rounding``), so that the
  gradient is unbiased in expectation;
- optionally a random Hadamard transform on the wgrad operands (``hadamard_wgrad``): both dy^T
  and x^T are multiplied by the same orthogonal H = diag(signs) H_16 / 4 over each group of 16
  tokens, which leaves dy^T x unchanged in exact arithmetic (H H^T = I) and spreads outliers
  over their group before the quantization.

The master weights stay in full precision (the module's ``weight`` parameter); only the GEMM
operands are quantized.  ``quantize_backward=False`` keeps the straight-through estimator but
computes both backward GEMMs in full precision from the forward's dequantized operands.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

import fp4_kernels
from fp4_kernels.formats import e2m1

from .error_feedback import (
    STEP_LIMIT,
    check_integer,
    check_seed,
    check_step,
    check_storage,
    philox_key,
)
from .gemm import fp4_gemm

BLOCK = fp4_kernels.FORMATS["nvfp4"]  # 16
HADAMARD_GROUP = 16  # tokens per Hadamard group on the wgrad path, one NVFP4 block
ROUNDINGS = e2m1.ROUNDINGS
#: the dtypes of x, of the master weights and of the bias
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _quantize(t, rounding, seed, step):
    kw = {"seed": seed, "step": step % 2**32} if rounding == "stochastic" else {}
    return fp4_kernels.quantize(t.contiguous(), "nvfp4", rounding, **kw)


def _pad_last(t, multiple):
    pad = -t.shape[-1] % multiple
    return torch.nn.functional.pad(t, (0, pad)) if pad else t


class _FP4LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias, options):
        rounding, grad_rounding, quantize_backward, hadamard_wgrad, seed, step = options
        qx = _quantize(x2d, rounding, philox_key(seed, "x"), step)
        qw = _quantize(weight, rounding, philox_key(seed, "weight"), step)
        y = fp4_gemm(qx, qw)
        if bias is not None:
            y = y + bias.float()
        ctx.options = options
        ctx.has_bias = bias is not None
        if quantize_backward:
            ctx.save_for_backward(x2d, weight)
        else:  # the straight-through estimator through the forward's quantized operands
            ctx.save_for_backward(
                fp4_kernels.dequantize(qx, dtype=torch.float32),
                fp4_kernels.dequantize(qw, dtype=torch.float32),
            )
        ctx.dtypes = (x2d.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y.to(x2d.dtype)

    @staticmethod
    def backward(ctx, dy):
        if torch.is_grad_enabled():  # create_graph=True: its result would miss the quantized
            # GEMMs' own derivatives (a gradient penalty through it would silently drop them)
            raise RuntimeError(
                "fp4_linear: a double backward (create_graph=True) is not supported: the "
                "gradients of its quantized GEMMs are not differentiable"
            )
        rounding, grad_rounding, quantize_backward, hadamard_wgrad, seed, step = ctx.options
        x2d, weight = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        dy = dy.contiguous()
        grad_x = grad_w = grad_b = None
        if not quantize_backward:
            dy32 = dy.float()
            if ctx.needs_input_grad[0]:
                grad_x = (dy32 @ weight).to(x_dtype)
            if ctx.needs_input_grad[1]:
                grad_w = (dy32.t() @ x2d).to(w_dtype)
        else:
            if ctx.needs_input_grad[0]:
                qdy = _quantize(dy, grad_rounding, philox_key(seed, "dgrad"), step)
                qwt = _quantize(weight.t(), "nearest", 0, step)
                grad_x = fp4_gemm(qdy, qwt).to(x_dtype)
            if ctx.needs_input_grad[1]:
                dyt = _pad_last(dy.t(), BLOCK)
                xt = _pad_last(x2d.t(), BLOCK)
                if hadamard_wgrad:  # the same orthogonal transform of both operands
                    signs = philox_key(seed, "hadamard")
                    dyt = fp4_kernels.hadamard(
                        dyt.float().contiguous(), group_size=HADAMARD_GROUP, signs=signs
                    )
                    xt = fp4_kernels.hadamard(
                        xt.float().contiguous(), group_size=HADAMARD_GROUP, signs=signs
                    )
                qdyt = _quantize(dyt, grad_rounding, philox_key(seed, "wgrad"), step)
                qxt = _quantize(xt, "nearest", 0, step)
                grad_w = fp4_gemm(qdyt, qxt).to(w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = dy.float().sum(0).to(b_dtype)
        return grad_x, grad_w, grad_b, None


def _check(x, weight, bias):
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is None and name != "bias":
            raise TypeError(f"fp4_linear: {name} must be a torch tensor, got None")
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(
                f"fp4_linear: {name} must be a torch tensor, got {type(t).__name__} "
                "(torch.from_numpy converts a numpy array)"
            )
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None:
            check_storage(t, f"fp4_linear: {name}")
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in DTYPES:
            raise TypeError(
                f"fp4_linear: {name} has dtype {t.dtype}; use float32, bfloat16 or float16"
            )
    if weight.dim() != 2:
        raise ValueError(
            f"fp4_linear: weight must be (out_features, in_features), got {tuple(weight.shape)}"
        )
    out_features, in_features = weight.shape
    if in_features == 0:
        raise ValueError(
            "fp4_linear: in_features is 0 (weight of shape "
            f"{tuple(weight.shape)}): there is no product to quantize; use torch.nn.functional."
            "linear, whose result is the bias alone"
        )
    for name, n in (("in_features", in_features), ("out_features", out_features)):
        if n % BLOCK:
            raise ValueError(
                f"fp4_linear: {name}={n} is not a multiple of the NVFP4 block size {BLOCK} "
                "(the GEMMs contract over it)"
            )
    if x.dim() < 1 or x.shape[-1] != in_features:
        raise ValueError(
            f"fp4_linear: x has shape {tuple(x.shape)}, expected (..., {in_features}) for a weight "
            f"of shape {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ValueError(
            f"fp4_linear: bias has shape {tuple(bias.shape)}, expected ({out_features},)"
        )
    devices = {t.device for t in (x, weight, bias) if t is not None}
    if len(devices) > 1:
        raise ValueError(
            f"fp4_linear: x, weight and bias are on different devices: {sorted(map(str, devices))}"
        )


def fp4_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    rounding: Literal["nearest", "stochastic"] = "nearest",
    grad_rounding: Literal["nearest", "stochastic"] = "stochastic",
    quantize_backward: bool = True,
    hadamard_wgrad: bool = False,
    seed: int = 0,
    step: int = 0,
) -> torch.Tensor:
    """``x @ weight^T + bias`` with NVFP4 operands in the forward and backward GEMMs.

    Args:
        x: (..., in_features), float32 / bfloat16 / float16; the output has x's dtype.
        weight: (out_features, in_features), both multiples of 16 (the full-precision master).
        bias: (out_features,) or None; added in float32.
        rounding: how the forward operands x and W are rounded ("nearest" or "stochastic").
        grad_rounding: how the output gradient dy is rounded in the backward GEMMs
            ("stochastic", the recipe's choice, or "nearest").
        quantize_backward: run dgrad and wgrad on NVFP4 operands (True) or in full precision
            with the forward's dequantized x and W (False).
        hadamard_wgrad: apply the random Hadamard transform (``fp4_kernels.hadamard``, signs
            drawn from ``seed``) to both wgrad operands over groups of 16 tokens.
        seed, step: stochastic rounding's seed, an int in [0, 2**64), and counter, an int in
            [0, 2**32) (pass the training step modulo 2**32).

    Non-finite values: a NaN or infinity in x or weight makes its NVFP4 block decode to NaN,
    so every output it takes part in is NaN, as in ``torch.nn.functional.linear``.  An empty
    batch (x of shape (0, in_features)) gives an empty output.

    Autograd: first derivatives (straight-through, above).  A backward that builds a graph of
    its own (``create_graph=True``, as a gradient penalty does) raises RuntimeError: the
    quantized GEMMs' gradients are not differentiable, and a result without their derivatives
    would be silently wrong.
    """
    for name, value in (("rounding", rounding), ("grad_rounding", grad_rounding)):
        if not isinstance(value, str) or value not in ROUNDINGS:
            raise ValueError(f"fp4_linear: {name}={value!r} is not one of {ROUNDINGS}")
    _check(x, weight, bias)
    for name, flag in (
        ("hadamard_wgrad", hadamard_wgrad),
        ("quantize_backward", quantize_backward),
    ):
        if not isinstance(flag, bool):
            raise TypeError(f"fp4_linear: {name} is True or False, got {flag!r}")
    seed = check_seed(seed, "fp4_linear: seed")
    step = check_step(step, "fp4_linear: step")
    # negative views (lazy negations) as the values they stand for; autograd goes through
    x, weight = x.resolve_neg(), weight.resolve_neg()
    bias = None if bias is None else bias.resolve_neg()
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    options = (rounding, grad_rounding, quantize_backward, hadamard_wgrad, seed, step)
    y = _FP4LinearFunction.apply(x2d, weight, bias, options)
    return y.reshape(*lead, weight.shape[0])


class FP4Linear(torch.nn.Module):
    """``torch.nn.Linear`` with NVFP4 GEMMs (``fp4_linear``) and full-precision master weights.

    Args:
        in_features, out_features: positive multiples of 16 (ints, or integers such as
            ``numpy.int64``; not bool or float).
        bias: add a learnable bias.
        rounding, grad_rounding, quantize_backward, hadamard_wgrad: as in ``fp4_linear``.
        seed: stochastic rounding's seed, an int in [0, 2**64); the counter is the number of
            training-mode forward calls so far (``self.step``, saved in the state dict) modulo
            2**32.  Layers of one seed called in step draw the same words for operands of the
            same shape: give each layer a seed of its own (``seed=base + index``).
            Activation checkpointing (``torch.utils.checkpoint``) recomputes the forward as one
            more call, with the next counter: with ``rounding="stochastic"`` the recomputed
            activations are rounded with other words than those the forward used, so the
            gradients belong to another rounding; use ``rounding="nearest"`` inside a
            checkpointed region (``grad_rounding`` is unaffected: the backward runs once).
        device, dtype: of the master weights (float32 by default; bfloat16 or float16).

    Checkpoints: the state dict is ``torch.nn.Linear``'s (``weight``, ``bias``) plus
    ``_extra_state`` (the step counter and the seed).  A ``torch.nn.Linear`` state dict loads
    into an FP4Linear (strict; the counter and the seed stay as they are).  The other way,
    ``torch.nn.Linear`` does not know ``_extra_state``: load with ``strict=False``, or drop the
    keys that end in ``_extra_state`` first.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        rounding: Literal["nearest", "stochastic"] = "nearest",
        grad_rounding: Literal["nearest", "stochastic"] = "stochastic",
        quantize_backward: bool = True,
        hadamard_wgrad: bool = False,
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        features = []
        for name, n in (("in_features", in_features), ("out_features", out_features)):
            n = check_integer(n, f"FP4Linear: {name}")
            if n <= 0 or n % BLOCK:
                raise ValueError(f"FP4Linear: {name}={n} is not a positive multiple of {BLOCK}")
            features.append(n)
        in_features, out_features = features
        for name, value in (("rounding", rounding), ("grad_rounding", grad_rounding)):
            if not isinstance(value, str) or value not in ROUNDINGS:
                raise ValueError(f"FP4Linear: {name}={value!r} is not one of {ROUNDINGS}")
        for name, flag in (
            ("bias", bias),
            ("quantize_backward", quantize_backward),
            ("hadamard_wgrad", hadamard_wgrad),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"FP4Linear: {name} is True or False, got {flag!r}")
        if dtype is not None and dtype not in DTYPES:
            raise TypeError(
                f"FP4Linear: dtype={dtype}; the master weights are float32, bfloat16 or float16"
            )
        seed = check_seed(seed, "FP4Linear: seed")
        reference = torch.nn.Linear(in_features, out_features, bias, device=device, dtype=dtype)
        self.in_features, self.out_features = in_features, out_features
        self.weight = reference.weight
        self.bias = reference.bias
        self.rounding = rounding
        self.grad_rounding = grad_rounding
        self.quantize_backward = quantize_backward
        self.hadamard_wgrad = hadamard_wgrad
        self.seed = seed
        self.step = 0

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, **options: Any) -> FP4Linear:
        """An FP4Linear holding (sharing) ``linear``'s weight and bias; ``options`` as in the
        constructor (rounding, grad_rounding, quantize_backward, hadamard_wgrad, seed): not
        ``dtype`` or ``device``, which are ``linear``'s (convert it first: ``linear.to(...)``),
        nor ``in_features``, ``out_features`` or ``bias``, which are linear's too.

        ``linear``'s weight is float32, bfloat16 or float16 (``linear.float()`` converts a
        float64 one), and initialized (a ``torch.nn.LazyLinear`` after its first forward).
        The layer takes ``linear``'s training mode: a model converted in eval mode stays in
        eval mode (``layer.train()`` switches it)."""
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(
                f"FP4Linear.from_linear: expected a torch.nn.Linear, got {type(linear).__name__}"
            )
        for name in ("dtype", "device"):
            if name in options:
                raise TypeError(
                    f"FP4Linear.from_linear: {name}: the layer shares linear's weight and bias, "
                    f"so they keep linear's {name}; convert linear first (linear.to(...))"
                )
        for name in ("in_features", "out_features", "bias"):
            if name in options:
                raise TypeError(
                    f"FP4Linear.from_linear: {name}: it is linear's (the layer shares linear's "
                    f"weight and bias); build FP4Linear(...) for another {name}"
                )
        if torch.nn.parameter.is_lazy(linear.weight):
            raise ValueError(
                "FP4Linear.from_linear: linear is a LazyLinear whose weight is not initialized "
                "yet (its in_features come from the first input); run a forward through it "
                "first, or build FP4Linear(in_features, out_features)"
            )
        for name, t in (("weight", linear.weight), ("bias", linear.bias)):
            if t is not None and t.dtype not in DTYPES:
                raise TypeError(
                    f"FP4Linear.from_linear: linear's {name} has dtype {t.dtype}; the master "
                    "weights are float32, bfloat16 or float16: convert linear first "
                    "(linear.float())"
                )
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, **options)
        layer.weight = linear.weight
        layer.bias = linear.bias
        return layer.train(linear.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``fp4_linear(x, self.weight, self.bias, ...)``; counts the step in training mode."""
        y = fp4_linear(
            x,
            self.weight,
            self.bias,
            rounding=self.rounding,
            grad_rounding=self.grad_rounding,
            quantize_backward=self.quantize_backward,
            hadamard_wgrad=self.hadamard_wgrad,
            seed=self.seed,
            step=self.step % STEP_LIMIT,
        )
        if self.training:
            self.step += 1
        return y

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ):
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
        )
        key = prefix + "_extra_state"
        if key not in state_dict and key in missing_keys:
            # a torch.nn.Linear checkpoint: weight and bias only; the counters stay
            missing_keys.remove(key)

    def get_extra_state(self) -> dict[str, int]:
        """The step counter and the seed (saved in ``state_dict()``)."""
        return {"step": self.step, "seed": self.seed}

    def set_extra_state(self, state: dict[str, int]) -> None:
        """Restore ``get_extra_state()``."""
        if not isinstance(state, dict) or not {"step", "seed"} <= state.keys():
            raise ValueError(
                f"FP4Linear extra state: expected {{'step': ..., 'seed': ...}}, got {state!r}"
            )
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"FP4Linear extra state: step must be an int >= 0, got {step!r}")
        self.seed = check_seed(state["seed"], "FP4Linear extra state: seed")
        self.step = step

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, rounding={self.rounding!r}, "
            f"grad_rounding={self.grad_rounding!r}, quantize_backward={self.quantize_backward}, "
            f"hadamard_wgrad={self.hadamard_wgrad}"
        )
