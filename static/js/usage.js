// Draws each chart from the Plotly figure JSON the server put in the <script> element its
// data-figure attribute names, on page load, after every htmx swap and after htmx restores a
// page of the history (back, forward). Charts in or near the view are drawn at once; the
// others when they come near it, since drawing every chart of a page was most of its first
// load. The config and layout are the site's (js/figures.js).
(function () {
  var NEAR_PX = 300;

  function drawChart(chart) {
    var source = document.getElementById(chart.dataset.figure);
    if (!source || !window.Plotly) return;
    var figure = JSON.parse(source.textContent);
    Plotly.react(chart, figure.data, acsFigures.layout(figure.layout, chart), acsFigures.config);
  }

  var observer = new IntersectionObserver(
    function (entries) {
      entries.forEach(function (entry) {
        if (!entry.isIntersecting) return;
        observer.unobserve(entry.target);
        drawChart(entry.target);
      });
    },
    { rootMargin: NEAR_PX + "px" }
  );

  function draw() {
    document.querySelectorAll("[data-figure]").forEach(function (chart) {
      if (chart.getBoundingClientRect().top < window.innerHeight + NEAR_PX) {
        drawChart(chart);
      } else {
        observer.observe(chart);
      }
    });
  }
  document.addEventListener("DOMContentLoaded", draw);
  document.addEventListener("htmx:afterSettle", draw);
  document.addEventListener("htmx:historyRestore", draw);
})();
