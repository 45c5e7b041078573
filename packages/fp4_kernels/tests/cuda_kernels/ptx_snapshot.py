"""The PTX of every kernel variant, written to a folder and compared with another such folder:
a refactoring that means to leave the kernels alone shows that it did.

    NUMBA_ENABLE_CUDASIM=0 python ptx_snapshot.py dump DIR [--only PREFIX ...]
    python ptx_snapshot.py compare DIR_BEFORE DIR_AFTER

Each variant is one file, ``<name>.ptx``, normalized: NVVM's header comments and numba's
environment globals dropped, and every mangled symbol renamed ``SYM<k>`` in order of first
appearance (a device function that moved to another module keeps its code, not its name; a
shared array's number depends on what the process compiled before it).
``compare`` lists the variants whose text differs and those only one folder has; it exits
non-zero when there are any.  Compiled for sm_90 as the compile-check tier does, no GPU needed.
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
from pathlib import Path

# mangled names, and numba's shared arrays (numbered in the order a process compiles them)
SYMBOL = re.compile(r"_Z[A-Za-z0-9_]+|_cudapy_smem_[0-9]+")


def normalize(ptx):
    """PTX text without comments and numba environment globals, symbols renamed by order."""
    names = {}
    lines = []
    for line in ptx.splitlines():
        stripped = line.strip()
        if stripped.startswith("//") or "NumbaEnv" in line:
            continue
        lines.append(SYMBOL.sub(lambda m: names.setdefault(m.group(0), f"SYM{len(names)}"), line))
    return "\n".join(lines) + "\n"


def variants():
    """(name, thunk) of every kernel variant; a thunk returns (kernel, signature)."""
    from numba import types

    from fp4_kernels.cuda import (
        amax,
        dequantize,
        fp4quant,
        hadamard,
        quantize,
        quantize_dequantize,
        reduce,
    )
    from fp4_kernels.formats import mxfp4, nvfp4

    w32 = types.Array(types.uint32, 1, "C")
    u16 = types.Array(types.uint16, 1, "C")
    u8 = types.Array(types.uint8, 1, "C")
    f32 = types.Array(types.float32, 1, "C")
    i64, u32 = types.int64, types.uint32
    elements = {0: w32, 1: u16, 2: u16}
    quantize_sig = (w32, w32, u8, w32, i64, i64, i64, f32, i64, types.float32, f32, u32, u32, u32)
    dequantize_sig = (u8, f32, w32, i64, i64, i64)
    hadamard_sig = (w32, i64, w32)
    encode_sig = (w32, u16, i64, u32, u32, u32)
    decode_sig = (u16, w32, i64)
    out = []

    def add(name, build, sig):
        out.append((name, lambda: (build(), sig)))

    formats = {"nvfp4": (nvfp4.SPEC, 2), "mxfp4": (mxfp4.SPEC, 4)}
    for kind, (fname, (fmt, fused_lanes)) in itertools.product((0, 1, 2), formats.items()):
        for sr, swz, fused in itertools.product((False, True), repeat=3):
            lane_choices = {1, fused_lanes} if fused else {1}
            for lanes in sorted(lane_choices):
                name = f"quantize_k{kind}_{fname}_sr{int(sr)}_swz{int(swz)}_fused{int(fused)}"
                add(
                    f"{name}_lanes{lanes}",
                    lambda a=(kind, fmt, sr, swz, fused, True, lanes): quantize.quantize_kernel(*a),
                    quantize_sig,
                )
        add(
            f"quantize_k{kind}_{fname}_unaligned",
            lambda a=(kind, fmt, False, False, False, False): quantize.quantize_kernel(*a),
            (elements[kind],) + quantize_sig[1:],
        )
        for swz in (False, True):
            codes = u16 if kind == 0 else w32
            add(
                f"dequantize_k{kind}_{fname}_swz{int(swz)}",
                lambda a=(kind, fmt, swz): dequantize.dequantize_kernel(*a),
                (codes,) + dequantize_sig,
            )
            add(
                f"dequantize_k{kind}_{fname}_swz{int(swz)}_unaligned",
                lambda a=(kind, fmt, swz, False): dequantize.dequantize_kernel(*a),
                (u8,) + dequantize_sig,
            )
    fake_sig = (w32, w32, i64, f32, i64, types.float32, f32, u32, u32, u32)
    for kind, (fname, (fmt, _)), sr in itertools.product((0, 1, 2), formats.items(), (0, 1)):
        add(
            f"fake_quantize_k{kind}_{fname}_sr{sr}",
            lambda a=(kind, fmt, bool(sr)): quantize_dequantize.fake_quantize_kernel(*a),
            fake_sig,
        )
        add(
            f"fake_quantize_k{kind}_{fname}_sr{sr}_unaligned",
            lambda a=(kind, fmt, bool(sr), False): quantize_dequantize.fake_quantize_kernel(*a),
            (elements[kind],) + fake_sig[1:],
        )
    for kind in (0, 1, 2):
        add(f"amax_k{kind}", lambda k=kind: amax.amax_kernel(k), (w32, i64, f32))
        add(
            f"amax_k{kind}_unaligned",
            lambda k=kind: amax.amax_kernel(k, False),
            (elements[kind], i64, f32),
        )
    reduce_head = (w32, u8, f32, i64, i64, i64)
    reduce_sig = reduce_head + (w32, u8, f32, f32, i64)
    for fname, (fmt, _) in formats.items():
        add(f"reduce_{fname}", lambda f=fmt: reduce.requantized_sum_kernel(f), reduce_sig)
        add(
            f"reduce_{fname}_unaligned",
            lambda f=fmt: reduce.requantized_sum_kernel(f, False),
            (u8,) + reduce_sig[1:],
        )
    add("reduce_amax_nvfp4", lambda: reduce.requantized_sum_amax_kernel(), reduce_head + (f32,))
    add(
        "reduce_amax_nvfp4_unaligned",
        lambda: reduce.requantized_sum_amax_kernel(False),
        (u8,) + reduce_head[1:] + (f32,),
    )
    groups = [16 << i for i in range(10)]
    group_cases = [(1, g) for g in groups] + [(k, g) for k in (0, 2) for g in (64, 2048)]
    for (kind, g), inverse, signed in itertools.product(group_cases, (False, True), (False, True)):
        tag = f"k{kind}_g{g}_inv{int(inverse)}_signed{int(signed)}"
        add(
            f"hadamard_{tag}",
            lambda a=(kind, g, inverse, signed): hadamard.hadamard_kernel(*a),
            (w32,) + hadamard_sig,
        )
        for pf in (False, True):
            if pf and kind == 0:
                continue
            add(
                f"smem_hadamard_{tag}_pf{int(pf)}",
                lambda a=(kind, g, inverse, signed, True, pf): hadamard.smem_hadamard_kernel(*a),
                (w32,) + hadamard_sig,
            )
    for (kind, g), sr in itertools.product(group_cases, (False, True)):
        sig = (w32,) + encode_sig if g < 8192 else (w32, u16) + encode_sig[1:]
        for had, smem, pf in ((True, False, False), (True, True, False), (True, True, True)):
            if pf and kind == 0:
                continue
            add(
                f"fp4quant_encode_k{kind}_g{g}_sr{int(sr)}_smem{int(smem)}_pf{int(pf)}",
                lambda a=(kind, g, had, sr, True, smem, pf): fp4quant.fp4quant_encode_kernel(*a),
                sig,
            )
        if g in (16, 256, 2048):
            add(
                f"fp4quant_encode_k{kind}_g{g}_sr{int(sr)}_nohadamard",
                lambda a=(kind, g, False, sr): fp4quant.fp4quant_encode_kernel(*a),
                sig,
            )
    for (kind, g), (smem, pf) in itertools.product(
        group_cases, ((False, False), (True, False), (True, True))
    ):
        add(
            f"fp4quant_decode_k{kind}_g{g}_smem{int(smem)}_pf{int(pf)}",
            lambda a=(kind, g, True, smem, pf): fp4quant.fp4quant_decode_kernel(*a),
            (w32,) + decode_sig,
        )
    return out


def dump(folder, only):
    from fp4_kernels.testing import compile_ptx

    folder.mkdir(parents=True, exist_ok=True)
    chosen = [(n, t) for n, t in variants() if not only or n.startswith(tuple(only))]
    for i, (name, thunk) in enumerate(chosen):
        kernel, sig = thunk()
        (folder / f"{name}.ptx").write_text(normalize(compile_ptx(kernel, sig)))
        print(f"{i + 1}/{len(chosen)} {name}", flush=True)


def compare(before, after):
    a = {p.name: p for p in before.glob("*.ptx")}
    b = {p.name: p for p in after.glob("*.ptx")}
    differ = sorted(n for n in a.keys() & b.keys() if a[n].read_text() != b[n].read_text())
    for n in differ:
        print("differs:", n)
    for n in sorted(a.keys() - b.keys()):
        print("only before:", n)
    for n in sorted(b.keys() - a.keys()):
        print("only after:", n)
    same = len(a.keys() & b.keys()) - len(differ)
    print(f"{same} identical, {len(differ)} differ, {len(a.keys() ^ b.keys())} in one folder only")
    return 1 if differ or a.keys() != b.keys() else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump")
    d.add_argument("folder", type=Path)
    d.add_argument("--only", nargs="*", default=[], help="name prefixes to dump")
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = ap.parse_args()
    if args.command == "dump":
        dump(args.folder, args.only)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
