/* The asv history site's graph, made readable (benchmarks/asv_site.py loads this after flot):
 *
 * - the legend of the main graph sits beside the plot, not over it, where it hid the series
 *   drawn beneath it (asv puts it in the plot's north-west corner);
 * - y tick labels are plain numbers: asv writes toPrecision(3), "3.00e+3" for 3000;
 * - on the "commits" x axis, the measured commits are labelled with their short hashes (asv
 *   draws no label there): at most MAX_COMMIT_LABELS of them, evenly picked, and of those the
 *   ones whose labels do not overlap, the newest first.
 *
 * It wraps $.plot and changes the options asv passes for #main-graph before flot sees them.
 */
(function ($) {
  "use strict";
  var LEGEND_WIDTH_PX = 300;
  var MAX_COMMIT_LABELS = 12;
  var flotPlot = $.plot;

  function plainNumber(label) {
    var text = String(label);
    if (!/^-?[0-9.]+e[+-]?[0-9]+$/.test(text)) return text;
    return String(Number(Number(text).toPrecision(3)));  // "3.00e+3" -> "3000"
  }

  function commitTicks(series) {
    var seen = {}, revisions = [];
    $.each(series, function (_, s) {
      $.each(s.data || [], function (_, point) {
        if (point && point[0] !== null && !seen[point[0]]) {
          seen[point[0]] = true;
          revisions.push(point[0]);
        }
      });
    });
    revisions.sort(function (a, b) { return a - b; });
    var main = $.asv.main_json, length = main.hash_length || 8;
    var step = Math.max(1, Math.ceil(revisions.length / MAX_COMMIT_LABELS));
    var ticks = [];
    for (var i = 0; i < revisions.length; i += step) {
      var hash = main.revision_to_hash[revisions[i]];
      if (hash) ticks.push([revisions[i], hash.slice(0, length)]);
    }
    return ticks;
  }

  function placeLegend(graph, options) {
    var box = graph.parent(), legend = $("#asv-site-legend");
    if (!legend.length) {
      legend = $('<div id="asv-site-legend"></div>').css({
        position: "absolute", top: box.css("top"), right: 0, bottom: box.css("bottom"),
        width: LEGEND_WIDTH_PX + "px", "overflow-y": "auto"
      }).insertAfter(box);
    }
    var show = Boolean(options.legend && options.legend.show);
    box.css("right", show ? (LEGEND_WIDTH_PX + 12) + "px" : 0);
    legend.empty().toggle(show);
    if (show) options.legend.container = legend;
  }

  function apart(plot, ticks) {
    /* The ticks whose labels do not overlap, newest first: from the right, each kept label
       at least a label's width (flot measured the widest) from the one kept before it. */
    var axis = plot.getAxes().xaxis, gap = (axis.labelWidth || 60) + 8;
    var kept = [], last = Infinity;
    for (var i = ticks.length - 1; i >= 0; --i) {
      var at = axis.p2c(ticks[i][0]);
      if (last - at >= gap) {
        kept.unshift(ticks[i]);
        last = at;
      }
    }
    return kept;
  }

  $.plot = function (placeholder, series, options) {
    var graph = $(placeholder), commits = null;
    if (options && graph.attr("id") === "main-graph") {
      placeLegend(graph, options);
      var y = options.yaxis || {};
      if (y.tickFormatter) {
        var format = y.tickFormatter;
        y.tickFormatter = function (v, axis) { return plainNumber(format(v, axis)); };
      }
      var x = options.xaxis || {};
      if (x.axisLabel === "commits" && !x.ticks && $.asv && $.asv.main_json) {
        commits = x.ticks = commitTicks(series);
      }
    }
    var plot = flotPlot.apply(this, arguments);
    if (commits && commits.length > 1) {
      var kept = apart(plot, commits);
      if (kept.length < commits.length) {  // drawn again with the labels that fit
        options.xaxis.ticks = kept;
        plot = flotPlot.apply(this, arguments);
      }
    }
    return plot;
  };
  $.extend($.plot, flotPlot);  // plugins, version, formatDate: the same objects as flot's
})(jQuery);
