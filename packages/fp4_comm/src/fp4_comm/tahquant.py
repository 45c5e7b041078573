"""TAH-Quant on the wire: the activation codec of He et al., "TAH-Quant: Effective Activation
Quantization in Pipeline Parallelism over Slow Network" (arXiv:2506.01352, 2025), and its
backward codec, 6-bit fixed point, as ``Codec`` s for the collectives.

Written from the paper's algorithm (section 3: tile-wise quantization, entropy-guided
token-level bit allocation, Hadamard transform with pivot swap) and checked against the
description of its public code (``compress/tah_modules.py`` and ``fixpoint.py``: 64-channel
tiles, 4 bits for 80 % of tokens and 3 for the rest, ratio 2 for the transform, backward 6 bits
on tiles of 32).  The definition is the vectorized torch operations below, the CPU path; every
float operation is a separate IEEE float32 operation in a fixed order, so CPU and GPU, and the
plain-numpy reference of the tests, give the same bits.  Do not ``torch.compile`` them: a fused
kernel may contract a multiply and an add into an FMA and change the bits.  CUDA tensors go
through the fused numba kernels of ``_tahquant_kernels`` (a few launches an encode or decode
instead of thousands), which perform the same operations in the same order: the same bytes
and values.

**Tokens on the wire.**  A payload row (one chunk of a collective, ``(chunks, n)``) is read as
``n / token_size`` tokens of ``token_size`` consecutive channels: the layout of a ``(..., C)``
activation flattened row-major, with ``token_size = C``, the hidden size.  ``granularity`` is
``token_size``, so the collectives cut and pad payloads at token boundaries only: an all-reduce
of ``(T, C)`` gives each rank ``ceil(T / W)`` whole tokens (zero tokens pad the last ones),
reduce-scatter / all-gather shards are whole rows of dim 0, a send is one chunk of all of its
tokens.  The entropy ranking is over the tokens of one chunk (the paper ranks the tokens of one
sequence; with one sequence per micro-batch, as in its runs, a pipeline send is the same).
Padding tokens (zeros) take part in the ranking (entropy 0, the lowest).  A tensor whose last
dimension is not ``token_size`` is still encoded and decoded correctly; its "tokens" are then
runs of the flattened tensor, which the paper's allocation was not designed for.

**Activation codec** (``TAHQuantCodec(token_size)``, name ``tahquant-h<C>``), per chunk of
``T`` tokens, in float32:

1. Entropy of each token: ``p_i = |x_i| / sum_j |x_j|``, ``H = -sum_i p_i ln p_i`` (terms with
   ``p_i = 0`` are 0; an all-zero token has ``H = 0``; a token whose magnitude sum is not finite
   ranks below every other).  The sums add halves (element ``i`` with ``i + w/2`` of a width
   ``w`` zero-padded to a power of two) and ``ln`` is computed from ``frexp`` and a fixed
   polynomial (``_ln``), so the value does not depend on a library's reduction order or
   ``log`` implementation.
2. The ``T * 20 // 100`` tokens of lowest entropy get 3 bits, the others 4 (ties: the lower
   token index first).  The paper's code computes ``int(T * (1 - 0.8))`` in floating point,
   which is one token fewer for some ``T`` (T = 5: 0); the integer form is exact.
3. Each tile of 64 channels: if its largest magnitude is at least twice the second largest
   (the second of the two largest, equal to the first where the maximum occurs twice), the
   element of largest magnitude (its first occurrence) is swapped with element 0 and the tile
   is replaced by its orthonormal Walsh-Hadamard transform ``tile @ hadamard(64) / 8``
   (Sylvester order; butterflies of stride 1, 2, ..., 32, then the exact scaling by 1/8).
4. Asymmetric min/max quantization: ``zero = fp16(min)``, ``scale = fp16(max(max - zero, 0) /
   L)``, ``L = 2^bits - 1``, both rounded to nearest even, and the codes ``clamp(rne((v - zero)
   / scale), 0, L)`` with those fp16 values (the paper's code quantizes with the unrounded
   values and sends fp16 ones; rounding first makes the decoder see the scale the encoder
   used).  ``min`` and ``max`` are taken with -0 as +0 (a reduction may return either zero).
   ``scale = 0`` (a constant tile): codes 0.
5. Decode: ``q * scale + zero`` (a product, then a sum), the inverse transform
   (``hadamard(64) / 8`` again) and the swap back.

Non-finite input: a tile that holds NaN or Inf, or whose transform, zero or scale overflows
(fp16 ends at 65504: tiles beyond it), is sent with zero = scale = NaN and decodes to NaN.
Rounding is to nearest only (the paper's); ``rounding="stochastic"`` raises ValueError.

Wire layout, one section, per chunk (bytes): codes of the 3-bit tokens in token order, each
token's ``C`` codes packed 8 to 3 bytes (code ``k`` of a group of 8 at bits ``3k..3k+2`` of a
little-endian 24-bit word); then the 4-bit tokens' codes, 2 to a byte (element ``2i`` in the
low nibble); then the fp16 zeros, the fp16 scales (one per tile, tile order); the token map
(1 bit a token, set for 3 bits; bit ``t % 8`` of byte ``t // 8``); the transform map (1 bit a
tile, the same order); the pivots (6 bits a tile, 0 where not transformed, packed 4 to 3 bytes
like the 3-bit codes, the last group cut to whole bytes).  For ``C = 768``: 4.41 bits an
element (3.8 of codes, 0.5 of zero and scale, 0.11 of maps and pivots).

**Gradient codec** (``TAHQuantGradCodec()``, name ``tahquant-grad``): tiles of 32 consecutive
elements, ``s = fp16(max |x|)`` (nearest even), codes ``clamp(rne(x / s * 32), -32, 31)``, sent
as ``code + 32`` in 6 bits, 4 to 3 bytes; decoded ``(code / 32) * s``.  ``s = 0``: codes 0.  A
tile with NaN or Inf, or ``max |x| >= 65520`` (fp16 overflow), has ``s = NaN`` and decodes to
NaN.  The fp16 scale flushes tiles with ``max |x| < 2^-25`` to zero and is coarse below 2^-14
(subnormal): gradients that small need a loss scale, as in the paper's fp16 runs.  Layout per
chunk: the codes (``6 n / 8`` bytes), then the fp16 scales.  6.5 bits an element.
"""

from __future__ import annotations

from abc import abstractmethod
from types import MappingProxyType

import numpy as np
import torch

from .codecs import (
    REL_HALF_ULP,
    CheckedCodec,
    Rounding,
    check_encode_args,
    check_error_bound_args,
    check_int,
    check_n,
    hadamard_f64,
)

TILE_SIZE = 64  # channels of a tile (forward)
HIGH_BITS = 4
LOW_BITS = 3
HIGH_PERCENT = 80  # share of a chunk's tokens that get HIGH_BITS
HADAMARD_RATIO = 2.0  # transform a tile whose largest magnitude >= 2 x the second
PIVOT_BITS = 6  # log2(TILE_SIZE)
GRAD_TILE_SIZE = 32
GRAD_BITS = 6
GRAD_STEPS = 2 ** (GRAD_BITS - 1)  # 32: codes -32..31 stand for -1 .. 31/32 of the scale
FP16_NAN_BITS = 0x7E00
# fp16: half an ulp relative in the normal range, half the subnormal step absolute.
FP16_REL_HALF_ULP = 2.0**-11
FP16_ABS_HALF_STEP = 2.0**-25
FP32_REL_HALF_ULP = 2.0**-24

# ln from frexp: m in [sqrt(1/2), sqrt(2)), s = (m - 1) / (m + 1), ln m = 2 s (1 + s^2/3 +
# s^4/5 + s^6/7 + s^8/9); |s| < 0.172, so the next term is below 2^-28 of the sum.
SQRT_HALF = np.float32(0.70710677)
LN2 = np.float32(0.6931472)
LN_SERIES = tuple(np.float32(1.0 / k) for k in (9, 7, 5, 3, 1))  # Horner order


def low_token_count(tokens: int) -> int:
    """How many of a chunk's ``tokens`` (an int >= 0) get LOW_BITS: the (100 - HIGH_PERCENT) %
    of lowest entropy, rounded down."""
    tokens = check_int(tokens, "low_token_count: tokens", 2**63)
    return tokens * (100 - HIGH_PERCENT) // 100


def _ln(p):
    """Natural log of positive float32 ``p`` from exact frexp and float32 operations in this
    order (a reproducible log; ~1 ulp)."""
    m, e = torch.frexp(p)
    small = m < float(SQRT_HALF)
    m = torch.where(small, m * 2.0, m)
    e = torch.where(small, e - 1, e)
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    r = torch.full_like(z, float(LN_SERIES[0]))
    for c in LN_SERIES[1:]:
        r = r * z
        r = r + float(c)
    t = s * r
    return e.to(torch.float32) * float(LN2) + (t + t)


def _halving_sum(a):
    """Sum over the last dim: zero-padded to a power of two, then halves added elementwise."""
    w = a.shape[-1]
    p2 = 1 << max(0, (w - 1).bit_length())
    if p2 != w:
        a = torch.nn.functional.pad(a, (0, p2 - w))
    while a.shape[-1] > 1:
        h = a.shape[-1] // 2
        a = a[..., :h] + a[..., h:]
    return a[..., 0]


def _check_float32(what, t, dims, min_dim):
    """TypeError / ValueError beginning with ``what`` unless ``t`` is a float32 torch tensor of
    at least ``min_dim`` dimensions (``dims``: their names, for the message)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a float32 torch tensor {dims}, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{what}: expected float32, got {t.dtype} (.float() converts)")
    if t.dim() < min_dim:
        raise ValueError(f"{what}: expected {dims}, got shape {tuple(t.shape)}")


def token_entropy(x):
    """(…, T, C) float32 torch tensor -> (…, T) float32 entropies; -inf where a token's sum is
    not finite."""
    _check_float32("token_entropy: x", x, "(..., T, C)", 2)
    a = x.abs()
    total = _halving_sum(a)
    p = a / total.unsqueeze(-1)
    pos = p > 0
    lnp = _ln(torch.where(pos, p, torch.ones_like(p)))
    terms = torch.where(pos, p * lnp, torch.zeros_like(p))
    h = 0.0 - _halving_sum(terms)
    return torch.where(torch.isfinite(total), h, torch.full_like(h, -float("inf")))


def low_precision_tokens(h, n_low):
    """(R, T) float32 entropies -> (R, T) bool: the ``n_low`` lowest of each row (ties: lower
    index), ``0 <= n_low <= T``."""
    _check_float32("low_precision_tokens: h", h, "(R, T)", 2)
    if h.dim() != 2:
        raise ValueError(f"low_precision_tokens: h: expected (R, T), got shape {tuple(h.shape)}")
    R, T = h.shape
    n_low = check_int(n_low, "low_precision_tokens: n_low", T + 1)
    bits = h.contiguous().view(torch.int32).to(torch.int64)
    # Entropies are >= +0 or -inf: the bits of a non-negative float order like the float;
    # -inf ranks first.  Keys are unique, so any sort gives this order.
    bits = torch.where(h == -float("inf"), torch.full_like(bits, -1), bits)
    key = bits * T + torch.arange(T, device=h.device)
    order = torch.argsort(key, dim=1)
    low = torch.zeros(R, T, dtype=torch.bool, device=h.device)
    low.scatter_(1, order[:, :n_low], True)
    return low


def _hadamard(t):
    """Rows of 64 (…, 64) -> unnormalized Walsh-Hadamard (Sylvester order) in float32:
    stages of stride 1, 2, ..., 32, pairs (i, i + h) -> (a + b, a - b)."""
    g = t.shape[-1]
    lead = t.shape[:-1]
    h = 1
    while h < g:
        v = t.reshape(*lead, g // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        t = torch.stack((a + b, a - b), dim=-2).reshape(*lead, g)
        h *= 2
    return t


def _orthonormal_hadamard(t):
    return _hadamard(t) * (1.0 / 8.0)  # 1/sqrt(64): a power of two, exact


def _swap_first(t, pivot):
    """Each row with element 0 and element ``pivot`` exchanged."""
    first = t[..., :1]
    at_pivot = torch.gather(t, -1, pivot.unsqueeze(-1))
    out = t.scatter(-1, pivot.unsqueeze(-1), first)
    out[..., :1] = at_pivot
    return out


# ------------------------------------------------------------------------ bit packing


def _pack24(codes, bits):
    """(…, K) ints < 2^bits, bits in (3, 6), K a multiple of 24 / bits -> (…, K * bits / 8)
    uint8: each group of 24 / bits codes is a little-endian 24-bit word, code k at bits k*bits."""
    per = 24 // bits
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], -1, per)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    word = (c << shifts).sum(-1, dtype=torch.int32)
    out = torch.stack((word & 255, (word >> 8) & 255, (word >> 16) & 255), dim=-1)
    return out.reshape(*codes.shape[:-1], -1).to(torch.uint8)


def _unpack24(packed, bits, k):
    """The inverse of ``_pack24``: (…, k * bits / 8) uint8 -> (…, k) int32."""
    per = 24 // bits
    b = packed.to(torch.int32).reshape(*packed.shape[:-1], -1, 3)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    codes = (word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :k]


def _pack24_cut(codes, bits):
    """``_pack24`` of codes zero-padded to a whole group, cut to ceil(K * bits / 8) bytes (the
    cut bytes hold only padding)."""
    k = codes.shape[-1]
    per = 24 // bits
    pad = -k % per
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    return _pack24(codes, bits)[..., : -(-k * bits // 8)]


def _unpack24_cut(packed, bits, k):
    per = 24 // bits
    full = -(-k // per) * 3
    if packed.shape[-1] != full:
        packed = torch.nn.functional.pad(packed, (0, full - packed.shape[-1]))
    return _unpack24(packed, bits, k)


def _pack4(codes):
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], -1, 2)
    return (c[..., 0] | (c[..., 1] << 4)).to(torch.uint8)


def _unpack4(packed):
    p = packed.to(torch.int32)
    return torch.stack((p & 15, p >> 4), dim=-1).reshape(*packed.shape[:-1], -1)


def _pack_bits(flags):
    """(R, K) bool -> (R, ceil(K / 8)) uint8, bit k % 8 of byte k // 8."""
    k = flags.shape[-1]
    pad = -k % 8
    f = flags.to(torch.int32)
    if pad:
        f = torch.nn.functional.pad(f, (0, pad))
    f = f.reshape(*flags.shape[:-1], -1, 8)
    shifts = torch.arange(8, device=flags.device, dtype=torch.int32)
    return (f << shifts).sum(-1, dtype=torch.int32).to(torch.uint8)


def _unpack_bits(packed, k):
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    bits = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    return bits.reshape(*packed.shape[:-1], -1)[..., :k].bool()


def _fp16_bytes(t):
    """(R, K) float16 -> (R, 2K) uint8 (little-endian, as the machine stores them)."""
    return t.contiguous().view(torch.uint8)


def _fp16_from_bytes(b):
    # a copy with standard strides: a one-row slice counts as contiguous yet keeps the row
    # stride of the whole section, which view(float16) rejects when it is odd
    return b.clone(memory_format=torch.contiguous_format).view(torch.float16)


def _nan_fp16(like):
    return torch.full_like(like, FP16_NAN_BITS, dtype=torch.int16).view(torch.float16)


class _OneSectionNearestCodec(CheckedCodec):
    """What TAH-Quant's two codecs share: ``encode`` / ``decode`` run the codecs' argument
    checks (``codecs.check_encode_args`` / ``_decode_args``: the empty result where there is no
    element), then TAH-Quant's own (nearest rounding only, checked before an empty ``x``
    returns), then the format's work on one section of (chunks, bytes) per chunk."""

    #: what ``tensor_parallel.direction_options`` reads: stochastic rounding is refused
    nearest_only = True

    def encode(
        self, x: torch.Tensor, rounding: Rounding = "nearest", seed: int = 0, step: int = 0
    ) -> list[torch.Tensor]:
        empty = check_encode_args(self, x, rounding, seed, step)
        if rounding != "nearest":
            raise ValueError(
                f"{type(self).__name__}.encode: rounding {rounding!r}: TAH-Quant rounds to "
                "nearest even only (the paper's algorithm); pass rounding='nearest'"
            )
        if empty is not None:
            return empty
        if x.is_cuda:
            return [self._encode_cuda(x)]
        return [torch.cat(self._encode_parts(x), dim=1).contiguous()]

    def _decode_checked(self, sections, n, dtype):
        raw = sections[0]
        y = self._decode_cuda(raw, n) if raw.is_cuda else self._decode_float32(raw, n)
        return y if dtype == torch.float32 else y.to(dtype)

    @abstractmethod
    def _encode_parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Checked, non-empty ``x`` (chunks, n) -> the parts of its one section, uint8
        (chunks, bytes each), in wire order."""

    @abstractmethod
    def _decode_float32(self, raw: torch.Tensor, n: int) -> torch.Tensor:
        """Checked, non-empty section ``raw`` -> the (chunks, n) float32 values."""

    @abstractmethod
    def _encode_cuda(self, x: torch.Tensor) -> torch.Tensor:
        """``_encode_parts`` joined, for a CUDA tensor: the fused kernels of
        ``_tahquant_kernels`` (the same bytes)."""

    @abstractmethod
    def _decode_cuda(self, raw: torch.Tensor, n: int) -> torch.Tensor:
        """``_decode_float32`` of a CUDA section: the fused kernels (the same values)."""


def _per_element_bound(per_tile, tile_size, x, dtype):
    """A bound per tile of the float32 round trip, repeated over its elements, plus the
    rounding of the result to ``dtype``."""
    R, n = x.shape
    bound = np.repeat(per_tile[..., None], tile_size, -1).reshape(R, n)
    return bound + (np.abs(x) + bound) * REL_HALF_ULP[dtype]


class TAHQuantCodec(_OneSectionNearestCodec):
    """TAH-Quant's activation codec (arXiv:2506.01352): tiles of 64 channels, 4 bits for 80 %
    of a chunk's tokens (3 bits for the 20 % of lowest entropy), a Hadamard transform with
    pivot swap on outlier tiles, fp16 zero and scale per tile.  ``token_size``: channels of a
    token, the hidden size of the activations it carries (a multiple of 64); also the
    granularity.  The module docstring says exactly what it computes."""

    def __init__(self, token_size: int) -> None:
        if isinstance(token_size, bool) or not isinstance(token_size, int):
            raise TypeError(f"TAHQuantCodec: token_size must be an int, got {token_size!r}")
        if token_size <= 0 or token_size % TILE_SIZE:
            raise ValueError(
                f"TAHQuantCodec: token_size {token_size} is no positive multiple of the tile "
                f"size {TILE_SIZE}; use the activations' hidden size"
            )
        self.token_size = token_size
        self.granularity = token_size
        self.name = f"tahquant-h{token_size}"
        self._layouts: dict[int, MappingProxyType] = {}  # by n: every call asks for it

    def layout(self, n: int) -> MappingProxyType:
        """Byte ranges (start, stop) of each part of one chunk of ``n`` elements (read-only;
        built once for each n)."""
        lay = self._layouts.get(n) if type(n) is int else None
        if lay is None:
            n = check_n(self, n)
            lay = self._layouts[n] = MappingProxyType(self._build_layout(n))
        return lay

    def _build_layout(self, n: int) -> dict[str, tuple[int, int]]:
        T = n // self.token_size
        n_low = low_token_count(T)
        tiles = n // TILE_SIZE
        sizes = (
            ("low_codes", n_low * self.token_size * LOW_BITS // 8),
            ("high_codes", (T - n_low) * self.token_size * HIGH_BITS // 8),
            ("zeros", 2 * tiles),
            ("scales", 2 * tiles),
            ("token_map", -(-T // 8)),
            ("transform_map", -(-tiles // 8)),
            ("pivots", -(-tiles * PIVOT_BITS // 8)),
        )
        out, at = {}, 0
        for name, size in sizes:
            out[name] = (at, at + size)
            at += size
        return out

    def section_nbytes(self, n: int) -> tuple[int, ...]:
        return (self.layout(n)["pivots"][1],)

    def _encode_parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        R, n = x.shape
        C = self.token_size
        T = n // C
        n_low = low_token_count(T)
        xf = x.float().reshape(R, T, C)
        low = low_precision_tokens(token_entropy(xf), n_low)  # (R, T)

        tiles = xf.reshape(R, T, C // TILE_SIZE, TILE_SIZE)
        finite = torch.isfinite(tiles).all(-1)
        a = tiles.abs()
        top1 = a.amax(-1)
        pivot = a.argmax(-1)  # the first index of the maximum (torch's documented tie rule)
        top2 = a.scatter(-1, pivot.unsqueeze(-1), 0.0).max(-1).values
        transform = finite & (top1 >= top2 * HADAMARD_RATIO)
        pivot = torch.where(transform, pivot, torch.zeros_like(pivot))
        rotated = _orthonormal_hadamard(_swap_first(tiles, pivot))
        v = torch.where(transform.unsqueeze(-1), rotated, tiles)

        levels = torch.where(low, float(2**LOW_BITS - 1), float(2**HIGH_BITS - 1))
        levels = levels.unsqueeze(-1)  # (R, T, 1): per tile of the token
        # + 0: -0 becomes +0 (and nothing else changes), since which of two zeros of opposite
        # signs a min or max reduction returns is up to its implementation
        lo = v.amin(-1) + 0.0
        hi = v.amax(-1) + 0.0
        zero16 = lo.to(torch.float16)
        zero = zero16.float()
        spread = torch.clamp(hi - zero, min=0.0)
        scale16 = (spread / levels).to(torch.float16)
        scale = scale16.float()
        ok = finite & torch.isfinite(v).all(-1) & torch.isfinite(zero) & torch.isfinite(scale)
        t = (v - zero.unsqueeze(-1)) / scale.unsqueeze(-1)
        q = torch.clamp(torch.round(t), torch.zeros_like(levels.unsqueeze(-1)),
                        levels.unsqueeze(-1))  # fmt: skip
        live = (ok & (scale > 0)).unsqueeze(-1)
        q = torch.where(live, q, torch.zeros_like(q)).to(torch.int32).reshape(R, T, C)
        nan16 = _nan_fp16(zero16)
        zero16 = torch.where(ok, zero16, nan16).reshape(R, -1)
        scale16 = torch.where(ok, scale16, nan16).reshape(R, -1)
        transform = (transform & ok).reshape(R, -1)
        pivot = torch.where(transform, pivot.reshape(R, -1), torch.zeros_like(transform,
                            dtype=pivot.dtype))  # fmt: skip

        # Tokens of each kind in ascending token order: the rank of each token among its kind.
        idx = torch.arange(T, device=x.device)
        kind_key = (~low).to(torch.int64) * T + idx  # 3-bit tokens first, then 4-bit
        order = torch.argsort(kind_key, dim=1)
        gathered = torch.gather(q, 1, order.unsqueeze(-1).expand(R, T, C))
        return [
            _pack24(gathered[:, :n_low].reshape(R, -1), LOW_BITS),
            _pack4(gathered[:, n_low:].reshape(R, -1)),
            _fp16_bytes(zero16),
            _fp16_bytes(scale16),
            _pack_bits(low),
            _pack_bits(transform),
            _pack24_cut(pivot, PIVOT_BITS),
        ]

    def _encode_cuda(self, x: torch.Tensor) -> torch.Tensor:
        from . import _tahquant_kernels

        n = x.shape[1]
        n_low = low_token_count(n // self.token_size)
        return _tahquant_kernels.encode(x, self.token_size, n_low, self.layout(n),
                                        low_precision_tokens)  # fmt: skip

    def _decode_cuda(self, raw: torch.Tensor, n: int) -> torch.Tensor:
        from . import _tahquant_kernels

        n_low = low_token_count(n // self.token_size)
        return _tahquant_kernels.decode(raw, n, self.token_size, n_low, self.layout(n),
                                        _unpack_bits)  # fmt: skip

    def _decode_float32(self, raw: torch.Tensor, n: int) -> torch.Tensor:
        R = raw.shape[0]
        C = self.token_size
        T = n // C
        lay = self.layout(n)
        n_low = low_token_count(T)
        tiles = n // TILE_SIZE

        def part(name):
            a, b = lay[name]
            return raw[:, a:b]

        low = _unpack_bits(part("token_map"), T)
        idx = torch.arange(T, device=raw.device)
        order = torch.argsort((~low).to(torch.int64) * T + idx, dim=1)
        q_low = _unpack24(part("low_codes"), LOW_BITS, n_low * C).reshape(R, n_low, C)
        q_high = _unpack4(part("high_codes")).reshape(R, T - n_low, C)
        q = torch.empty(R, T, C, dtype=torch.int32, device=raw.device)
        q.scatter_(1, order.unsqueeze(-1).expand(R, T, C), torch.cat((q_low, q_high), dim=1))
        zero = _fp16_from_bytes(part("zeros")).float().reshape(R, tiles, 1)
        scale = _fp16_from_bytes(part("scales")).float().reshape(R, tiles, 1)
        transform = _unpack_bits(part("transform_map"), tiles).reshape(R, tiles, 1)
        pivot = _unpack24_cut(part("pivots"), PIVOT_BITS, tiles).to(torch.int64)
        v = q.reshape(R, tiles, TILE_SIZE).float() * scale
        v = v + zero
        back = _swap_first(_orthonormal_hadamard(v), pivot.reshape(R, tiles))
        return torch.where(transform, back, v).reshape(R, n)

    def error_bound(
        self, x: np.ndarray, rounding: Rounding = "nearest", dtype: torch.dtype = torch.float32
    ) -> np.ndarray:
        """Per-element bound on the round-trip error for finite ``x`` (chunks, n) whose tiles
        stay within fp16's range after the transform.  Derived per tile in float64 from the
        values the encoder quantizes (the transform decision is exact in float64 too)."""
        check_error_bound_args(self, x, rounding, dtype)
        R, n = x.shape
        C = self.token_size
        T = n // C
        xt = x.astype(np.float64).reshape(R, T, C // TILE_SIZE, TILE_SIZE)
        a = np.abs(xt)
        amax = a.max(-1)
        piv = a.argmax(-1)
        a2 = a.copy()
        np.put_along_axis(a2, piv[..., None], 0.0, -1)
        second = a2.max(-1)
        transform = amax >= HADAMARD_RATIO * second
        swapped = xt.copy()
        first = swapped[..., 0].copy()
        swapped[..., 0] = np.take_along_axis(xt, piv[..., None], -1)[..., 0]
        np.put_along_axis(swapped, piv[..., None], first[..., None], -1)
        rot = hadamard_f64(swapped.reshape(-1, TILE_SIZE)).reshape(xt.shape) / 8.0
        v = np.where(transform[..., None], rot, xt)
        # float32 butterflies: each of 6 stages rounds partial sums of at most 64 amax, and an
        # output collects one rounding per stage; /8 after.
        transform_err = np.where(transform, 6 * FP32_REL_HALF_ULP * 64 * amax / 8.0, 0.0)
        lo = v.min(-1) - transform_err
        hi = v.max(-1) + transform_err
        zero_err = np.abs(lo) * FP16_REL_HALF_ULP + FP16_ABS_HALF_STEP
        spread = hi - lo + zero_err
        levels = float(2**LOW_BITS - 1)  # the coarser of the two: a bound for either
        scale = spread / levels * (1 + FP16_REL_HALF_ULP) * (1 + 4 * FP32_REL_HALF_ULP)
        scale += FP16_ABS_HALF_STEP
        # nearest rounding: half a step; the top code can miss the max by the scale's fp16
        # rounding times the levels; the bottom clamp by the zero's rounding; the float32
        # roundings of (v - zero) / scale and q * scale + zero.
        rounding = 4 * FP32_REL_HALF_ULP * (spread + np.abs(lo) + np.abs(hi))
        quant = scale / 2 + spread * FP16_REL_HALF_ULP + levels * FP16_ABS_HALF_STEP
        quant += zero_err + rounding
        in_v = quant + transform_err
        # The inverse transform maps an error of at most e per element to at most 8 e (a sum
        # of 64 terms / 8), and rounds like the forward one.
        vmax = np.maximum(np.abs(lo), np.abs(hi)) + in_v
        back = 8 * in_v + 6 * FP32_REL_HALF_ULP * 64 * vmax / 8.0
        per_tile = np.where(transform, back, in_v)
        return _per_element_bound(per_tile, TILE_SIZE, x, dtype)

    def __repr__(self) -> str:
        return f"TAHQuantCodec(token_size={self.token_size})"


class TAHQuantGradCodec(_OneSectionNearestCodec):
    """TAH-Quant's backward codec: 6-bit fixed point on tiles of 32 with an fp16 scale (the
    module docstring says exactly what it computes)."""

    granularity = GRAD_TILE_SIZE
    name = "tahquant-grad"

    def section_nbytes(self, n: int) -> tuple[int, ...]:
        n = check_n(self, n)
        return (n * GRAD_BITS // 8 + 2 * (n // GRAD_TILE_SIZE),)

    def _encode_parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        R, n = x.shape
        tiles = x.float().reshape(R, n // GRAD_TILE_SIZE, GRAD_TILE_SIZE)
        amax = tiles.abs().amax(-1)  # NaN where the tile holds NaN
        scale16 = amax.to(torch.float16)
        scale = scale16.float()
        ok = torch.isfinite(scale) & torch.isfinite(tiles).all(-1)
        t = tiles / scale.unsqueeze(-1)
        t = t * float(GRAD_STEPS)
        q = torch.clamp(torch.round(t), -GRAD_STEPS, GRAD_STEPS - 1)
        live = (ok & (scale > 0)).unsqueeze(-1)
        q = torch.where(live, q, torch.zeros_like(q)).to(torch.int32) + GRAD_STEPS
        scale16 = torch.where(ok, scale16, _nan_fp16(scale16))
        codes = _pack24(q.reshape(R, n), GRAD_BITS)
        return [codes, _fp16_bytes(scale16)]

    def _encode_cuda(self, x: torch.Tensor) -> torch.Tensor:
        from . import _tahquant_kernels

        return _tahquant_kernels.grad_encode_section(x, self.section_nbytes(x.shape[1])[0])

    def _decode_cuda(self, raw: torch.Tensor, n: int) -> torch.Tensor:
        from . import _tahquant_kernels

        return _tahquant_kernels.grad_decode_section(raw, n)

    def _decode_float32(self, raw: torch.Tensor, n: int) -> torch.Tensor:
        R = raw.shape[0]
        split = n * GRAD_BITS // 8
        q = _unpack24(raw[:, :split], GRAD_BITS, n) - GRAD_STEPS
        scale = _fp16_from_bytes(raw[:, split:]).float()
        # (code / 32) is exact; one rounding in the product with the scale
        v = q.float().reshape(R, -1, GRAD_TILE_SIZE) * (1.0 / GRAD_STEPS)
        return (v * scale.unsqueeze(-1)).reshape(R, n)

    def error_bound(
        self, x: np.ndarray, rounding: Rounding = "nearest", dtype: torch.dtype = torch.float32
    ) -> np.ndarray:
        """Per-element bound for finite ``x`` whose tiles' max |x| stays below fp16's 65504."""
        check_error_bound_args(self, x, rounding, dtype)
        R, n = x.shape
        amax = np.abs(x.astype(np.float64)).reshape(R, -1, GRAD_TILE_SIZE).max(-1)
        scale = amax * (1 + FP16_REL_HALF_ULP) + FP16_ABS_HALF_STEP
        # a step is scale / 32: nearest rounding errs by half of it; the top code (31 / 32)
        # misses +max by one step plus the scale's rounding below max; float32 roundings of
        # x / s * 32 and of the product.
        per_tile = (scale / GRAD_STEPS + amax * FP16_REL_HALF_ULP + FP16_ABS_HALF_STEP
                    + 4 * FP32_REL_HALF_ULP * scale)  # fmt: skip
        return _per_element_bound(per_tile, GRAD_TILE_SIZE, x, dtype)

    def __repr__(self) -> str:
        return "TAHQuantGradCodec()"
