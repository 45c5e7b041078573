"""Check that the asv history site renders in a real (headless) browser, and keep a screenshot.

    python benchmarks/site_check.py [--html .asv/html] [--out .asv/site_check.png]

Serves the site that ``asv publish`` wrote over HTTP on 127.0.0.1 (asv's pages load their JSON
with XMLHttpRequest, which browsers refuse on file:// URLs), opens the graph page of one
benchmark in headless Chromium, lets its JavaScript run, and fails unless the rendered DOM holds
a drawn graph (flot's canvas) for that benchmark; the screenshot is written next to it as the
artifact a person can look at.  Standard library only, plus a Chromium binary
(``chromium-headless-shell`` or ``chromium`` from Debian's packages).

asv's pages load jQuery, flot, bootstrap, stupidtable and blueimp-md5 from CDNs, so a viewer
needs the internet, and on a machine without it (CI) the page shows asv's "failed to load"
error.  ``--local-libs DIR`` (default: Debian's ``/usr/share/javascript`` when it holds them:
packages libjs-jquery, libjs-jquery-flot, libjs-bootstrap, node-blueimp-md5,
libjs-jquery-stupidtable) checks a copy of the site whose CDN links point at those files
instead.  They are other versions (jQuery 3.6 for 3.3, flot 4.2 for 0.8.3); flot-orderbars has
no package and is left out (asv uses it only for bar charts).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")
# CDN file (the end of its URL) -> the file of Debian's packages that stands in for it
LOCAL_LIBS = {
    "jquery-3.3.1.min.js": "jquery/jquery.min.js",
    "flot/0.8.3/jquery.flot.min.js": "jquery-flot/jquery.flot.js",  # flot 4: plugins bundled
    "flot/0.8.3/jquery.flot.time.min.js": None,
    "flot/0.8.3/jquery.flot.selection.min.js": None,
    "flot/0.8.3/jquery.flot.categories.min.js": None,
    "jquery.flot.orderBars.js": None,  # no package; bar charts only
    "stupidtable.min.js": "jquery-stupidtable/stupidtable.js",
    "md5.min.js": "blueimp-md5/md5.min.js",
    "bootstrap.min.js": "bootstrap/js/bootstrap.min.js",
    "bootstrap.min.css": "bootstrap/css/bootstrap.min.css",
}


def _browser():
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    raise SystemExit(
        f"site_check: no headless browser found (looked for {', '.join(BROWSERS)}); "
        "install Debian's chromium-headless-shell"
    )


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _benchmark_with_results(html, preferred=None):
    """A benchmark name that has a graph: ``preferred`` if it has one, else the first in the
    site's index with any result."""
    index = json.loads((html / "index.json").read_text())
    graphs = sorted(p.name for p in (html / "graphs").rglob("*.json"))
    if preferred and f"{preferred}.json" in graphs:
        return preferred
    for name in sorted(index["benchmarks"]):
        if f"{name}.json" in graphs:
            return name
    raise SystemExit("site_check: the site has no graph at all (no results were published)")


def _with_local_libs(html, libs, workdir):
    """A copy of the site whose CDN links point at ``libs`` (see the module docstring)."""
    site = Path(workdir) / "html"
    shutil.copytree(html, site)
    vendor = site / "vendor"
    vendor.mkdir()
    page = (site / "index.html").read_text()

    def local(match):
        tag = match.group(0)
        url = re.search(r'(?:src|href)="(https://[^"]+)"', tag).group(1)
        key = next((k for k in LOCAL_LIBS if url.endswith(k)), None)
        if key is None:
            raise SystemExit(f"site_check: no local stand-in for {url}")
        if LOCAL_LIBS[key] is None:
            return ""
        src = Path(libs) / LOCAL_LIBS[key]
        shutil.copy(src, vendor / src.name)
        attr = "href" if tag.startswith("<link") else "src"
        if attr == "href":
            return f'<link rel="stylesheet" href="vendor/{src.name}">'
        return f'<script src="vendor/{src.name}" onerror="js_load_failure()"></script>'

    page = re.sub(r'<script src="https://[^"]+"[^>]*></script>', local, page)
    page = re.sub(r'<link rel="stylesheet" href="https://[^"]+"[^>]*>', local, page)
    (site / "index.html").write_text(page)
    return site


def _chromium(browser, url, *args, timeout=120):
    cmd = [
        browser,
        "--headless",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox refuses to start
        "--disable-gpu",
        "--hide-scrollbars",
        "--window-size=1400,900",
        "--virtual-time-budget=15000",  # let the page's scripts fetch and draw
        *args,
        url,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--html", default=".asv/html", help="the published site (default: %(default)s)")
    ap.add_argument("--out", default=".asv/site_check.png", help="screenshot path")
    ap.add_argument(
        "--local-libs",
        default="/usr/share/javascript",
        help="folder of Debian's libjs-* files to use instead of the CDNs, or '' for the CDNs",
    )
    ap.add_argument(
        "--benchmark",
        default="bench_quantize.QuantizeGPU.track_gbps",
        help="the graph page to open (default: %(default)s, which has the H200 history; "
        "the first benchmark with results if it has none)",
    )
    args = ap.parse_args(argv)
    html = Path(args.html).resolve()
    if not (html / "index.html").exists():
        raise SystemExit(f"site_check: {html}/index.html not found; run `asv publish` first")
    name = _benchmark_with_results(html, args.benchmark)
    browser = _browser()

    workdir = tempfile.mkdtemp(prefix="site_check_")
    if args.local_libs:
        html = _with_local_libs(html, args.local_libs, workdir)
    handler = functools.partial(_QuietHandler, directory=str(html))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/#{name}"
        dom = _chromium(browser, url, "--dump-dom")
        out = Path(args.out).resolve()
        out.parent.mkdir(parents=True, exist_ok=True)
        shot = _chromium(browser, url, f"--screenshot={out}")
    finally:
        server.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
    problems = []
    if dom.returncode != 0:
        problems.append(f"chromium --dump-dom exited {dom.returncode}: {dom.stderr[-2000:]}")
    if "flot-base" not in dom.stdout:  # the canvas flot draws the graph on
        problems.append(f"no graph drawn on the page of {name}")
    if shot.returncode != 0 or not out.exists() or out.stat().st_size < 10_000:
        problems.append(f"no screenshot written ({shot.stderr[-2000:]})")
    if problems:
        print("site_check: FAILED\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print(f"site_check: {name}: graph drawn; screenshot {out} ({out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
