"""CSV files a spreadsheet opens as data, never as formulas (CSV injection, as OWASP names it).

A spreadsheet reads a cell starting with `=`, `+`, `-` or `@` (or a tab or carriage return
before them) as a formula: a token string such as "=HYPERLINK(…)" or "@SUM(…)" in a download
would run when the file is opened. The rule, the same as static/js/exports.js's `csvCell`:

- a text cell starting with one of those characters gets a leading `'` (OWASP's advice),
  which a spreadsheet shows as text and hides;
- unless the whole text is a decimal number ("-1.25", "+3", "-2e-05"): a spreadsheet reads
  that as the number, not as a formula, and a number must stay a number;
- numbers (int, float) are written as they are: `str` of a number never starts a formula.

A program reading such a CSV sees the `'` in front of those text cells (a token "-" is "'-");
the JSON downloads carry every text as it is.
"""

import csv
import re

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def safe_cell(value):
    """`value` as a CSV cell a spreadsheet reads as data (see the module's docstring)."""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS) and not NUMBER.fullmatch(value):
        return "'" + value
    return value


class SafeWriter:
    """`csv.writer` writing every cell through `safe_cell`, each row ending in CR LF (RFC
    4180): under a line terminator of LF alone the csv module leaves a carriage return inside
    a cell unquoted, and a reader splits the row there."""

    def __init__(self, stream):
        self._writer = csv.writer(stream, lineterminator="\r\n")

    def writerow(self, row):
        return self._writer.writerow([safe_cell(cell) for cell in row])

    def writerows(self, rows):
        for row in rows:
            self.writerow(row)
