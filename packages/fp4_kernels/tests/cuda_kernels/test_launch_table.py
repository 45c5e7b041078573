"""cuda/launch_table.py: every op launches as its row of the launch table says (threads a CTA,
work a thread a pass, the caps on the grid), read here from the same table.

Without a GPU: torch tensors pretend to live on cuda:0 (``_fake_cuda``, 132 SMs, occupancy
2048 threads an SM) and the launches are recorded.
"""

from __future__ import annotations

import importlib

import pytest

torch = pytest.importorskip("torch")

from _fake_cuda import SM_COUNT, fake_cuda  # noqa: E402

import fp4_kernels as fk  # noqa: E402
from fp4_kernels import _plans  # noqa: E402
from fp4_kernels.cuda.launch_table import LAUNCH_TABLE, LAUNCHES  # noqa: E402

ROWS, K = 64, 4096
N = ROWS * K


@pytest.fixture
def launches():
    _plans.clear()
    with fake_cuda() as recorder:
        yield lambda: [(blocks, threads) for _, blocks, threads, *_ in recorder.launches]
    _plans.clear()


def _x(dtype=torch.bfloat16, shape=(ROWS, K)):
    return torch.randn(shape).to(dtype)


def _grid(work_items, per_cta, row=None, threads=None):
    blocks = -(-work_items // per_cta)
    if row is not None and row.threads_per_sm is not None:
        blocks = min(blocks, SM_COUNT * (row.threads_per_sm // threads))
    return min(blocks, SM_COUNT * (2048 // (threads or per_cta)))


def test_every_row_names_its_module():
    """cuda/<module>.py exists and holds the row (its launch constant reads it)."""
    assert len(LAUNCHES) == len(LAUNCH_TABLE)
    for row in LAUNCH_TABLE:
        module = importlib.import_module(f"fp4_kernels.cuda.{row.module}")
        assert any(value is row for value in vars(module).values()), row.op
        assert row.threads % 32 == 0 and row.items_per_thread >= 1


def test_the_group_kernels_rows_hold_the_butterfly_networks_registers():
    """The transform's and FP4Quant's rows: 32 elements a thread, the registers every kernel on
    the butterfly networks holds (``cuda.butterflies.REGISTERS``, read from the table), which
    ``launch.group_grid`` sizes their grids and CTAs by."""
    from fp4_kernels.cuda.butterflies import REGISTERS

    assert REGISTERS == 32
    for op in ("hadamard", "hadamard_prefetch", "fp4quant"):
        assert LAUNCHES[op].items_per_thread == REGISTERS, op


def test_nvfp4_quantize_launches_the_amax_row_then_the_quantize_row(launches):
    fk.quantize(_x())
    a, q = LAUNCHES["amax"], LAUNCHES["quantize"]
    n_vec = N * 2 // 16  # 16-byte words of bf16
    amax_blocks = min(_grid(n_vec, a.threads * a.items_per_thread), SM_COUNT * a.partials_per_sm)
    assert launches() == [(amax_blocks, a.threads), (_grid(N // 16, q.threads), q.threads)]


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fake_quantization_is_one_launch_of_its_row(launches, fmt):
    """8 elements an item, items_per_thread items a pass; NVFP4 given its global_amax too."""
    fk.quantize_dequantize(_x(), fmt=fmt, global_amax=4.0 if fmt == "nvfp4" else None)
    f = LAUNCHES["quantize_dequantize"]
    assert launches() == [(_grid(N // 8, f.threads * f.items_per_thread), f.threads)]


def test_nvfp4_fake_quantization_launches_the_amax_row_first(launches):
    fk.quantize_dequantize(_x())
    a, f = LAUNCHES["amax"], LAUNCHES["quantize_dequantize"]
    amax_blocks = min(
        _grid(N * 2 // 16, a.threads * a.items_per_thread), SM_COUNT * a.partials_per_sm
    )
    assert launches() == [
        (amax_blocks, a.threads),
        (_grid(N // 8, f.threads * f.items_per_thread), f.threads),
    ]


def test_dequantize_takes_items_per_thread_items_a_pass(launches):
    with _plans.disabled():
        qt = fk.quantize(_x())
    launches()
    fk.dequantize(qt)
    d = LAUNCHES["dequantize"]
    items = N // 8  # 16 bytes of bf16 output an item
    assert launches()[-1] == (_grid(items, d.threads * d.items_per_thread), d.threads)


def test_requantized_sum_launches_its_row(launches):
    with _plans.disabled():
        qt = fk.quantize(_x(torch.float32, (4, 1024)), fmt="mxfp4")
    n_before = len(launches())
    fk.requantized_sum(qt)
    r = LAUNCHES["requantized_sum"]
    assert launches()[n_before:] == [(_grid(1024 // 32, r.threads), r.threads)]


def test_nvfp4_requantized_sum_launches_its_amax_row_then_its_row(launches):
    with _plans.disabled():
        qt = fk.quantize(_x(torch.float32, (4, 1 << 20)))
    n_before = len(launches())
    fk.requantized_sum(qt, torch.ones(4))
    a, r = LAUNCHES["requantized_sum_amax"], LAUNCHES["requantized_sum"]
    n_blocks = (1 << 20) // 16
    amax_blocks = min(_grid(n_blocks, a.threads), SM_COUNT * a.partials_per_sm)
    expect = [(amax_blocks, a.threads), (_grid(n_blocks, r.threads, r, r.threads), r.threads)]
    assert launches()[n_before:] == expect


@pytest.mark.parametrize("g", [64, 1024, 4096])
def test_the_prefetching_transform_launches_its_row(launches, monkeypatch, g):
    monkeypatch.setenv("FP4_HADAMARD_VARIANT", "smem-pf")
    fk.hadamard(_x(), group_size=g)
    row = LAUNCHES["hadamard_prefetch"]
    threads = row.threads if g <= 1024 else 32 * g // 1024
    assert launches() == [(_grid(N, threads * 32, row, threads), threads)]


def test_the_shuffle_transform_and_fp4quant_launch_their_rows(launches, monkeypatch):
    monkeypatch.setenv("FP4_HADAMARD_VARIANT", "shfl")
    fk.hadamard(_x(), group_size=64)
    fk.quantize(_x(), fmt=fk.FP4Quant(64))
    h, f = LAUNCHES["hadamard"], LAUNCHES["fp4quant"]
    assert launches() == [
        (_grid(N, h.threads * 32, h, h.threads), h.threads),
        (_grid(N, f.threads * 32, f, f.threads), f.threads),
    ]
