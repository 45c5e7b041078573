"""The packages' shape, kept by tests: short functions and private names kept private in the
three packages' sources (``packages/*/src``), and the host path of a torch CUDA call from the
public function to ``cuLaunchKernel`` (the number of source files and Python calls it passes
through, ``_fake_cuda.call_path``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fp4_kernels

REPO_ROOT = Path(__file__).resolve().parents[3]
SRC = REPO_ROOT / "packages"
SOURCES = sorted(SRC.glob("*/src/**/*.py"))
PACKAGES = {path.parent.name for path in SRC.glob("*/src/*/__init__.py")}
MAX_FUNCTION_LINES = 80


def _name(path):
    return path.relative_to(SRC).as_posix()


def _functions(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_the_checks_read_every_package():
    assert PACKAGES == {"fp4_kernels", "fp4_comm", "fp4_train"}
    assert {path.relative_to(SRC).parts[0] for path in SOURCES} == PACKAGES


def test_no_function_is_longer_than_80_lines():
    """Every function of the packages, nested ones and kernel builders included (a builder's
    device functions count in its length)."""
    long = [
        f"{_name(path)}:{fn.lineno} {fn.name} ({fn.end_lineno - fn.lineno + 1} lines)"
        for path in SOURCES
        for fn in _functions(path)
        if fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, "functions over 80 lines: " + ", ".join(long)


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def _private_imports(path):
    """``from module import _name`` of a private name of another module of the same package (a
    private module itself, ``from . import _arrays``, is a module of this package and fine),
    and any private module or name of another package (``from fp4_kernels._plans import x``,
    ``import fp4_kernels._plans``, ``fp4_kernels._plans``): the packages use each other's
    public names only."""
    package = path.relative_to(SRC).parts[0]
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            other = node.level == 0 and _other_package(node.module, package)
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}" if other else alias.name
                if other and any(map(_private, dotted.split("."))):
                    yield f"{_name(path)}:{node.lineno} {dotted}"
                elif not other and _private(alias.name) and not _is_module(path, node, alias.name):
                    yield f"{_name(path)}:{node.lineno} {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _other_package(alias.name, package) and any(
                    map(_private, alias.name.split("."))
                ):
                    yield f"{_name(path)}:{node.lineno} {alias.name}"
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if isinstance(node.value, ast.Name) and _other_package(node.value.id, package):
                yield f"{_name(path)}:{node.lineno} {node.value.id}.{node.attr}"


def _other_package(module, package):
    top = (module or "").split(".")[0]
    return top in PACKAGES and top != package


def _is_module(path, node, name):
    base = path.parent
    for _ in range(max(node.level - 1, 0)):
        base = base.parent
    if node.module:
        base = base.joinpath(*node.module.split("."))
    return (base / f"{name}.py").exists() or (base / name / "__init__.py").exists()


def test_no_private_name_is_imported_across_modules():
    found = [hit for path in SOURCES for hit in _private_imports(path)]
    assert not found, "private names imported from another module: " + ", ".join(found)


def test_the_checks_see_a_long_function_and_a_private_import(tmp_path):
    src = tmp_path / "m.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    src.write_text(f"def f():\n{body}\n")
    assert [fn.end_lineno - fn.lineno + 1 for fn in _functions(src)] == [MAX_FUNCTION_LINES + 1]
    src.write_text("from .other import _hidden, shown\nfrom . import _module\n")
    (tmp_path / "other.py").write_text("_hidden = shown = 1\n")
    (tmp_path / "_module.py").write_text("")
    tree = ast.parse(src.read_text())
    found = [a.name for n in tree.body for a in n.names if not _is_module(src, n, a.name)]
    assert found == [
        "_hidden",
        "shown",
    ]


def test_the_checks_see_another_packages_private_names(monkeypatch, tmp_path):
    monkeypatch.setattr(f"{__name__}.SRC", tmp_path)
    src = tmp_path / "fp4_comm" / "src" / "fp4_comm" / "m.py"
    src.parent.mkdir(parents=True)
    src.write_text(
        "import fp4_kernels\n"
        "import fp4_kernels._plans\n"
        "from fp4_kernels import _arrays, quantize\n"
        "from fp4_kernels.cuda._primitives import WARP_SIZE\n"
        "from fp4_kernels.formats import nvfp4\n"
        "x = fp4_kernels._plans.clear, fp4_kernels.quantize\n"
    )
    assert [hit.split(" ")[1] for hit in _private_imports(src)] == [
        "fp4_kernels._plans",
        "fp4_kernels._arrays",
        "fp4_kernels.cuda._primitives.WARP_SIZE",
        "fp4_kernels._plans",
    ]


# ---------------------------------------------------------------------- the host path

torch = pytest.importorskip("torch")

from _fake_cuda import call_path, fake_cuda  # noqa: E402

from fp4_kernels import _plans  # noqa: E402

WARM_FILES = 3  # the public function's module, the plan, the launcher
WARM_CALLS = 12  # e.g. quantize: quantize, _quantize, the key (its named tuple), the tensor
# key, the plan lookup and run, one launch a kernel (amax, blocks) and the result

G64 = fp4_kernels.FP4Quant(group_size=64)


def _dequantize_of(fmt):
    def prepare(x):
        q = fp4_kernels.quantize(x, fmt=fmt)
        return lambda: fp4_kernels.dequantize(q)

    return prepare


def _requantized_sum_of(fmt, with_row_scales=False):
    """A requantized_sum of a tensor's first sixteenth of rows, quantized (NVFP4 with row_scales:
    each row under its own tensor scale)."""

    def prepare(x):
        rows = x.shape[0] // 16
        q = fp4_kernels.quantize(x[:rows].float().contiguous(), fmt=fmt)
        row_scales = torch.rand(rows) + 0.5 if with_row_scales else None
        return lambda: fp4_kernels.requantized_sum(q, row_scales)

    return prepare


WARM_OPS = {
    "nvfp4": lambda x: lambda: fp4_kernels.quantize(x),
    "nvfp4_stochastic": lambda x: lambda: fp4_kernels.quantize(x, rounding="stochastic", seed=3),
    "nvfp4_amax_float": lambda x: lambda: fp4_kernels.quantize(x, global_amax=2.0),
    "mxfp4": lambda x: lambda: fp4_kernels.quantize(x, fmt="mxfp4"),
    "quantize_dequantize": lambda x: lambda: fp4_kernels.quantize_dequantize(x),
    "fp4quant": lambda x: lambda: fp4_kernels.quantize(x, fmt=G64),
    "fp4quant_quantize_dequantize": lambda x: lambda: fp4_kernels.quantize_dequantize(x, fmt=G64),
    "dequantize_nvfp4": _dequantize_of("nvfp4"),
    "dequantize_fp4quant": _dequantize_of(G64),
    "hadamard": lambda x: lambda: fp4_kernels.hadamard(x, group_size=256),
    "requantized_sum_mxfp4": _requantized_sum_of("mxfp4"),
    "requantized_sum_nvfp4": _requantized_sum_of("nvfp4"),
    "requantized_sum_nvfp4_row_scales": _requantized_sum_of("nvfp4", with_row_scales=True),
}


@pytest.mark.parametrize("op", sorted(WARM_OPS))
def test_a_warm_call_passes_three_files_and_twelve_calls(op):
    _plans.clear()
    with fake_cuda():
        call = WARM_OPS[op](torch.randn(256, 256).to(torch.bfloat16))
        for _ in range(_plans.RECORD_AT):  # the plan made
            call()
        calls, files = call_path(call)
    _plans.clear()
    assert len(files) <= WARM_FILES and {"_plans.py", "cuda/launch.py"} <= set(files), files
    assert calls <= WARM_CALLS


FIRST_CALL_FILES = 6  # the public function, the descriptor, the plan, the op's host function
# (two where it runs another op's pass: cuda/amax; or the QuantizedTensor's check, _quantized)
# and the launcher


FIRST_OPS = {
    name: WARM_OPS[name]
    for name in (
        "nvfp4", "mxfp4", "quantize_dequantize", "fp4quant", "fp4quant_quantize_dequantize",
        "hadamard", "requantized_sum_mxfp4", "requantized_sum_nvfp4_row_scales",
        "dequantize_nvfp4", "dequantize_fp4quant",
    )
}  # fmt: skip


# a new shape of a kind of call planned before, made from its plan of every shape before any
# check: the public function's module, the kind key (_calls; a QuantizedTensor's fields' leading
# dimensions: _quantized), the plan and the launcher
NEW_SHAPE_FILES = 5
NEW_SHAPE_OPS = {
    "nvfp4", "mxfp4", "quantize_dequantize", "fp4quant", "hadamard", "dequantize_nvfp4",
    "dequantize_fp4quant",
}  # fmt: skip


@pytest.mark.parametrize("op", sorted(FIRST_OPS))
def test_the_first_call_of_a_shape_passes_at_most_six_files(op):
    _plans.clear()
    with fake_cuda():
        with _plans.disabled():
            FIRST_OPS[op](torch.randn(64, 256).to(torch.bfloat16))()  # the kernels built
        call = FIRST_OPS[op](torch.randn(128, 256).to(torch.bfloat16))  # its kind's first call
        _, first = call_path(call)
        _, recording = call_path(call)
        _, warm = call_path(call)
        _, new_shape = call_path(FIRST_OPS[op](torch.randn(96, 256).to(torch.bfloat16)))
    _plans.clear()
    assert len(first) <= FIRST_CALL_FILES, first
    assert len(recording) > len(warm) == 3, (recording, warm)
    assert len(new_shape) <= FIRST_CALL_FILES, new_shape
    if op in NEW_SHAPE_OPS:
        assert len(new_shape) <= NEW_SHAPE_FILES and "_plans.py" in new_shape, new_shape
