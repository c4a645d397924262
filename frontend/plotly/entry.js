// The trace types the figure builders use (tests/test_static.py keeps this list and theirs equal).
// Plotly's cartesian bundle also registers box, violin, histograms, contours, pie, image and
// world calendars, which made a fresh browser spend ~1 s evaluating it before any chart.
const Plotly = require("plotly.js/lib/core"); // core registers scatter

Plotly.register([require("plotly.js/lib/bar"), require("plotly.js/lib/heatmap")]);

module.exports = Plotly;
