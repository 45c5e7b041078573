"""fp4_comm._p2p_kernels: the exchange kernel compiled by the real NVVM to sm_90 PTX (no GPU
needed), with the instructions the protocol rests on, the parameters the launch packs, and no
local memory or float64; assembled by ptxas where the machine has one.  Its logic runs in the
CPU model (test_fp4_comm_p2p.py)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from numba import config

from fp4_comm import _p2p_kernels as K

if config.ENABLE_CUDASIM:
    pytest.skip("compile check needs the real NVVM, not the simulator", allow_module_level=True)

pytestmark = pytest.mark.compile_check


@pytest.fixture(scope="module")
def ptx():
    from fp4_kernels.testing import compile_ptx

    return compile_ptx(K.exchange_kernel(), K.signature())


def test_entry_takes_the_packed_parameters(ptx):
    K.check_ptx_params(ptx)  # raises otherwise
    assert len(K.entry_params(ptx)) == len(K.PARAMS) == 17 + 3 * K.MAX_SECTIONS
    assert "exchange" in K.entry_name(ptx)


def test_flags_are_release_acquire_at_system_scope(ptx):
    # the sender's flag and the receiver's acknowledgement are released, and both waits
    # acquire, at system scope: the other side is another process, maybe another GPU
    assert ptx.count("st.release.sys.global.u64") == 2
    assert ptx.count("ld.acquire.sys.global.u64") >= 2
    # deadlines from the global timer; the first failure wins a compare-and-swap and is
    # written to the host page behind a system fence
    assert "%globaltimer" in ptx
    assert "atom.global.cas.b64" in ptx and "fence.sc.sys" in ptx
    assert "ld.relaxed.sys.global.u64" in ptx and "st.relaxed.sys.global.u64" in ptx


def test_data_moves_in_wide_accesses_between_barriers(ptx):
    for access in ("ld.global.v4.u32", "st.global.v4.u32", "ld.global.v2.u32", "ld.global.u8"):
        assert access in ptx, access
    assert "bar.sync" in ptx
    # never the non-coherent path: a slot's bytes are written by another rank during the kernel
    assert "ld.global.nc" not in ptx


def test_no_local_memory_and_no_float64(ptx):
    assert ".local" not in ptx, "local memory in the kernel (spill or run-time-indexed array)"
    f64 = re.findall(r"^\s*\S*\.f64\b.*$", ptx, re.M)
    assert not f64, f"float64 arithmetic in the kernel: {f64[:3]}"


def test_ptxas_assembles_it_for_sm_90(ptx, tmp_path):
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("no ptxas on PATH")
    # PTX ISA 7.8 (CUDA 11.8, the first with sm_90) has every instruction the kernel uses: so
    # that any ptxas from 11.8 on takes the PTX of a newer NVVM
    source = re.sub(r"^\.version \S+", ".version 7.8", ptx, count=1, flags=re.M)
    path = tmp_path / "exchange.ptx"
    path.write_text(source)
    done = subprocess.run([ptxas, "-arch=sm_90", "-v", str(path), "-o", str(tmp_path / "x.cubin")],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    registers = int(re.search(r"Used (\d+) registers", done.stderr).group(1))
    # THREADS threads a block launch only below 65536 registers a block
    assert registers * K.THREADS <= 65536, registers
    assert "spill" not in done.stderr or "0 bytes spill stores" in done.stderr


def test_cuda_core_links_it_to_a_cubin(ptx):
    # the transport links the PTX as numba-cuda links its own kernels (cuda.core's Linker:
    # nvJitLink, no GPU needed; the driver's linker where nvJitLink is missing)
    try:
        from cuda.core import Linker, LinkerOptions, ObjectCode
    except ImportError:
        pytest.skip("no cuda.core")
    try:
        linker = Linker(ObjectCode.from_ptx(ptx.encode()), options=LinkerOptions(arch="sm_90"))
    except Exception as err:  # noqa: BLE001 - neither nvJitLink nor a driver on this machine
        pytest.skip(f"no linker here: {err}")
    try:
        cubin = linker.link("cubin")
    finally:
        linker.close()
    assert len(cubin.code) > 10_000  # a cubin with the kernel, not an empty image
