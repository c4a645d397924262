"""A steering evaluation's dataset as pasted or uploaded: CSV with the header
`prompt,target,foil`, or JSON Lines of objects with those three keys. Every refusal names
the row (and line) that caused it; sizes are checked before anything is parsed whole."""

import csv
import io
import json
from dataclasses import dataclass

COLUMNS = ("prompt", "target", "foil")
MAX_ROWS = 200
# The pasted or uploaded text, checked before it is parsed.
MAX_DATASET_CHARS = 200_000
FORMAT_HELP = (
    f"CSV with the header prompt,target,foil, or JSON Lines (one object per line with the "
    f"keys prompt, target and foil); at most {MAX_ROWS} rows. Completions keep their "
    f"leading space (“ Paris”): it is part of the token."
)


class DatasetError(ValueError):
    """Why the dataset cannot be used, naming the row at fault."""


@dataclass(frozen=True)
class DatasetRow:
    prompt: str
    target: str
    foil: str


def parse_dataset(text: str) -> list[DatasetRow]:
    """The rows of `text`: JSON Lines when its first non-blank line starts with `{`, else
    CSV with a header. Raises DatasetError naming the first bad row."""
    if len(text) > MAX_DATASET_CHARS:
        raise DatasetError(
            f"The dataset is {len(text):,} characters; at most {MAX_DATASET_CHARS:,}."
        )
    first = next((line for line in text.splitlines() if line.strip()), "")
    if not first:
        raise DatasetError("The dataset is empty: give a header line and at least one row.")
    rows = _jsonl_rows(text) if first.lstrip().startswith("{") else _csv_rows(text)
    if not rows:
        raise DatasetError("The dataset has a header but no rows.")
    return rows


def _too_many() -> DatasetError:
    return DatasetError(f"Too many rows: more than {MAX_ROWS}; at most {MAX_ROWS}.")


def _checked(fields: dict, where: str) -> DatasetRow:
    """A row from its fields (each a string), refused when one is missing or empty or the
    target equals the foil."""
    for column in COLUMNS:
        if fields.get(column) is None:
            raise DatasetError(f"{where}: missing column “{column}”.")
        if not isinstance(fields[column], str):
            raise DatasetError(f"{where}: “{column}” must be text.")
        if not fields[column].strip():
            raise DatasetError(f"{where}: the {column} is empty.")
    if fields["target"] == fields["foil"]:
        raise DatasetError(
            f"{where}: the target equals the foil ({fields['target']!r}); they must differ."
        )
    return DatasetRow(prompt=fields["prompt"], target=fields["target"], foil=fields["foil"])


def _csv_rows(text: str) -> list[DatasetRow]:
    reader = csv.reader(io.StringIO(text))
    header = next(reader)
    names = [name.strip().lower() for name in header]
    missing = [column for column in COLUMNS if column not in names]
    if missing:
        raise DatasetError(
            f"Line 1 (the header): missing column “{missing[0]}”; the header must be "
            f"{','.join(COLUMNS)} (got {','.join(header)})."
        )
    rows = []
    for values in reader:
        if not any(value.strip() for value in values):
            continue
        if len(rows) == MAX_ROWS:
            raise _too_many()
        where = f"Row {len(rows) + 1} (line {reader.line_num})"
        if len(values) > len(names):
            raise DatasetError(
                f"{where}: {len(values)} values for {len(names)} columns (quote a value that "
                f"holds a comma)."
            )
        rows.append(_checked(dict(zip(names, values, strict=False)), where))
    return rows


def _jsonl_rows(text: str) -> list[DatasetRow]:
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if len(rows) == MAX_ROWS:
            raise _too_many()
        where = f"Row {len(rows) + 1} (line {number})"
        try:
            fields = json.loads(line)
        except json.JSONDecodeError as error:
            raise DatasetError(f"{where} is not JSON: {error.msg}.") from None
        if not isinstance(fields, dict):
            raise DatasetError(f"{where}: give an object with the keys prompt, target and foil.")
        rows.append(_checked(fields, where))
    return rows
