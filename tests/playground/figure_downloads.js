// static/js/exports.js under node, for test_figure_downloads.py: reads on stdin, as JSON,
// {"figures": {name: figure as the page embeds it}, "cells": [values]} and writes on stdout,
// as JSON, each figure's downloads ({"json": its JSON document, "csv": its CSV}) and each
// value as a CSV cell.
"use strict";

const path = require("path");

// The part of the browser's DOMParser the downloads use: plotly text (HTML-escaped, with <br>
// and a few tags) read back as plain text.
global.DOMParser = class {
  parseFromString(html) {
    const text = html
      .replace(/<[^>]*>/g, "")
      .replace(/&lt;/g, "<")
      .replace(/&gt;/g, ">")
      .replace(/&quot;/g, '"')
      .replace(/&#39;/g, "'")
      .replace(/&amp;/g, "&");
    return { documentElement: { textContent: text } };
  }
};

const downloads = require(path.join(__dirname, "..", "..", "static", "js", "exports.js"));

let input = "";
process.stdin.setEncoding("utf8");
process.stdin.on("data", (chunk) => { input += chunk; });
process.stdin.on("end", () => {
  const request = JSON.parse(input);
  const figures = {};
  for (const [name, figure] of Object.entries(request.figures || {})) {
    const document = downloads.figureDocument(name, figure, "page");
    figures[name] = { json: document, csv: downloads.toCsv(document.records) };
  }
  const cells = (request.cells || []).map(downloads.csvCell);
  process.stdout.write(JSON.stringify({ figures: figures, cells: cells }));
});
