"""Run the asv suite for several commits on a machine that has no package registry (the GPU
machine) and bring the results back for `.asv/results/<machine>/`.

Here (a checkout with git):

    python benchmarks/asv_commits.py prepare HASH [HASH ...]

writes `.asvrun/` (git-ignored): a bare clone of this repository (asv reads commit dates and
hashes from it; the GPU machine's copy of the tree has no usable .git), the `packages/` folder
of each commit (`git archive`), and `asv.conf.json` with `repo` pointed at the clone and
results going to `.asvrun/results`.  Carry `.asvrun` (and `.whl`, which holds asv) to the GPU
machine; there:

    python3 benchmarks/asv_commits.py run --machine h200 [--bench REGEX] [--quick] HASH ...

runs, for each commit, `asv run -E existing:python3 --set-commit-hash HASH` with that commit's
three packages first on PYTHONPATH (the benchmarks are this checkout's: the suite of today
measuring the code of each commit), then packs `.asvrun/results/<machine>` into
`$OUT/asv_<machine>.tgz` (or `--out`), with asv's `benchmarks.json` (the suite as discovered
there).  Back here, unpack it into `.asv/results/` and commit:

    tar xzf asv_h200.tgz -C .asv/results && git add .asv/results

Every asv process compiles its kernels again (numba), so a full run of the GPU suite takes
minutes per commit; `--bench` narrows it (an asv regular expression on benchmark names).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / ".asvrun"
PACKAGES = ("fp4_kernels", "fp4_comm", "fp4_train")


def _git(*args, cwd=ROOT):
    return subprocess.check_output(["git", *args], cwd=cwd, text=True).strip()


def _config():
    """asv.conf.json (JSON5) as asv reads it, with repo and results redirected into .asvrun."""
    from asv.util import load_json

    conf = load_json(str(ROOT / "asv.conf.json"), js_comments=True)
    conf.update(repo=".asvrun/git", results_dir=".asvrun/results", html_dir=".asvrun/html")
    return conf


def prepare(hashes):
    if (RUN / "git").exists():
        shutil.rmtree(RUN / "git")
    RUN.mkdir(exist_ok=True)
    subprocess.run(["git", "clone", "-q", "--bare", str(ROOT), str(RUN / "git")], check=True)
    for h in hashes:
        full = _git("rev-parse", "--verify", f"{h}^{{commit}}")
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


def run(hashes, machine, bench, quick, out):
    conf = RUN / "asv.conf.json"
    if not conf.exists():
        sys.exit(f"{conf} is missing: run `python benchmarks/asv_commits.py prepare ...` first")
    root_conf = ROOT / ".asvrun.conf.json"  # beside benchmarks/, so relative paths hold
    shutil.copy(conf, root_conf)
    asv = [sys.executable, "-m", "asv"]
    subprocess.run([*asv, "machine", "--yes", "--machine", machine, "--config", str(root_conf)],
                   cwd=ROOT, check=True)  # fmt: skip
    failed = []
    for h in hashes:
        full = _git("rev-parse", "--verify", f"{h}^{{commit}}", cwd=RUN / "git")
        src = RUN / "src" / full[:8] / "packages"
        if not src.is_dir():
            sys.exit(f"{src} is missing: prepare {h} first")
        paths = [str(src / p / "src") for p in PACKAGES]
        rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths + rest))
        cmd = [*asv, "run", "--config", str(root_conf), "-E", f"existing:{sys.executable}",
               "--machine", machine, "--set-commit-hash", full, "--show-stderr"]  # fmt: skip
        if bench:
            cmd += ["--bench", bench]
        if quick:
            cmd.append("--quick")
        print(" ".join(cmd[2:]), flush=True)
        if subprocess.run(cmd, cwd=ROOT, env=env).returncode:
            failed.append(h)
    results = RUN / "results" / machine
    out = Path(out or os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / f"asv_{machine}.tgz", "w:gz") as tar:
        tar.add(results, arcname=machine)
        # the suite as discovered there (GPU benchmarks with their parameters): asv publish
        # reads the benchmark list from it
        tar.add(RUN / "results" / "benchmarks.json", arcname="benchmarks.json")
    print(f"wrote {out / f'asv_{machine}.tgz'}")
    if failed:
        sys.exit(f"asv failed for {' '.join(failed)}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="here: bare clone and each commit's packages/")
    p.add_argument("hashes", nargs="+")
    r = sub.add_parser("run", help="there: asv run for each commit, results packed")
    r.add_argument("hashes", nargs="+")
    r.add_argument("--machine", required=True)
    r.add_argument("--bench", default=None, help="asv --bench regular expression")
    r.add_argument("--quick", action="store_true", help="asv --quick (one repeat)")
    r.add_argument("--out", default=None, help="folder for the .tgz (default $OUT or .)")
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args.hashes)
    else:
        run(args.hashes, args.machine, args.bench, args.quick, args.out)


if __name__ == "__main__":
    main()
