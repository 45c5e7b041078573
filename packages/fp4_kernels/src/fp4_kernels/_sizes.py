"""Symbolic sizes: what makes a launch plan serve every shape of its kind of call.

A plan (``_plans``) is recorded by running an op's host function against placeholders.  When the
placeholders' leading dimensions are ``Size`` objects instead of ints, every size the host
function derives from them (element counts, grids, byte offsets, the outputs' shapes) is a
``Size`` too: an integer expression over the call's dimensions, carried with its value at the
shape being recorded.  A comparison of a ``Size`` (a branch of the host function, a ``min`` of a
grid and its cap) answers from that value and records the answer as a guard.  The recording is
then a plan for every call of the same kind whose dimensions satisfy the guards: its sizes are
recomputed from the call's dimensions, not traced again (``_plans.KindPlan``).

Only integer arithmetic is symbolic (``+ - * // %``, unary minus); anything that needs the
concrete value (``int()``, ``range``, hashing, numpy conversion) raises ``Unplannable``, and
the kind of call is then planned per shape as before.  A kernel's integer scalar argument is
made with ``launch.int64``, which keeps a ``Size`` symbolic.
"""

from __future__ import annotations

import operator
import threading

import numpy as np


class Unplannable(TypeError):
    """A host function needed a symbolic size's concrete value: no plan for every shape."""


_STATE = threading.local()  # .guards: the guards of the recording in progress on this thread


class Size:
    """An integer expression ``src`` (Python source over the dimensions ``d0, d1, ...``) and its
    ``value`` at the shape being recorded; ``dtype``: numpy's int64 where it is a kernel's
    scalar argument (``as_int64``), else None."""

    __slots__ = ("value", "src", "dtype")
    __array_ufunc__ = None  # numpy defers to the reflected operators below

    def __init__(self, value, src, dtype=None):
        self.value = value
        self.src = src
        self.dtype = dtype

    @classmethod
    def dimension(cls, index, value):
        return cls(int(value), f"d{index}")

    def as_int64(self):
        return Size(self.value, self.src, INT64)

    def __repr__(self):
        return f"Size({self.src} = {self.value})"

    # -- arithmetic: a new expression

    def _op(self, other, op, reflected=False):
        operand = _operand(other)
        if operand is None:
            return NotImplemented
        ov, osrc = operand
        a, b = (ov, self.value) if reflected else (self.value, ov)
        sa, sb = (osrc, self.src) if reflected else (self.src, osrc)
        return Size(_OPERATORS[op](a, b), f"({sa} {op} {sb})")  # (// and % by 0: Python's error)

    def _arithmetic(op, reflected=False):  # noqa: N805 (a method factory of the class body)
        return lambda self, other: self._op(other, op, reflected)

    __add__, __radd__ = _arithmetic("+"), _arithmetic("+", True)
    __sub__, __rsub__ = _arithmetic("-"), _arithmetic("-", True)
    __mul__, __rmul__ = _arithmetic("*"), _arithmetic("*", True)
    __floordiv__, __rfloordiv__ = _arithmetic("//"), _arithmetic("//", True)
    __mod__, __rmod__ = _arithmetic("%"), _arithmetic("%", True)

    def __neg__(self):
        return Size(-self.value, f"(-{self.src})")

    def __pos__(self):
        return self

    # -- comparisons: answered from the value, recorded as guards

    def _compare(self, other, op):
        operand = _operand(other)
        if operand is None:
            return NotImplemented
        ov, osrc = operand
        result = _OPERATORS[op](self.value, ov)
        guard(f"({self.src} {op} {osrc})", result)
        return result

    def _comparison(op):  # noqa: N805
        return lambda self, other: self._compare(other, op)

    __lt__, __le__, __gt__, __ge__ = (
        _comparison("<"),
        _comparison("<="),
        _comparison(">"),
        _comparison(">="),
    )
    __eq__, __ne__ = _comparison("=="), _comparison("!=")
    del _arithmetic, _comparison

    def __bool__(self):
        return self._compare(0, "!=")

    # -- what needs a concrete value

    def _concrete(self, *_):
        raise Unplannable(f"the concrete value of the symbolic size {self.src} was needed")

    __int__ = __index__ = __float__ = __hash__ = __array__ = __iter__ = __len__ = _concrete
    __and__ = __rand__ = __or__ = __ror__ = __xor__ = __rxor__ = _concrete
    __lshift__ = __rlshift__ = __rshift__ = __rrshift__ = __truediv__ = __rtruediv__ = _concrete


INT64 = np.dtype(np.int64)
# what each operator a Size writes into its source computes on the values
_OPERATORS = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "//": operator.floordiv,
    "%": operator.mod, "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
    "==": operator.eq, "!=": operator.ne,
}  # fmt: skip


def _operand(other):
    """(value, source) of a size or an integer (not a bool), else None."""
    if isinstance(other, Size):
        return other.value, other.src
    if isinstance(other, (int, np.integer)) and not isinstance(other, bool):
        return int(other), repr(int(other))
    return None


def guard(src, result):
    """Record that the expression ``src`` evaluated to ``result`` (outside a recording: no-op)."""
    guards = getattr(_STATE, "guards", None)
    if guards is not None:
        guards[src] = bool(result)


class recording:
    """The guards of the symbolic recording inside (``with recording() as guards``): a dict of
    expression source -> the truth value it must have."""

    def __enter__(self):
        self.saved = getattr(_STATE, "guards", None)
        _STATE.guards = {}
        return _STATE.guards

    def __exit__(self, *exc):
        _STATE.guards = self.saved
