// withPlotly(callback): runs callback(Plotly) once plotly.js is loaded, fetching it the first
// time a page has a chart to draw. A page without one (the playground before its first run,
// the jobs page) never loads the 1.5 MB bundle. Its URL is this script's data-plotly-src.
(function () {
  "use strict";
  var source = document.currentScript.dataset.plotlySrc;
  var loaded = null;

  window.withPlotly = function (callback) {
    if (!loaded) {
      loaded = new Promise(function (resolve, reject) {
        var script = document.createElement("script");
        script.src = source;
        script.onload = function () { resolve(window.Plotly); };
        script.onerror = reject;
        document.head.appendChild(script);
      });
    }
    loaded.then(callback);
  };
})();
