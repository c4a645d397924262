"""Downloads of the numbers the playground's pages show, and the `acs_client` code that gets
the same numbers in a notebook: a JSON document (the numbers with their definitions, units,
tokens and the runs and request ids they came from) and a CSV of its records, one row each.

The figures drawn with plotly download in the browser from the data the page embeds
(static/js/exports.js); the patching grid and the steering comparison or sweep through
`download`, each with the notebook code that sends its requests again (the features'
`exports` modules: patching, steering, compare), which starts with `NOTEBOOK_HEADER`.
"""

import io
import json

from django.http import HttpResponse

from infra.spreadsheet import SafeWriter


def records_csv(records: list[dict]) -> str:
    """`records` as CSV: a column per key (in the order they first appear), empty where a
    record has none or None; lists and objects as JSON; text cells a spreadsheet would read
    as a formula with a leading `'` (`infra.spreadsheet`)."""
    columns = list(dict.fromkeys(key for record in records for key in record))
    buffer = io.StringIO()
    writer = SafeWriter(buffer)
    writer.writerow(columns)
    for record in records:
        writer.writerow([_csv_value(record.get(column)) for column in columns])
    return buffer.getvalue()


def _csv_value(value):
    if value is None:
        return ""
    if isinstance(value, list | dict):
        return json.dumps(value, ensure_ascii=False)
    return value


def download(document: dict, *, records: list[dict], file_format: str, name: str) -> HttpResponse:
    """`document` as a JSON file, or its `records` as a CSV file, named `name`."""
    if file_format == "json":
        body = json.dumps(document, ensure_ascii=False, indent=1)
        content_type = "application/json"
    else:
        body = records_csv(records)
        content_type = "text/csv; charset=utf-8"
    response = HttpResponse(body, content_type=content_type)
    response["Content-Disposition"] = f'attachment; filename="{name}.{file_format}"'
    return response


NOTEBOOK_HEADER = """import os

import numpy as np
from acs_client.client import AcsClient, steering_vector

client = AcsClient(base_url={base_url!r}, api_key=os.environ["ACS_API_KEY"])
"""
