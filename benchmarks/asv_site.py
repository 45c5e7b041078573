"""Make the asv history site that `asv publish` built self-contained and its graph readable.

    python benchmarks/asv_site.py [--html .asv/html] [--libs /usr/share]

asv's pages load jQuery, flot 0.8.3 with its time, selection and categories plugins,
bootstrap 3, stupidtable and blueimp-md5 from CDNs: without the internet a page shows asv's
"failed to load external JavaScript" error.  This copies Debian's copies of those libraries
into the site (``vendor/``) and points the page at them, so the site works offline.  It needs
Debian's packages (``LOCAL_LIBS`` names the file of each):

    apt-get install libjs-jquery libghc-js-flot-data libjs-bootstrap node-blueimp-md5 \\
        libjs-jquery-stupidtable

Not Debian's libjs-jquery-flot: that is flot 4, which bundles an axis-label plugin of its own
(beside the one asv ships, so every axis label is drawn twice) and an SVG legend that is black
without flot 4's stylesheet.  flot-orderbars has no package; asv uses it only for bar charts,
and its tag is dropped.  Where a package is missing, its CDN link stays, and this says which
packages to install (the site then needs the internet).

It also loads ``asv_site.js`` (beside this file) after flot: the graph's legend beside the plot
instead of over the series, plain y tick labels (not "3.00e+3"), and the commits on the x axis
labelled with their hashes.  Run after every `asv publish` (`nox -s bench_site` does);
running it twice changes nothing more.  Standard library only.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

# CDN file (the end of its URL) -> (the file under /usr/share that stands in for it, its Debian
# package); None: left out (see the module docstring)
LOCAL_LIBS = {
    "jquery-3.3.1.min.js": ("javascript/jquery/jquery.min.js", "libjs-jquery"),  # jQuery 3.6
    "flot/0.8.3/jquery.flot.min.js": ("haskell-js-flot/jquery.flot.min.js", "libghc-js-flot-data"),
    "flot/0.8.3/jquery.flot.time.min.js": (
        "haskell-js-flot/jquery.flot.time.min.js",
        "libghc-js-flot-data",
    ),
    "flot/0.8.3/jquery.flot.selection.min.js": (
        "haskell-js-flot/jquery.flot.selection.min.js",
        "libghc-js-flot-data",
    ),
    "flot/0.8.3/jquery.flot.categories.min.js": (
        "haskell-js-flot/jquery.flot.categories.min.js",
        "libghc-js-flot-data",
    ),
    "jquery.flot.orderBars.js": None,  # no package; bar charts only
    "stupidtable.min.js": (
        "javascript/jquery-stupidtable/stupidtable.js",
        "libjs-jquery-stupidtable",
    ),
    "md5.min.js": ("javascript/blueimp-md5/md5.min.js", "node-blueimp-md5"),
    "bootstrap.min.js": ("javascript/bootstrap/js/bootstrap.min.js", "libjs-bootstrap"),
    "bootstrap.min.css": ("javascript/bootstrap/css/bootstrap.min.css", "libjs-bootstrap"),
}
PACKAGES = sorted({lib[1] for lib in LOCAL_LIBS.values() if lib})
VENDOR = "vendor"
GRAPH_SCRIPT = Path(__file__).with_name("asv_site.js")
GRAPH_SCRIPT_TAG = f'<script src="{VENDOR}/{GRAPH_SCRIPT.name}"></script>'
EXTERNAL_TAG = re.compile(
    r'<script src="https?://[^"]+"[^>]*></script>|<link rel="stylesheet" href="https?://[^"]+"[^>]*>'
)


def external_urls(page):
    """The URLs of the scripts and stylesheets that ``page`` (HTML) loads from elsewhere."""
    return [
        re.search(r'(?:src|href)="([^"]+)"', tag).group(1) for tag in EXTERNAL_TAG.findall(page)
    ]


def make_self_contained(html, libs="/usr/share"):
    """Rewrite ``html``/index.html in place (see the module docstring).  Returns the Debian
    packages that were missing (their CDN links stay); ValueError for a CDN link this file
    does not know."""
    html = Path(html)
    index = html / "index.html"
    page = index.read_text(encoding="utf-8")
    vendor = html / VENDOR
    vendor.mkdir(exist_ok=True)
    missing = set()

    def local(match):
        tag = match.group(0)
        url = re.search(r'(?:src|href)="([^"]+)"', tag).group(1)
        key = next((k for k in LOCAL_LIBS if url.endswith(k)), None)
        if key is None:
            raise ValueError(f"asv_site: no local stand-in for {url} (a new asv?): see LOCAL_LIBS")
        if LOCAL_LIBS[key] is None:
            return ""
        path, package = LOCAL_LIBS[key]
        src = Path(libs) / path
        if not src.is_file():
            missing.add(package)
            return tag
        # files of the same name from different folders (jquery.flot.min.js) stay apart
        dest = vendor / path.replace("/", "_")
        shutil.copyfile(src, dest)
        if tag.startswith("<link"):
            return f'<link rel="stylesheet" href="{VENDOR}/{dest.name}">'
        return f'<script src="{VENDOR}/{dest.name}" onerror="js_load_failure()"></script>'

    page = EXTERNAL_TAG.sub(local, page)
    shutil.copyfile(GRAPH_SCRIPT, vendor / GRAPH_SCRIPT.name)
    if GRAPH_SCRIPT_TAG not in page:
        # last in <head>: after flot and its plugins, before asv draws anything (on ready)
        head_end = page.index("</head>")
        page = f"{page[:head_end]}  {GRAPH_SCRIPT_TAG}\n  {page[head_end:]}"
    index.write_text(page, encoding="utf-8")
    return sorted(missing)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--html", default=".asv/html", help="the published site (default: %(default)s)")
    ap.add_argument(
        "--libs",
        default="/usr/share",
        help="the folder holding Debian's copies of the libraries (default: %(default)s)",
    )
    args = ap.parse_args(argv)
    html = Path(args.html)
    if not (html / "index.html").is_file():
        raise SystemExit(f"asv_site: {html}/index.html not found; run `asv publish` first")
    try:
        missing = make_self_contained(html, args.libs)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if missing:
        print(
            f"asv_site: {html}: still loads libraries from CDNs (needs the internet to show): "
            f"not found under {args.libs}: {', '.join(missing)} (apt-get install "
            f"{' '.join(PACKAGES)})"
        )
        return 0
    print(f"asv_site: {html}: self-contained (libraries in {html / VENDOR}), graph fixes loaded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
