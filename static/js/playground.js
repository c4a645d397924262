// Playground: live run output over server-sent events, plotly figures, copy buttons.
// Model output is only ever inserted with textContent, never as HTML.
(function () {
  "use strict";

  // Timings of the latest run, read by the latency benchmark and the browser tests.
  window.playgroundTimings = window.playgroundTimings || {};

  // Narrower than this, a figure's colour bar goes above its plot, across its width: beside
  // it, it took a fifth of a phone's width, and a plot wider than the screen scrolled it off.
  var NARROW_PX = 480;
  var COLOUR_BAR_PX = 56;

  var ABOVE = { orientation: "h", x: 0, xanchor: "left", y: 1.02, yanchor: "bottom", len: 1,
                thickness: 10 };

  // `figure` with each colour bar (a heatmap's, or a scatter's markers') above its plot.
  function withColourBarsAbove(figure) {
    var bars = 0;
    var data = figure.data.map(function (trace) {
      if (trace.showscale === false) return trace;
      if (trace.type === "heatmap") {
        bars += 1;
        return Object.assign({}, trace, { colorbar: Object.assign({}, trace.colorbar, ABOVE) });
      }
      if (!trace.marker || !trace.marker.colorbar) return trace;
      bars += 1;
      var colorbar = Object.assign({}, trace.marker.colorbar, ABOVE);
      var marker = Object.assign({}, trace.marker, { colorbar: colorbar });
      return Object.assign({}, trace, { marker: marker });
    });
    if (!bars) return figure;
    var layout = Object.assign({}, figure.layout);
    var margin = Object.assign({}, layout.margin);
    margin.t = (margin.t === undefined ? 100 : margin.t) + COLOUR_BAR_PX;
    margin.r = Math.min(margin.r === undefined ? 80 : margin.r, 20);
    layout.margin = margin;
    if (layout.height) layout.height += COLOUR_BAR_PX;
    return { data: data, layout: layout };
  }

  // The token strip has as many cells to a row as fit its width at about eight characters
  // each (at most the server's, figures.STRIP_WIDTH), in a smaller font when narrow, and a
  // cell holds its token only as far as it fits (the rest is "…", the whole token in the
  // hover): at any width no label runs into its neighbour's.
  var STRIP_CELL_PX = 64;
  var MIN_STRIP_COLUMNS = 3;
  var NARROW_STRIP_FONT = 10;
  var CELL_TEXT_EM = 0.62;
  // What a plot's margins and colour bar take of its width, beside it or (narrow) above it.
  var PLOT_SIDES_PX = { wide: 160, narrow: 80 };

  function stripColumns(width, narrow, most) {
    var plot = width - PLOT_SIDES_PX[narrow ? "narrow" : "wide"];
    return Math.max(MIN_STRIP_COLUMNS, Math.min(most, Math.floor(plot / STRIP_CELL_PX)));
  }

  // Part `part` of each cell of `row`, then `fill` up to `length`.
  function padded(row, part, length, fill) {
    var values = row.map(function (cell) { return cell[part]; });
    while (values.length < length) values.push(fill);
    return values;
  }

  // The strip (figures.token_strip_figure) wrapped every `columns` cells: its rows are
  // "prompt #a–b" and "completion #c–d", a cell's customdata [hover, position] (-1: padding).
  function rewrapStrip(figure, columns, narrow) {
    var trace = figure.data[0];
    var names = figure.layout.yaxis.ticktext;
    var cells = { prompt: [], completion: [] };
    trace.z.forEach(function (row, r) {
      var source = names[r].split(" ")[0];
      row.forEach(function (value, c) {
        var custom = trace.customdata[r][c];
        if (custom[1] >= 0) cells[source].push([value, trace.text[r][c], custom]);
      });
    });
    var z = [], text = [], customdata = [], rows = [];
    ["prompt", "completion"].forEach(function (source) {
      for (var start = 0; start < cells[source].length; start += columns) {
        var row = cells[source].slice(start, start + columns);
        var first = row[0][2][1], last = row[row.length - 1][2][1];
        rows.push(source + " #" + (last > first ? first + "–" + last : first));
        z.push(padded(row, 0, columns, null));
        text.push(padded(row, 1, columns, ""));
        customdata.push(padded(row, 2, columns, ["", -1]));
      }
    });
    var textfont = narrow
      ? Object.assign({}, trace.textfont, { size: NARROW_STRIP_FONT })
      : trace.textfont;
    var layout = Object.assign({}, figure.layout, {
      height: Math.max(160, 48 * rows.length + 80),
      yaxis: Object.assign({}, figure.layout.yaxis, {
        tickvals: rows.map(function (_, index) { return index; }),
        ticktext: rows,
      }),
    });
    var shown = Object.assign({}, trace, {
      z: z, text: text, customdata: customdata, textfont: textfont,
    });
    return { data: [shown], layout: layout };
  }

  function fitCellText(div, text) {
    var columns = text[0].length;
    var size = div.data[0].textfont.size;
    var cell = div._fullLayout.xaxis._length / columns;
    var fits = Math.max(1, Math.floor(cell / (size * CELL_TEXT_EM)) - 1);
    if (div.dataset.cellChars === String(fits)) return;
    div.dataset.cellChars = String(fits);
    var shown = text.map(function (row) {
      return row.map(function (label) {
        var characters = Array.from(label);
        if (characters.length <= fits) return label;
        return characters.slice(0, Math.max(fits - 1, 1)).join("") + "…";
      });
    });
    window.Plotly.restyle(div, { text: [shown] }, [0]);
  }

  // Whether the plot `div` is the token strip, whose cells re-wrap to its width (its figure's
  // data-width, from playground/runs/registry.py).
  function isStrip(div) {
    var figure = div.closest("[data-width]");
    return Boolean(figure) && figure.dataset.width === "strip";
  }

  // How the div's width now shapes `figure`: narrow or not, and the token strip's columns.
  function shape(div, figure) {
    var narrow = div.clientWidth < NARROW_PX;
    if (!isStrip(div)) return { narrow: narrow };
    var most = figure.data[0].z[0].length;
    return { narrow: narrow, columns: stripColumns(div.clientWidth, narrow, most), most: most };
  }

  // Draws `figure` for the div's width now; returns what it drew.
  function draw(div, figure) {
    var drawn = shape(div, figure);
    div.dataset.shape = JSON.stringify(drawn);
    delete div.dataset.cellChars;
    var shown = figure;
    if (drawn.columns < drawn.most || (drawn.columns && drawn.narrow)) {
      shown = rewrapStrip(shown, drawn.columns, drawn.narrow);
    }
    if (drawn.narrow) shown = withColourBarsAbove(shown);
    var layout = acsFigures.layout(shown.layout, div);
    return window.Plotly.react(div, shown.data, layout, acsFigures.config).then(function () {
      // A titled colour bar above the plot makes plotly move the figure's title up by half
      // the bar's height (fullLayout._hColorbarMoveTitle in the vendored plotly.js), into the
      // mode bar's band: the title's top pad gives that back.
      var moved = div._fullLayout._hColorbarMoveTitle;
      if (!moved || !layout.title || !layout.title.pad) return shown;
      var pad = layout.title.pad.t + moved;
      return window.Plotly.relayout(div, { "title.pad.t": pad }).then(function () {
        return shown;
      });
    });
  }

  // The one way a figure is drawn, on first load and after any htmx swap (after settling).
  // An element swapped in over one with the same id carries the old element's class and
  // style until htmx settles it, then gets its own back: that strips the js-plotly-plot
  // class plotly.js scopes its CSS to (mode bar, titles) from a figure drawn in between.
  // So "drawn" is that class itself: a figure that lost it is drawn again.
  function drawFigure(div) {
    if (div.classList.contains("js-plotly-plot")) return;
    var data = document.getElementById(div.dataset.plot);
    if (!data) return;
    var figure = JSON.parse(data.textContent);
    var tokens = isStrip(div);
    var drawn = figure;
    function fit(shown) {
      drawn = shown;
      if (tokens) fitCellText(div, shown.data[0].text);
    }
    draw(div, figure).then(function (shown) {
      fit(shown);
      // After every redraw (the window resized, say): the figure for the width it now has.
      div.on("plotly_afterplot", function () {
        if (JSON.stringify(shape(div, figure)) !== div.dataset.shape) {
          draw(div, figure).then(fit);
        } else if (tokens) {
          fitCellText(div, drawn.data[0].text);
        }
      });
      if (!tokens) return;
      div.on("plotly_click", function (event) {
        var position = event.points[0].customdata[1];
        var select = div.closest(".run-panel").querySelector("[data-picker='topk']");
        // Padding, and positions without a top-k (the prompt's first token), pick nothing.
        if (!select || !select.querySelector('option[value="' + position + '"]')) return;
        select.value = String(position);
        select.dispatchEvent(new Event("change", { bubbles: true }));
      });
    });
  }

  function renderFigures(root) {
    if (!window.Plotly) return;
    root.querySelectorAll("[data-plot]").forEach(drawFigure);
  }

  function reloadPanel(panel) {
    window.htmx.ajax("GET", panel.dataset.detailUrl, { target: panel, swap: "outerHTML" });
  }

  function followRun(panel) {
    if (panel.dataset.following || !panel.dataset.eventsUrl) return;
    panel.dataset.following = "1";
    var runId = panel.dataset.runId;
    var timing = (window.playgroundTimings[runId] = window.playgroundTimings[runId] || {});
    timing.streamOpened = performance.now();
    var source = new EventSource(panel.dataset.eventsUrl);
    var badge = panel.querySelector("[data-run-badge]");
    source.onmessage = function (message) {
      var event = JSON.parse(message.data);
      if (event.type === "status") {
        badge.textContent = event.label;
        badge.className = "badge " + event.status;
        panel.dataset.runStatus = event.status;
      } else if (event.type === "token") {
        var output = panel.querySelector('[data-choice-output="' + event.choice + '"]');
        if (!output) {
          output = document.createElement("pre");
          output.className = "output live";
          output.dataset.choiceOutput = event.choice;
          panel.querySelector("[data-live-output]").after(output);
        }
        if (timing.firstToken === undefined) timing.firstToken = performance.now();
        timing.tokens = (timing.tokens || 0) + 1;
        output.appendChild(document.createTextNode(event.text));
      } else if (event.type === "end") {
        source.close();
        timing.end = performance.now();
        panel.dataset.runStatus = event.status;
        if (event.error) {
          var box = panel.querySelector("[data-run-error]");
          box.hidden = false;
          box.textContent = "";
          var code = document.createElement("code");
          code.textContent = event.error.code;
          var strong = document.createElement("strong");
          strong.appendChild(code);
          box.appendChild(strong);
          box.appendChild(document.createTextNode(" " + event.error.message));
        }
        reloadPanel(panel);
        window.htmx.trigger(document.body, "runFinished");
      }
    };
  }

  function start(root) {
    root.querySelectorAll(".run-panel[data-events-url]").forEach(followRun);
    renderFigures(root);
  }

  document.addEventListener("click", function (event) {
    var button = event.target.closest("[data-copy]");
    if (!button) return;
    var text = document.getElementById(button.dataset.copy).textContent;
    navigator.clipboard.writeText(text).then(function () {
      button.dataset.copied = "1";
      button.textContent = "Copied";
    });
  });

  document.addEventListener("submit", function (event) {
    if (event.target.matches("[data-submit-form]")) {
      window.playgroundTimings.lastSubmit = performance.now();
    }
  });

  // A form that creates runs ([data-submit-once]) keeps its submit button disabled while its
  // request is in flight and for a moment after: a fast answer gives the form a new one-time
  // token, and the second click of a double click must not send it. (The server returns the
  // first run for a token it has seen, which covers a resend of the same token.)
  var RESUBMIT_PAUSE_MS = 800;
  document.addEventListener("htmx:beforeRequest", function (event) {
    var form = event.detail.elt;
    if (!form.matches || !form.matches("form[data-submit-once]")) return;
    var buttons = form.querySelectorAll("button[type=submit]");
    var started = Date.now();
    buttons.forEach(function (button) { button.disabled = true; });
    form.addEventListener("htmx:afterRequest", function answered(after) {
      if (after.detail.elt !== form) return; // a request of an element inside the form
      form.removeEventListener("htmx:afterRequest", answered);
      setTimeout(function () {
        buttons.forEach(function (button) { button.disabled = false; });
      }, Math.max(0, started + RESUBMIT_PAUSE_MS - Date.now()));
    });
  });

  // A form answered with its errors is swapped in over itself: bring its first error, and
  // the field it is about, into view (the page would otherwise stay where the button was).
  document.addEventListener("htmx:afterSettle", function (event) {
    var target = event.detail.target;
    var form = target && target.id && document.getElementById(target.id);
    var error = form && form.querySelector(".errorlist");
    if (!error) return;
    (error.closest(".field") || error).scrollIntoView({ block: "center" });
    var field = form.querySelector("[aria-invalid=true]");
    if (field) field.focus({ preventScroll: true });
  });

  // Capture cannot be streamed: choosing it switches streaming off, and says so.
  document.addEventListener("change", function (event) {
    var form = event.target.closest("#completion-form");
    if (!form) return;
    var note = form.querySelector("[data-stream-off-note]");
    var stream = form.elements.stream;
    if (event.target === form.elements.capture && event.target.value && stream.checked) {
      stream.checked = false;
      note.hidden = false;
    } else if (event.target === stream) {
      note.hidden = true;
    }
  });

  // afterSwap, not afterSettle: the event stream opens as soon as the panel is in the page.
  document.addEventListener("htmx:afterSwap", function (event) {
    var panel = event.detail.elt.querySelector && event.detail.elt.querySelector(".run-panel");
    if (panel && window.playgroundTimings.lastSubmit && !panel.dataset.following) {
      var timing = (window.playgroundTimings[panel.dataset.runId] =
        window.playgroundTimings[panel.dataset.runId] || {});
      if (timing.submitted === undefined) timing.submitted = window.playgroundTimings.lastSubmit;
    }
    (event.detail.elt.parentNode || document)
      .querySelectorAll(".run-panel[data-events-url]")
      .forEach(followRun);
  });

  // Figures are drawn after settling (see drawFigure).
  document.addEventListener("htmx:afterSettle", function () {
    renderFigures(document);
  });

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", function () { start(document); });
  } else {
    start(document);
  }
})();
