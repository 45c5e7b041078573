"""formats/spec.py: each format's spec states what its oracle module and the API use."""

import numpy as np
import pytest

import fp4_kernels as fk
from fp4_kernels.formats import e4m3, e8m0, mxfp4, nvfp4


def test_the_specs_are_the_formats_of_the_api():
    assert fk.FORMATS == {"nvfp4": nvfp4.BLOCK_SIZE, "mxfp4": mxfp4.BLOCK_SIZE}
    assert (nvfp4.SPEC.name, nvfp4.SPEC.block_size) == ("nvfp4", nvfp4.BLOCK_SIZE)
    assert (mxfp4.SPEC.name, mxfp4.SPEC.block_size) == ("mxfp4", mxfp4.BLOCK_SIZE)
    assert {nvfp4.SPEC.code, mxfp4.SPEC.code} == {0, 1}


def test_the_scale_codecs_and_the_tensor_scale():
    assert nvfp4.SPEC.scale == e4m3.__name__.rsplit(".", 1)[1] and nvfp4.SPEC.tensor_scale
    assert mxfp4.SPEC.scale == e8m0.__name__.rsplit(".", 1)[1] and not mxfp4.SPEC.tensor_scale
    assert nvfp4.SPEC.element == mxfp4.SPEC.element == "e2m1"
    assert str(nvfp4.SPEC) == "nvfp4"


@pytest.mark.parametrize(
    "oracle, decode_args", [(mxfp4, ()), (nvfp4, (np.float32(1.0),))], ids=["mxfp4", "nvfp4"]
)
def test_the_oracles_reject_bad_arguments(oracle, decode_args):
    # check_input / check_codes, through each oracle (nvfp4's decode takes the tensor scale too)
    b = oracle.BLOCK_SIZE
    with pytest.raises(ValueError, match="x"):
        oracle.quantize_reference(np.zeros((2, b + b // 2), dtype=np.float32))
    with pytest.raises(TypeError, match="x"):
        oracle.quantize_reference(np.zeros((2, b), dtype=np.float64))
    with pytest.raises(ValueError, match="rounding"):
        oracle.quantize_reference(np.zeros((2, b), dtype=np.float32), rounding="down")
    with pytest.raises(ValueError, match="scales"):
        oracle.dequantize_reference(
            np.zeros((2, b), np.uint8), np.zeros((2, 2), np.uint8), *decode_args
        )
