"""The python example of this package's README runs, in a fresh process (it makes and destroys
a process group, which would leak into other tests)."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 1
    result = subprocess.run(
        [sys.executable, "-c", blocks[0]], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "['all_gather', 'reduce_scatter'] 20" in result.stdout
