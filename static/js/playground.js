// Playground: live run output over server-sent events, plotly figures, copy buttons.
// Model output is only ever inserted with textContent, never as HTML.
(function () {
  "use strict";

  // Timings of the latest run, read by the latency benchmark and the browser tests.
  window.playgroundTimings = window.playgroundTimings || {};

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
    var layout = acsFigures.layout(figure.layout, div);
    window.Plotly.newPlot(div, figure.data, layout, acsFigures.config);
    if (div.dataset.plot === "tokens") {
      div.on("plotly_click", function (event) {
        var position = event.points[0].customdata[1];
        var select = div.closest(".run-panel").querySelector("[data-topk-position]");
        if (position < 0 || !select) return;
        select.value = String(position);
        select.dispatchEvent(new Event("change", { bubbles: true }));
      });
    }
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
