// Figure downloads: a figure's numbers as CSV or JSON, from the figure the page embeds (the
// very data plotly draws), one record per bar, point or heatmap cell. Columns are named by
// the figure's axis titles and colour-bar title, with a "… label" column where an axis names
// its values (a position's token); `layout.meta.customdata` names the hover values a figure
// carries (hover texts, which are HTML, are left out). plotly text is HTML-escaped, so every
// text is read back as plain text.
(function () {
  "use strict";

  var parser = new DOMParser();

  function plain(text) {
    if (text === null || text === undefined) return "";
    var html = String(text).replace(/<br\s*\/?>/gi, " ");
    return parser.parseFromString(html, "text/html").documentElement.textContent;
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
    return { name: titleOf(settings.title) || fallback, labels: labels };
  }

  function setValue(record, axis, value) {
    record[axis.name] = value;
    var label = axis.labels.get(String(value));
    if (label !== undefined) record[axis.name + " label"] = label;
  }

  // The hover values of one bar, point or cell: numbers and plain strings, by name.
  function setCustom(record, custom, names) {
    if (custom === undefined || custom === null) return;
    var values = Array.isArray(custom) ? custom : [custom];
    values.forEach(function (value, index) {
      if (typeof value === "string" && /<[a-z]/i.test(value)) return;
      var name = names[index] || (values.length > 1 ? "hover " + index : "hover value");
      record[name] = typeof value === "string" ? plain(value) : value;
    });
  }

  function heatmapRecords(trace, base, x, y, names) {
    var records = [];
    var zName = titleOf((trace.colorbar || {}).title) || "value";
    trace.z.forEach(function (row, i) {
      row.forEach(function (value, j) {
        var text = trace.text ? trace.text[i][j] : "";
        if (value === null && !text) return; // padding
        var record = Object.assign({}, base);
        setValue(record, x, trace.x ? trace.x[j] : j);
        setValue(record, y, trace.y ? trace.y[i] : i);
        record[zName] = value;
        if (trace.text) record.text = plain(text);
        setCustom(record, trace.customdata && trace.customdata[i] && trace.customdata[i][j], names);
        records.push(record);
      });
    });
    return records;
  }

  function pointRecords(trace, base, x, y, names) {
    var count = (trace.x || trace.y || []).length;
    var records = [];
    for (var k = 0; k < count; k += 1) {
      var record = Object.assign({}, base);
      setValue(record, x, trace.x ? trace.x[k] : k);
      setValue(record, y, trace.y ? trace.y[k] : k);
      if (Array.isArray(trace.text)) record.text = plain(trace.text[k]);
      setCustom(record, trace.customdata && trace.customdata[k], names);
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
      var base = { trace: plain(trace.name || "trace " + index) };
      var add = trace.type === "heatmap" ? heatmapRecords : pointRecords;
      records = records.concat(add(trace, base, x, y, names));
    });
    return records;
  }

  function csvCell(value) {
    if (value === null || value === undefined) return "";
    var text = String(value);
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

  document.addEventListener("click", function (event) {
    var button = event.target.closest("[data-figure-export]");
    if (!button) return;
    var name = button.dataset.figure;
    var figure = JSON.parse(document.getElementById(name).textContent);
    var records = figureRecords(figure);
    if (button.dataset.figureExport === "csv") {
      save(name + ".csv", toCsv(records), "text/csv");
      return;
    }
    var document_ = {
      figure: name,
      title: titleOf((figure.layout || {}).title),
      page: window.location.href,
      records: records,
    };
    save(name + ".json", JSON.stringify(document_, null, 1), "application/json");
  });
})();
