"""Run the asv suite for several commits on a GPU machine that may have neither git history nor a
package registry, and bring the results back for `.asv/results/<machine>/`.

In a checkout with git:

    python benchmarks/asv_commits.py prepare HASH [HASH ...]

writes `.asvrun/` (git-ignored): a bare clone of this repository, shallow where it can be (asv
reads commit dates and hashes from it, so a copy of the tree without `.git` will do on the GPU
machine), the `packages/` folder of each commit (`git archive`), and `asv.conf.json` with `repo`
pointed at the clone and results going to `.asvrun/results`.  Copy the tree with `.asvrun` to
the GPU machine, whose Python has asv, CUDA builds of torch, numba-cuda and CuPy, and the
packages' dependencies; there:

    python3 benchmarks/asv_commits.py run --machine h200 [--bench REGEX] [--quick] HASH ...

runs, for each commit, `asv run -E existing:python3 --set-commit-hash HASH` with that commit's
three packages first on PYTHONPATH (the benchmarks are this checkout's: the current suite
measuring the code of each commit), then packs `.asvrun/results/<machine>` into
`asv_<machine>.tgz` in `--out` (default: `$OUT`, else the current folder), with asv's
`benchmarks.json` (the suite as discovered there).  Back in the checkout, unpack it into
`.asv/results/` and commit:

    tar xzf asv_h200.tgz -C .asv/results && git add .asv/results

Every asv process compiles its kernels again (numba), so a full run of the GPU suite takes
minutes per commit; `--bench` narrows it (an asv regular expression on benchmark names).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / ".asvrun"
PACKAGES = ("fp4_kernels", "fp4_comm", "fp4_train")


def _git(*args, cwd=ROOT):
    return subprocess.check_output(["git", *args], cwd=cwd, text=True).strip()


def _config():
    """asv.conf.json (JSON5) as asv reads it, with repo and results redirected into .asvrun.
    Read with json5 (an asv dependency): importing ``asv.util`` registers asv's commands,
    which fails where asv and asv_runner disagree on their names."""
    import json5

    conf = json5.loads((ROOT / "asv.conf.json").read_text())
    conf.update(repo=".asvrun/git", results_dir=".asvrun/results", html_dir=".asvrun/html")
    return conf


def _clone(fulls):
    """The bare clone asv reads: shallow, as deep as the oldest of ``fulls`` below HEAD (asv
    reads only the commits' hashes and dates; the full history would take most of what may
    travel to a GPU machine), or whole where a commit is not an ancestor of HEAD."""
    dest = RUN / "git"
    if dest.exists():
        shutil.rmtree(dest)
    head = _git("rev-parse", "HEAD")
    ancestors = all(
        subprocess.run(["git", "merge-base", "--is-ancestor", f, head], cwd=ROOT).returncode == 0
        for f in fulls
    )
    shallow = []
    if ancestors:
        depth = 1 + max(int(_git("rev-list", "--count", f"{f}..{head}")) for f in fulls)
        shallow = ["--depth", str(depth)]
    subprocess.run(["git", "clone", "-q", "--bare", *shallow, ROOT.as_uri(), str(dest)],
                   check=True)  # fmt: skip


def prepare(hashes):
    RUN.mkdir(exist_ok=True)
    fulls = [_git("rev-parse", "--verify", f"{h}^{{commit}}") for h in hashes]
    _clone(fulls)
    for h, full in zip(hashes, fulls, strict=True):
        dest = RUN / "src" / full[:8]
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", full, "packages"], cwd=ROOT,
                                 check=True, capture_output=True).stdout  # fmt: skip
        subprocess.run(["tar", "x", "-C", str(dest)], input=archive, check=True)
        print(f"{h}: {full[:8]} -> {dest.relative_to(ROOT)}")
    # asv reads the configuration relative to its own folder: keep it at the root
    (ROOT / ".asvrun" / "asv.conf.json").write_text(json.dumps(_config(), indent=1) + "\n")


def _asv_cmd(root_conf, machine, full, bench, quick):
    cmd = [sys.executable, "-m", "asv", "run", "--config", str(root_conf),
           "-E", f"existing:{sys.executable}", "--machine", machine,
           "--set-commit-hash", full, "--show-stderr"]  # fmt: skip
    if bench:
        cmd += ["--bench", bench]
    if quick:
        cmd.append("--quick")
    return cmd


def run(hashes, machine, benches, quick, out, gpus=0, time_limit_s=None):
    """asv run for each commit (and each --bench expression, one asv process each, so that a
    stopped run keeps the results of the processes before it: asv saves a commit's results when
    its process ends).  With ``gpus`` > 0, one worker per GPU (CUDA_VISIBLE_DEVICES) takes
    whole commits from a queue, so no two processes write the same commit's result file; only
    for benchmarks that use one GPU each.  ``time_limit_s``: no asv process starts after that
    many seconds and a running one is stopped at it."""
    conf = RUN / "asv.conf.json"
    if not conf.exists():
        sys.exit(f"{conf} is missing: run `python benchmarks/asv_commits.py prepare ...` first")
    root_conf = ROOT / ".asvrun.conf.json"  # beside benchmarks/, so relative paths hold
    shutil.copy(conf, root_conf)
    asv = [sys.executable, "-m", "asv"]
    subprocess.run([*asv, "machine", "--yes", "--machine", machine, "--config", str(root_conf)],
                   cwd=ROOT, check=True)  # fmt: skip
    commits = []
    for h in hashes:
        full = _git("rev-parse", "--verify", f"{h}^{{commit}}", cwd=RUN / "git")
        src = RUN / "src" / full[:8] / "packages"
        if not src.is_dir():
            sys.exit(f"{src} is missing: prepare {h} first")
        commits.append((h, full, src))
    out = Path(out or os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
    queue = list(commits)
    lock = threading.Lock()
    failed, stopped = [], []

    def worker(gpu):
        env = dict(os.environ)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        log = open(out / f"asv_gpu{gpu}.log", "a") if gpu is not None else None
        while True:
            with lock:
                if not queue:
                    break
                h, full, src = queue.pop(0)
            paths = [str(src / p / "src") for p in PACKAGES]
            rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
            env["PYTHONPATH"] = os.pathsep.join(paths + rest)
            # asv drops PYTHONPATH from its benchmark processes and uses ASV_PYTHONPATH
            env["ASV_PYTHONPATH"] = env["PYTHONPATH"]
            probe = "import fp4_kernels; print(fp4_kernels.__file__)"
            where = subprocess.run([sys.executable, "-c", probe], env=env,
                                   capture_output=True, text=True).stdout.strip()  # fmt: skip
            if not where.startswith(str(src)):
                failed.append(f"{h}: fp4_kernels imports from {where or '(nowhere)'}, not {src}")
                continue
            for bench in benches or [None]:
                what = f"{h} {bench or 'all'}" + ("" if gpu is None else f" (GPU {gpu})")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left < 1:
                    stopped.append(what)
                    continue
                cmd = _asv_cmd(root_conf, machine, full, bench, quick)
                print(f"start {what}", flush=True)
                t0 = time.monotonic()
                # own process group: a stop takes asv's benchmark processes with it
                proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                        stderr=subprocess.STDOUT if log else None,
                                        start_new_session=True)  # fmt: skip
                try:
                    rc = proc.wait(timeout=left)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    stopped.append(what)
                    continue
                print(f"done  {what}: rc {rc}, {time.monotonic() - t0:.0f} s", flush=True)
                if rc:
                    failed.append(what)
        if log:
            log.close()

    threads = [
        threading.Thread(target=worker, args=(g,)) for g in (range(gpus) if gpus else [None])
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _pack(machine, out)
    if stopped:
        print("not run or stopped by --time-limit-s: " + "; ".join(stopped))
    if failed:
        sys.exit("asv failed for " + "; ".join(failed))


def _pack(machine, out):
    """asv_<machine>.tgz in ``out``: the machine's results and the suite as discovered there
    (GPU benchmarks with their parameters: asv publish reads the benchmark list from it).
    Where asv wrote neither (its discovery failed: the log above says why), no archive."""
    results, suite = RUN / "results" / machine, RUN / "results" / "benchmarks.json"
    missing = [str(p.relative_to(ROOT)) for p in (results, suite) if not p.exists()]
    if missing:
        print(f"no asv_{machine}.tgz: asv wrote no {' and no '.join(missing)}", flush=True)
        return
    with tarfile.open(out / f"asv_{machine}.tgz", "w:gz") as tar:
        tar.add(results, arcname=machine)
        tar.add(suite, arcname="benchmarks.json")
    print(f"wrote {out / f'asv_{machine}.tgz'}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="here: bare clone and each commit's packages/")
    p.add_argument("hashes", nargs="+")
    r = sub.add_parser("run", help="there: asv run for each commit, results packed")
    r.add_argument("hashes", nargs="+")
    r.add_argument("--machine", required=True)
    r.add_argument(
        "--bench",
        action="append",
        default=None,
        help="asv --bench regular expression; repeat it for one asv process each",
    )
    r.add_argument(
        "--gpus",
        type=int,
        default=0,
        help="spread the commits over this many GPUs, one at a time on each "
        "(benchmarks that use one GPU only)",
    )
    r.add_argument(
        "--time-limit-s",
        type=float,
        default=None,
        help="start nothing after this many seconds, stop what is running",
    )
    r.add_argument("--quick", action="store_true", help="asv --quick (one repeat)")
    r.add_argument("--out", default=None, help="folder for the .tgz (default: $OUT, else .)")
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args.hashes)
    else:
        run(args.hashes, args.machine, args.bench, args.quick, args.out, args.gpus,
            args.time_limit_s)  # fmt: skip


if __name__ == "__main__":
    main()
