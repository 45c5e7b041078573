"""The example scripts (examples/): where they write unless told, and the install line the docs
give for them."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "packages" / "fp4_train" / "examples"
WRITERS = ("rounding_toys.py", "stored_weight_training.py", "fp4linear_training.py")


def _common():
    spec = importlib.util.spec_from_file_location(
        "fp4_train_examples_common", EXAMPLES / "_common.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_scripts_write_outside_the_repository_unless_told(monkeypatch, tmp_path):
    """A rerun must not rewrite the committed results in docs/results: the default --out is
    outside the repository; `--out docs/results` still writes there."""
    import tempfile

    # (a temporary folder of the test's own: a file left at the shared default would fail
    # parse_args's check of --out)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    common = _common()
    threads = torch.get_num_threads()  # parse_args sets one torch thread for the scripts
    try:
        for script in WRITERS:
            assert "parse_args(__doc__" in (EXAMPLES / script).read_text(), script
            monkeypatch.setattr(sys, "argv", [script])
            out = common.parse_args("doc").out.resolve()
            assert not out.is_relative_to(ROOT.resolve()), out
            monkeypatch.setattr(sys, "argv", [script, "--out", "docs/results"])
            assert common.parse_args("doc").out == Path("docs/results")
    finally:
        torch.set_num_threads(threads)


def _install_lines():
    docs = [ROOT / "README.md", *ROOT.glob("packages/*/README.md"), *ROOT.glob("docs/*.md")]
    for path in docs:
        for line in path.read_text().splitlines():
            if "pip install" in line and "fp4_train[examples]" in line:
                yield path, line


def test_examples_install_line_brings_fp4_comm():
    """[examples] needs fp4-comm, which no index has: every install line of it names its
    folder; the README's experiments, which need matplotlib (tp_summary), give that line."""
    lines = list(_install_lines())
    assert lines
    for path, line in lines:
        assert "./packages/fp4_comm" in line, (path, line)
    readme = (ROOT / "packages" / "fp4_train" / "README.md").read_text()
    experiments = re.search(r"## Experiments\n(.*?)\n## ", readme, flags=re.S).group(1)
    assert '"./packages/fp4_train[examples]"' in experiments.split("tp_summary.py")[0]


def test_scripts_name_an_unusable_out_or_device_before_running(monkeypatch, tmp_path, capsys):
    """An --out under a file failed at the first write, after the run; a device name torch
    does not know failed inside it."""
    import pytest

    common = _common()
    threads = torch.get_num_threads()
    (tmp_path / "afile").write_text("x")
    try:
        for argv, message in (
            (["--out", str(tmp_path / "afile" / "x")], "afile is not a folder"),
            (["--out", str(tmp_path / "afile")], "exists and is not a folder"),
            (["--device", "bogus"], "invalid choice: 'bogus'"),
        ):
            monkeypatch.setattr(sys, "argv", ["rounding_toys.py", *argv])
            with pytest.raises(SystemExit):
                common.parse_args("doc")
            assert message in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)
