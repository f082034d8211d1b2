"""What a subcommand prints: an :class:`Output`, its tables, and colour on a terminal."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Output:
    """What a subcommand produced: a JSON document, the lines people read, an exit status,
    and errors it met on the way that the report shows in place (and stderr repeats)."""

    document: dict
    lines: list[str]
    status: int = 0
    errors: tuple[str, ...] = ()

    def __add__(self, other: Output) -> Output:
        return Output({**self.document, **other.document}, [*self.lines, "", *other.lines],
                      max(self.status, other.status), self.errors + other.errors)


def one_line(error: Exception) -> str:
    """An error as one line: its first line, and the equation it shows if any."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    shown = [line for line in lines[1:] if set(line) != {"^"}]
    return " — ".join(lines[:1] + shown[:1])


_STYLES = {"bold": "1", "PASS": "32", "FAIL": "31", "SKIP": "33"}  # ANSI SGR codes
VERDICTS = ("PASS", "FAIL", "SKIP")


@dataclass(frozen=True)
class Paint:
    """ANSI colour, or nothing: on only when stdout is a terminal and NO_COLOR is unset."""

    on: bool

    @classmethod
    def for_stdout(cls) -> Paint:
        return cls(sys.stdout.isatty() and not os.environ.get("NO_COLOR"))

    def __call__(self, text: str, style: str) -> str:
        return f"\033[{_STYLES[style]}m{text}\033[0m" if self.on else text

    def verdict(self, cell: str) -> str:
        """A cell reading PASS, FAIL or SKIP in its colour; any other cell as it is."""
        word = cell.strip()
        return cell.replace(word, self(word, word)) if word in VERDICTS else cell


def table(header: Sequence[str], rows: Sequence[Sequence[str]], paint: Paint,
          right: Sequence[int] = ()) -> list[str]:
    """Columns padded to their widest cell, two spaces apart; ``right`` columns right-aligned."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        padded = [cell.rjust(w) if k in right else cell.ljust(w)
                  for k, (cell, w) in enumerate(zip(cells, widths, strict=True))]
        padded[-1] = padded[-1].rstrip()  # no trailing blanks, painted or not
        return "  ".join(paint.verdict(cell) for cell in padded).rstrip()

    return [paint(line(header), "bold"), *(line(row) for row in rows)]


def sizes_text(sizes: dict[str, int]) -> str:
    """The sizes the options set (j is i's twin, B is always 3)."""
    return " ".join(f"{index}={sizes[index]}" for index in ("n", "τ", "σ", "i", "μ", "a"))


def letters_text(letters: dict[str, str]) -> str:
    """``μ=b τ=c``: each index and the ``torch.einsum`` letter it runs as."""
    return " ".join(f"{index}={letter}" for index, letter in letters.items())
