"""What a new user of the repository runs: the install commands of the READMEs and docs, and
the nox sessions (noxfile.py, loaded with a stand-in for nox, so that it runs without nox)."""

from __future__ import annotations

import ast
import importlib.util
import inspect
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


# ---------------------------------------------------------------------- the asv history site

ASV_PAGE = """<html><head>
<script src="https://code.jquery.com/jquery-3.3.1.min.js" onerror="js_load_failure()"></script>
<script src="https://cdnjs.cloudflare.com/ajax/libs/flot/0.8.3/jquery.flot.min.js"></script>
<script src="https://cdn.jsdelivr.net/npm/flot-orderbars@1.0.0/js/jquery.flot.orderBars.js"></script>
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/bootstrap@3.1.1/dist/css/bootstrap.min.css">
<script src="asv.js"></script>
</head><body></body></html>
"""


# what a module of benchmarks/ may run at import: asv imports every module of the folder to
# discover its suite (once per asv process), so a script's work belongs under its `__main__`
_IMPORT_TIME_ROOTS = frozenset({"torch", "fk", "fp4_kernels", "cp", "cupy", "numba", "cuda"})


def _import_time_work(tree):
    """The top-level statements of a module that do work when it is imported: loops, ``with``,
    calls other than ``sys.path``'s, and assignments that call into torch, CuPy, numba or
    fp4_kernels (allocations, launches)."""

    def rooted(call):
        f = call.func
        while isinstance(f, ast.Attribute):
            f = f.value
        return isinstance(f, ast.Name) and f.id in _IMPORT_TIME_ROOTS

    found = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            if ast.unparse(node.value.func).startswith("sys.path."):
                continue
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Try, ast.If)):
            calls = [c for c in ast.walk(node) if isinstance(c, ast.Call) and rooted(c)]
            if not calls:
                continue
        found.append(f"line {node.lineno}: {ast.unparse(node).splitlines()[0][:70]}")
    return found


def test_benchmark_modules_do_nothing_when_imported():
    """asv discovers the suite by importing every module of benchmarks/, scripts included: a
    script that allocates or launches at import would run its workload in each asv process
    (and fail discovery where there is no GPU)."""
    work = {
        path.name: _import_time_work(ast.parse(path.read_text(encoding="utf-8")))
        for path in sorted((REPO_ROOT / "benchmarks").glob("*.py"))
    }
    assert {name: found for name, found in work.items() if found} == {}
    # the check sees what it is for
    script = "import torch\nx = torch.randn(4, device='cuda')\nfor i in range(2):\n    pass\n"
    assert [f.split(":")[0] for f in _import_time_work(ast.parse(script))] == ["line 2", "line 3"]


def test_committed_asv_results_are_published():
    """asv publish shows a stored result only where its benchmark version is the suite's
    (``.asv/results/benchmarks.json``) and drops the others without a word: every committed
    result must carry its benchmark's version, or the history site loses it."""
    results = REPO_ROOT / ".asv" / "results"
    suite = json.loads((results / "benchmarks.json").read_text())
    dropped, checked = [], 0
    for path in sorted(results.glob("*/*.json")):
        if path.name == "machine.json":
            continue
        stored = json.loads(path.read_text())
        at = stored["result_columns"].index("version")
        for name, row in stored["results"].items():
            checked += 1
            if name not in suite or row[at] != suite[name]["version"]:
                dropped.append(f"{path.parent.name}/{path.name[:8]} {name}")
    assert checked > 100 and dropped == []


def test_measured_benchmark_classes_name_their_version(monkeypatch):
    """Every asv class that measures in ``setup_cache`` (the GPU classes) declares ``version``:
    without it asv versions a benchmark by a hash of its code, and publishes only the results
    of the current hash, so an edit of the class would hide its whole history."""
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    unversioned, measured = [], 0
    for path in sorted((REPO_ROOT / "benchmarks").glob("bench_*.py")):
        module = importlib.import_module(f"benchmarks.{path.stem}")
        for name, cls in vars(module).items():
            if name.startswith("_") or not inspect.isclass(cls) or inspect.isabstract(cls):
                continue
            if cls.__module__ == module.__name__ and hasattr(cls, "setup_cache"):
                measured += 1
                if not isinstance(getattr(cls, "version", None), str):
                    unversioned.append(f"{path.stem}.{name}")
    assert measured >= 9 and unversioned == []


@pytest.fixture
def site_tools(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT / "benchmarks"))
    import asv_site
    import site_check

    return asv_site, site_check


def test_asv_site_is_made_self_contained(site_tools, tmp_path):
    """The CDN scripts of asv's page come from local copies (Debian's files, here stand-ins),
    the graph fixes load after them, once however often it runs; a missing package is named
    and its link kept."""
    asv_site, _ = site_tools
    html, libs = tmp_path / "html", tmp_path / "share"
    html.mkdir()
    (html / "index.html").write_text(ASV_PAGE)
    for path in ("javascript/jquery/jquery.min.js", "haskell-js-flot/jquery.flot.min.js"):
        (libs / path).parent.mkdir(parents=True, exist_ok=True)
        (libs / path).write_text(f"/* {path} */")
    assert asv_site.make_self_contained(html, libs) == ["libjs-bootstrap"]
    page = (html / "index.html").read_text()
    assert asv_site.external_urls(page) == [
        "https://cdn.jsdelivr.net/npm/bootstrap@3.1.1/dist/css/bootstrap.min.css"
    ]
    assert "orderBars" not in page
    assert (html / "vendor" / "javascript_jquery_jquery.min.js").read_text().startswith("/*")
    assert page.index("vendor/haskell-js-flot_jquery.flot.min.js") < page.index(
        "vendor/asv_site.js"
    )
    (libs / "javascript/bootstrap/css").mkdir(parents=True)
    (libs / "javascript/bootstrap/css/bootstrap.min.css").write_text("/* css */")
    assert asv_site.make_self_contained(html, libs) == []
    page = (html / "index.html").read_text()
    assert asv_site.external_urls(page) == [] and page.count("vendor/asv_site.js") == 1
    assert (html / "vendor" / "asv_site.js").read_text() == (
        REPO_ROOT / "benchmarks" / "asv_site.js"
    ).read_text()
    (html / "index.html").write_text(ASV_PAGE.replace("jquery-3.3.1.min.js", "jquery-9.9.9.min.js"))
    with pytest.raises(ValueError, match="no local stand-in for https://code.jquery.com/jquery-9"):
        asv_site.make_self_contained(html, libs)


def _site_report(**changes):
    report = {
        "axis_labels": {"x": "commits", "y": "GB/s"},
        "tick_labels": {"x": ["997a76e8", "fb5a8a80", "b4931e2a"], "y": ["500", "1000"]},
        "x_tick_boxes": [
            {"x": 0, "y": 700, "w": 60, "h": 12},
            {"x": 300, "y": 700, "w": 60, "h": 12},
        ],
        "plot_area": {"x": 280, "y": 117, "w": 780, "h": 620},
    }
    report.update(changes)
    return report


def test_site_check_fails_on_the_graph_defects(site_tools):
    """What the site check reads from the page: exponent y ticks, a commits axis without
    commits, overlapping x labels, a legend over the plot."""
    _, site_check = site_tools
    assert site_check._tick_problems(_site_report()) == []
    bad_y = _site_report(tick_labels={"x": ["997a76e8", "b4931e2a"], "y": ["1.00e+3", "3.00e+3"]})
    assert "exponent notation" in site_check._tick_problems(bad_y)[0]
    no_commits = _site_report(tick_labels={"x": ["", "", ""], "y": ["500"]})
    assert "names 0 commits" in site_check._tick_problems(no_commits)[0]
    boxes = [{"x": 0, "y": 700, "w": 60, "h": 12}, {"x": 40, "y": 700, "w": 60, "h": 12}]
    crossed = site_check._tick_problems(_site_report(x_tick_boxes=boxes))
    assert "1 pairs of x tick labels overlap" in crossed[0]
    legend = {"box": {"x": 287, "y": 122, "w": 253, "h": 133}, "labels": []}
    problems = site_check._legend_placement_problems(_site_report(legend=legend))
    assert "lies over the plot area" in problems[0]
    beside = {"box": {"x": 1080, "y": 117, "w": 300, "h": 133}, "labels": []}
    assert site_check._legend_placement_problems(_site_report(legend=beside)) == []
