// Draws each chart from the Plotly figure JSON the server put in the <script> element its
// data-figure attribute names, on page load and again after every htmx swap.
(function () {
  function draw() {
    var charts = Array.prototype.filter.call(document.querySelectorAll("[data-figure]"), function (chart) {
      return document.getElementById(chart.dataset.figure);
    });
    if (!charts.length) return;
    window.withPlotly(function (Plotly) {
      charts.forEach(function (chart) {
        var figure = JSON.parse(document.getElementById(chart.dataset.figure).textContent);
        Plotly.react(chart, figure.data, figure.layout, { responsive: true, displaylogo: false });
      });
    });
  }
  document.addEventListener("DOMContentLoaded", draw);
  document.addEventListener("htmx:afterSettle", draw);
})();
