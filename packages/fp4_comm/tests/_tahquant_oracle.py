"""A plain-numpy TAH-Quant, written from the text of ``fp4_comm.tahquant``'s docstring (and
the paper), not from its code: token by token and tile by tile, scalar float32 arithmetic in
the order the text gives, one LSB-first bit stream for every packed field.  The oracle of
test_fp4_comm_tahquant.py."""

from __future__ import annotations

import numpy as np

F32 = np.float32
TILE = 64
GRAD_TILE = 32
NAN16 = np.uint16(0x7E00)


def _f16_bits(v):
    with np.errstate(over="ignore"):  # beyond 65504: inf, which the codec marks NaN
        return int(np.array(v, dtype=np.float32).astype(np.float16).view(np.uint16))


def _f16_value(bits):
    return F32(np.array(bits, dtype=np.uint16).view(np.float16))


def halving_sum(values):
    """Zero-pad to a power of two, then add the upper half to the lower one until one is left."""
    v = [F32(t) for t in values]
    w = 1
    while w < len(v):
        w *= 2
    v += [F32(0)] * (w - len(v))
    while len(v) > 1:
        h = len(v) // 2
        v = [F32(v[i] + v[i + h]) for i in range(h)]
    return v[0]


def ln(p):
    """ln of a positive float32 from frexp: m in [sqrt(1/2), sqrt(2)), s = (m-1)/(m+1),
    2 s (1 + s^2/3 + s^4/5 + s^6/7 + s^8/9) by Horner, plus e ln 2."""
    m, e = np.frexp(F32(p))
    m, e = F32(m), int(e)
    if m < F32(0.70710677):
        m, e = F32(m * F32(2)), e - 1
    s = F32(F32(m - F32(1)) / F32(m + F32(1)))
    z = F32(s * s)
    r = F32(1.0 / 9)
    for k in (7, 5, 3, 1):
        r = F32(F32(r * z) + F32(1.0 / k))
    t = F32(s * r)
    return F32(F32(F32(e) * F32(0.6931472)) + F32(t + t))


def entropy(token):
    a = [F32(abs(t)) for t in token]
    total = halving_sum(a)
    if not np.isfinite(total):
        return -np.inf
    terms = []
    for ai in a:
        p = F32(ai / total) if total != 0 else F32(np.nan)
        terms.append(F32(p * ln(p)) if p > 0 else F32(0))
    return F32(F32(0) - halving_sum(terms))


def hadamard(tile):
    t = [F32(v) for v in tile]
    h = 1
    while h < len(t):
        for i in range(len(t)):
            if i & h == 0:
                a, b = t[i], t[i + h]
                t[i], t[i + h] = F32(a + b), F32(a - b)
        h *= 2
    return [F32(v * F32(0.125)) for v in t]


def encode_fields(x, token_size):
    """x (chunks, n) float32 -> the fields of every chunk, unpacked."""
    x = np.asarray(x, dtype=np.float32)
    R, n = x.shape
    C = token_size
    T = n // C
    n_low = T * 20 // 100
    out = []
    for r in range(R):
        tokens = x[r].reshape(T, C)
        h = [entropy(tokens[t]) for t in range(T)]
        ranked = sorted(range(T), key=lambda t: (h[t], t))
        low = [False] * T
        for t in ranked[:n_low]:
            low[t] = True
        codes = np.zeros((T, C), dtype=np.int64)
        zeros, scales, transform, pivots = [], [], [], []
        for t in range(T):
            levels = 7 if low[t] else 15
            for j in range(C // TILE):
                tile = [F32(v) for v in tokens[t, j * TILE : (j + 1) * TILE]]
                finite = all(np.isfinite(v) for v in tile)
                mags = [abs(v) for v in tile]
                pivot = 0
                apply = False
                if finite:
                    top1, top2 = sorted(mags)[-1], sorted(mags)[-2]
                    pivot = mags.index(top1)
                    apply = bool(top1 >= F32(top2 * F32(2)))
                v = tile
                if apply:
                    v = list(tile)
                    v[0], v[pivot] = tile[pivot], tile[0]
                    v = hadamard(v)
                ok = finite and all(np.isfinite(e) for e in v)
                if ok:
                    lo, hi = F32(min(v) + F32(0)), F32(max(v) + F32(0))  # -0 counts as +0
                    z_bits = _f16_bits(lo)
                    zero = _f16_value(z_bits)
                    spread = F32(hi - zero)
                    spread = spread if spread > 0 else F32(0)
                    s_bits = _f16_bits(F32(spread / F32(levels)))
                    scale = _f16_value(s_bits)
                    ok = bool(np.isfinite(zero) and np.isfinite(scale))
                if not ok:
                    zeros.append(int(NAN16))
                    scales.append(int(NAN16))
                    transform.append(False)
                    pivots.append(0)
                    continue
                zeros.append(z_bits)
                scales.append(s_bits)
                transform.append(apply)
                pivots.append(pivot if apply else 0)
                if scale > 0:
                    for i, e in enumerate(v):
                        q = np.rint(F32(F32(e - zero) / scale))
                        codes[t, j * TILE + i] = int(min(max(q, 0), levels))
        out.append({"low": low, "codes": codes, "zeros": zeros, "scales": scales,
                    "transform": transform, "pivots": pivots})  # fmt: skip
    return out


def stream(fields):
    """(value, width) pairs -> bytes of one LSB-first bit stream (bit j is bit j % 8 of byte
    j // 8), the last byte zero-filled."""
    bits = [(int(v) >> k) & 1 for v, w in fields for k in range(w)]
    bits += [0] * (-len(bits) % 8)
    return [sum(bits[i + k] << k for k in range(8)) for i in range(0, len(bits), 8)]


def pack(fields):
    rows = []
    for f in fields:
        low = f["low"]
        row = stream([(c, 3) for t, is_low in enumerate(low) if is_low for c in f["codes"][t]])
        row += stream([(c, 4) for t, is_low in enumerate(low) if not is_low for c in f["codes"][t]])
        for key in ("zeros", "scales"):
            for b in f[key]:
                row += [b & 255, b >> 8]
        row += stream([(v, 1) for v in low])
        row += stream([(v, 1) for v in f["transform"]])
        row += stream([(v, 6) for v in f["pivots"]])
        rows.append(row)
    return np.array(rows, dtype=np.uint8)


def decode_fields(fields, token_size):
    out = []
    for f in fields:
        T = len(f["low"])
        y = np.zeros(T * token_size, dtype=np.float32)
        tiles = token_size // TILE
        for t in range(T):
            for j in range(tiles):
                k = t * tiles + j
                zero = _f16_value(f["zeros"][k])
                scale = _f16_value(f["scales"][k])
                v = [
                    F32(F32(F32(q) * scale) + zero)
                    for q in f["codes"][t, j * TILE : (j + 1) * TILE]
                ]
                if f["transform"][k]:
                    v = hadamard(v)
                    p = f["pivots"][k]
                    v[0], v[p] = v[p], v[0]
                y[k * TILE : (k + 1) * TILE] = v
        out.append(y)
    return np.stack(out)


def grad_encode(x):
    """(chunks, n) -> uint8 (chunks, 6n/8 + 2n/32): 6-bit codes, then fp16 scales."""
    x = np.asarray(x, dtype=np.float32)
    rows = []
    for r in range(x.shape[0]):
        codes, scales = [], []
        for j in range(x.shape[1] // GRAD_TILE):
            tile = [F32(v) for v in x[r, j * GRAD_TILE : (j + 1) * GRAD_TILE]]
            finite = all(np.isfinite(v) for v in tile)
            s_bits = _f16_bits(max(abs(v) for v in tile)) if finite else int(NAN16)
            scale = _f16_value(s_bits)
            if not np.isfinite(scale):
                s_bits, scale = int(NAN16), F32(np.nan)
            for v in tile:
                q = 0
                if np.isfinite(scale) and scale > 0:
                    q = int(min(max(np.rint(F32(F32(v / scale) * F32(32))), -32), 31))
                codes.append(q + 32)
            scales.append(s_bits)
        row = stream([(c, 6) for c in codes])
        for b in scales:
            row += [b & 255, b >> 8]
        rows.append(row)
    return np.array(rows, dtype=np.uint8)


def grad_decode(raw, n):
    raw = np.asarray(raw, dtype=np.uint8)
    out = np.zeros((raw.shape[0], n), dtype=np.float32)
    for r in range(raw.shape[0]):
        bits = [(int(b) >> k) & 1 for b in raw[r] for k in range(8)]
        split = n * 6 // 8
        for i in range(n):
            code = sum(bits[6 * i + k] << k for k in range(6)) - 32
            j = i // GRAD_TILE
            s = int(raw[r, split + 2 * j]) | int(raw[r, split + 2 * j + 1]) << 8
            out[r, i] = F32(F32(F32(code) * F32(1 / 32)) * _f16_value(s))
    return out
