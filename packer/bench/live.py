"""The quick benchmark's rows as they finish, on stderr (stdout keeps the final report, verdict first).

On a terminal: a table redrawn in place, its newest rows under the header and a status line saying what is being
measured, erased at the end (the final report prints the whole table under the verdict). Elsewhere (a pipe, a file):
the header, then one plain line per row as it finishes, nothing redrawn.
"""

from __future__ import annotations

import shutil
import sys
from typing import Any, TextIO

from .report import cell

Column = tuple[str, str, str]
LEFT = 2  # the first columns (dataset, store) are aligned left


class LiveTable:
    """Rows printed as each measurement finishes.

    Args:
        columns: ``(key, title, format)`` of each column.
        widths: each column's width (a cell is never cut: a wider one pushes the next along).
        stream: where to print (stderr).
        enabled: False prints nothing (``--quiet``).
        tty: whether ``stream`` is a terminal (default: it says).
    """

    def __init__(self, columns: list[Column], widths: list[int], stream: TextIO | None = None, enabled: bool = True,
                 tty: bool | None = None):
        self.columns, self.widths = columns, widths
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty() if tty is None else tty
        self.rows: list[str] = []
        self.text = ""
        self.drawn = 0  # lines of the live region on the screen (terminal only)
        self.headed = False

    def _line(self, cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < LEFT else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, self.widths, strict=True))).rstrip()

    def header(self) -> list[str]:
        return [self._line([title for _, title, _ in self.columns]), self._line(["-" * w for w in self.widths])]

    def format(self, row: dict[str, Any]) -> str:
        """One row as a line of the table."""
        return self._line([cell(row, key, fmt) for key, _, fmt in self.columns])

    def add(self, row: dict[str, Any]) -> None:
        """Print ``row`` now."""
        if not self.enabled:
            return
        line = self.format(row)
        self.rows.append(line)
        if self.tty:
            self._draw()
            return
        if not self.headed:
            self.stream.write("\n".join(self.header()) + "\n")
            self.headed = True
        self.stream.write(line + "\n")
        self.stream.flush()

    def status(self, text: str) -> None:
        """Say what is being measured (on a terminal only)."""
        self.text = text
        if self.enabled and self.tty:
            self._draw()

    def close(self) -> None:
        """Erase the live region (terminal only)."""
        if self.enabled and self.tty:
            self._erase()
            self.stream.flush()

    def _erase(self) -> None:
        if self.drawn:
            self.stream.write(f"\x1b[{self.drawn}A\r\x1b[J")
        self.drawn = 0

    def _draw(self) -> None:
        size = shutil.get_terminal_size()
        room = max(1, size.lines - 4)  # what fits under the header with the status line: the region stays erasable
        lines = [*self.header(), *self.rows[-room:], self.text] if self.rows else [self.text]
        self._erase()
        self.stream.write("".join(line[: size.columns - 1] + "\n" for line in lines))
        self.stream.flush()
        self.drawn = len(lines)


def widths_for(columns: list[Column], texts: dict[str, list[str]], numeric: int = 8) -> list[int]:
    """Each column's width: its title's, its longest text (``texts[key]``: the values known before measuring), or
    ``numeric`` for figures."""
    return [max(len(title), *(len(t) for t in texts.get(key, [])), 0 if key in texts else numeric)
            for key, title, _ in columns]
