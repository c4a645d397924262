// The one figure config and layout of the site: every page that draws a plotly figure (usage,
// jobs, playground) draws it with `acsFigures.config` and `acsFigures.layout(layout, div)`.
// plotly's mode bar sits over the top right of a figure, where a title runs on a narrow
// screen (at 390 px it covered it), and plotly never wraps a title, which then ran past the
// figure's right edge. So the layout keeps a band for the mode bar above the title, breaks a
// title too wide for the figure into lines, and grows the figure by what that adds, so the
// plotting area keeps the size its builder gave it.
(function () {
  "use strict";

  // The band kept for the mode bar: it ends 28 px below the figure's top (2 px offset and
  // 25.5 px of buttons), and the title's letters start a few px below the band.
  var MODE_BAR_PX = 34;
  // plotly's defaults, for a layout that sets none.
  var PLOTLY_TOP_MARGIN = 100;
  var PLOTLY_TITLE_FONT = { size: 17, family: '"Open Sans", verdana, arial, sans-serif' };
  // plotly's line spacing, and how far it raises a title of several lines (by its cap
  // shift, 0.7 em) above where it puts a one-line title: measured in this plotly.js.
  var LINE_HEIGHT = 1.3;
  var MULTI_LINE_RAISE = 0.7;
  var measure = document.createElement("canvas").getContext("2d");

  // The words of `text` in lines no wider than `width` px in `font` (a CSS font).
  function wrap(text, width, font) {
    measure.font = font;
    var lines = [];
    text.split(" ").forEach(function (word) {
      var last = lines.length - 1;
      if (last >= 0 && measure.measureText(lines[last] + " " + word).width <= width) {
        lines[last] += " " + word;
      } else {
        lines.push(word);
      }
    });
    return lines;
  }

  // `given` laid out for drawing in `div`; the figure's own layout is left as it was.
  function layout(given, div) {
    var source = given || {};
    var title = typeof source.title === "string" ? { text: source.title } : source.title;
    if (!title || !title.text) return source;
    var font = Object.assign({}, PLOTLY_TITLE_FONT, source.font && { family: source.font.family },
                             title.font);
    var text = title.text;
    var extraLines = 0;
    var width = div && div.clientWidth;
    if (width && text.indexOf("<br") === -1) {
      var lines = wrap(text, width - 8, font.size + "px " + font.family);
      text = lines.join("<br>");
      extraLines = lines.length - 1;
    }
    var added = MODE_BAR_PX + Math.ceil(extraLines * font.size * LINE_HEIGHT);
    var raise = extraLines ? Math.ceil(MULTI_LINE_RAISE * font.size) : 0;
    var margin = Object.assign({}, source.margin);
    margin.t = (margin.t === undefined ? PLOTLY_TOP_MARGIN : margin.t) + added;
    var placed = Object.assign({}, source, {
      margin: margin,
      title: Object.assign({}, title, {
        text: text,
        yref: "container",
        y: 1,
        yanchor: "top",
        pad: Object.assign({}, title.pad, { t: MODE_BAR_PX + raise }),
      }),
    });
    if (source.height) placed.height = source.height + added;
    return placed;
  }

  window.acsFigures = {
    config: { responsive: true, displaylogo: false },
    layout: layout,
  };
})();
