"""fp4_kernels' public API (and the numpy references and test support documented with it)
carries type annotations that resolve, and the package ships a py.typed marker."""

import ast
import importlib
import importlib.resources
import pkgutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import fp4_kernels
import fp4_kernels.formats
import fp4_kernels.testing

SOURCE = Path(fp4_kernels.__file__).resolve().parent


def _public_callables():
    """(qualified name, function) of every public function that fp4_kernels exports, and of
    every public method, property and dunder of its exported classes (their base classes in
    fp4_kernels included); and the public functions and classes of the modules documented with
    it, the numpy references in ``fp4_kernels.formats`` and ``fp4_kernels.testing``."""
    documented = [
        importlib.import_module(f"fp4_kernels.formats.{m.name}")
        for m in pkgutil.iter_modules(fp4_kernels.formats.__path__)
    ]
    exports = {
        m.__name__.removeprefix("fp4_kernels."): m for m in [*documented, fp4_kernels.testing]
    }
    exports.update((name, getattr(fp4_kernels, name)) for name in fp4_kernels.__all__)
    return fp4_kernels.testing.public_callables(fp4_kernels, exports)


def test_the_public_api_lists_what_it_should():
    expected = {
        "quantize",
        "dequantize",
        "quantize_dequantize",
        "hadamard",
        "requantized_sum",
        "swizzled_scale_shape",
        "FP4Quant.bits_per_element",
        "QuantizedTensor.to",
        "QuantizedTensor.cpu",
        "QuantizedTensor.cuda",
        "QuantizedTensor.numel",
        "QuantizedTensor.nbytes",
        "QuantizedTensor.typed_scales",
        "formats.nvfp4.quantize_reference",
        "formats.e2m1.pack_e2m1",
        "formats.hadamard.hadamard_reference",
        "testing.reference_quantization",
    }
    assert expected <= set(_public_callables())


def test_public_functions_carry_type_annotations():
    assert fp4_kernels.testing.annotation_gaps(_public_callables()) == {}  # and the hints resolve


def test_quantized_tensor_fields_are_annotated():
    hints = typing.get_type_hints(fp4_kernels.QuantizedTensor)
    assert set(hints) == {
        "data",
        "scales",
        "global_scale",
        "fmt",
        "shape",
        "dtype",
        "scale_layout",
        "payload",
    }


def test_py_typed_marker_is_in_the_package():
    # hatchling ships every file of src/fp4_kernels in the wheel, this marker included
    assert importlib.resources.files("fp4_kernels").joinpath("py.typed").is_file()


def _module_name(path):
    rel = path.relative_to(SOURCE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _import_graph():
    """{module: {modules it imports}} for every module of fp4_kernels, from its source: every
    ``import`` statement counts, those inside functions (deferred imports) included.  The
    packages that Python imports implicitly before a submodule are not edges."""
    modules = {_module_name(p): p for p in SOURCE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module
                # `from .pkg import sub` imports the submodule; `from .mod import f` the module
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def _cycle(graph):
    """One import cycle of ``graph`` as a list of modules, or None."""
    state = {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt, stack)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_package_has_no_import_cycle():
    graph = _import_graph()
    assert {"fp4_kernels._api", "fp4_kernels._quantized", "fp4_kernels._calls"} <= set(graph)
    assert "fp4_kernels._calls" in graph["fp4_kernels._quantized"]  # edges are seen
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


PRIVATE_HOST_MODULES = [
    "_quantized", "_calls", "_plans", "_api", "_hadamard", "_reduce",
]  # fmt: skip


@pytest.mark.parametrize("module", PRIVATE_HOST_MODULES)
def test_each_host_module_imports_alone(module):
    # a fresh interpreter, so that no other module of the package is imported already
    code = f"import importlib; importlib.import_module('fp4_kernels.{module}')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
