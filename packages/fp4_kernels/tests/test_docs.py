"""Docs examples are code that a test runs: every ```python block of the documents below.

Each block is executed on its own, in a fresh namespace, on the CPU with numpy only; its
assertions check the numbers the text quotes.  A block that needs a GPU carries the comment
``# doc-test: gpu``: it runs where there is a real CUDA GPU (``nox -s gpu``) and is reported
as skipped, with the reason, elsewhere.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REAL_GPU

REPO_ROOT = Path(__file__).resolve().parents[3]  # packages/fp4_kernels/tests/ -> the root
DOCUMENTS = (
    "docs/formats.md",
    "docs/fp4quant.md",
    "packages/fp4_kernels/README.md",
    "README.md",
)
GPU_MARKER = "# doc-test: gpu"

# An opening fence of exactly "```python" at the start of a line, up to the next closing fence.
_PYTHON_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(document):
    """(line number of the opening fence, source) of every ```python block of ``document``."""
    text = (REPO_ROOT / document).read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _PYTHON_BLOCK.finditer(text)]


# A missing document collects no blocks here and fails test_document_has_examples instead.
BLOCKS = [
    (doc, line, src)
    for doc in DOCUMENTS
    if (REPO_ROOT / doc).is_file()
    for line, src in python_blocks(doc)
]


@pytest.mark.parametrize("document", DOCUMENTS)
def test_document_has_examples(document):
    """A moved document or a misspelt fence must not leave a document silently untested."""
    assert (REPO_ROOT / document).is_file(), f"{document}: not found under {REPO_ROOT}"
    assert python_blocks(document), f"{document}: no ```python block found"


@pytest.mark.parametrize(
    ("document", "line", "source"), BLOCKS, ids=[f"{doc}:{line}" for doc, line, _ in BLOCKS]
)
def test_example_runs(document, line, source):
    if GPU_MARKER in source and not REAL_GPU:
        pytest.skip(f"{document}:{line} needs a real CUDA GPU ({GPU_MARKER!r})")
    # Pad with blank lines so that a traceback's line numbers are the document's own.
    code = compile("\n" * line + source, f"{REPO_ROOT / document}", "exec")
    exec(code, {"__name__": f"doc_example_{line}"})
