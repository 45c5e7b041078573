"""The python examples of this package's README and of its API page in the docs run, each in a
fresh process (they make and destroy a process group, which would leak into other tests)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1]
README = PACKAGE / "README.md"
API_PAGE = PACKAGE.parents[1] / "docs" / "api" / "fp4_comm.md"


def _python_blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


BLOCKS = _python_blocks(README)


def _run(code):
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def test_readme_has_the_two_examples():
    assert len(BLOCKS) == 2
    assert "fp4_comm.ddp.register(" in BLOCKS[1]  # the usage documented for DDP


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index):
    out = _run(BLOCKS[index])
    if index == 0:
        assert "['all_gather', 'reduce_scatter'] 20" in out


def test_api_page_example_is_a_code_block_that_runs():
    # The page's example must be a fenced python block (Sphinx renders an indented docstring
    # example as prose, with curly quotes), and it must run as written.
    text = API_PAGE.read_text()
    blocks = _python_blocks(API_PAGE)
    assert len(blocks) == 1, f"{API_PAGE}: one ```python block expected, found {len(blocks)}"
    assert "automodule:: fp4_comm\n" not in text  # its docstring example would render as prose
    assert not re.search("[\u2018\u2019\u201c\u201d]", blocks[0]), "curly quotes in the example"
    _run(blocks[0])
