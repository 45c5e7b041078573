"""What a new user of the repository runs: the install commands of the READMEs and docs, and
the nox sessions (noxfile.py, loaded with a stand-in for nox, so that it runs without nox)."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import sys
import types
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
INSTALL_DOCUMENTS = (
    "README.md",
    "CONTRIBUTING.md",
    "docs/install.md",
    "packages/fp4_comm/README.md",
    "packages/fp4_train/README.md",
)
# what installs torch as a dependency: fp4-comm, fp4-train, fp4-kernels[torch]
NEEDS_TORCH = re.compile(r"packages/fp4_(comm|train)|fp4-(comm|train)|fp4_kernels\[[^\]]*torch")
INSTALLS_TORCH = re.compile(r"pip install torch\b")


def _command_blocks(text):
    """The indented and fenced command blocks of a Markdown text, as lists of lines."""
    blocks, block, fenced = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            if fenced:
                blocks.append(block)
                block = []
            fenced = not fenced
            continue
        if fenced or line.startswith("    ") or (block and not line.strip()):
            block.append(line)
        elif block:
            blocks.append(block)
            block = []
    return [*blocks, block] if block else blocks


@pytest.mark.parametrize("document", INSTALL_DOCUMENTS)
def test_torch_is_installed_before_what_depends_on_it(document):
    """A block of commands that installs fp4-comm, fp4-train or fp4-kernels[torch] installs
    torch first (the CPU build where there is no GPU): pip keeps a torch it finds installed, and
    otherwise fetches PyPI's CUDA wheel, 555 MB, and backtracks through older ones where that
    wheel's CUDA pins clash with numba-cuda's."""
    text = (REPO_ROOT / document).read_text(encoding="utf-8")
    checked = 0
    for block in _command_blocks(text):
        torch_seen = False
        for line in block:
            command = line.split("#")[0]
            if INSTALLS_TORCH.search(command):
                torch_seen = True
            elif "pip install" in command and NEEDS_TORCH.search(command):
                checked += 1
                assert torch_seen, f"{document}: {line.strip()!r} comes before torch's install"
    assert checked, f"{document}: no install command of a package that needs torch"


# ---------------------------------------------------------------------- noxfile.py


class _Session:
    """What the sessions call on nox's Session, recorded."""

    def __init__(self, tmp_path, posargs=()):
        self.calls = []
        self.posargs = list(posargs)
        self.bin = str(tmp_path / "bin")
        self._tmp = tmp_path

    def install(self, *args, **kwargs):
        self.calls.append(("install", args, kwargs))

    def log(self, message):
        self.calls.append(("log", message))

    def run(self, *args, **kwargs):
        self.calls.append(("run", args, kwargs))
        if "--report" in args:  # pip's dry run: plans nothing
            Path(args[args.index("--report") + 1]).write_text(json.dumps({"install": []}))

    def create_tmp(self):
        return str(self._tmp)

    def error(self, message):
        raise AssertionError(message)


def _fake_nox():
    nox = types.ModuleType("nox")
    nox.options = types.SimpleNamespace()
    nox.Session = _Session
    nox.session = lambda *args, **kwargs: lambda f: f
    return nox


@pytest.fixture
def noxfile(monkeypatch):
    monkeypatch.setitem(sys.modules, "nox", _fake_nox())
    spec = importlib.util.spec_from_file_location("repository_noxfile", REPO_ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    nox_logger = logging.getLogger("nox")
    filters = list(nox_logger.filters)
    spec.loader.exec_module(module)
    yield module
    nox_logger.filters[:] = filters


def test_noxfile_drops_the_uv_probe_line(noxfile, caplog):
    """nox looks for uv whenever it makes a venv and logs "uv binary not found." where there
    is none; the sessions use venv + pip, and the line is dropped."""
    with caplog.at_level(logging.INFO, logger="nox"):
        logging.getLogger("nox").info("uv binary not found.")
        logging.getLogger("nox").info("nox > a line that stays")
    assert [r.getMessage() for r in caplog.records] == ["nox > a line that stays"]


SESSIONS = ("tests", "tests_kernels", "tests_comm", "tests_train", "compile_check", "study")
SESSIONS += ("lint", "bench", "demo", "build", "docs", "bench_site")


@pytest.mark.parametrize("name", SESSIONS)
def test_sessions_say_what_they_install_and_put_cpu_torch_first(
    name, noxfile, tmp_path, monkeypatch
):
    """Each install is announced (a log line naming what comes) and shows pip's output (nox
    hides it by default: a first run was minutes without a word); every session that installs
    something needing torch installs torch's CPU build first."""
    monkeypatch.chdir(tmp_path)  # `build` writes dist/
    session = _Session(tmp_path, posargs=["--check"] if name == "build" else ())
    monkeypatch.setattr(
        noxfile, "_install_torch_cpu", lambda s: s.calls.append(("torch", "cpu build"))
    )
    getattr(noxfile, name)(session)
    installs = [i for i, c in enumerate(session.calls) if c[0] == "install"]
    assert installs, f"{name} installs nothing"
    for i in installs:
        _, args, kwargs = session.calls[i]
        assert kwargs.get("silent") is False, (name, args)
        before = session.calls[i - 1]
        assert before[0] == "log" and before[1].startswith("installing "), (name, args)
        if any(NEEDS_TORCH.search(a) or a.startswith("torch") for a in args):
            assert ("torch", "cpu build") in session.calls[:i], f"{name}: {args} before CPU torch"


def test_benchmarks_page_leads_with_its_results():
    """docs/benchmarks.md shows a reader the results first: its first table comes before any
    list of the commits measured (which has a section of its own further down)."""
    text = (REPO_ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    before_table = text[: text.index("\n|")]
    commits = re.findall(r"`[0-9a-f]{7,40}`", before_table)
    assert len(commits) <= 1, f"{len(commits)} commit hashes before the first table: {commits}"
    assert "## What was measured" in text
