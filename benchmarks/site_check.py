"""Check that the asv history site renders in a real (headless) browser, offline, and keep a
screenshot.

    python benchmarks/site_check.py [--html .asv/html] [--out .asv/site_check.png]

Checks the site as `asv publish` and then ``benchmarks/asv_site.py`` built it (`nox -s
bench_site` runs both): serves it over HTTP on 127.0.0.1 (asv's pages load their JSON with
XMLHttpRequest, which browsers refuse on file:// URLs), opens the graph page of one benchmark in
headless Chromium with every host but 127.0.0.1 unresolvable (as on a machine without the
internet), lets its JavaScript run, and fails unless a reader could read the graph:

- the page loads no script or stylesheet from elsewhere (asv's own page takes them from CDNs:
  offline it shows asv's "failed to load external JavaScript" page);
- flot drew it (its canvas is in the rendered DOM);
- each axis label (the unit, "commits") is drawn exactly once, on a canvas or as page text:
  two axis-label plugins at once print "GB/sGB/s";
- the y tick labels are plain numbers, not "3.00e+3"; on the "commits" x axis, at least two
  commits are labelled with their hashes;
- the legend has a label for every series, lies outside the plot area (over it, it hides the
  series drawn beneath), its background is not black, and its labels stand out from that
  background in the screenshot (pixels sampled where the browser laid them out).

A probe script injected into the served copy of the page records what the page draws (every
canvas ``fillText``, the axis-label, tick-label and legend elements with their boxes, the plot
area) and writes it into the DOM, which ``chromium --dump-dom`` returns; the screenshot is
written next to it as the artifact a person can look at.  Standard library only, plus a
Chromium binary (Debian's ``chromium-headless-shell`` or ``chromium``).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # asv_site, beside this file
from asv_site import external_urls  # noqa: E402

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")
# Injected first into the served page: records every text drawn on a canvas, then (once a
# second, so the last report is of the page as it settled) the graph's axis labels and legend
# as laid out, as JSON in an element that `--dump-dom` returns.
PROBE_JS = """
(function () {
  var canvases = [], texts = [];  // texts[i]: drawn on canvases[i] since it was last cleared
  function drawnOn(canvas) {
    var i = canvases.indexOf(canvas);
    if (i < 0) { canvases.push(canvas); texts.push([]); i = canvases.length - 1; }
    return texts[i];
  }
  var proto = CanvasRenderingContext2D.prototype;
  var fillText = proto.fillText, clear = proto.clearRect;
  proto.fillText = function (text) {
    drawnOn(this.canvas).push(String(text));
    return fillText.apply(this, arguments);
  };
  proto.clearRect = function (x, y) {  // flot clears the whole canvas before each redraw
    if (x <= 0 && y <= 0) drawnOn(this.canvas).length = 0;
    return clear.apply(this, arguments);
  };
  function box(el) {
    var r = el.getBoundingClientRect();
    return {x: r.left, y: r.top, w: r.width, h: r.height};
  }
  function report() {
    var graph = document.getElementById("main-graph"), out = {canvas_texts: []};
    canvases.forEach(function (canvas, i) {
      if (graph && graph.contains(canvas)) out.canvas_texts = out.canvas_texts.concat(texts[i]);
    });
    var plot = window.jQuery && graph && jQuery(graph).data("plot");
    if (plot) {
      var axes = plot.getAxes();
      out.axis_labels = {x: axes.xaxis.options.axisLabel || "",
                         y: axes.yaxis.options.axisLabel || ""};
      out.series = plot.getData().length;
      function labels(axis) {
        return (axis.ticks || []).map(function (t) { return String(t.label); });
      }
      out.tick_labels = {x: labels(axes.xaxis), y: labels(axes.yaxis)};
      out.x_tick_boxes = [];
      graph.querySelectorAll(".flot-x-axis .tickLabel").forEach(function (el) {
        if (el.textContent) out.x_tick_boxes.push(box(el));
      });
      var offset = plot.getPlotOffset(), at = graph.getBoundingClientRect();
      out.plot_area = {x: at.left + offset.left, y: at.top + offset.top,
                       w: plot.width(), h: plot.height()};
    }
    out.page_texts = [];
    if (graph) graph.querySelectorAll("[class*=axisLabel]").forEach(function (el) {
      if (el.children.length === 0) out.page_texts.push(el.textContent);
    });
    // flot puts the legend in the graph (".legend"), or, given a container, a table there
    var area = document.getElementById("graph") || graph, legend = null;
    if (area) {
      legend = area.querySelector(".legend");
      var label = legend ? null : area.querySelector(".legendLabel");
      if (label) legend = label.closest("table").parentNode;
    }
    if (legend) {
      var labels = legend.querySelectorAll(".legendLabel, text");
      out.legend = {box: box(legend), labels: []};
      labels.forEach(function (el) {
        out.legend.labels.push({text: el.textContent.trim(), box: box(el)});
      });
      var inner = legend.querySelector("table, svg");
      if (inner) out.legend.box = box(inner);
    }
    var node = document.getElementById("site-check-report");
    if (!node) {
      node = document.createElement("script");
      node.type = "application/json";
      node.id = "site-check-report";
      document.body.appendChild(node);
    }
    node.textContent = JSON.stringify(out);
  }
  setInterval(report, 1000);
})();
"""


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


def _site_copy(html, workdir):
    """A copy of the site with the probe script first in its page."""
    site = Path(workdir) / "html"
    shutil.copytree(html, site)
    page = (site / "index.html").read_text()
    head = page.index("<head>") + len("<head>")
    page = f"{page[:head]}\n<script>{PROBE_JS}</script>{page[head:]}"
    (site / "index.html").write_text(page)
    return site


def _probe_report(dom):
    """The probe's JSON from the rendered DOM, or None when the page never wrote it."""
    found = re.search(r'<script[^>]*id="site-check-report"[^>]*>(.*?)</script>', dom, re.S)
    return json.loads(found.group(1)) if found else None


def _axis_problems(report):
    """Each axis label drawn exactly once, nowhere doubled ("GB/sGB/s")."""
    if "axis_labels" not in report:
        return ["no flot plot on #main-graph (the page's graph was never drawn)"]
    problems = []
    drawn = report["canvas_texts"] + report["page_texts"]
    for axis, label in report["axis_labels"].items():
        if not label:
            problems.append(f"the {axis} axis has no label")
            continue
        on_canvas, on_page = report["canvas_texts"].count(label), report["page_texts"].count(label)
        if on_canvas + on_page != 1:
            problems.append(
                f"the {axis} axis label {label!r} is drawn {on_canvas + on_page} times "
                f"({on_canvas} on a canvas, {on_page} as page text): it reads doubled"
            )
        doubled = [t for t in drawn if len(t) > len(label) and t == label * (len(t) // len(label))]
        if doubled:
            problems.append(f"the {axis} axis label reads {doubled[0]!r}")
    return problems


EXPONENT = re.compile(r"^-?[0-9.]+e[+-]?[0-9]+$")
COMMIT_HASH = re.compile(r"^[0-9a-f]{7,40}$")


def _tick_problems(report):
    """Plain numbers on the y axis; commits named on a "commits" x axis."""
    ticks = report.get("tick_labels", {"x": [], "y": []})
    problems = []
    exponents = [t for t in ticks["y"] if EXPONENT.match(t)]
    if exponents:
        problems.append(f"the y tick labels are in exponent notation: {exponents[:3]}")
    if report["axis_labels"]["x"] == "commits":
        hashes = [t for t in ticks["x"] if COMMIT_HASH.match(t)]
        if len(hashes) < 2:
            problems.append(f"the commits x axis names {len(hashes)} commits: {ticks['x'][:5]}")
    boxes = report.get("x_tick_boxes", [])
    crossed = sum(_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    if crossed:
        problems.append(f"{crossed} pairs of x tick labels overlap (unreadable): {ticks['x']}")
    return problems


def _overlap(a, b):
    return (
        a["x"] < b["x"] + b["w"]
        and b["x"] < a["x"] + a["w"]
        and (a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"])
    )


def _png_rows(path, rows_needed):
    """The first ``rows_needed`` pixel rows of an 8-bit RGB(A) PNG (Chromium's screenshots) as
    lists of (r, g, b) tuples: enough to sample the page's top, without a decoder library."""
    data = Path(path).read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise SystemExit(f"site_check: {path} is not a PNG")
    pos, idat, header = 8, [], None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + length
    width, height, depth, color, _, _, interlace = header
    if depth != 8 or color not in (2, 6) or interlace:
        raise SystemExit(f"site_check: {path}: only 8-bit RGB(A), non-interlaced PNGs are read")
    step = 3 if color == 2 else 4
    raw = zlib.decompress(b"".join(idat))
    stride, prev, rows = width * step, bytearray(width * step), []
    for y in range(min(rows_needed, height)):
        kind, line = (
            raw[y * (stride + 1)],
            bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)]),
        )
        for i in range(stride):  # undo PNG's per-row filter (none, sub, up, average, Paeth)
            left = line[i - step] if i >= step else 0
            up, corner = prev[i], prev[i - step] if i >= step else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + up) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                guess = left + up - corner
                pa, pb, pc = abs(guess - left), abs(guess - up), abs(guess - corner)
                near = left if pa <= pb and pa <= pc else up if pb <= pc else corner
                line[i] = (line[i] + near) & 255
        rows.append([tuple(line[x : x + 3]) for x in range(0, stride, step)])
        prev = line
    return rows


def _luminance(rgb):
    r, g, b = rgb
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def _pixels(rows, box):
    x0, y0 = max(int(box["x"]), 0), max(int(box["y"]), 0)
    x1, y1 = int(box["x"] + box["w"]), int(box["y"] + box["h"])
    return [px for row in rows[y0:y1] for px in row[x0:x1]]


def _legend_placement_problems(report):
    """The legend outside the plot area: over it, it hides the series drawn beneath it."""
    legend = report.get("legend")
    if legend and "plot_area" in report and _overlap(legend["box"], report["plot_area"]):
        return [
            f"the legend {legend['box']} lies over the plot area {report['plot_area']}: it "
            "hides the series drawn beneath it"
        ]
    return []


def _legend_problems(report, screenshot):
    """A label for every series, on a background that is not black, each label visible on it:
    some of the pixels where the label was laid out differ clearly from the background."""
    legend = report.get("legend")
    if not legend:
        return ["the graph has no legend (asv shows one by default)"]
    problems = []
    texts = [label["text"] for label in legend["labels"]]
    if not texts or not all(texts) or len(texts) != report.get("series", len(texts)):
        problems.append(f"the legend's labels are {texts!r} for {report.get('series')} series")
    box = legend["box"]
    rows = _png_rows(screenshot, int(box["y"] + box["h"]) + 1)
    pixels = _pixels(rows, box)
    if not pixels:
        return [*problems, f"the legend lies outside the screenshot ({box})"]
    background = max(set(pixels), key=pixels.count)  # the colour most of the legend has
    if _luminance(background) < 64:
        problems.append(f"the legend's background is black (rgb{background})")
    unseen = []
    for label in legend["labels"]:
        inside = _pixels(rows, label["box"])
        ink = sum(abs(_luminance(px) - _luminance(background)) > 96 for px in inside)
        if not inside or ink < 0.02 * len(inside):
            unseen.append(label["text"])
    if unseen:
        problems.append(
            f"{len(unseen)} of {len(texts)} legend labels cannot be seen against the legend's "
            f"background rgb{background}: {unseen[:3]}"
        )
    return problems


def _chromium(browser, url, *args, timeout=120):
    cmd = [
        browser,
        "--headless",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox refuses to start
        "--disable-gpu",
        "--hide-scrollbars",
        "--window-size=1400,900",
        "--virtual-time-budget=15000",  # let the page's scripts fetch and draw
        # offline: every host but the local server unresolvable, CDNs included
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        *args,
        url,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--html", default=".asv/html", help="the published site (default: %(default)s)")
    ap.add_argument("--out", default=".asv/site_check.png", help="screenshot path")
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
    external = external_urls((html / "index.html").read_text(encoding="utf-8"))

    workdir = tempfile.mkdtemp(prefix="site_check_")
    html = _site_copy(html, workdir)
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
    if external:
        problems.append(
            f"the page loads {len(external)} scripts or stylesheets from the internet "
            f"({external[0]}, ...): run benchmarks/asv_site.py (its docstring names the Debian "
            "packages it copies them from)"
        )
    if dom.returncode != 0:
        problems.append(f"chromium --dump-dom exited {dom.returncode}: {dom.stderr[-2000:]}")
    if "flot-base" not in dom.stdout:  # the canvas flot draws the graph on
        problems.append(f"no graph drawn on the page of {name}")
    if shot.returncode != 0 or not out.exists() or out.stat().st_size < 10_000:
        problems.append(f"no screenshot written ({shot.stderr[-2000:]})")
    report = _probe_report(dom.stdout)
    if report is None:
        problems.append("the probe script wrote no report (the page's scripts did not run)")
    elif not problems:
        problems += _axis_problems(report)
        if not problems:
            problems += _tick_problems(report) + _legend_placement_problems(report)
            problems += _legend_problems(report, out)
    if problems:
        print(f"site_check: {name}: FAILED (screenshot {out})\n  " + "\n  ".join(problems),
              file=sys.stderr)  # fmt: skip
        return 1
    print(
        f"site_check: {name}: drawn offline, axis labels {report['axis_labels']} once each, "
        f"x ticks {report['tick_labels']['x'][:3]}..., y ticks {report['tick_labels']['y'][:3]}"
        f"..., {len(report['legend']['labels'])} legend labels visible beside the plot; "
        f"screenshot {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
