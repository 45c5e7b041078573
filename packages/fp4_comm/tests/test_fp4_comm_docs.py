"""The python examples of this package's README run, each in a fresh process (they make and
destroy a process group, which would leak into other tests)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_the_two_examples():
    assert len(BLOCKS) == 2
    assert "fp4_comm.ddp.register(" in BLOCKS[1]  # the usage documented for DDP


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index):
    result = subprocess.run(
        [sys.executable, "-c", BLOCKS[index]], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    if index == 0:
        assert "['all_gather', 'reduce_scatter'] 20" in result.stdout
