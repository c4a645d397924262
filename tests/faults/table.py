"""The fault table (issue #12): each fault test adds a row; the session's terminal summary
prints the table and writes it to `.run/faults-table.md`. Under pytest-xdist the rows are
recorded on a worker and sent to the controller, which prints them (tests/conftest.py)."""

from dataclasses import asdict, dataclass
from pathlib import Path

TABLE_PATH = Path(__file__).resolve().parents[2] / ".run" / "faults-table.md"


@dataclass
class FaultRow:
    fault: str
    client_saw: str
    metered: str
    produced: str
    recovery: str


ROWS: list[FaultRow] = []


def rows_as_dicts() -> list[dict]:
    return [asdict(row) for row in ROWS]


def rows_add_dicts(rows: list[dict]) -> None:
    ROWS.extend(FaultRow(**row) for row in rows)


def table_lines() -> list[str]:
    lines = [
        "| fault | what the client saw | tokens metered | tokens produced | recovery |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.fault} | {r.client_saw} | {r.metered} | {r.produced} | {r.recovery} |" for r in ROWS
    ]
    return lines


def table_report(terminalreporter) -> None:
    if not ROWS:
        return
    lines = table_lines()
    terminalreporter.section("fault suite (issue #12)")
    for line in lines:
        terminalreporter.write_line(line)
    TABLE_PATH.parent.mkdir(exist_ok=True)
    TABLE_PATH.write_text("\n".join(lines) + "\n")
    terminalreporter.write_line(f"(written to {TABLE_PATH.relative_to(TABLE_PATH.parents[1])})")
