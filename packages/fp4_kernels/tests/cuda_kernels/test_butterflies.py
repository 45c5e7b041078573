"""cuda/butterflies.py's "smem" network, checked on its tables (no kernel runs): every layout
covers each element once, the stages fall in registers in the reference's order, each
shared-memory access instruction is free of bank conflicts and each global access instruction
covers whole 128-byte lines."""

import pytest

from fp4_kernels.cuda import butterflies as H
from fp4_kernels.formats.hadamard import stage_order

GROUP_SIZES = [16 << i for i in range(10)]
LINE_BYTES = 128


def _element(layout, i, lane, warp):
    return (
        H.bits_offset(layout.regs, i)
        + H.bits_offset(layout.lanes, lane)
        + H.bits_offset(layout.warps, warp)
    )


def _warps(g):
    return max(1, g // H.WARP_TILE)


# (data loaded, data stored) float32, two-transpose exchange: the transform (same; 16-bit data
# with the direct exchange from g = 2048), FP4Quant decode to float32 (codes in, float32
# out) and encode of float32 (float32 in, codes out in runs of 8), and the FP4Quant kernels of
# 16-bit data (three transposes)
WIDTHS = [(False, False, True), (True, True, False), (False, True, False), (True, False, False),
          (False, False, False)]  # fmt: skip


def _transposes(g, wide):
    chain = H.layouts(g, *wide)
    k = H.cross_warp_bits(g)
    for src, dst in zip(chain, chain[1:], strict=False):
        yield src, dst, (k if dst is chain[-1] and k else 0)


@pytest.mark.parametrize("wide", WIDTHS)
@pytest.mark.parametrize("g", GROUP_SIZES)
def test_layouts_cover_the_tile_once(g, wide):
    n_warps = max(_warps(g), 8 if g <= H.WARP_TILE else 1)
    for layout in H.layouts(g, *wide):
        seen = {
            _element(layout, i, lane, warp)
            for i in range(32)
            for lane in range(32)
            for warp in range(n_warps)
        }
        assert seen == set(range(32 * 32 * n_warps)), layout


@pytest.mark.parametrize("wide", WIDTHS)
@pytest.mark.parametrize("g", GROUP_SIZES)
def test_every_stage_is_a_register_stage_in_order(g, wide):
    """Walking the layouts as ``make_network`` does finds every stage of the reference's order
    in registers, and ends in the final layout."""
    chain = H.layouts(g, *wide)
    at = 0
    for b in stage_order(g):
        while b not in chain[at].regs:
            at += 1
        assert at < len(chain)
    assert H.make_network(g, wide[0], wide[1], direct_exchange=wide[2])[0] == chain[-1]


def _bank_groups(addr_bytes, width):
    """Shared-memory wavefront conflicts of one access instruction (32 lanes, ``width`` bytes
    each): lanes are served 128 bytes at a time (8 lanes of 16 bytes, 16 of 8); within such a
    group, two lanes on the same bank row but different addresses conflict."""
    per = LINE_BYTES // width
    worst = 1
    for first in range(0, 32, per):
        banks = {}
        for a in addr_bytes[first : first + per]:
            banks.setdefault((a % LINE_BYTES) // width, set()).add(a)
        worst = max(worst, max(len(s) for s in banks.values()))
    return worst


@pytest.mark.parametrize("wide", WIDTHS)
@pytest.mark.parametrize("g", GROUP_SIZES)
def test_transposes_are_one_to_one_and_conflict_free(g, wide):
    for src, dst, k in _transposes(g, wide):
        vec, amap = H.address_map(src, dst, 10 + k)
        n_bits = 10 + k
        words = set()
        for e in range(1 << n_bits):
            a = 0
            for b in range(n_bits):
                if e >> b & 1:
                    a ^= amap[b]
            words.add(a)
        assert words == set(range(1 << n_bits)), (g, src, dst)
        width = 4 << len(vec)
        for layout in (src, dst):
            lo, hi, regs = H.split_accesses(layout, vec, [4 * a for a in amap], k)
            for q in range(len(lo)):
                for warp in range(1 << k if k else 1):
                    lane_addr = [
                        H.xor_of([4 * a for a in amap], layout.lanes, lane)
                        ^ H.xor_of([4 * a for a in amap], layout.warps[:k], warp)
                        for lane in range(32)
                    ]
                    addrs = [(a ^ lo[q]) + hi[q] for a in lane_addr]
                    assert all(a % width == 0 for a in addrs)
                    assert _bank_groups(addrs, width) == 1, (g, layout, q)
                    # the vector holds the registers whose elements are consecutive words
                    r = regs[q * (1 << len(vec)) : (q + 1) * (1 << len(vec))]
                    for m, i in enumerate(r):
                        e = _element(layout, i, 0, warp) % (1 << n_bits)
                        a = 0
                        for b in range(n_bits):
                            if e >> b & 1:
                                a ^= 4 * amap[b]
                        assert a == addrs[0] + 4 * m


@pytest.mark.parametrize("g", GROUP_SIZES)
@pytest.mark.parametrize("element_bytes", [2, 4])
def test_global_accesses_cover_whole_lines(g, element_bytes):
    """Each load (first layout) and each store (final layout, of either exchange) instruction of
    a warp (16 bytes a lane; a run of 4 bf16, or of 2 in the direct exchange at g = 8192)
    touches only 128-byte lines it reads or writes entirely."""
    wide = element_bytes == 4
    chain = H.layouts(g, wide)
    for layout in (chain[0], chain[-1], H.layouts(g, wide, direct_exchange=True)[-1]):
        run = H.run_length(layout)
        per_access = min(run, 16 // element_bytes)  # elements one access moves
        assert per_access * element_bytes >= (4 if layout is H.EXCHANGED_DIRECT.get(3) else 8)
        for i0 in range(0, 32, per_access):
            touched = {}
            for lane in range(32):
                e = _element(layout, i0, lane, 0)
                for b in range(per_access * element_bytes):
                    touched.setdefault((e * element_bytes + b) // LINE_BYTES, set()).add(b)
            sizes = {
                line: sum(
                    per_access * element_bytes
                    for lane in range(32)
                    if (_element(layout, i0, lane, 0) * element_bytes) // LINE_BYTES == line
                )
                for line in touched
            }
            assert all(size == LINE_BYTES for size in sizes.values()), (g, layout, i0)
