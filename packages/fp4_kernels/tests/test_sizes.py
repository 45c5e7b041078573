"""fp4_kernels._sizes: symbolic sizes, the guards their comparisons record, and what refuses to
be symbolic."""

import numpy as np
import pytest

from fp4_kernels import _sizes
from fp4_kernels._sizes import Size, Unplannable


def _eval(size, **dims):
    return eval(size.src, {}, dims)  # noqa: S307 (the expressions this module writes)


def test_arithmetic_keeps_the_value_and_the_expression():
    d0, d1 = Size.dimension(0, 7), Size.dimension(1, 3)
    exprs = [
        d0 * 256 // 16,
        -(-(d0 * d1) // 4),
        (d0 + 1) * (d1 - 2) % 5,
        1024 - d0,
        3 * d0 + np.int64(5),
        np.int64(2) * d1,
        2 // d1 + 100 % d0,
        +d0 - -d1,
    ]
    for e in exprs:
        assert isinstance(e, Size)
        for a, b in ((7, 3), (1, 1), (1000, 17)):
            assert _eval(e, d0=a, d1=b) == eval(  # noqa: S307
                e.src.replace("d0", str(a)).replace("d1", str(b))
            )
        assert _eval(e, d0=7, d1=3) == e.value


def test_comparisons_answer_from_the_value_and_record_guards():
    d0 = Size.dimension(0, 10)
    with _sizes.recording() as guards:
        assert d0 > 4 and not d0 < 4 and d0 >= 10 and d0 <= 10 and d0 == 10 and d0 != 3
        assert max(1, d0 // 2).value == 5 and min(d0, 1056) is d0
        assert bool(d0 - 10) is False
    assert guards["(d0 > 4)"] is True and guards["(d0 < 4)"] is False
    assert guards["((d0 - 10) != 0)"] is False
    for src, want in guards.items():
        assert bool(eval(src, {}, {"d0": 10})) is want  # noqa: S307
    d0 < 3  # noqa: B015 (outside a recording: nothing recorded, no error)


def test_the_guards_are_the_recordings_own():
    d0 = Size.dimension(0, 5)
    with _sizes.recording() as outer:
        d0 > 1  # noqa: B015
        with _sizes.recording() as inner:
            d0 > 2  # noqa: B015
        d0 > 3  # noqa: B015
    assert list(outer) == ["(d0 > 1)", "(d0 > 3)"] and list(inner) == ["(d0 > 2)"]


@pytest.mark.parametrize(
    "use",
    [int, float, hash, range, np.int64, np.asarray, lambda s: s & 1, lambda s: 1 << s,
     lambda s: s / 2, lambda s: [0, 1][s], lambda s: {s: 1}],
)  # fmt: skip
def test_what_needs_the_concrete_value_is_unplannable(use):
    with pytest.raises(Unplannable, match="d0"):
        use(Size.dimension(0, 1))


def test_int64_keeps_a_size_symbolic():
    from fp4_kernels.cuda import launch

    d0 = Size.dimension(0, 9)
    a = launch.int64(d0 * 2)
    assert isinstance(a, Size) and a.dtype == np.dtype(np.int64) and a.value == 18
    b = launch.int64(18)
    assert type(b) is np.int64 and b == 18


def test_division_by_a_zero_size_is_an_error():
    with pytest.raises(ZeroDivisionError):
        Size.dimension(0, 4) // Size.dimension(1, 0)
    assert Size.dimension(0, 4).__mul__(1.5) is NotImplemented  # floats are not sizes
