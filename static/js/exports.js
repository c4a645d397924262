// Figure downloads: a figure's numbers as CSV or JSON, from the figure the page embeds (the
// very data plotly draws), one record per bar, point or heatmap cell. Columns are named by
// the figure's axis titles and colour-bar title, with a "… label" column where an axis names
// its values (a position's token); `layout.meta.customdata` names the hover values a figure
// carries (hover texts, which are HTML, are left out). plotly text is HTML-escaped, so every
// text is read back as plain text.
//
// A figure draws tokens with their whitespace made visible (·, ⏎); the downloads hold the
// tokens' own text, which the figure carries beside what it draws (playground/plots.py):
// a trace's `meta` the plain text of its `text`, `x`, `y`, `customdata` or `name`, the
// layout's `meta.labels` the plain text naming each value of an axis ("x", "y2").
//
// Under node (tests/playground/test_figure_downloads.py) the file exports its functions and
// listens to no click.
(function () {
  "use strict";

  var parser = null;

  function plain(text) {
    if (text === null || text === undefined) return "";
    var html = String(text).replace(/<br\s*\/?>/gi, " ");
    parser = parser || new DOMParser();
    return parser.parseFromString(html, "text/html").documentElement.textContent;
  }

  // The figure's own plain text of a trace's `key` (see above), or undefined.
  function ownText(trace, key) {
    var meta = trace.meta;
    if (!meta || typeof meta !== "object" || Array.isArray(meta)) return undefined;
    return meta[key];
  }

  function titleOf(thing) {
    if (!thing) return "";
    return plain(typeof thing === "string" ? thing : thing.text);
  }

  // An axis of the layout ("x", "x2", "y2"): its title and the label of each named value.
  function axisOf(layout, ref, fallback) {
    var settings = layout[ref.charAt(0) + "axis" + ref.slice(1)] || {};
    var labels = new Map();
    (settings.tickvals || []).forEach(function (value, index) {
      labels.set(String(value), plain((settings.ticktext || [])[index]));
    });
    var own = ((layout.meta || {}).labels || {})[ref] || {};
    Object.keys(own).forEach(function (value) { labels.set(value, own[value]); });
    return { name: titleOf(settings.title) || fallback, labels: labels };
  }

  function setValue(record, axis, value) {
    record[axis.name] = value;
    var label = axis.labels.get(String(value));
    if (label !== undefined) record[axis.name + " label"] = label;
  }

  // The hover values of one bar, point or cell: numbers and plain strings, by name. `own`:
  // the figure's own plain values (nothing to read back, no HTML to leave out).
  function setCustom(record, custom, names, own) {
    if (custom === undefined || custom === null) return;
    var values = Array.isArray(custom) ? custom : [custom];
    values.forEach(function (value, index) {
      if (!own && typeof value === "string" && /<[a-z]/i.test(value)) return;
      var name = names[index] || (values.length > 1 ? "hover " + index : "hover value");
      record[name] = typeof value === "string" && !own ? plain(value) : value;
    });
  }

  // What a download holds of a trace's `key`: the figure's own plain text where it gives
  // it, else the values drawn (read back as plain text when `text`).
  function source(trace, key) {
    var own = ownText(trace, key);
    return { values: own !== undefined ? own : trace[key], own: own !== undefined };
  }

  function heatmapRecords(trace, base, x, y, names) {
    var records = [];
    var zName = titleOf((trace.colorbar || {}).title) || "value";
    var texts = source(trace, "text");
    var xs = source(trace, "x").values;
    var ys = source(trace, "y").values;
    var custom = source(trace, "customdata");
    trace.z.forEach(function (row, i) {
      row.forEach(function (value, j) {
        var text = trace.text ? trace.text[i][j] : "";
        if (value === null && !text) return; // padding
        var record = Object.assign({}, base);
        setValue(record, x, xs ? xs[j] : j);
        setValue(record, y, ys ? ys[i] : i);
        record[zName] = value;
        if (texts.values) record.text = texts.own ? texts.values[i][j] : plain(text);
        setCustom(record, custom.values && custom.values[i] && custom.values[i][j], names,
          custom.own);
        records.push(record);
      });
    });
    return records;
  }

  function pointRecords(trace, base, x, y, names) {
    var count = (trace.x || trace.y || []).length;
    var records = [];
    var texts = source(trace, "text");
    var xs = source(trace, "x").values;
    var ys = source(trace, "y").values;
    var custom = source(trace, "customdata");
    for (var k = 0; k < count; k += 1) {
      var record = Object.assign({}, base);
      setValue(record, x, xs ? xs[k] : k);
      setValue(record, y, ys ? ys[k] : k);
      if (Array.isArray(texts.values)) {
        record.text = texts.own ? texts.values[k] : plain(texts.values[k]);
      }
      setCustom(record, custom.values && custom.values[k], names, custom.own);
      records.push(record);
    }
    return records;
  }

  function figureRecords(figure) {
    var layout = figure.layout || {};
    var names = (layout.meta || {}).customdata || [];
    var records = [];
    figure.data.forEach(function (trace, index) {
      var x = axisOf(layout, trace.xaxis || "x", "x");
      var y = axisOf(layout, trace.yaxis || "y", "y");
      if (x.name === y.name) {
        // Both positions of a pairwise matrix, say: each under its own name.
        x.name += " (x)";
        y.name += " (y)";
      }
      var name = ownText(trace, "name");
      var base = { trace: name !== undefined ? name : plain(trace.name || "trace " + index) };
      var add = trace.type === "heatmap" ? heatmapRecords : pointRecords;
      records = records.concat(add(trace, base, x, y, names));
    });
    return records;
  }

  // A CSV cell a spreadsheet reads as data, never as a formula (CSV injection, as OWASP
  // names it; the same rule as infra/spreadsheet.py's on the server): text starting with
  // = + - @, a tab or a carriage return gets a leading ', unless the whole text is a decimal
  // number ("-1.25", which a spreadsheet reads as that number); numbers are written as they
  // are. A program reading the CSV sees the ' (a token "-" is "'-"); the JSON download holds
  // every text as it is.
  var FORMULA_START = /^[=+\-@\t\r]/;
  var NUMBER = /^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$/;

  function csvCell(value) {
    if (value === null || value === undefined) return "";
    var text = String(value);
    if (typeof value !== "number" && FORMULA_START.test(text) && !NUMBER.test(text)) {
      text = "'" + text;
    }
    return /[",\n\r]/.test(text) ? '"' + text.replace(/"/g, '""') + '"' : text;
  }

  function toCsv(records) {
    var columns = [];
    records.forEach(function (record) {
      Object.keys(record).forEach(function (key) {
        if (columns.indexOf(key) === -1) columns.push(key);
      });
    });
    var lines = [columns.map(csvCell).join(",")];
    records.forEach(function (record) {
      lines.push(columns.map(function (column) { return csvCell(record[column]); }).join(","));
    });
    return lines.join("\n") + "\n";
  }

  function save(name, text, type) {
    var link = document.createElement("a");
    link.href = URL.createObjectURL(new Blob([text], { type: type }));
    link.download = name;
    document.body.appendChild(link);
    link.click();
    link.remove();
    setTimeout(function () { URL.revokeObjectURL(link.href); }, 0);
  }

  // The JSON download of figure `name` on page `page`.
  function figureDocument(name, figure, page) {
    return {
      figure: name,
      title: titleOf((figure.layout || {}).title),
      page: page,
      records: figureRecords(figure),
    };
  }

  if (typeof module === "object" && module.exports) {
    module.exports = { csvCell: csvCell, figureDocument: figureDocument, toCsv: toCsv };
  }
  if (typeof document === "undefined") return;

  document.addEventListener("click", function (event) {
    var button = event.target.closest("[data-figure-export]");
    if (!button) return;
    var name = button.dataset.figure;
    var figure = JSON.parse(document.getElementById(name).textContent);
    var document_ = figureDocument(name, figure, window.location.href);
    if (button.dataset.figureExport === "csv") {
      save(name + ".csv", toCsv(document_.records), "text/csv");
      return;
    }
    save(name + ".json", JSON.stringify(document_, null, 1), "application/json");
  });
})();
