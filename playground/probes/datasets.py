"""A probe's labelled dataset, pasted or uploaded as CSV (a header naming the columns `text`
and `label`) or JSON Lines (one object `{"text": …, "label": …}` a line), parsed into texts
and two classes, or refused with the row and the reason (`DatasetError`)."""

import csv
import hashlib
import io
import json
import math
from dataclasses import dataclass

# A dataset is harvested whole, one capture per row.
MAX_ROWS = 2000
MAX_TEXT_CHARS = 2000
# Of the pasted text or the uploaded file, checked before either is parsed.
MAX_DATASET_BYTES = 4 * 1024 * 1024
# Each class needs this many rows in the held-out split (and in the training split), so that
# accuracy and AUROC are measured on both classes.
MIN_TEST_ROWS_PER_CLASS = 2

FORMAT_HELP = (
    "CSV with a header line naming the columns text and label (other columns are ignored), "
    'or JSON Lines: one object {"text": "…", "label": …} per line, the label a string, a '
    "whole number or true/false. Exactly two classes (labels); the one that sorts second "
    "as text (1 of 0 and 1, “yes” of “no” and “yes”) is the positive class. At most "
    f"{MAX_ROWS:,} rows of at most {MAX_TEXT_CHARS:,} characters each."
)


class DatasetError(ValueError):
    """What is wrong with a dataset, naming the row (its line) where one is to blame."""


@dataclass(frozen=True)
class Dataset:
    """The rows in order: `texts`, `labels` (as given, as strings) and `classes` (the two
    labels sorted; `targets()` codes a row 1 for the second)."""

    texts: list[str]
    labels: list[str]
    classes: list[str]

    def targets(self) -> list[int]:
        return [self.classes.index(label) for label in self.labels]

    def class_counts(self) -> dict[str, int]:
        return {name: self.labels.count(name) for name in self.classes}

    @property
    def sha256(self) -> str:
        """SHA-256 of the rows as JSON Lines (`canonical_jsonl`): the same for a dataset
        pasted or uploaded, as CSV or as JSON Lines."""
        return hashlib.sha256(canonical_jsonl(self.texts, self.labels).encode()).hexdigest()


def canonical_jsonl(texts: list[str], labels: list[str]) -> str:
    """One line per row, `{"label": …, "text": …}` with sorted keys, no ASCII escaping, each
    line ending in a newline: what a dataset's SHA-256 is taken of."""
    return "".join(
        json.dumps({"label": label, "text": text}, sort_keys=True, ensure_ascii=False) + "\n"
        for text, label in zip(texts, labels, strict=True)
    )


def parse_dataset(content: str) -> Dataset:
    """The dataset in `content` (CSV or JSON Lines, told apart by its first non-blank
    character: `{` for JSON Lines); DatasetError naming the first bad row otherwise."""
    if len(content.encode()) > MAX_DATASET_BYTES:
        raise DatasetError(f"The dataset is larger than {MAX_DATASET_BYTES // 2**20} MiB.")
    stripped = content.lstrip()
    if not stripped:
        raise DatasetError("Give a dataset: paste it here or upload a file.")
    rows = _jsonl_rows(content) if stripped.startswith("{") else _csv_rows(content)
    texts, labels, classes = [], [], []
    for where, text, label in rows:
        if len(texts) == MAX_ROWS:
            raise DatasetError(f"More than {MAX_ROWS:,} rows: {where} is one too many.")
        if not isinstance(text, str) or not text.strip():
            raise DatasetError(f"{where}: missing text.")
        if len(text) > MAX_TEXT_CHARS:
            raise DatasetError(
                f"{where}: the text is {len(text):,} characters; at most {MAX_TEXT_CHARS:,}."
            )
        if "\0" in text:
            raise DatasetError(f"{where}: the text holds a NUL character, which the API refuses.")
        label = _label(label, where)
        if label not in classes:
            if len(classes) == 2:
                raise DatasetError(
                    f"{where}: label “{label}” is a third class; the rows before it have "
                    f"“{classes[0]}” and “{classes[1]}”, and a probe here tells two apart."
                )
            classes.append(label)
        texts.append(text)
        labels.append(label)
    if len(classes) < 2:
        only = f" (every row is “{classes[0]}”)" if classes else ""
        raise DatasetError(f"A probe needs rows of two classes; this dataset has one{only}.")
    return Dataset(texts=texts, labels=labels, classes=sorted(classes))


def _label(value, where: str) -> str:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise DatasetError(f"{where}: missing label.")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return value.strip()
    raise DatasetError(f"{where}: the label must be a string, a whole number or true/false.")


def _jsonl_rows(content: str):
    for number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"Line {number}"
        try:
            row = json.loads(line)
        except ValueError:
            raise DatasetError(f"{where} is not JSON.") from None
        if not isinstance(row, dict):
            raise DatasetError(f'{where} is not a JSON object {{"text": …, "label": …}}.')
        yield where, row.get("text"), row.get("label")


def _csv_rows(content: str):
    reader = csv.reader(io.StringIO(content))
    try:
        header = [name.strip().lower() for name in next(reader)]
    except csv.Error as error:
        raise DatasetError(f"Line 1 is not CSV ({error}).") from None
    if "text" not in header or "label" not in header:
        raise DatasetError(
            "The CSV's first line must name its columns, text and label (e.g. “text,label”); "
            f"it names {', '.join(header) or 'none'}. JSON Lines starts each line with {{."
        )
    text_column, label_column = header.index("text"), header.index("label")
    line = reader.line_num + 1
    while True:
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as error:
            raise DatasetError(f"Line {line} is not CSV ({error}).") from None
        if cells and any(cell.strip() for cell in cells):
            where = f"Line {line}"
            text = cells[text_column] if text_column < len(cells) else None
            label = cells[label_column] if label_column < len(cells) else None
            yield where, text, label
        line = reader.line_num + 1


def min_rows_per_class(test_fraction: float) -> int:
    """The fewest rows of each class that give `MIN_TEST_ROWS_PER_CLASS` of it in both the
    held-out and the training split at `test_fraction`."""
    smaller = min(test_fraction, 1 - test_fraction)
    return math.ceil(MIN_TEST_ROWS_PER_CLASS / smaller - 1e-9)


def check_split(dataset: Dataset, *, test_fraction: float) -> None:
    """DatasetError naming a class with too few rows for a stratified split at
    `test_fraction`."""
    needed = min_rows_per_class(test_fraction)
    for name, count in dataset.class_counts().items():
        if count < needed:
            raise DatasetError(
                f"Class “{name}” has {count} row{'s' if count != 1 else ''}; with a test "
                f"fraction of {test_fraction:g} each class needs at least {needed}, so that "
                f"both splits hold {MIN_TEST_ROWS_PER_CLASS} of it."
            )
