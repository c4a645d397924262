// The scrubber of a finished sweep: its slider shows each scale's text, summary and
// same-token figure and marks the scale on the sweep chart, in place (the steps are embedded
// in the page: playground/steering/scrub.py). Model output is only ever inserted with textContent.
(function () {
  "use strict";

  var MARKER = "current-scale";

  function summary(step) {
    if (step.mean_delta === null) return "The baseline: nothing to compare.";
    var text = "mean Δ logprob on the baseline's tokens " + step.mean_delta.toFixed(3) + " nats/token";
    if (step.mean_kl !== null) {
      text += ", mean KL(baseline ‖ steered) " + step.mean_kl.toFixed(3) + " nats/token";
    }
    return text + " ";
  }

  // A vertical line at the scale shown, replacing the previous one (other shapes are kept).
  function mark(panel, scale) {
    var chart = panel.querySelector("[data-plot='sweep']");
    if (!chart || !chart.layout || !window.Plotly) return;
    var shapes = (chart.layout.shapes || []).filter(function (shape) { return shape.name !== MARKER; });
    shapes.push({
      name: MARKER, type: "line", xref: "x", yref: "paper", x0: scale, x1: scale, y0: 0, y1: 1,
      line: { color: "#b30000", width: 2, dash: "dot" },
    });
    window.Plotly.relayout(chart, { shapes: shapes });
  }

  function show(section, steps, index) {
    var step = steps[index];
    var panel = section.closest(".group-panel");
    var slider = section.querySelector("[data-scrub-slider]");
    slider.setAttribute("aria-valuetext", step.label);
    section.querySelector("[data-scrub-label]").textContent = step.label;
    section.querySelector("[data-scrub-text]").textContent = step.error || step.text;
    var line = section.querySelector("[data-scrub-summary]");
    var link = line.querySelector("[data-scrub-run]");
    link.href = step.url;
    line.textContent = summary(step);
    line.appendChild(link);
    panel.querySelectorAll(".card[data-run]").forEach(function (card) {
      card.classList.toggle("current", card.dataset.run === step.run);
    });
    panel.querySelectorAll(".figure[data-figure-name^='diff-']").forEach(function (figure) {
      var shown = figure.dataset.figureName === step.figure;
      figure.hidden = !shown;
      var plot = figure.querySelector(".js-plotly-plot");
      if (shown && plot) window.Plotly.Plots.resize(plot);
    });
    mark(panel, step.scale);
    section.dataset.scrubIndex = String(index);
  }

  function start(root) {
    root.querySelectorAll("[data-sweep-scrub]").forEach(function (section) {
      if (section.dataset.scrubReady) return;
      section.dataset.scrubReady = "1";
      var steps = JSON.parse(document.getElementById(section.dataset.sweepScrub).textContent);
      var slider = section.querySelector("[data-scrub-slider]");
      slider.addEventListener("input", function () { show(section, steps, Number(slider.value)); });
      show(section, steps, Number(slider.value));
    });
  }

  // After playground.js has drawn the figures (its listeners come first: it loads first).
  document.addEventListener("htmx:afterSettle", function () { start(document); });
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", function () { start(document); });
  } else {
    start(document);
  }
})();
