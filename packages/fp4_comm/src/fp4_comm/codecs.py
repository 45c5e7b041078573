"""Wire codecs: how a collective turns float chunks into bytes and back.

A codec encodes a (chunks, n) float tensor, n elements per chunk, into a few *sections*: uint8
tensors of shape (chunks, bytes_per_chunk) (for the FP4 formats: codes, block scales, tensor
scale).  A collective exchanges chunk i of every section with one peer; the receiver decodes the
sections it gathered, which are views of one flat receive buffer.  Sections instead of one
interleaved buffer per chunk, because ``fp4_kernels.quantize`` already writes codes and scales
as two contiguous tensors: sending them as they are costs no copy, and the received codes of all
chunks stay contiguous, so one ``dequantize`` call decodes every chunk.

Codecs:

- ``NoneCodec("bfloat16")`` ("none"): the values themselves in a float dtype (the baseline path);
  exact for values the wire dtype holds.
- ``NVFP4Codec`` ("nvfp4"): E2M1 codes, an E4M3 scale per 16 elements and the float32 tensor
  scale 1/S of the encoded tensor, sent with every chunk (4 bytes), so that ranks need not agree
  on a tensor amax before they quantize.
- ``MXFP4Codec`` ("mxfp4"): E2M1 codes and an E8M0 scale per 32 elements.
- ``FP4QuantCodec(group_size, hadamard)`` (or an ``fp4_kernels.FP4Quant`` passed as codec):
  E2M1 codes and a bfloat16 scale per group, after a Walsh-Hadamard transform of each group.
- ``TAHQuantCodec(token_size)`` ("tahquant-h<C>") and ``TAHQuantGradCodec`` ("tahquant-grad"),
  in ``fp4_comm.tahquant``: TAH-Quant (arXiv:2506.01352), a baseline from the literature.

All work on torch tensors, CPU (numba CPU path of fp4_kernels) or CUDA (its kernels, on the
current stream); bit-identical on both.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
import torch

import fp4_kernels
from fp4_kernels.formats import e2m1, nvfp4

ROUNDINGS = e2m1.ROUNDINGS
# fp4_kernels.quantize's ranges: the Philox key is 64 bits, its counter word 32.
SEED_LIMIT = 2**64
STEP_LIMIT = 2**32
# E2M1 (OCP MX v1.0 §5.3.3): the largest magnitude, and the code of it (sign bit masked off).
E2M1_MAX = e2m1.E2M1_MAX
E2M1_MAX_MAGNITUDE_CODE = e2m1.E2M1_MAX_CODE
# E4M3 has 3 mantissa bits: rounding a normal value to it errs by at most 2^-4 relative; in the
# subnormal range (step 2^-9) by at most 2^-10 absolute (a scale below 2^-10 becomes 0).
E4M3_REL_HALF_ULP = 2.0**-4
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10
NVFP4_S_NUMERATOR = float(nvfp4.NVFP4_GLOBAL_AMAX_TARGET)  # S = 2688 / amax
# float32 roundings on the NVFP4 path (S, fp32(1/6), S * (1/6), * amax_b, 1/S, the decode
# products), each at most 2^-24 relative: 2^-20 bounds sixteen of them.
FLOAT32_ROUNDING_SLACK = 2.0**-20
# Half an ulp of a float dtype, relative: the last rounding of a decode to that dtype.
# (p significand bits: 2^-p; bfloat16 has 8, float16 11, float32 24; normal range only).
FLOAT32_REL_HALF_ULP = 2.0**-24
REL_HALF_ULP = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# Half the subnormal step of a float dtype, absolute: a rounding to that dtype below its
# smallest normal number (float32 and bfloat16: 2^-149 and 2^-133 steps; float16: 2^-24).
HALF_SUBNORMAL_STEP = {torch.float32: 2.0**-150, torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25}
# The encoders' reciprocal of a block scale is clamped to FLT_MAX (Transformer Engine's
# NVFP4 cast does so; FP4Quant likewise): a block whose scale is below 1 / FLT_MAX is encoded
# from x * FLT_MAX instead of x / scale, so its codes come out smaller, down to 0.
FLOAT32_MAX = float(np.finfo(np.float32).max)
# The widest field a built-in codec reads through a view of its uint8 sections (float32: NVFP4's
# 1/S, the "none-float32" values).  torch views bytes as such fields only where they start at a
# multiple of the field's size in their storage; decode copies a section that does not.
SECTION_VIEW_ALIGN = 4

Rounding = Literal["nearest", "stochastic"]


class Codec(ABC):
    """What a collective needs from a wire format."""

    name: str
    #: elements per chunk must be a multiple of this (the block size; 1 for plain values)
    granularity: int

    @abstractmethod
    def section_nbytes(self, n: int) -> tuple[int, ...]:
        """Bytes of each section for one chunk of ``n`` elements (n % granularity == 0)."""

    def encoded_nbytes(self, n: int) -> int:
        """Bytes on the wire for one chunk of ``n`` elements."""
        return sum(self.section_nbytes(n))

    @abstractmethod
    def encode(
        self, x: torch.Tensor, rounding: Rounding = "nearest", seed: int = 0, step: int = 0
    ) -> list[torch.Tensor]:
        """``x`` (chunks, n) contiguous float -> sections, uint8 (chunks, section_nbytes(n)[i]).
        ``step``: an int, or (the built-in codecs) a one-element int64 tensor where ``x``
        lives that holds it, read by the kernels (``fp4_kernels.quantize``; CUDA graphs)."""

    @abstractmethod
    def decode(
        self, sections: Sequence[torch.Tensor], n: int, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Sections of ``chunks`` chunks (each contiguous) -> (chunks, n) of ``dtype``."""

    @property
    def key(self) -> str:
        """Identifies the wire format; every rank of a collective must have the same one."""
        return self.name

    # -- what a collective's plan (``collectives.py``) calls on its hot path.  The defaults
    # -- fall back on ``encode`` / ``decode``, so a codec written against the methods above
    # -- works unchanged; the built-in codecs do the checks and the views once instead.

    #: True where ``decode`` always returns new memory, never a view of its sections: a
    #: collective may then keep its receive buffers and reuse them for its next call.
    decode_copies = False

    def encode_unchecked(
        self, x: torch.Tensor, rounding: Rounding, seed: int, step: int
    ) -> list[torch.Tensor]:
        """``encode`` of arguments that the caller has checked once for a kind of call (a
        non-empty, contiguous (chunks, n) float tensor; rounding, seed and step valid).  A
        section of one row where ``x`` has several chunks holds bytes that are the same for
        every chunk (NVFP4's tensor scale): it is meant for each of them."""
        return self.encode(x, rounding, seed, step)

    def decoder(
        self, sections: Sequence[torch.Tensor], n: int, dtype: torch.dtype
    ) -> Callable[[], torch.Tensor]:
        """``f()``: ``decode(sections, n, dtype)`` of whatever ``sections`` hold when it is
        called, with the views and the objects that do not depend on the bytes made once.
        ``sections`` as ``section_nbytes`` lays them out (not checked again; for the built-in
        codecs each at a multiple of ``SECTION_VIEW_ALIGN`` bytes of its storage, as the
        collectives' receive buffers place them)."""
        return lambda: self.decode(sections, n, dtype)

    def saturated(self, sections: Sequence[torch.Tensor], n: int) -> torch.Tensor | None:
        """bool (chunks, n): elements encoded with the largest magnitude of their block, or
        None where the format has no such notion.  Used for the clipped-fraction statistic."""
        return None

    def error_bound(
        self, x: np.ndarray, rounding: Rounding = "nearest", dtype: torch.dtype = torch.float32
    ) -> np.ndarray:
        """Per-element bound on ``|decode(encode(x)) - x|`` for a (chunks, n) float32 numpy
        array of finite values, derived from the format (docs/comm.md, "Error bounds");
        decoding to ``dtype`` (for values that ``dtype`` holds: float16's range ends at 65504).
        (FP4Quant with the transform: for groups whose transform stays below FLT_MAX, about
        ``|x| < FLT_MAX / g``; beyond, the encoder marks the group NaN.)  Blocks whose scale
        falls below 1 / FLT_MAX (NVFP4 and FP4Quant blocks of magnitude below about 2e-38)
        may decode to anything between 0 and their value: their bound is ``|x|`` or more."""
        raise NotImplementedError(f"{self.name}: no error bound")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class CheckedCodec(Codec):
    """The built-in codecs' ``encode`` / ``decode``: the argument checks (``check_encode_args`` /
    ``_decode_args``: the empty result where there is no element), then the format's work on
    checked, non-empty arguments (``_encode_checked`` / ``_decode_checked``).  ``decode`` takes
    sections at any byte offset of their storage (slices of one flat byte buffer): one whose
    offset is no multiple of ``SECTION_VIEW_ALIGN`` is read from a copy."""

    def encode(
        self, x: torch.Tensor, rounding: Rounding = "nearest", seed: int = 0, step: int = 0
    ) -> list[torch.Tensor]:
        empty = check_encode_args(self, x, rounding, seed, step)
        if empty is not None:
            return empty
        return self._encode_checked(x, rounding, seed, step)

    def decode(
        self, sections: Sequence[torch.Tensor], n: int, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        n, empty = _decode_args(self, sections, n, dtype)
        if empty is not None:
            return empty
        return self._decode_checked(_viewable(sections), n, dtype)

    def _encode_checked(self, x, rounding, seed, step):
        """Checked, non-empty ``x`` (chunks, n) -> its sections, one row per chunk."""
        return self.encode_unchecked(x, rounding, seed, step)

    @abstractmethod
    def _decode_checked(self, sections, n, dtype):
        """Checked sections of at least one chunk of n > 0 -> (chunks, n) of ``dtype``."""


def _bytes_per_chunk(t, chunks):
    return t.contiguous().view(torch.uint8).reshape(chunks, -1)


class NoneCodec(CheckedCodec):
    """The values as they are, in ``dtype`` (default bfloat16, the usual baseline).

    No copy where none is needed: ``encode`` of a tensor already in ``dtype`` returns a view of
    its bytes (sent as they are), and ``decode`` to ``dtype`` a view of its section
    (``decode_copies`` is False).  So a local ``decode(encode(x), n, x.dtype)`` shares ``x``'s
    memory and changes with it; ``.clone()`` it to keep it.  The collectives' results never
    share their input's memory: they decode what their receive buffers hold."""

    granularity = 1

    def __init__(self, dtype: str | torch.dtype = "bfloat16") -> None:
        self.dtype = _NONE_DTYPES.get(dtype) if isinstance(dtype, str) else dtype
        if self.dtype not in REL_HALF_ULP:
            raise ValueError(f"NoneCodec: dtype {dtype!r}: use float32, bfloat16 or float16")
        self.name = "none" if self.dtype == torch.bfloat16 else f"none-{_dtype_name(self.dtype)}"
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()

    def section_nbytes(self, n: int) -> tuple[int, ...]:
        return (check_n(self, n) * self.itemsize,)

    def encode_unchecked(
        self, x: torch.Tensor, rounding: Rounding, seed: int, step: int
    ) -> list[torch.Tensor]:
        # Casting rounds to nearest even; stochastic rounding is a format feature of FP4 only.
        return [_bytes_per_chunk(x.to(self.dtype), x.shape[0])]

    def _decode_checked(self, sections, n, dtype):
        (raw,) = sections
        values = raw.view(self.dtype).reshape(raw.shape[0], n)
        return values.to(dtype) if dtype != self.dtype else values

    def decoder(
        self, sections: Sequence[torch.Tensor], n: int, dtype: torch.dtype
    ) -> Callable[[], torch.Tensor]:
        values = sections[0].view(self.dtype).view(sections[0].shape[0], n)
        return (lambda: values) if dtype == self.dtype else (lambda: values.to(dtype))

    def error_bound(
        self, x: np.ndarray, rounding: Rounding = "nearest", dtype: torch.dtype = torch.float32
    ) -> np.ndarray:
        """For ``|x|`` up to the largest value of the wire dtype (bfloat16: 3.39e38; float16:
        65504): beyond, the cast gives infinity."""
        check_error_bound_args(self, x, rounding, dtype)
        rel = REL_HALF_ULP[self.dtype] + (REL_HALF_ULP[dtype] if dtype != self.dtype else 0.0)
        absolute = HALF_SUBNORMAL_STEP[self.dtype]
        absolute += HALF_SUBNORMAL_STEP[dtype] if dtype != self.dtype else 0.0
        # A second rounding sees a value already within rel of x: (1 + rel) covers it.
        return np.abs(x).astype(np.float64) * rel * (1 + rel) + absolute

    def __repr__(self) -> str:
        return f"NoneCodec({_dtype_name(self.dtype)!r})"


class _FP4BlockCodec(CheckedCodec):
    fmt: str

    def __init__(self) -> None:
        self.granularity = fp4_kernels.FORMATS[self.fmt]
        self.name = self.fmt

    def _code_and_scale_nbytes(self, n):
        n = check_n(self, n)
        return (n // 2, n // self.granularity)

    def _encode_checked(self, x, rounding, seed, step):
        q = fp4_kernels.quantize(x, fmt=self.fmt, rounding=rounding, seed=seed, step=step)
        return self._sections(q, x.shape[0])

    decode_copies = True  # dequantize writes a new tensor

    def encode_unchecked(
        self, x: torch.Tensor, rounding: Rounding, seed: int, step: int
    ) -> list[torch.Tensor]:
        q = fp4_kernels.quantize(x, fmt=self.fmt, rounding=rounding, seed=seed, step=step)
        return self._sections(q, 1)

    def _sections(self, q, chunks):
        return [q.data, q.scales]

    def decoder(
        self, sections: Sequence[torch.Tensor], n: int, dtype: torch.dtype
    ) -> Callable[[], torch.Tensor]:
        q = self._quantized(sections, n, sections[0].shape[0])
        name, dequantize = _dtype_name(dtype), fp4_kernels.dequantize
        return lambda: dequantize(q, name)

    def _quantized(self, sections, n, chunks):
        codes, scales = sections[0], sections[1]
        ones = _ones(codes.device)
        return fp4_kernels.QuantizedTensor(
            data=codes.reshape(chunks, n // 2),
            scales=scales.reshape(chunks, n // self.granularity),
            global_scale=ones,
            fmt=self.fmt,
            shape=(chunks, n),
            dtype="float32",
            scale_layout="linear",
        )

    def _row_scales(self, sections, chunks):
        """The tensor decode scale of each received chunk (a float32 view of the sections,
        ``fp4_kernels.requantized_sum``'s ``row_scales``), or None where the format has none."""
        return None

    def requantized_sum(self, sections: Sequence[torch.Tensor], n: int) -> list[torch.Tensor]:
        """The received chunks decoded, added in float32 in rank order and encoded again with
        nearest rounding: the sections of one chunk, bit for bit ``encode(decode(...) summed)``
        (``fp4_kernels.requantized_sum``: on a GPU kernels that read the encoded chunks and
        write the encoded sum, no float32 intermediate; NVFP4 decodes each chunk under the
        tensor scale it came with)."""
        n, empty = _decode_args(self, sections, n, torch.float32)
        if empty is not None:
            raise ValueError(
                f"{type(self).__name__}.requantized_sum: needs at least one chunk of n > 0"
            )
        return self.requantizer(_viewable(sections), n)()

    def requantizer(
        self, sections: Sequence[torch.Tensor], n: int
    ) -> Callable[[], list[torch.Tensor]]:
        """``f()``: ``requantized_sum(sections, n)`` of whatever ``sections`` hold when it is
        called (``decoder``'s contract)."""
        chunks = sections[0].shape[0]
        q = self._quantized(sections, n, chunks)
        row_scales = self._row_scales(sections, chunks)
        summed, to_sections = fp4_kernels.requantized_sum, self._sections
        return lambda: to_sections(summed(q, row_scales), 1)

    def saturated(self, sections: Sequence[torch.Tensor], n: int) -> torch.Tensor:
        codes = sections[0]
        low = (codes & E2M1_MAX_MAGNITUDE_CODE) == E2M1_MAX_MAGNITUDE_CODE
        high = ((codes >> 4) & E2M1_MAX_MAGNITUDE_CODE) == E2M1_MAX_MAGNITUDE_CODE
        # element 2i sits in the low nibble, 2i+1 in the high one
        return torch.stack([low, high], dim=-1).reshape(codes.shape[0], n)

    def _block_amax(self, x):
        chunks, n = x.shape
        a = np.abs(x.astype(np.float64)).reshape(chunks, n // self.granularity, -1).max(-1)
        return np.repeat(a, self.granularity, axis=-1)


class NVFP4Codec(_FP4BlockCodec):
    """NVFP4 on the wire: codes (n/2 bytes), E4M3 scales (n/16), float32 1/S (4 bytes)."""

    fmt = "nvfp4"

    def section_nbytes(self, n: int) -> tuple[int, ...]:
        return (*self._code_and_scale_nbytes(n), 4)

    def _sections(self, q, chunks):
        # Every chunk of one encode call shares the tensor scale; each chunk carries a copy so
        # that a receiver holding chunks from several ranks knows each one's scale.  With
        # chunks = 1 the section is the quantizer's own 4 bytes (no copy): for encode_unchecked
        # one row meant for every chunk, which the transport sends to each peer.
        gs = q.global_scale.view(torch.uint8).view(1, 4)
        if chunks > 1:
            gs = gs.expand(chunks, 4).contiguous()
        return [q.data, q.scales, gs]

    def _row_scales(self, sections, chunks):
        return sections[2].view(torch.float32).view(chunks)  # each chunk's own 1/S, a view

    def _decode_checked(self, sections, n, dtype):
        chunks = sections[0].shape[0]
        # Decode with 1/S = 1, then multiply by each chunk's own 1/S: one dequantize call serves
        # chunks whose tensor scales differ.  e2m1 * s (2 by 4 significant bits, between 2^-10
        # and 2688) is exact in float32, bfloat16 and float16 alike, so it is decoded straight
        # to the output dtype; the in-place product with the float32 1/S is computed in float32
        # (torch's type promotion) and rounded once: the kernel's ((e2m1 * s) * (1/S)) rounded
        # to the dtype, bit for bit, without a float32 copy of the whole tensor.
        y = fp4_kernels.dequantize(self._quantized(sections, n, chunks), _dtype_name(dtype))
        inv_s = sections[2].reshape(chunks, 4).view(torch.float32)
        return y.mul_(inv_s)

    def decoder(
        self, sections: Sequence[torch.Tensor], n: int, dtype: torch.dtype
    ) -> Callable[[], torch.Tensor]:
        chunks = sections[0].shape[0]
        q = self._quantized(sections, n, chunks)
        inv_s = sections[2].view(torch.float32)  # (chunks, 1): each chunk's own 1/S
        name, dequantize = _dtype_name(dtype), fp4_kernels.dequantize
        return lambda: dequantize(q, name).mul_(inv_s)  # as decode: see there

    def error_bound(
        self, x: np.ndarray, rounding: Rounding = "nearest", dtype: torch.dtype = torch.float32
    ) -> np.ndarray:
        check_error_bound_args(self, x, rounding, dtype)
        finite = np.abs(x[np.isfinite(x)])
        amax = np.float32(finite.max() if finite.size else 0.0)
        # S and the 1/S sent with the chunk, as the encoder makes them in float32 (S clamped
        # to FLT_MAX for amax below 2688 / FLT_MAX, ~7.9e-36); S * (1/S) is 1 up to roundings
        s_enc = nvfp4.global_encode_scale(amax)
        inv_s = float(np.float32(1.0) / s_enc)
        ratio = float(s_enc) * inv_s
        amax_b = self._block_amax(x)
        # Effective block scale sigma = s * (1/S), s the E4M3 rounding of amax_b * S / 6, so
        # sigma <= amax_b S (1/S) / 6 * (1 + 2^-4) + 2^-10 / S and 6 * sigma >= amax_b S (1/S)
        # * (1 - 2^-4) - 6 * 2^-10 / S.  Nearest rounding errs by at most half the widest E2M1
        # step (2, between 4 and 6): sigma; stochastic by less than a step: 2 sigma.
        # Saturation (a scale rounded down, or to 0) loses at most amax_b - 6 * sigma.
        sigma = amax_b * ratio / E2M1_MAX * (1 + E4M3_REL_HALF_ULP)
        sigma += E4M3_SUBNORMAL_HALF_STEP * inv_s
        steps = 1.0 if rounding == "nearest" else 2.0
        saturation = amax_b * (1 - ratio * (1 - E4M3_REL_HALF_ULP))
        saturation += E2M1_MAX * E4M3_SUBNORMAL_HALF_STEP * inv_s
        bound = np.maximum(steps * sigma, saturation)
        # A block whose sigma may be below 1 / FLT_MAX is encoded from x * FLT_MAX < x / sigma
        # (FLOAT32_MAX above): its codes are smaller, of the same sign, so it decodes to
        # between 0 and x plus a step: within max(|x|, steps * sigma).
        sigma_lo = amax_b * ratio / E2M1_MAX * (1 - E4M3_REL_HALF_ULP)
        sigma_lo -= E4M3_SUBNORMAL_HALF_STEP * inv_s
        clamped = sigma_lo * (1 - FLOAT32_ROUNDING_SLACK) <= 1 / FLOAT32_MAX
        bound = np.where(clamped, np.maximum(bound, np.abs(x)), bound)
        bound *= 1 + FLOAT32_ROUNDING_SLACK
        # decode: e2m1 * s is exact; its product with 1/S is rounded (in float32, then to
        # dtype), in the subnormal range by up to half a step of each
        absolute = HALF_SUBNORMAL_STEP[torch.float32] + HALF_SUBNORMAL_STEP[dtype]
        return bound + (np.abs(x) + bound) * REL_HALF_ULP[dtype] + absolute


class MXFP4Codec(_FP4BlockCodec):
    """MXFP4 on the wire: codes (n/2 bytes) and E8M0 scales (n/32 bytes)."""

    fmt = "mxfp4"

    def section_nbytes(self, n: int) -> tuple[int, ...]:
        return self._code_and_scale_nbytes(n)

    def _decode_checked(self, sections, n, dtype):
        chunks = sections[0].shape[0]
        return fp4_kernels.dequantize(self._quantized(sections, n, chunks), dtype)

    def error_bound(
        self, x: np.ndarray, rounding: Rounding = "nearest", dtype: torch.dtype = torch.float32
    ) -> np.ndarray:
        check_error_bound_args(self, x, rounding, dtype)
        amax_b = self._block_amax(x)
        with np.errstate(divide="ignore"):
            e = np.floor(np.log2(np.where(amax_b > 0, amax_b, 1.0))) - 2
        sigma = np.exp2(np.maximum(e, -127))
        # amax_b / sigma lies in [4, 8): saturation to 6 loses < 2 sigma, nearest rounding at
        # most 1 sigma, stochastic rounding < 2 sigma.
        bound = np.where(amax_b > 0, 2 * sigma, 0.0)
        return bound + (np.abs(x) + bound) * REL_HALF_ULP[dtype]


class FP4QuantCodec(CheckedCodec):
    """FP4Quant on the wire: codes (n/2 bytes) and bfloat16 group scales (2n/g bytes).

    ``fp4_kernels.FP4Quant`` lays one tensor out as codes then scales in one payload; the
    sections here are that payload's two parts, so chunk i of each is contiguous.
    """

    def __init__(self, group_size: int = 64, hadamard: bool = True) -> None:
        self.fmt = fp4_kernels.FP4Quant(group_size=group_size, hadamard=hadamard)
        self.granularity = self.fmt.group_size
        self.name = f"fp4quant-g{group_size}" + ("" if hadamard else "-nohadamard")

    def section_nbytes(self, n: int) -> tuple[int, ...]:
        n = check_n(self, n)
        return (n // 2, 2 * (n // self.granularity))

    decode_copies = True  # dequantize writes a new tensor

    def encode_unchecked(
        self, x: torch.Tensor, rounding: Rounding, seed: int, step: int
    ) -> list[torch.Tensor]:
        q = fp4_kernels.quantize(x, fmt=self.fmt, rounding=rounding, seed=seed, step=step)
        return [q.data, q.scales.view(torch.uint8).view(x.shape[0], -1)]

    def _decode_checked(self, sections, n, dtype):
        return fp4_kernels.dequantize(self._quantized(sections, n), _dtype_name(dtype))

    def decoder(
        self, sections: Sequence[torch.Tensor], n: int, dtype: torch.dtype
    ) -> Callable[[], torch.Tensor]:
        q = self._quantized(sections, n)
        name, dequantize = _dtype_name(dtype), fp4_kernels.dequantize
        return lambda: dequantize(q, name)

    def _quantized(self, sections, n):
        codes, scales = sections
        chunks = codes.shape[0]
        return fp4_kernels.QuantizedTensor(
            data=codes.reshape(chunks, n // 2),
            scales=scales.reshape(chunks, -1).view(torch.uint16),
            global_scale=None,
            fmt=self.fmt,
            shape=(chunks, n),
            dtype="float32",
            scale_layout="linear",
        )

    def error_bound(
        self, x: np.ndarray, rounding: Rounding = "nearest", dtype: torch.dtype = torch.float32
    ) -> np.ndarray:
        check_error_bound_args(self, x, rounding, dtype)
        g = self.granularity
        stages = g.bit_length() - 1 if self.fmt.hadamard else 0
        groups = np.abs(x.astype(np.float64)).reshape(-1, g)
        amax_x = groups.max(axis=1)
        t = hadamard_f64(x.astype(np.float64).reshape(-1, g)) if self.fmt.hadamard else groups
        # float32 butterflies: each of the log2(g) stages rounds partial sums no larger than
        # g * amax_x, and every output collects one rounding per stage of that size.
        transform_err = stages * FLOAT32_REL_HALF_ULP * g * amax_x
        # s = bf16 rounding *up* of amax(t) * fp32(1/6): never below amax(t) / 6 (no element
        # clips), at most 2^-7 (one bfloat16 ulp) above it, or one subnormal step (2^-133)
        # in bfloat16's subnormal range.
        s_hi = (np.abs(t).max(axis=1) + transform_err) / E2M1_MAX * (1 + 2.0**-7)
        s_hi = s_hi * (1 + FLOAT32_ROUNDING_SLACK) + 2 * HALF_SUBNORMAL_STEP[torch.bfloat16]
        steps = 1.0 if rounding == "nearest" else 2.0
        # The inverse transform divided by g maps a code-domain error bounded by e elementwise
        # to one bounded by e again (a mean of +-e), and rounds like the forward one.
        per_group = steps * s_hi + transform_err + stages * FLOAT32_REL_HALF_ULP * 6 * s_hi
        # A scale below 1 / FLT_MAX: the codes come from t * FLT_MAX < t / s (FLOAT32_MAX
        # above), smaller and of the same sign, so each decoded t errs by at most max(|t|,
        # steps * s): within amax(t) per element, through the inverse transform as well.
        t_hi = np.abs(t).max(axis=1) + transform_err
        s_lo = (np.abs(t).max(axis=1) - transform_err) / E2M1_MAX * (1 - FLOAT32_ROUNDING_SLACK)
        clamped = s_lo - HALF_SUBNORMAL_STEP[torch.float32] <= 1 / FLOAT32_MAX
        per_group = np.where(clamped, np.maximum(per_group, t_hi), per_group)
        bound = np.repeat(per_group, g).reshape(x.shape)
        # the decode is exact in float32 (module docstring of fp4_kernels.formats.fp4quant)
        # and then rounded to dtype: in its subnormal range by up to half a step
        return bound + (np.abs(x) + bound) * REL_HALF_ULP[dtype] + HALF_SUBNORMAL_STEP[dtype]

    @property
    def key(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"FP4QuantCodec(group_size={self.granularity}, hadamard={self.fmt.hadamard})"


def hadamard_f64(groups):
    """Unnormalized Walsh-Hadamard transform of each row, in float64 (the exact reference)."""
    t = groups.copy()
    g = t.shape[1]
    h = 1
    while h < g:
        t = t.reshape(-1, g // (2 * h), 2, h)
        a, b = t[:, :, 0, :].copy(), t[:, :, 1, :].copy()
        t[:, :, 0, :], t[:, :, 1, :] = a + b, a - b
        t = t.reshape(-1, g)
        h *= 2
    return t


_ONES = {}


def _ones(device):
    # The 1/S = 1 that decode hands to dequantize; one per device, made once (an allocation and
    # a fill on every call would be two more launches on the data path).
    t = _ONES.get(device)
    if t is None:
        t = _ONES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return t


def check_float_tensor(what: str, t: torch.Tensor) -> None:
    """``t``, a torch tensor: dense (strided, not nested) and of float32, bfloat16 or float16;
    TypeError beginning with ``what`` and naming the fix otherwise.  Meta tensors and lazily
    negated views pass: each caller says what it does with them."""
    if t.is_nested or t.layout != torch.strided:
        kind = "nested" if t.is_nested else str(t.layout)
        raise TypeError(f"{what}: a {kind} tensor; pass a dense one "
                        "(torch.nested.to_padded_tensor, or .to_dense())")  # fmt: skip
    if t.dtype not in REL_HALF_ULP:
        raise TypeError(f"{what}: dtype {t.dtype} is not supported; use float32, bfloat16, "
                        "float16")  # fmt: skip


def check_rounding(rounding):
    if not isinstance(rounding, str) or rounding not in ROUNDINGS:
        raise ValueError(f"rounding: {rounding!r} is not one of {ROUNDINGS}")


def check_int(value, name: str, limit: int) -> int:
    """``value`` as an int in [0, limit): TypeError for a non-integer (floats included),
    ValueError out of range; the rule of ``fp4_kernels.quantize`` for its seed and step (a
    bool is refused: ``True`` for 1 is a slip)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__}") from None
    if not 0 <= v < limit:
        bound = f"2**{limit.bit_length() - 1}" if limit & (limit - 1) == 0 else str(limit)
        raise ValueError(f"{name}: {v} is outside [0, {bound})")
    return v


def check_n(codec, n):
    """``n``, the elements a chunk, as an int that is a multiple of ``codec.granularity``
    (errors name the codec)."""
    what = f"{type(codec).__name__}: n"
    n = check_int(n, what, 2**63)
    if n % codec.granularity:
        raise ValueError(f"{what} = {n} is no multiple of the block size {codec.granularity}")
    return n


def check_encode_args(codec, x, rounding, seed, step):
    """Check ``encode``'s arguments; the (empty) sections where ``x`` has no element, else None."""
    what = f"{type(codec).__name__}.encode"
    check_rounding(rounding)
    check_int(seed, "seed", SEED_LIMIT)
    if not isinstance(step, torch.Tensor):  # a step tensor: fp4_kernels.quantize checks it
        check_int(step, "step", STEP_LIMIT)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: x: expected a torch tensor, got {type(x).__name__}")
    check_float_tensor(f"{what}: x", x)
    if x.is_meta or x.is_neg():
        kind = "meta" if x.is_meta else "negative-view"
        raise TypeError(f"{what}: x: a {kind} tensor; pass a tensor holding its values "
                        "(.resolve_neg(); the collectives take such views)")  # fmt: skip
    if x.dim() != 2:
        raise ValueError(f"{what}: x: expected (chunks, n), got shape {tuple(x.shape)}")
    n = check_n(codec, x.shape[1])
    if not x.is_contiguous():
        raise ValueError(f"{what}: x must be contiguous; call .contiguous()")
    if x.numel() == 0:
        return [torch.empty(x.shape[0], b, dtype=torch.uint8, device=x.device)
                for b in codec.section_nbytes(n)]  # fmt: skip
    return None


def check_error_bound_args(codec, x, rounding, dtype):
    """Check ``error_bound``'s arguments: a (chunks, n) float32 numpy array with n a multiple
    of the codec's granularity, a rounding the codec encodes with, a decoded dtype."""
    what = f"{type(codec).__name__}.error_bound"
    check_rounding(rounding)
    if rounding == "stochastic" and getattr(codec, "nearest_only", False):
        raise ValueError(f"{what}: rounding 'stochastic': {codec.name} rounds to nearest only")
    if dtype not in REL_HALF_ULP:
        raise TypeError(f"{what}: dtype {dtype!r}: use torch.float32, bfloat16 or float16")
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2:
        kind = f"{x.dtype} array of shape {x.shape}" if isinstance(x, np.ndarray) else (
            type(x).__name__)  # fmt: skip
        raise TypeError(f"{what}: x: expected a (chunks, n) float32 numpy array, got {kind}")
    check_n(codec, x.shape[1])


def _decode_args(codec, sections, n, dtype):
    """Check ``decode``'s arguments: as many uint8 (chunks, section_nbytes(n)[i]) tensors as
    the codec has sections, contiguous, on one device.  ``n`` as an int (``check_n``), and the
    (empty) result where there is no element, else None."""
    what = f"{type(codec).__name__}.decode"
    n = check_n(codec, n)
    sizes = codec.section_nbytes(n)
    if dtype not in REL_HALF_ULP:
        raise TypeError(f"{what}: dtype {dtype!r}: use torch.float32, bfloat16 or float16")
    if not isinstance(sections, (list, tuple)) or len(sections) != len(sizes):
        got = len(sections) if isinstance(sections, (list, tuple)) else type(sections).__name__
        raise ValueError(f"{what}: expected {len(sizes)} sections (uint8, {sizes} bytes per "
                         f"chunk), got {got}")  # fmt: skip
    chunks = device = None
    for i, (t, b) in enumerate(zip(sections, sizes, strict=True)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
            kind = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{what}: section {i} is {kind}, not a uint8 tensor")
        chunks = t.shape[0] if chunks is None else chunks
        device = t.device if device is None else device
        if t.dim() != 2 or tuple(t.shape) != (chunks, b):
            raise ValueError(f"{what}: section {i} has shape {tuple(t.shape)}; for n = {n} "
                             f"it is ({chunks}, {b})")  # fmt: skip
        if t.device != device or not t.is_contiguous():
            raise ValueError(f"{what}: the sections must be contiguous and on one device")
    if chunks == 0 or n == 0:
        return n, torch.empty(chunks, n, dtype=dtype, device=device)
    return n, None


def _viewable(sections):
    """``sections``, each one whose byte offset in its storage is no multiple of
    ``SECTION_VIEW_ALIGN`` replaced by a copy, which starts at offset 0 (a view of wider fields
    is then possible)."""
    if all(t.storage_offset() % SECTION_VIEW_ALIGN == 0 for t in sections):
        return sections
    return [t if t.storage_offset() % SECTION_VIEW_ALIGN == 0 else t.clone() for t in sections]


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


_BY_NAME = {"nvfp4": NVFP4Codec, "mxfp4": MXFP4Codec, "none": NoneCodec}
# The dtypes of the "none-<dtype>" codecs, by the name torch gives them.
_NONE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
#: The codec names that ``get_codec`` takes ("none" is "none-bfloat16").
CODEC_NAMES = (
    *_BY_NAME,
    *(f"none-{name}" for name in _NONE_DTYPES),
    "tahquant-h<C>",
    "tahquant-grad",
)


#: ``codec=`` of the collectives: a name (``CODEC_NAMES``), an ``fp4_kernels.FP4Quant`` or a
#: ``Codec``.
CodecSpec = str | fp4_kernels.FP4Quant | Codec


def get_codec(spec: CodecSpec) -> Codec:
    """A codec from ``"nvfp4"``, ``"mxfp4"``, ``"none"`` (bfloat16 values), ``"none-bfloat16"``
    / ``"none-float32"`` / ``"none-float16"``, ``"tahquant-h<C>"`` (TAH-Quant's activation codec
    for tokens of ``C`` channels) / ``"tahquant-grad"`` (its gradient codec;
    ``fp4_comm.tahquant``), an ``fp4_kernels.FP4Quant``, or a ``Codec`` instance (as is).  Other
    names (``"none-fp16"`` too: no aliases) raise ValueError."""
    if isinstance(spec, Codec):
        return spec
    if isinstance(spec, fp4_kernels.FP4Quant):
        return FP4QuantCodec(spec.group_size, spec.hadamard)
    if isinstance(spec, str):
        if spec in _BY_NAME:
            return _BY_NAME[spec]()
        if spec.startswith("none-") and spec[len("none-") :] in _NONE_DTYPES:
            return NoneCodec(spec[len("none-") :])
        if spec.startswith("tahquant"):
            return _tahquant(spec)
    raise ValueError(
        f"codec: {spec!r} is not a Codec, an fp4_kernels.FP4Quant, nor one of "
        f"{', '.join(map(repr, CODEC_NAMES))}"
    )


def _tahquant(spec):
    # imported here: tahquant builds on this module's Codec
    from .tahquant import TAHQuantCodec, TAHQuantGradCodec

    if spec == "tahquant-grad":
        return TAHQuantGradCodec()
    digits = spec[len("tahquant-h") :] if spec.startswith("tahquant-h") else ""
    if not (digits.isascii() and digits.isdigit()):  # ("²" is a digit to str.isdigit)
        raise ValueError(
            f"codec: {spec!r}: TAH-Quant's activation codec ranks tokens, so its name carries "
            "the tokens' hidden size: 'tahquant-h<C>' (e.g. 'tahquant-h768'); 'tahquant-grad' "
            "is its gradient codec"
        )
    return TAHQuantCodec(int(digits))


def padded_chunk(n: int, chunks: int, granularity: int) -> int:
    """Elements per chunk when ``n`` elements (an int >= 0) are split into ``chunks`` equal
    chunks (an int >= 1), each a multiple of ``granularity`` (an int >= 1; zeros pad the end)."""
    n = check_int(n, "padded_chunk: n", 2**63)
    for name, value in (("chunks", chunks), ("granularity", granularity)):
        try:
            positive = check_int(value, f"padded_chunk: {name}", 2**63) >= 1
        except ValueError:
            positive = False
        if not positive:
            raise ValueError(f"padded_chunk: {name}: {value}; expected an int >= 1") from None
    per = max(1, -(-n // chunks))
    return -(-per // granularity) * granularity
