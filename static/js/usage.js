// Draws each chart from the Plotly figure JSON the server put in the <script> element its
// data-figure attribute names, on page load and again after every htmx swap.
(function () {
  function draw() {
    if (!window.Plotly) return;
    document.querySelectorAll("[data-figure]").forEach(function (chart) {
      var source = document.getElementById(chart.dataset.figure);
      if (!source) return;
      var figure = JSON.parse(source.textContent);
      Plotly.react(chart, figure.data, figure.layout, { responsive: true, displaylogo: false });
    });
  }
  document.addEventListener("DOMContentLoaded", draw);
  document.addEventListener("htmx:afterSettle", draw);
})();
